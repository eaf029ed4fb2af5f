"""The block scope of ToMe and ToDo on ComfyUI's DiTs: a whole transformer block on the reduced image tokens.

At the attention scope (``comfyui_dit``) only the attention call sees fewer
tokens. At the block scope the projections, the attention and the MLP of a
block all run on them: a ``dit`` block replacement
(``transformer_options["patches_replace"]["dit"][("double_block", i)]`` and
``("single_block", i)``, ComfyUI's own hook around every block of the families
that have it) reduces the block's image tokens at its entry, runs the block
(or the replacement another node put there) on them, and gives every token of
the full image the change its reduced token went through:

    out = image + expand(block(reduce(image)) - reduce(image))

so each token keeps its own residual stream and only the block's change is
shared, never its output. ToMe merges the image tokens by bipartite soft
matching on the block's input (one matching per block call) and gives each
merged token its destination's change; ToDo pools them over the grid's cells
and gives each token its cell's change. Text, reference (Kontext, Flux 2) and
every other token the layout does not place in the image run whole, and their
output is the block's own. ComfyUI's blocks add into their input in place
(``x += ...``): the block gets a new tensor (the reduced one joined to the rest)
and the change is taken against the reduced image, which the block never sees.

Positions follow the tokens: a merged token runs at its destination's rotary
position (Flux's ``pe`` is per token along the sequence, gathered like the
tokens), a pooled cell at the position of its first token (its top-left, the
token ``nearest`` pooling keeps). While a reduced block runs, the attention
override (``comfyui_dit``) is told the reduced layout: after ToDo, the pooled
grid (an attention-scope ToMe then merges it); after ToMe, none (the merged
tokens are no grid, so attention runs on them as they are).

Families done: Flux and its descendants (Flux 2, Chroma, Chroma Radiance),
whose double blocks take ``img`` ([image | references]) and ``txt`` apart and
whose single blocks take ``[txt | image | references]``. Every other family
is left to the attention scope, with a warning (``comfyui_dit``).

Which blocks: the first ``skip_first`` and the last ``skip_last`` blocks of the
model, in the order they run (double blocks, then single ones), stay whole;
which steps: the node's sampling window. A replacement goes on every block of
the model (those outside the chosen ones pass straight through): whether a key
is in ``patches_replace`` is read by a compiled model without a guard on the
ComfyUI of late 2026, so every clone with the block scope shows a compiled
model the same keys. Replacements run outside compiled graphs (``eager``): on
a compiled model each block the scope reaches runs uncompiled.

No ComfyUI import; patch objects hold only frozen settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..downsample import NEAREST
from ..merge import IDENTITY, PRUNE
from .comfyui import RUN_KEY, eager, model_call
from .comfyui_dit import (
    LAYOUT_KEY,
    SCOPE_BLOCK,
    DiTReduction,
    DiTToDo,
    DiTToMe,
    _warn_grid_too_small,
    pool_grid,
    replace_span,
)
from .dit_families import FLUX, ImageLayout, image_layout

log = logging.getLogger(__name__)

DOUBLE, SINGLE = "double_block", "single_block"


def flux_block_keys(net: torch.nn.Module) -> tuple[tuple[str, int], ...]:
    """Flux's blocks in the order they run: its double blocks, then its single blocks."""
    return tuple((DOUBLE, i) for i in range(len(net.double_blocks))) + \
        tuple((SINGLE, i) for i in range(len(net.single_blocks)))


# The families whose blocks the block scope reaches, and how their blocks are listed.
BLOCK_KEYS: dict[str, Callable[[torch.nn.Module], tuple[tuple[str, int], ...]]] = {FLUX: flux_block_keys}


def chosen_blocks(keys: tuple, skip_first: int, skip_last: int) -> frozenset:
    """The keys of ``keys`` (in the order the blocks run) left after the first ``skip_first`` and the last
    ``skip_last``."""
    return frozenset(keys[skip_first:max(skip_first, len(keys) - skip_last)])


# Reducing one block's image tokens: ToDo's pooling, then ToMe's merge, each undone in turn.

def cell_index(grid: tuple[int, int, int], factor: int, time_factor: int, device: torch.device) -> torch.Tensor:
    """``[t*h*w]``: the pooled cell (``pool_grid``'s order) of each token of ``grid (t, h, w)``. Made on the
    device: an index made on the host would be a copy to the device in every block call."""
    t, h, w = grid
    rows, cols = math.ceil(h / factor), math.ceil(w / factor)
    frames = torch.arange(t, device=device) // time_factor
    ys = torch.arange(h, device=device) // factor
    xs = torch.arange(w, device=device) // factor
    return ((frames[:, None, None] * rows + ys[None, :, None]) * cols + xs[None, None, :]).flatten()


@dataclass(frozen=True)
class Pooling:
    """ToDo at a block's entry: image tokens pooled over ``factor x factor`` (x ``time_factor`` frames) cells."""

    todo: DiTToDo
    grid: tuple[int, int, int]

    @property
    def pooled_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return (math.ceil(t / self.todo.time_factor), math.ceil(h / self.todo.factor),
                math.ceil(w / self.todo.factor))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return pool_grid(x, self.grid, self.todo.factor, self.todo.time_factor, self.todo.method)

    def position(self, x: torch.Tensor) -> torch.Tensor:
        """A cell's position: its first token's (the one ``nearest`` keeps)."""
        return pool_grid(x, self.grid, self.todo.factor, self.todo.time_factor, NEAREST)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """Each cell's value to every token of the cell."""
        return x.index_select(1, cell_index(self.grid, self.todo.factor, self.todo.time_factor, x.device))


@dataclass(frozen=True)
class Merging:
    """ToMe at a block's entry: image tokens merged by ``plan`` (a ``FramePlan``)."""

    plan: object
    mode: str

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.plan.merge(x, self.mode)

    def position(self, x: torch.Tensor) -> torch.Tensor:
        """A merged token's position: its destination's (an unmerged token keeps its own)."""
        return self.plan.merge(x, PRUNE)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """Each merged token's value to every token merged into it."""
        return self.plan.unmerge(x)


class Reduction:
    """The stages reducing one block call's image tokens, in order; undone in the reverse order."""

    def __init__(self, stages: list, grid: tuple[int, int, int] | None):
        self.stages = stages
        self.grid = grid  # the reduced tokens' grid (after ToDo alone), or None (merged tokens are no grid)

    def position(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage.position(x)
        return x

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        for stage in reversed(self.stages):
            x = stage.expand(x)
        return x


def gathered_positions(pe: torch.Tensor | None, start: int, n: int, batch: int, reduction: Reduction):
    """Flux's rotary table ``pe [B or 1, 1, L, D/2, 2, 2]`` (one entry per token of ``[txt | img]``) with the
    ``n`` image tokens' entries from ``start`` replaced by those of the reduced tokens: ``[B, 1, L', ...]``."""
    if pe is None:
        return None
    tokens = pe.movedim(2, 1)  # [B, L, 1, D/2, 2, 2]
    if tokens.shape[0] != batch:
        tokens = tokens.expand(batch, *tokens.shape[1:])
    rest = tokens.shape[2:]
    image = reduction.position(tokens[:, start:start + n].reshape(batch, n, -1))
    return replace_span(tokens, start, n, image.reshape(batch, -1, *rest)).movedim(1, 2)


def _warn_unrecognised_block(options, length: int, layout: ImageLayout) -> None:
    """Once per sampling run: a block whose sequence the layout does not know is left whole."""
    run = options.get(RUN_KEY)
    if run is None or run.first_warning("unrecognised block"):
        log.warning("Apply ToDo / Apply ToMe: a block of %d tokens is not one this model's token layout knows "
                    "(image grid %s); it runs whole, as does every such block in this run", length,
                    "x".join(map(str, layout.grid)))


@dataclass(frozen=True)
class BlockScope:
    """What the block scope reduces on one model: the ToDo and ToMe settings whose scope is the block (either
    may be ``None``), and every block key of the model (``keys``, in the order they run)."""

    todo: DiTToDo | None
    tome: DiTToMe | None
    keys: tuple[tuple[str, int], ...]

    def replacing(self, replaces: Mapping) -> dict:
        """A copy of ``patches_replace`` (the model's, shared with its clones: never written) whose ``dit``
        entries reduce each block, around whatever replacement was there (it runs on the reduced tokens)."""
        dit = dict(replaces.get("dit") or {})
        for key in self.keys:
            dit[key] = BlockReduction(self, key, dit.get(key))
        return dict(replaces, dit=dit)

    def reduction(self, image: torch.Tensor, layout: ImageLayout, key,
                  options) -> tuple[Reduction, torch.Tensor] | None:
        """How block ``key`` of this call reduces its image tokens ``image [B, t*h*w, C]``, and the reduced
        tokens; ``None``: not at all (a block or step outside the chosen ones, a grid smaller than
        the cell, nothing to merge). ToMe matches on the (pooled) tokens, once."""
        todo = self.todo if self.todo is not None and key in self.todo.blocks and \
            self.todo.reach.in_window(options) else None
        tome = self.tome if self.tome is not None and key in self.tome.blocks and \
            self.tome.reach.in_window(options) else None
        stages, grid, reduced = [], layout.grid, image
        if todo is not None:
            if todo.factor > min(grid[1], grid[2]):
                _warn_grid_too_small(grid, todo.factor)
            else:
                pooling = Pooling(todo, grid)
                stages.append(pooling)
                grid, reduced = pooling.pooled_grid, pooling.reduce(reduced)
        if tome is not None:
            plan = DiTReduction.plan(tome, reduced, grid, model_call(options).next_attention(), options)
            if plan is not IDENTITY:
                merging = Merging(plan, tome.reduce)
                stages.append(merging)
                grid, reduced = None, merging.reduce(reduced)
        return (Reduction(stages, grid), reduced) if stages else None


@dataclass(frozen=True)
class BlockReduction:
    """The ``dit`` block replacement of block ``key`` (``("double_block", i)`` or ``("single_block", i)``):
    runs the block on the reduced image tokens, or whole where the scope does not reach it. Made for one model
    call (``BlockScope.replacing``). ``inner``: the replacement another node put on that block, called in the
    block's place (on the reduced tokens) as before."""

    scope: BlockScope
    key: tuple[str, int]
    inner: Callable | None = None

    def run(self, args: dict, extra: dict) -> dict:
        return self.inner(args, extra) if self.inner is not None else extra["original_block"](args)

    @eager  # outside compiled graphs: which blocks and steps, and the plan, are decided at every call
    def __call__(self, args: dict, extra: dict) -> dict:
        options = args.get("transformer_options") or {}
        layout = options.get(LAYOUT_KEY)
        if layout is None or args.get("attn_mask") is not None or layout.row_stride is not None:
            return self.run(args, extra)
        img = args["img"]
        # Double blocks take the text apart; single blocks [txt | img | references] joined. The rotary table
        # covers [txt | img] either way.
        offset = args["txt"].shape[1] if self.key[0] == DOUBLE else 0
        length = offset + img.shape[1]
        start = layout.start(length)
        if start is None or start < offset:
            if not layout.recognises(length):
                _warn_unrecognised_block(options, length, layout)
            return self.run(args, extra)
        n = layout.n_tokens
        image = img[:, start - offset:start - offset + n]
        reduced = self.scope.reduction(image, layout, self.key, options)
        if reduced is None:
            return self.run(args, extra)
        # The block adds into its input in place: it gets a copy (``replace_span``'s cat), so ``reduced``, the
        # change's base, stays what the block received.
        reduction, reduced = reduced
        m = reduced.shape[1]
        reduced_args = dict(args, img=replace_span(img, start - offset, n, reduced),
                            pe=gathered_positions(args.get("pe"), start, n, img.shape[0], reduction))
        options[LAYOUT_KEY] = None if reduction.grid is None else \
            image_layout(reduction.grid, {length - n + m: start})
        try:
            out = self.run(reduced_args, extra)
        finally:
            options[LAYOUT_KEY] = layout
        out_img = out["img"]
        span = slice(start - offset, start - offset + m)
        image_out = image + reduction.expand(out_img[:, span] - reduced)
        if image_out.dtype == torch.float16:  # as the blocks keep their half-precision output finite
            image_out = torch.nan_to_num(image_out, nan=0.0, posinf=65504, neginf=-65504)
        return dict(out, img=replace_span(out_img, start - offset, m, image_out))


# Registration: what ``comfyui_dit``'s apply functions call.

def block_keys(model, family: str) -> tuple[tuple[str, int], ...] | None:
    """Every block of ``model`` the block scope can reach, in the order they run; ``None`` for a family it does
    not cover."""
    keys = BLOCK_KEYS.get(family)
    return None if keys is None else keys(model.get_model_object("diffusion_model"))


def block_scope(todo: DiTToDo | None, tome: DiTToMe | None, keys) -> BlockScope | None:
    """The ``BlockScope`` of a reduction's settings, or ``None`` where none of them has the block scope."""
    todo = todo if todo is not None and todo.scope == SCOPE_BLOCK else None
    tome = tome if tome is not None and tome.scope == SCOPE_BLOCK else None
    if (todo is None and tome is None) or not keys:
        return None
    return BlockScope(todo, tome, tuple(keys))
