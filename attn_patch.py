"""The attn1 patches that run ToMe and ToDo inside ComfyUI's transformer blocks.

ComfyUI calls ``attn1_patch(n, context, value, extra_options)`` with
``n = norm1(x)`` (and ``context`` and ``value`` equal to it for self-attention)
and ``attn1_output_patch(out, extra_options)`` on the attention output. The
``extra_options`` dict is created afresh for every block call and handed to
both, so the plan made by the first travels to the second inside it: no state
is kept on the patch objects, which the model patcher deep-copies on clone.

No ComfyUI import: only the calling convention above.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from .tome.downsample import NEAREST, downsample_tokens
from .tome.grid import block_downsample, derive_seed, token_grid
from .tome.merge import IDENTITY, build_plan

log = logging.getLogger(__name__)

# Which of the self-attention inputs are merged.
MERGE_QKV = "q, k and v"
MERGE_Q = "q only"
MERGE_KV = "k and v only"
MERGE_MODES = (MERGE_QKV, MERGE_Q, MERGE_KV)

PLAN_KEY = "tome_plan"  # the plan of this block call, in its extra_options


def _current_sigma(extra_options) -> float | None:
    sigmas = extra_options.get("sigmas")
    return None if sigmas is None else float(sigmas.flatten()[0])


@dataclass(frozen=True)
class Scope:
    """Where and when a patch acts: blocks at ``max_downsample`` or finer, while the sampler's sigma lies in
    ``[sigma_end, sigma_start]``."""

    max_downsample: int
    sigma_start: float = math.inf
    sigma_end: float = 0.0

    def grid(self, n_tokens: int, extra_options) -> tuple[int, int] | None:
        """``(w, h)`` of this block call's token grid when the patch acts on it, else ``None``."""
        original_shape = extra_options.get("original_shape")
        if original_shape is None:
            return None
        original_h, original_w = original_shape[-2:]
        if block_downsample(n_tokens, original_h, original_w) > self.max_downsample:
            return None
        sigma = _current_sigma(extra_options)
        if sigma is not None and not (self.sigma_end <= sigma <= self.sigma_start):
            return None
        return token_grid(n_tokens, original_shape, extra_options.get("activations_shape"))


@dataclass(frozen=True)
class ToMeSettings:
    """What one Apply ToMe node asked for."""

    ratio: float
    sx: int
    sy: int
    scope: Scope
    seed: int = 0
    use_rand: bool = True
    merge: str = MERGE_QKV


class ToMeAttn1Patch:
    """Builds the plan from ``norm1(x)`` and merges the self-attention inputs."""

    def __init__(self, settings: ToMeSettings):
        self.settings = settings

    def plan(self, n: torch.Tensor, extra_options):
        """The merge plan for this block call, or ``IDENTITY`` where ToMe must not act."""
        s = self.settings
        n_tokens = n.shape[1]
        grid = s.scope.grid(n_tokens, extra_options)
        if grid is None:
            return IDENTITY
        w, h = grid
        generator = None
        if s.use_rand:
            block = extra_options.get("block") or ()
            sigma = _current_sigma(extra_options) or 0.0
            seed = derive_seed(s.seed, sigma, block, extra_options.get("block_index", 0))
            generator = torch.Generator().manual_seed(seed)
        return build_plan(n, w, h, s.sx, s.sy, int(n_tokens * s.ratio), no_rand=not s.use_rand, generator=generator)

    def __call__(self, n, context, value, extra_options):
        plan = self.plan(n, extra_options)
        if plan is IDENTITY:
            return n, context, value
        n_tokens = n.shape[1]

        def merged(t):
            # Another pack's earlier patch may have swapped in a context of another layout: leave it.
            if t is n:
                return merged_n
            return plan.merge(t) if t is not None and t.shape[1] == n_tokens else t

        merge_q = self.settings.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = self.settings.merge in (MERGE_QKV, MERGE_KV)
        merged_n = plan.merge(n)
        if merge_q:
            extra_options[PLAN_KEY] = plan
        return (merged_n if merge_q else n,
                merged(context) if merge_kv else context,
                merged(value) if merge_kv else value)


class ToMeAttn1OutputPatch:
    """Gives every merged query token its destination's attention output back."""

    def __call__(self, out, extra_options):
        plan = extra_options.pop(PLAN_KEY, None)
        return out if plan is None else plan.unmerge(out)


TOME_PATCH_TYPES = (ToMeAttn1Patch, ToMeAttn1OutputPatch)


@dataclass(frozen=True)
class ToDoSettings:
    """What one Apply ToDo node asked for."""

    factor: int
    scope: Scope
    method: str = NEAREST


@functools.lru_cache(maxsize=64)
def _warn_grid_too_small(w: int, h: int, factor: int) -> None:
    """Once per grid and factor, not once per block call."""
    log.warning("Apply ToDo: downsample_factor %d is larger than a %dx%d token grid; that block is left as is",
                factor, w, h)


class ToDoAttn1Patch:
    """Pools the keys and values of self-attention over ``factor x factor`` cells; the queries stay full.

    It acts on the grid-shaped inputs only: keys or values another patch already
    changed (ToMe merged them, say) are passed on untouched.
    """

    def __init__(self, settings: ToDoSettings):
        self.settings = settings

    def __call__(self, n, context, value, extra_options):
        s = self.settings
        n_tokens = n.shape[1]
        grid = s.scope.grid(n_tokens, extra_options)
        if grid is None:
            return n, context, value
        w, h = grid
        if s.factor > min(w, h):
            _warn_grid_too_small(w, h, s.factor)
            return n, context, value

        def pooled(t):
            return downsample_tokens(t, w, h, s.factor, s.method) if t is not None and t.shape[1] == n_tokens else t

        pooled_context = pooled(context)
        return n, pooled_context, pooled_context if value is context else pooled(value)
