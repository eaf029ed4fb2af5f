"""What the nodes ask of ComfyUI's DiTs: the ToDo and ToMe settings, the scopes and block choices they name, and
the keys our hooks use in a model call's ``transformer_options``.

Every DiT module reads these; this one reads only the shared conventions (``comfyui``). No ComfyUI import.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..merge import MEAN
from .comfyui import MERGE_QKV, Window

OVERRIDE_KEY = "optimized_attention_override"  # the one attention override slot of transformer_options
LAYOUT_KEY = "tome_layout"  # in a model call's transformer_options: its ImageLayout
MAIN_BLOCK_KEY = "tome_main_block"  # in a VACE model call's transformer_options: whether a main block is running
# Where a DiT reduces: inside the attention call (the override, ``comfyui_dit_attention``), or the whole block
# (``comfyui_dit_block``).
SCOPE_ATTENTION, SCOPE_BLOCK = "attention", "block"
DIT_SCOPES = (SCOPE_ATTENTION, SCOPE_BLOCK)
MAX_SKIP_BLOCKS = 100  # skip_first_blocks, skip_last_blocks: up to this many (Flux has 57 blocks, Qwen-Image 60)
# The block scope's defaults: the blocks at either end cost the most to reduce on every trained judge (docs/DITS.md
# "Which blocks and which steps, measured"; AsymRnR and SDTM found the same), so they stay whole.
SKIP_FIRST_BLOCKS, SKIP_LAST_BLOCKS = 2, 2


@dataclass(frozen=True)
class DiTToDo:
    """What one Apply ToDo node asked for, on a DiT."""

    factor: int
    time_factor: int
    method: str
    window: Window  # the sampling window
    keep_norms: bool = True  # average-pooled keys at their tokens' mean length (tome.norms)
    scope: str = SCOPE_ATTENTION  # SCOPE_BLOCK: the whole block runs on the pooled tokens (comfyui_dit_block)
    blocks: frozenset = frozenset()  # at the block scope: the keys of the blocks it reduces


@dataclass(frozen=True)
class TokenCaching:
    """At the block scope, instead of merging (``dit_token_cache``): each reduced block computes ``1 - ratio`` of
    the image tokens, the rest keep their own change from the last step they were computed. Every token is
    computed at the run's first ``full_steps`` steps and every ``refresh_every``-th (0: never again); a change
    ``max_age`` steps old is computed first. The node offers these defaults, the ones measured in docs/DITS.md
    "Token-wise caching"."""

    full_steps: int = 2
    refresh_every: int = 0
    max_age: int = 4

    def whole_at(self, step: int) -> bool:
        """Whether step ``step`` of the run computes every token."""
        return step < self.full_steps or (self.refresh_every > 0 and step % self.refresh_every == 0)


@dataclass(frozen=True)
class DiTToMe:
    """What one Apply ToMe node asked for, on a DiT."""

    ratio: float
    sx: int
    sy: int
    window: Window  # the sampling window
    seed: int = 0
    use_rand: bool = True
    merge: str = MERGE_QKV
    reduce: str = MEAN  # PRUNE: the quality bench's baseline, which drops the tokens ToMe would merge
    keep_norms: bool = True  # merged keys at their tokens' mean length (tome.norms)
    scope: str = SCOPE_ATTENTION  # SCOPE_BLOCK: the whole block runs on the merged tokens (comfyui_dit_block)
    blocks: frozenset = frozenset()  # at the block scope: the keys of the blocks it reduces
    # At the block scope: how many consecutive sampling steps a block's matching serves (1: every block call
    # matches afresh).
    reuse_steps: int = 1
    token_cache: TokenCaching | None = None  # at the block scope: tokens computed or cached instead of merged
    # One matching per model call, shared by every attention call or block on the image grid (comfyui.block_plan).
    share_matching: bool = False
