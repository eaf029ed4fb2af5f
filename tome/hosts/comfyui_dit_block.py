"""The block scope of ToMe and ToDo on ComfyUI's DiTs: a whole transformer block on the reduced image tokens.

At the attention scope (``comfyui_dit_attention``) only the attention call sees fewer
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
position (the rotary table ``pe`` is per token along the sequence, gathered
like the tokens), a pooled cell at the position of its first token (its
top-left, the token ``nearest`` pooling keeps); every other per-token table (a
per-token modulation, a mask over the sequence) likewise. While a reduced
block runs, the attention override (``comfyui_dit_attention``) is told the reduced
layout: after ToDo, the pooled grid (an attention-scope ToMe then merges it);
after ToMe, none (the merged tokens are no grid, so attention runs on them as
they are).

Every argument a block takes is declared, per family and kind of block, in
``dit_families.BLOCK_FAMILIES`` (a ``BlockArgs``; how each family's blocks
hold their tokens is described there): reduced (``img``), passed whole,
gathered (per-token tables), moved (token ranges). A call whose arguments the
reduced tokens cannot follow runs whole, with one warning per sampling run
naming the argument (``refused``): an undeclared tensor with an axis as long
as the sequence or ``img`` (a newer ComfyUI's, another pack's), a mask over the
sequence (regional prompting), a table of the wrong kind (not a tensor, or of
neither one row per token nor one row). A token range inside a frame, or a
per-frame modulation beside other tokens, runs whole too (``placed``, one
warning per run).

Every other family (Wan 2.2 S2V and HuMo among them: S2V hands its blocks no
``transformer_options`` and a per-token modulation of its own, HuMo's audio
attention gathers each frame's full tokens; Cosmos, whose blocks take the video
as a grid) is left to the attention scope, with a warning when the node runs
(``comfyui_dit.scope_and_blocks``).

A matching reused (ToMe): a block's plan serves its next ``reuse_steps - 1``
steps (kept in the run's ``SamplingRun`` per batch of conds, as on U-Nets).
A token cache (ToMe's ``token_cache``, ``dit_token_cache``): instead of
merging, a block computes ``1 - ratio`` of the image tokens and every other
token takes its own change from the last step it was computed.
Seeds count every block call, reused or not. (One plan for several blocks of a
call is the benches' ``tome_harness.block_reuse``: measured, offered by no node.)

Which blocks: the first ``skip_first`` and the last ``skip_last`` blocks of the
model, in the order they run (double blocks, then single ones), stay whole;
which steps: the node's sampling window. Replacements go on the chosen blocks
only; the others run as the model runs them.

Under ``torch.compile`` only the decision runs outside the compiled graph
(``BlockReduction.decide``, ``eager``): it reads the call's options (whose
guards the newest host drops) and matches ToMe's plan. The block, the
gathering of its arguments and the spreading of its change are traced, with
shapes the decision fixes; the blocks left whole are traced as without the
pack.

No ComfyUI import; patch objects hold only frozen settings.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..downsample import NEAREST
from ..merge import IDENTITY, PRUNE
from .comfyui import (
    block_plan,
    eager,
    first_in_run,
    model_call,
    options_of_call,
    with_dit_replacements,
    with_replacements,
)
from .comfyui_dit_swap import SWAPPED_KEY, swap_blocks, without_swapped_blocks
from .dit_families import (
    BLOCK_FAMILIES,
    IMG,
    BlockArgs,
    BlockKey,
    ImageLayout,
    TokenRows,
    image_layout,
)
from .dit_settings import LAYOUT_KEY, SCOPE_BLOCK, DiTToDo, DiTToMe
from .dit_token_cache import token_selection
from .dit_tokens import frame_plan, pool_grid, pools, replace_span

log = logging.getLogger(__name__)


def chosen_blocks(keys: tuple, skip_first: int, skip_last: int) -> frozenset:
    """The keys of ``keys`` (in the order the blocks run) left after the first ``skip_first`` and the last
    ``skip_last``."""
    return frozenset(keys[skip_first:max(skip_first, len(keys) - skip_last)])


# Reducing one block's image tokens: ToDo's pooling, then ToMe's merge, each undone in turn.

@functools.lru_cache(maxsize=64)
def cell_index(grid: tuple[int, int, int], factor: int, time_factor: int, device: torch.device) -> torch.Tensor:
    """``[t*h*w]``: the pooled cell (``pool_grid``'s order) of each token of ``grid (t, h, w)``. Made on the
    device (an index made on the host would be a copy to the device in every block call), once per grid, factors
    and device, and kept: in the eager decision, never inside a compiled graph (``Pooling.cells``)."""
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
    cells: torch.Tensor = field(compare=False)  # ``cell_index`` of the grid, on the tokens' device

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

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        """A per-frame ``x [B, t, ...]`` for the pooled frames: each cell's first frame's."""
        return x[:, ::self.todo.time_factor]

    def frame(self, k: int) -> int:
        """The pooled frame that frame ``k`` starts, or the count of pooled frames that ``k`` frames make."""
        return math.ceil(k / self.todo.time_factor)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """Each cell's value to every token of the cell."""
        return x.index_select(1, self.cells)


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

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        """A per-frame ``x [B, t, ...]``: merging keeps every frame (it merges within frames)."""
        return x

    def frame(self, k: int) -> int:
        return k

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

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage.frames(x)
        return x

    def frame(self, k: int) -> int:
        """The reduced frame that frame ``k`` of the image starts (each reduced frame holds as many tokens)."""
        for stage in self.stages:
            k = stage.frame(k)
        return k

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        for stage in reversed(self.stages):
            x = stage.expand(x)
        return x

    def prepare(self) -> None:
        """Make the index maps ``expand`` needs now (outside a compiled graph), not on first use inside it."""
        for stage in self.stages:
            if isinstance(stage, Merging):
                stage.plan.prepare()


def gathered_rows(table: torch.Tensor, rows: TokenRows, start: int, n: int, batch: int,
                 reduction: Reduction) -> torch.Tensor:
    """A per-token ``table`` (``rows`` says how it holds them: ``[B or 1, 1, L, D/2, 2, 2]`` along axis 2 for
    Flux's rotary table, ``[B or 1, L, 1, ...]`` along 1 for Wan's, ``[L, heads, D/2]`` along 0, unbatched, for
    Mochi's), the ``n`` image tokens' rows from ``start`` replaced by those of the reduced tokens, batched: a
    merged token's rows may differ between batch elements."""
    axis = rows.axis if rows.batched else rows.axis + 1
    tokens = (table if rows.batched else table.unsqueeze(0)).movedim(axis, 1)
    if tokens.shape[0] != batch:
        tokens = tokens.expand(batch, *tokens.shape[1:])
    rest = tokens.shape[2:]
    image = reduction.position(tokens[:, start:start + n].reshape(batch, n, -1))
    return replace_span(tokens, start, n, image.reshape(batch, -1, *rest)).movedim(1, axis)


def range_bounds(ranges) -> list[int]:
    """The token bounds of ``[(start, end or None, index)]`` ranges (none for ``None``)."""
    return [bound for a, b, _ in ranges or () for bound in (a, b) if bound is not None]


@dataclass(frozen=True)
class MovedBounds:
    """A token bound of ``img`` (before, inside at a frame's start, or after the image's ``layout.n_tokens``
    from ``at``) moved to the reduced tokens: ``reduced`` of them, frame by frame of the reduced frames."""

    at: int
    layout: ImageLayout
    reduction: Reduction
    reduced: int

    def __call__(self, bound: int | None) -> int | None:
        n = self.layout.n_tokens
        if bound is None or bound <= self.at:
            return bound
        if bound >= self.at + n:
            return bound - n + self.reduced
        frame = (bound - self.at) // (self.layout.grid[1] * self.layout.grid[2])
        frames = self.reduction.frame(self.layout.grid[0])
        return self.at + self.reduction.frame(frame) * (self.reduced // frames)


# What a block call's arguments allow: the checks before its tokens are reduced.

def tensors_in(value) -> list[torch.Tensor]:
    """The tensors of one block argument: itself, or those of a tuple or list (Flux 2's modulations)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else []


def refused(form: BlockArgs, args: dict, length: int) -> tuple[str, str] | None:
    """The argument of this block call (``args``, of a sequence of ``length`` tokens) that its reduced tokens
    cannot follow, and why; ``None`` where there is none: a mask over the sequence, a table of the wrong kind, or
    an undeclared tensor with an axis as long as the sequence or ``img``."""
    for key in form.masks:
        if args.get(key) is not None:
            return key, ("masks attention over the sequence (regional prompting, say), which reduced tokens cannot "
                         "follow")
    wrong = form.wrong_table(args, length)
    if wrong is not None:
        return wrong, ("should be a tensor of one row per token, or of one row, and is not (a newer ComfyUI or "
                       "another pack may have changed it)")
    counts = {length, args[IMG].shape[1]}
    for key, value in args.items():
        if key not in form.declared and any(n in counts for t in tensors_in(value) for n in t.shape):
            return key, ("is no argument this pack knows for this model's blocks and has an entry per token (a "
                         "newer ComfyUI or another pack may have added it)")
    return None


def per_frame(vec) -> bool:
    """Whether a block's modulation ``vec`` holds one entry per latent frame (``[B, T, 6, C]``, ``T > 1``)."""
    return isinstance(vec, torch.Tensor) and vec.ndim == 4 and vec.shape[1] > 1


def placed(form: BlockArgs, args: dict, layout: ImageLayout, start: int, offset: int, length: int) -> bool:
    """Whether this call's positions and modulation can follow the reduced tokens (its tables of the right kind
    already): its token ranges bounded at the image's frames, a per-frame modulation only where the sequence is
    the video alone."""
    frame, at = layout.grid[1] * layout.grid[2], start - offset
    for key in form.ranges:
        for bound in range_bounds(args.get(key)):
            if at < bound < at + layout.n_tokens and (bound - at) % frame:
                return False
    if form.frame_vec and per_frame(args.get("vec")):
        return start == 0 and layout.n_tokens == length and args["vec"].shape[1] == layout.grid[0]
    return True


def following(form: BlockArgs, args: dict, reduction: Reduction, start: int, offset: int, length: int,
              layout: ImageLayout, reduced: int) -> dict:
    """The ``args`` entries that follow the tokens into the reduced block: each table's image rows replaced by the
    reduced tokens' (``start``, ``offset``: where the image and ``img`` start in the layout's sequence), token
    ranges moved to the reduced frames (the image's ``n_tokens`` now ``reduced``), a per-frame modulation pooled
    over frames as the tokens are."""
    batch, n = args[IMG].shape[0], layout.n_tokens
    changes = {rows.key: gathered_rows(table, rows, rows.image_at(start, offset), n, batch, reduction)
               for rows, table in form.tables(args, length)}
    for key in form.ranges:
        if args.get(key) is not None:
            moved = MovedBounds(start - offset, layout, reduction, reduced)
            changes[key] = [(moved(a), moved(b), index) for a, b, index in args[key]]
    if form.frame_vec and per_frame(args.get("vec")):
        changes["vec"] = reduction.frames(args["vec"])
    return changes


def _warn_unrecognised_block(options, length: int, layout: ImageLayout) -> None:
    """Once per sampling run: a block whose sequence the layout does not know is left whole."""
    if first_in_run(options, "unrecognised block"):
        log.warning("Apply ToDo / Apply ToMe: a block of %d tokens is not one this model's token layout knows "
                    "(image grid %s); it runs whole, as does every such block in this run", length,
                    "x".join(map(str, layout.grid)))


def _warn_unplaced_block(options, length: int) -> None:
    """Once per sampling run: a block whose positions or modulation cannot follow its reduced tokens."""
    if first_in_run(options, "unplaced block"):
        log.warning("Apply ToDo / Apply ToMe: a block of %d tokens has rotary positions, a modulation or a mask "
                    "that do not match its tokens one for one; it runs whole, as does every such block in this run",
                    length)


def _warn_refused(options, key: str, why: str) -> None:
    """Once per sampling run and argument: a block call whose argument ``key`` its reduced tokens cannot follow."""
    if first_in_run(options, f"block argument {key}"):
        log.warning("Apply ToDo / Apply ToMe: the block argument %r %s; dit_scope 'block' runs such blocks whole "
                    "in this run", key, why)


def _warn_image_in_rows(options) -> None:
    """Once per sampling run: an image laid out in rows between other tokens (HiDream E1's, beside its edit
    image) is no span a block can be handed reduced; its blocks run whole."""
    if first_in_run(options, "image in rows"):
        log.warning("Apply ToDo / Apply ToMe: this model's image lies in rows between other tokens (HiDream E1's, "
                    "beside its edit image): dit_scope 'block' leaves its blocks whole; dit_scope 'attention' "
                    "reduces it")


@dataclass(frozen=True)
class BlockScope:
    """What the block scope reduces on one model: the ToDo and ToMe settings whose scope is the block (either
    may be ``None``), every block key of the model (``keys``, in the order they run), and its family (a key of
    ``BLOCK_FAMILIES``: how its blocks hold their tokens)."""

    todo: DiTToDo | None
    tome: DiTToMe | None
    keys: tuple[BlockKey, ...]
    family: str

    def args(self, key: BlockKey) -> BlockArgs:
        """What block ``key`` takes."""
        return BLOCK_FAMILIES[self.family].args[key[0]]

    def reaches(self, net: torch.nn.Module) -> bool:
        """Whether ``net``'s blocks, as a model call finds them, are those this scope was made for (First Block
        Cache swaps the block lists for one cached block that runs them all)."""
        return BLOCK_FAMILIES[self.family].keys(net) == self.keys

    @property
    def chosen(self) -> tuple[BlockKey, ...]:
        """The blocks some setting reduces (in some steps), in the order they run."""
        chosen = frozenset().union(*(s.blocks for s in (self.todo, self.tome) if s is not None))
        return tuple(key for key in self.keys if key in chosen)

    def install(self, options: dict, net: torch.nn.Module) -> None:
        """Put a ``BlockReduction`` on each chosen block of this model call (``options``, the call's own copy) of
        ``net``, around whatever replacement was there (it runs on the reduced tokens); the others get nothing."""
        replace_blocks(options, self.family, self.chosen, lambda key, inner: BlockReduction(
            self, key, inner, direct_block(self.family, net, key)))

    def reduction(self, image: torch.Tensor, layout: ImageLayout, key,
                  options) -> tuple[Reduction, torch.Tensor] | None:
        """How block ``key`` of this call reduces its image tokens ``image [B, t*h*w, C]``, and the reduced
        tokens; ``None``: not at all (a block or step outside the chosen ones, a grid smaller than
        the cell, nothing to merge, a token cache outside a sampling run). ToMe matches on the (pooled) tokens,
        once, or selects those it computes (``token_cache``, ``dit_token_cache``)."""
        todo = self.todo if self.todo is not None and key in self.todo.blocks and \
            self.todo.window.in_window(options) else None
        tome = self.tome if self.tome is not None and key in self.tome.blocks and \
            self.tome.window.in_window(options) else None
        stages, grid, reduced = [], layout.grid, image
        if todo is not None:
            if pools(todo, grid):
                pooling = Pooling(todo, grid, cell_index(grid, todo.factor, todo.time_factor, reduced.device))
                stages.append(pooling)
                grid, reduced = pooling.pooled_grid, pooling.reduce(reduced)
        if tome is not None:
            stage = token_selection(tome, reduced, grid, key, options) if tome.token_cache is not None else \
                self.tome_merging(tome, reduced, grid, key, options)
            if stage is not None:
                stages.append(stage)
                grid, reduced = None, stage.reduce(reduced)
        return (Reduction(stages, grid), reduced) if stages else None

    def tome_merging(self, tome: DiTToMe, tokens: torch.Tensor, grid: tuple[int, int, int], key,
                     options) -> Merging | None:
        """ToMe's merging of block ``key``'s (pooled) image tokens; ``None`` where its plan merges nothing."""
        plan = self.tome_plan(tome, tokens, grid, key, options)
        return None if plan is IDENTITY else Merging(plan, tome.reduce)

    def tome_plan(self, tome: DiTToMe, tokens: torch.Tensor, grid: tuple[int, int, int], key, options):
        """ToMe's plan for block ``key``'s (pooled) image tokens ``tokens [B, t*h*w, C]``: matched on them, or the
        one this block matched at an earlier step of the run (``reuse_steps``, kept per batch of conds as on
        U-Nets), or with ``share_matching`` the one the call's first reduced block matched on this grid."""
        index = model_call(options).next_attention()  # counted at every block call, a kept plan's too
        return block_plan(options, tome.share_matching, SCOPE_BLOCK, key, grid, tokens, tome.reuse_steps,
                          lambda: frame_plan(tome, tokens, grid, index, options))


@dataclass(frozen=True)
class ReducedCall:
    """One block call on reduced image tokens, as the eager decision (``BlockReduction.decide``) hands it to the
    part a compiled model traces: how the tokens were reduced (``reduction``) and the reduced ones (``reduced``,
    the base of the block's change), and what moving the block's other arguments takes (``form``, ``layout``,
    ``start``, ``offset``, ``length``: ``following``'s). While the block runs, the call's ``options`` hold the
    reduced tokens' layout; ``restore`` puts ``layout`` back."""

    reduction: Reduction
    reduced: torch.Tensor
    form: BlockArgs
    layout: ImageLayout
    start: int
    offset: int
    length: int
    options: dict

    @property
    def at(self) -> int:
        """Where the image starts in ``img``."""
        return self.start - self.offset

    @property
    def n(self) -> int:
        """The image's tokens, before they were reduced."""
        return self.layout.n_tokens

    def block_args(self, args: dict) -> dict:
        """The block's arguments for the reduced tokens: ``img`` with its image replaced by them, every table,
        token range and per-frame modulation following them."""
        m = self.reduced.shape[1]
        return dict(args, img=replace_span(args[IMG], self.at, self.n, self.reduced),
                    **following(self.form, args, self.reduction, self.start, self.offset, self.length, self.layout,
                                m))

    def spread(self, image: torch.Tensor, out: dict) -> dict:
        """The block's output ``out`` for every token of the full ``image``: each token its own input plus the
        change its reduced token went through."""
        m = self.reduced.shape[1]
        out_img = out["img"]
        image_out = image + self.reduction.expand(out_img[:, self.at:self.at + m] - self.reduced)
        if image_out.dtype == torch.float16:  # as the blocks keep their half-precision output finite
            image_out = torch.nan_to_num(image_out, nan=0.0, posinf=65504, neginf=-65504)
        return dict(out, img=replace_span(out_img, self.at, m, image_out))

    @eager
    def restore(self) -> None:
        """The call's layout back, the block done. (No ``finally``: a block that raises ends its model call, whose
        options are its own copy.)"""
        self.options[LAYOUT_KEY] = self.layout


@dataclass(frozen=True)
class BlockReduction:
    """The ``dit`` block replacement of block ``key`` (``("double_block", i)`` or ``("single_block", i)``):
    runs the block on the reduced image tokens, or whole where the scope does not reach it or the call's
    arguments do not allow it (``refused``, ``placed``). Made for one model call (``BlockScope.install``).
    ``inner``: the replacement another node put on that block, called in the block's place, on the reduced
    tokens.

    Under ``torch.compile`` only ``decide`` runs outside the graph (``eager``): whether and how this call is
    reduced is read from the call's options, whose guards the newest host drops, and the ToMe plan is matched
    there. The block itself, the gathering of its arguments and the spreading of its change are traced: every
    shape they see is fixed by the decision, which dynamo guards on."""

    scope: BlockScope
    key: BlockKey
    inner: Callable | None = None
    direct: Callable[[dict], dict] | None = None  # the block itself, in place of ``original_block`` (``DirectBlock``)

    def run(self, args: dict, extra: dict) -> dict:
        return run_block(self.inner, self.direct, args, extra)

    def __call__(self, args: dict, extra: dict) -> dict:
        call = self.decide(args, extra)
        if call is None:
            return self.run(args, extra)
        out = self.run(call.block_args(args), extra)
        call.restore()
        return call.spread(args[IMG][:, call.at:call.at + call.n], out)

    @eager  # outside compiled graphs: which blocks and steps, and the plan, are decided at every call
    def decide(self, args: dict, extra: dict) -> ReducedCall | None:
        """This call on reduced tokens, its layout put in the call's options; ``None``: run the block whole."""
        options = options_of_call(args, extra)
        layout = options.get(LAYOUT_KEY)
        if layout is None:
            return None
        model_call(options).reached.add(SCOPE_BLOCK)
        if layout.row_stride is not None:
            _warn_image_in_rows(options)
            return None
        form = self.scope.args(self.key)
        img = args[IMG]
        offset, length = form.sequence(args)  # where img starts in the layout's sequence, and its length
        refusal = refused(form, args, length)
        if refusal is not None:
            _warn_refused(options, *refusal)
            return None
        start = layout.start(length)
        if start is None or start < offset or start - offset + layout.n_tokens > img.shape[1]:
            if not layout.recognises(length):
                _warn_unrecognised_block(options, length, layout)
            return None
        if not placed(form, args, layout, start, offset, length):
            _warn_unplaced_block(options, length)
            return None
        n = layout.n_tokens
        reduced = self.scope.reduction(img[:, start - offset:start - offset + n], layout, self.key, options)
        if reduced is None:
            return None
        reduction, tokens = reduced
        reduction.prepare()
        m = tokens.shape[1]
        # Every sequence of the layout (SD3.5's image-only attn2 besides the joint one) loses the same tokens.
        options[LAYOUT_KEY] = None if reduction.grid is None else \
            image_layout(reduction.grid, {size - n + m: at for size, at in layout.starts.items()}, layout.others)
        # The block adds into its input in place: it gets a new tensor (``replace_span``'s cat), so ``tokens``,
        # the change's base, stays what the block received.
        return ReducedCall(reduction, tokens, form, layout, start, offset, length, options)


# Registration: what ``comfyui_dit``'s apply functions and layout wrapper call.

def replace_blocks(options: dict, family: str, keys, make: Callable) -> None:
    """Give this model call (``options``, its own copy of ``transformer_options``) ``make(key, inner)`` as the
    replacement of each block ``key`` of ``keys``, ``inner`` being the one there before (``None``): in a copy of
    ``patches_replace["dit"]`` (the model's, shared with its clones: never written), or under ``SWAPPED_KEY``
    for a family whose blocks' classes are swapped."""
    if BLOCK_FAMILIES[family].swap is not None:
        options[SWAPPED_KEY] = with_replacements(options.get(SWAPPED_KEY), keys, make)
    else:
        options["patches_replace"] = with_dit_replacements(options.get("patches_replace") or {}, keys, make)


def swap_family_blocks(model, scope: BlockScope) -> None:
    """On ``model`` (a clone), swap the classes of the blocks ``scope`` reduces, where its family's are swapped
    (``comfyui_dit_swap``); none for a family ComfyUI hands its replacements to."""
    without_swapped_blocks(model)
    swap = BLOCK_FAMILIES[scope.family].swap
    if swap is not None:
        paths = swap.paths(model.get_model_object("diffusion_model"))
        swap_blocks(model, {key: paths[key] for key in scope.chosen}, swap.mixin)


def direct_block(family: str, net: torch.nn.Module, key: BlockKey) -> Callable[[dict], dict] | None:
    """Block ``key`` of ``net`` as a function of a ``dit`` replacement's ``args``, where its ``family`` runs its
    blocks itself (``DirectBlock``); ``None`` where the family calls ``original_block``."""
    direct = BLOCK_FAMILIES[family].direct
    return None if direct is None else functools.partial(direct.run, direct.module(net, key), net)


def run_block(inner: Callable | None, direct: Callable[[dict], dict] | None, args: dict, extra: dict) -> dict:
    """What a block replacement runs in the block's place: the replacement another node put there (``inner``),
    else the block itself where its family runs it (``direct_block``), else ComfyUI's ``original_block``."""
    if inner is not None:
        return inner(args, extra)
    return direct(args) if direct is not None else extra["original_block"](args)


def block_keys(model, family: str) -> tuple[BlockKey, ...] | None:
    """Every block of ``model`` the block scope can reach, in the order they run; ``None`` for a family it does
    not cover."""
    blocks = BLOCK_FAMILIES.get(family)
    return None if blocks is None else blocks.keys(model.get_model_object("diffusion_model"))


def block_scope(todo: DiTToDo | None, tome: DiTToMe | None, keys, family: str) -> BlockScope | None:
    """The ``BlockScope`` of a reduction's settings on a model of ``family``, or ``None`` where none of them has
    the block scope."""
    todo = todo if todo is not None and todo.scope == SCOPE_BLOCK else None
    tome = tome if tome is not None and tome.scope == SCOPE_BLOCK else None
    if (todo is None and tome is None) or not keys:
        return None
    return BlockScope(todo, tome, tuple(keys), family)
