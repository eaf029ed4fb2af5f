"""ToMe and ToDo in ComfyUI's DiTs (SD3.5, Flux / Flux 2 / Chroma, Wan 2.x, Qwen-Image, Lumina 2 / Z-Image,
HunyuanVideo, LTX-Video, HiDream, Cosmos Predict2).

No DiT calls ``attn1_patch``, but every one of them calls attention through
``wrap_attn``, which hands the call to
``transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)``
when that is set (``comfy/ldm/modules/attention.py``). The override cannot see
the image grid or the text length, so a keyed ``apply_model`` wrapper, which
sees the latent and the conds of every model call, writes the call's
``ImageLayout`` (the grid in patches, and where the image tokens start in each
sequence that holds them) into a copy of that call's ``transformer_options``;
the override reads it back from its ``transformer_options`` keyword. Each
family's layout, and how the family is recognised, is in ``dit_families``; this
module is the machinery they share.

Inside an attention call the override finds the image tokens by the length of
the sequence (self-attention: queries as long as keys, a length the layout
knows), and leaves everything else as it is: text, registers, reference images
and padding tokens, cross-attention, masked calls, and Wan VACE's control
blocks (told apart by a ``dit`` block replacement that marks the main blocks
while they run: their sequences have the video's length). A self-attention call
of a length the layout neither places the image in nor knows as image-free (a
variant that adds tokens, another pack's extra tokens) is left alone too, with
one warning per sampling run: the image is never looked for by guess. ToDo pools the image
keys and values over cells of the grid; ToMe merges the image tokens by
bipartite soft matching and, where the queries were merged, gives every merged
query its destination's output back. An image laid out in rows between other
tokens (HiDream E1's edit image shares each row of patches) is first gathered
into one span by reordering the sequence (keys and values attend alike in any
order); merged queries' outputs are put back in their places after.

Tensor layouts differ by model: ``[B, H, L, D]`` with ``skip_reshape`` (Flux,
Qwen-Image, Lumina 2), ``[B, L, H*D]`` (Wan, SD3's q and k) and ``[B, L, H, D]``
(SD3's v). Every operation here works in the token-major view (``[B, L, ...]``,
a transpose for heads-major tensors), where the image tokens of Flux's strided
single-block views are gathered without copying whole sequences.

That is the attention scope, the default. At the block scope (``dit_scope``
``block``) whole blocks run on the reduced image tokens, through ComfyUI's
``dit`` block replacement, or on Lumina 2 and HiDream, which ComfyUI calls
without one, through their blocks' classes swapped on the patched clone
(``comfyui_dit_block``, ``comfyui_dit_swap``; a family neither reaches falls
back to the attention scope with a warning); the layout wrapper puts those
replacements on each model call.

There is one override slot: an override already on the model is kept and
called instead of ``func``. Patch objects hold only frozen settings (see
``comfyui``). No ComfyUI import.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..downsample import AVERAGE, MAX, METHODS, NEAREST
from ..grid import derive_seed
from ..merge import IDENTITY, MEAN, REDUCTIONS, build_plan
from ..norms import keeping_norms
from .comfyui import (
    APPLY_MODEL,
    OUTER_SAMPLE,
    RUN_KEY,
    WRAPPER_KEY,
    Reach,
    SamplingRun,
    StartRun,
    call_options,
    capped_ratio,
    check_choice,
    check_range,
    current_sigma,
    eager,
    model_call,
    options_of_call,
    running_call,
    sigma_window,
)
from .comfyui_dit_swap import without_swapped_blocks
from .comfyui_unet import MERGE_KV, MERGE_MODES, MERGE_Q, MERGE_QKV
from .dit_families import FAMILIES, DiTSpec, ImageLayout, dit_family, dit_spec

log = logging.getLogger(__name__)

OVERRIDE_KEY = "optimized_attention_override"  # the one attention override slot of transformer_options
LAYOUT_KEY = "tome_layout"  # in a model call's transformer_options: its ImageLayout
MAIN_BLOCK_KEY = "tome_main_block"  # in a VACE model call's transformer_options: whether a main block is running
# Where a DiT reduces: inside the attention call (the override), or the whole block (comfyui_dit_block).
SCOPE_ATTENTION, SCOPE_BLOCK = "attention", "block"
DIT_SCOPES = (SCOPE_ATTENTION, SCOPE_BLOCK)
MAX_SKIP_BLOCKS = 100  # skip_first_blocks, skip_last_blocks: up to this many (Flux has 57 blocks, Qwen-Image 60)
MAX_REUSE_BLOCKS = 100  # reuse_blocks: up to this many (one matching for every block of the largest models)


@dataclass(frozen=True)
class LayoutWrapper:
    """A keyed ``apply_model`` wrapper: hands the model call a copy of its ``transformer_options`` holding the
    call's ``ImageLayout`` and its ``ModelCall`` (``comfyui.call_options``); with ``blocks`` (a
    ``comfyui_dit_block.BlockScope``), a copy of its block replacements reducing the blocks, made for the call
    around whatever replacements the call has (another node's, put there before or after ours). ``attention``:
    whether our override reduces anything inside attention calls (settings at the attention scope), which
    another override put over ours at run time would lose if it does not call ours."""

    spec: DiTSpec
    blocks: object | None = None
    attention: bool = True

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                 **conds):
        text = 0 if c_crossattn is None else c_crossattn.shape[1]
        options = call_options(transformer_options)
        options[LAYOUT_KEY] = self.spec.layout(x.shape, text, conds, model_call(options).read)
        alone = RUN_KEY not in options  # a model call outside a sampling run is a run of its own
        run = options.setdefault(RUN_KEY, SamplingRun())
        if self.blocks is not None:  # first, so that VACE's marks and S2V's options go around it
            if self.blocks.reaches(executor.class_obj.diffusion_model):
                self.blocks.install(options)
            elif run.first_warning(unreached_key(SCOPE_BLOCK)):
                warn_blocks_replaced(self.attention)
        if self.spec.vace_main_blocks:
            options[MAIN_BLOCK_KEY] = False
            options["patches_replace"] = with_main_blocks_marked(options.get("patches_replace") or {},
                                                                 self.spec.vace_main_blocks)
        if self.spec.blocks_without_options:
            options["patches_replace"] = with_options_handed(options.get("patches_replace") or {},
                                                             executor.class_obj.diffusion_model.blocks, options)
        with running_call(options):
            out = self.run(executor, options, x, t, c_concat, c_crossattn, control, **conds)
        run.note_call(model_call(options).reached)
        if alone:
            warn_unreached(run, self.scopes)
        return out

    @property
    def scopes(self) -> tuple[str, ...]:
        """The scopes this model's settings reduce at."""
        return scopes_of(self.attention, self.blocks is not None)

    def run(self, executor, options, x, t, c_concat, c_crossattn, control, **conds):
        """The model call with ``options``, watching whether another override put over ours still calls ours."""
        on_top = options.get(OVERRIDE_KEY)
        if on_top is None or isinstance(on_top, DiTReduction) or not self.attention:
            # not self.attention: the block scope alone, whose replacements do not go through the override
            return executor(x, t, c_concat, c_crossattn, control, options, **conds)
        # Another node put its override over ours after our node ran (an attention backend reinstalling itself
        # at every step): watch, for this call, whether it still calls ours.
        watch = options[OVERRIDE_KEY] = OverrideWatch(on_top)
        out = executor(x, t, c_concat, c_crossattn, control, options, **conds)
        if watch.calls and not watch.reached and options[RUN_KEY].first_warning(unreached_key(SCOPE_ATTENTION)):
            warn_dropped(on_top, self.blocks is not None)
        return out


def scopes_of(attention: bool, blocks: bool) -> tuple[str, ...]:
    """The scopes of a model's settings: ``attention`` whether any reduces inside attention calls, ``blocks``
    whether any reduces whole blocks."""
    return (SCOPE_ATTENTION,) * attention + (SCOPE_BLOCK,) * blocks


@dataclass(frozen=True)
class DiTRunStart(StartRun):
    """``StartRun`` for a DiT whose settings reduce at ``scopes``: when the run ends, one warning for each scope
    whose hooks no model call of the run reached."""

    scopes: tuple[str, ...] = ()

    def ended(self, run: SamplingRun) -> None:
        warn_unreached(run, self.scopes)


def unreached_key(scope: str) -> str:
    """The run's warning key for ``scope`` not acting: given once per run, whatever the cause."""
    return f"unreached {scope}"


# The replaced forwards of the step caches people install (TeaCache, MagCache) call the blocks without
# transformer_options, so the attention override is out of reach; their forwards still call the dit block
# replacements (and the swapped blocks), which find the model call's options another way (options_of_call).
UNREACHED_CAUSE = {
    SCOPE_ATTENTION: ("its attention override", "a node or pack replaced the model's forward and calls the blocks "
                      "without ComfyUI's transformer_options (TeaCache and MagCache do), so the override cannot "
                      "reach the attention calls. dit_scope 'block' acts under TeaCache and MagCache"),
    SCOPE_BLOCK: ("its block replacements", "a node or pack replaced the model's forward and runs the blocks "
                  "without ComfyUI's dit block replacements. dit_scope 'attention' may still act"),
}


def warn_unreached(run: SamplingRun, scopes) -> None:
    """One warning per run for each of ``scopes`` whose hooks no model call of ``run`` reached."""
    for scope in run.unreached(scopes):
        if run.first_warning(unreached_key(scope)):
            hook, cause = UNREACHED_CAUSE[scope]
            log.warning("Apply ToDo / Apply ToMe: no model call of this sampling run reached %s, so nothing was "
                        "reduced at dit_scope '%s': %s (docs/STEP_CACHES.md)", hook, scope, cause)


def warn_blocks_replaced(attention: bool) -> None:
    """The model's block lists are not those the node saw (First Block Cache swaps them for one cached block):
    the block scope leaves this run whole."""
    log.warning("Apply ToDo / Apply ToMe: the model's blocks were replaced after this node ran (First Block Cache "
                "swaps them for one cached block), so dit_scope 'block' reduces nothing in this run%s",
                "; what dit_scope 'attention' reduces still is" if attention else
                "; dit_scope 'attention' acts under First Block Cache (docs/STEP_CACHES.md)")


@dataclass(frozen=True)
class MainBlockMark:
    """A ``dit`` block replacement for main block ``("double_block", i)`` of a Wan VACE model: marks the call's
    ``transformer_options`` while the block runs. VACE's control blocks attend over the control video, a
    sequence of exactly the video's length and grid, and run between the main blocks: the mark is the only
    thing that tells the override which of the two it is in. ``inner``: the replacement another node put on
    that block (skip-layer guidance, say), called in the block's place as before."""

    inner: Callable | None = None

    def __call__(self, args, extra):
        options = options_of_call(args, extra)
        options[MAIN_BLOCK_KEY] = True
        try:
            return self.inner(args, extra) if self.inner is not None else extra["original_block"](args)
        finally:
            options[MAIN_BLOCK_KEY] = False


def with_main_blocks_marked(replaces: Mapping, blocks: int) -> dict:
    """A copy of ``patches_replace`` (the model's, shared with its clones: never written) whose ``dit`` entries
    mark each of ``blocks`` main blocks, over whatever replacement was there."""
    dit = dict(replaces.get("dit") or {})
    for i in range(blocks):
        dit[("double_block", i)] = MainBlockMark(dit.get(("double_block", i)))
    return dict(replaces, dit=dit)


@dataclass(frozen=True)
class OptionsHanded:
    """A ``dit`` block replacement for block ``("double_block", i)`` of a model that calls its blocks without
    ``transformer_options`` (Wan 2.2 S2V in ComfyUI 0.3.75), so that no attention override would reach them:
    runs ``block`` with the model call's ``options``. Made for one model call (it holds that call's options).
    ``inner``: the replacement another node put on that block, called as before, with an ``original_block``
    that hands the options over."""

    block: torch.nn.Module
    options: dict
    inner: Callable | None = None

    def __call__(self, args, extra):
        if self.inner is None:
            return self.original(args)
        return self.inner(args, dict(extra, original_block=self.original))

    def original(self, args) -> dict:
        """The block as the model would run it (``WanModel_S2V.forward_orig``'s ``block_wrap``), with the options."""
        return {"img": self.block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                  transformer_options=self.options)}


def with_options_handed(replaces: Mapping, blocks: Sequence[torch.nn.Module], options: dict) -> dict:
    """A copy of ``patches_replace`` whose ``dit`` entries run each of ``blocks`` with ``options``, over whatever
    replacement was there."""
    dit = dict(replaces.get("dit") or {})
    for i, block in enumerate(blocks):
        dit[("double_block", i)] = OptionsHanded(block, options, dit.get(("double_block", i)))
    return dict(replaces, dit=dit)


@dataclass
class OverrideWatch:
    """Another node's override, found on top of ours in one model call, called in its place: counts its calls;
    ours, when reached below it, sets ``reached``. Outside compiled graphs, as ours is: its counts are state."""

    inner: Callable
    calls: int = 0
    reached: bool = False

    @eager
    def __call__(self, func, *args, **kwargs):
        self.calls += 1
        return self.inner(func, *args, **kwargs)


def warn_dropped(override, blocks: bool = False) -> None:
    """One line, once per sampling run: the override on top of ours never calls ours. ``blocks``: some settings
    have the block scope, whose blocks are still reduced (only what is reduced inside attention calls is lost)."""
    name = getattr(override, "__qualname__", None) or type(override).__qualname__
    module = getattr(override, "__module__", None) or type(override).__module__
    lost = ("nothing is reduced inside attention calls in this run (the blocks that dit_scope 'block' reaches are "
            "still reduced); at dit_scope 'attention'") if blocks else "nothing is reduced in this run;"
    log.warning("Apply ToDo / Apply ToMe: another node's attention override (%s from %s) replaced this pack's "
                "at run time and does not call it, so %s that node cannot be stacked with Apply ToDo / Apply ToMe "
                "on a DiT", name, module, lost)


# Token-major tensor operations.

def heads_of(args: tuple, kwargs: dict) -> int:
    """The head count of ``wrap_attn``'s call ``func(q, k, v, heads, ...)``: positional, or ``heads=`` (Wan)."""
    return args[3] if len(args) > 3 else kwargs["heads"]


def token_major(x: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """``x [B, H, L, D]`` (``heads_major``) as the view ``[B, L, H, D]``; anything else as it is."""
    return x.transpose(1, 2) if heads_major else x


def pool_grid(x: torch.Tensor, grid: tuple[int, int, int], factor: int, time_factor: int,
              method: str) -> torch.Tensor:
    """Image tokens ``x [B, t*h*w, ...]`` pooled over ``time_factor x factor x factor`` cells of ``grid (t, h, w)``.

    Partial cells at the far edges are kept, pooled over the tokens they have
    (as ``tome.downsample.downsample_tokens`` does). Returns
    ``[B, ceil(t/tf) * ceil(h/f) * ceil(w/f), ...]``. ``nearest`` keeps the
    first token of each cell and copies only those.
    """
    t, h, w = grid
    batch, rest = x.shape[0], x.shape[2:]
    cells = x.unflatten(1, (t, h, w))
    if method == NEAREST:
        return cells[:, ::time_factor, ::factor, ::factor].flatten(1, 3)
    dims, steps = (t, h, w), (time_factor, factor, factor)
    sizes = [math.ceil(n / step) for n, step in zip(dims, steps, strict=True)]
    # Pad every axis up to whole cells (F.pad lists the last axis first: channels, w, h, t), then reduce each cell.
    pad = [0, 0]
    for n, step, size in zip(dims[::-1], steps[::-1], sizes[::-1], strict=True):
        pad += [0, size * step - n]
    fill = -math.inf if method == MAX else 0.0
    blocks = F.pad(cells.reshape(batch, t, h, w, -1), pad, value=fill)
    blocks = blocks.view(batch, sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2], -1)
    if method == MAX:
        pooled = blocks.amax(dim=(2, 4, 6))
    else:  # a partial cell is the mean of the tokens it has: counted by pooling ones padded as the tokens are,
        # made on the device (a tensor of the counts made on the host would be a blocking copy per call)
        ones = F.pad(x.new_ones(1, t, h, w, 1), pad, value=0.0)
        count = ones.view(1, sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2], 1).sum(dim=(2, 4, 6))
        pooled = blocks.sum(dim=(2, 4, 6)) / count
    return pooled.reshape(batch, -1, *rest)


def replace_span(x: torch.Tensor, start: int, length: int, image: torch.Tensor) -> torch.Tensor:
    """``x [B, L, ...]`` with its ``length`` tokens from ``start`` replaced by ``image [B, L', ...]``."""
    return torch.cat([x[:, :start], image, x[:, start + length:]], dim=1)


def image_first(layout: ImageLayout, start: int, length: int, device: torch.device) -> torch.Tensor | None:
    """For an image in rows between other tokens (``layout.row_stride``, HiDream E1), the order ``[length]`` of
    a sequence's tokens that puts the image's ``t*h*w`` first, row-major, then every other token in its own
    order; ``None`` where the image is one span. Made on the device: an index made on the host would be a
    copy to the device in every attention call."""
    if layout.row_stride is None:
        return None
    t, h, w = layout.grid
    positions = torch.arange(length, device=device)
    end = start + t * h * layout.row_stride
    rows = positions[start:end].view(t * h, layout.row_stride)
    return torch.cat([rows[:, :w].flatten(), positions[:start], rows[:, w:].flatten(), positions[end:]])


class FramePlan:
    """A ``MergePlan`` per frame of a ``(t, h, w)`` grid (frames folded into the batch): merges the image
    tokens ``[B, t*h*w, ...]`` to ``[B, t*m, ...]`` and back."""

    def __init__(self, plan, frames: int):
        self.plan = plan
        self.frames = frames

    @property
    def removed(self) -> int:
        """How many image tokens ``merge`` removes, over all frames."""
        return self.plan.removed * self.frames

    def merge(self, x: torch.Tensor, mode: str = MEAN) -> torch.Tensor:
        batch, n, rest = x.shape[0], x.shape[1], x.shape[2:]
        merged = self.plan.merge(x.reshape(batch * self.frames, n // self.frames, -1), mode)
        return merged.reshape(batch, -1, *rest)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        batch, m, rest = x.shape[0], x.shape[1], x.shape[2:]
        return self.plan.unmerge(x.reshape(batch * self.frames, m // self.frames, -1)).reshape(batch, -1, *rest)


# The attention override.

@dataclass(frozen=True)
class DiTToDo:
    """What one Apply ToDo node asked for, on a DiT."""

    factor: int
    time_factor: int
    method: str
    reach: Reach  # only its sampling window counts on a DiT
    keep_norms: bool = True  # average-pooled keys at their tokens' mean length (tome.norms)
    scope: str = SCOPE_ATTENTION  # SCOPE_BLOCK: the whole block runs on the pooled tokens (comfyui_dit_block)
    blocks: frozenset = frozenset()  # at the block scope: the keys of the blocks it reduces


@dataclass(frozen=True)
class DiTToMe:
    """What one Apply ToMe node asked for, on a DiT."""

    ratio: float
    sx: int
    sy: int
    reach: Reach  # only its sampling window counts on a DiT
    seed: int = 0
    use_rand: bool = True
    merge: str = MERGE_QKV
    reduce: str = MEAN  # PRUNE: the quality bench's baseline, which drops the tokens ToMe would merge
    keep_norms: bool = True  # merged keys at their tokens' mean length (tome.norms)
    scope: str = SCOPE_ATTENTION  # SCOPE_BLOCK: the whole block runs on the merged tokens (comfyui_dit_block)
    blocks: frozenset = frozenset()  # at the block scope: the keys of the blocks it reduces
    # At the block scope: how many consecutive blocks of a model call one matching serves, and how many
    # consecutive sampling steps a block's matching serves (1 and 1: every block call matches afresh).
    reuse_blocks: int = 1
    reuse_steps: int = 1


def warn_unrecognised(options, length: int, layout: ImageLayout) -> None:
    """Once per sampling run: a self-attention call of a length the layout does not know."""
    run = options.get(RUN_KEY)
    if run is None or run.first_warning("unrecognised"):
        log.warning("Apply ToDo / Apply ToMe: a self-attention call of %d tokens is not one this model's token "
                    "layout knows (%s, image grid %s); it is left whole, as is every such call in this run",
                    length, ", ".join(f"{n} tokens with the image at {s}" for n, s in layout.starts.items())
                    or "no sequence with the image", "x".join(map(str, layout.grid)))


@functools.lru_cache(maxsize=64)
def _warn_grid_too_small(grid: tuple[int, int, int], factor: int) -> None:
    """Once per grid and factor, not once per attention call."""
    log.warning("Apply ToDo: downsample_factor %d is larger than a %dx%d token grid; it is left as is",
                factor, grid[2], grid[1])


@dataclass(frozen=True)
class DiTReduction:
    """The ``optimized_attention_override`` of a patched DiT: ToDo, ToMe or both, on image self-attention.

    ``inner``: the override that was on the model before (called instead of
    ``func``). With both, ToDo pools the image keys and values and ToMe merges
    the queries only (as on U-Nets), matching on the unpooled keys.
    """

    todo: DiTToDo | None = None
    tome: DiTToMe | None = None
    inner: Callable | None = None

    @eager  # outside compiled graphs: the layout, the window and the plan are decided at every call
    def __call__(self, func, *args, **kwargs):
        """``wrap_attn``'s call: ``func(q, k, v, heads, [mask], **kwargs)`` is the attention it would run."""
        attention = func if self.inner is None else functools.partial(self.inner, func)
        options = kwargs.get("transformer_options") or {}
        watch = options.get(OVERRIDE_KEY)
        if isinstance(watch, OverrideWatch):  # another override is on top of ours, and it called ours
            watch.reached = True
        layout = options.get(LAYOUT_KEY)
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if layout is None or mask is not None or len(args) < 3 or options.get(MAIN_BLOCK_KEY) is False:
            return attention(*args, **kwargs)  # MAIN_BLOCK_KEY False: in a VACE control block
        heads_major = bool(kwargs.get("skip_reshape", False))
        q, k, v = (token_major(t, heads_major) for t in args[:3])
        # Self-attention only: cross-attention has as many keys as context tokens, never as many as queries
        # unless the layout already left that length out.
        self_attention = q.shape[1] == k.shape[1] == v.shape[1]
        start = layout.start(k.shape[1]) if self_attention else None
        if start is not None:  # an image self-attention reached the override (a text refiner's is no sign)
            model_call(options).reached.add(SCOPE_ATTENTION)
        todo, tome = (s if s is not None and s.scope == SCOPE_ATTENTION and s.reach.in_window(options) else None
                      for s in (self.todo, self.tome))
        if todo is None and tome is None:
            return attention(*args, **kwargs)
        if start is None:
            if self_attention and not layout.recognises(k.shape[1]):
                warn_unrecognised(options, k.shape[1], layout)
            return attention(*args, **kwargs)
        call_index = model_call(options).next_attention()
        order = image_first(layout, start, k.shape[1], k.device)
        if order is not None:  # the image one span at 0: keys and values in any order attend alike
            k, v = (t.index_select(1, order) for t in (k, v))
            start = 0
        plan = IDENTITY
        if tome is not None:
            plan = self.plan(tome, k[:, start:start + layout.n_tokens], layout.grid, call_index, options)
        merge_q = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_KV) and todo is None
        heads = heads_of(args, kwargs)
        if todo is not None:
            k = self.pooled(todo, k, start, layout, heads=heads if todo.keep_norms else None)
            v = self.pooled(todo, v, start, layout)
        elif merge_kv:
            k = self.merged(plan, k, start, layout.n_tokens, tome.reduce, heads=heads if tome.keep_norms else None)
            v = self.merged(plan, v, start, layout.n_tokens, tome.reduce)
        if merge_q:  # the plain mean: a merged query attends more evenly, nearer its tokens' mean output
            q = self.merged(plan, q if order is None else q.index_select(1, order), start, layout.n_tokens,
                            tome.reduce)
        out = attention(*(token_major(t, heads_major) for t in (q, k, v)), *args[3:], **kwargs)
        if not merge_q:
            return out
        out_heads_major = heads_major and bool(kwargs.get("skip_output_reshape", False))
        out = self.unmerged(plan, token_major(out, out_heads_major), start, layout.n_tokens)
        if order is not None:  # each query's output back to its place in the sequence
            out = torch.empty_like(out).index_copy_(1, order, out)
        return token_major(out, out_heads_major)

    @staticmethod
    def merged(plan, x: torch.Tensor, start: int, n: int, mode: str, heads: int | None = None) -> torch.Tensor:
        """``x [B, L, ...]`` with its ``n`` image tokens from ``start`` merged by ``plan`` (``mode``: ``MEAN``
        or ``PRUNE``). ``heads``: given for keys, whose lengths the mean keeps (``tome.norms``)."""
        image = x[:, start:start + n]
        if heads is not None and mode == MEAN:
            image = keeping_norms(lambda t: plan.merge(t, MEAN), image, heads)
        else:
            image = plan.merge(image, mode)
        return replace_span(x, start, n, image)

    @staticmethod
    def unmerged(plan, out: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """The attention output ``out [B, L - removed, ...]`` of merged queries, every image query given its
        destination's output back: ``[B, L, ...]``."""
        kept = n - plan.removed
        return replace_span(out, start, kept, plan.unmerge(out[:, start:start + kept]))

    @staticmethod
    def pooled(todo: DiTToDo, x: torch.Tensor, start: int, layout: ImageLayout,
               heads: int | None = None) -> torch.Tensor:
        """``x [B, L, ...]`` with its image tokens pooled, or as it is where the grid is smaller than a cell.
        ``heads``: given for keys, which ``average`` pooling gives their tokens' mean length (``tome.norms``)."""
        _, h, w = layout.grid
        if todo.factor > min(h, w):
            _warn_grid_too_small(layout.grid, todo.factor)
            return x

        def pool(t):
            return pool_grid(t, layout.grid, todo.factor, todo.time_factor, todo.method)

        image = x[:, start:start + layout.n_tokens]
        image = keeping_norms(pool, image, heads) if heads is not None and todo.method == AVERAGE else pool(image)
        return replace_span(x, start, layout.n_tokens, image)

    @staticmethod
    def plan(tome: DiTToMe, keys: torch.Tensor, grid: tuple[int, int, int], call_index: int, options):
        """The merge plan of this call, matched on the image keys ``keys [B, t*h*w, ...]`` frame by frame:
        a ``FramePlan``, or ``IDENTITY`` where nothing is merged."""
        t, h, w = grid
        metric = keys.reshape(keys.shape[0] * t, h * w, -1)
        generator = None
        if tome.use_rand:
            seed = derive_seed(tome.seed, current_sigma(options) or 0.0, ("dit",), call_index)
            generator = torch.Generator().manual_seed(seed)
        plan = build_plan(metric, w, h, tome.sx, tome.sy, int(h * w * tome.ratio), no_rand=not tome.use_rand,
                          generator=generator)
        return IDENTITY if plan is IDENTITY else FramePlan(plan, t)


# Registration: what the nodes call. Each clones the model; the input model is never touched.

def current_reduction(model) -> DiTReduction | None:
    """Our override on ``model``, if an earlier node put one there."""
    override = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    return override if isinstance(override, DiTReduction) else None


def known_family(model, node: str) -> str | None:
    """``dit_family(model)``, with a warning naming the model's class where it is not a known DiT."""
    family = dit_family(model)
    if family is None:
        log.warning("%s: %s is not a DiT this node knows (%s); the model passes through unchanged",
                    node, type(model.model).__name__, ", ".join(FAMILIES))
    return family


def with_reduction(model, family: str, reduction: DiTReduction):
    """A clone of ``model`` with ``reduction`` in the override slot and the layout wrapper registered; where
    ``reduction`` does nothing, both are removed and the override that was there before is put back."""
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    patched.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    patched.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    without_swapped_blocks(patched)
    if reduction.todo is None and reduction.tome is None:
        if reduction.inner is None:
            options.pop(OVERRIDE_KEY, None)
        else:
            options[OVERRIDE_KEY] = reduction.inner
        return patched
    options[OVERRIDE_KEY] = reduction
    from .comfyui_dit_block import block_keys, block_scope, swap_family_blocks  # it imports this module's helpers

    blocks = block_scope(reduction.todo, reduction.tome, block_keys(patched, family), family)
    if blocks is not None:
        swap_family_blocks(patched, family)
    attention = any(s is not None and s.scope == SCOPE_ATTENTION for s in (reduction.todo, reduction.tome))
    patched.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY,
                                 LayoutWrapper(dit_spec(patched, family), blocks, attention))
    keeps_plans = blocks is not None and blocks.tome is not None and blocks.tome.reuse_steps > 1
    patched.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY,
                                 DiTRunStart(keeps_plans, scopes_of(attention, blocks is not None)))
    return patched


def base_reduction(model) -> DiTReduction:
    """Our override on ``model``, or an empty one keeping the override another node put there."""
    current = current_reduction(model)
    if current is not None:
        return current
    return DiTReduction(inner=model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY))


# The block scope's defaults: the blocks at either end cost the most to reduce (1.4 to 2.2 times a middle block on
# every trained judge, docs/DITS.md "Which blocks and which steps, measured"; AsymRnR and SDTM found the same), so
# they stay whole.
SKIP_FIRST_BLOCKS, SKIP_LAST_BLOCKS = 2, 2


def scope_and_blocks(model, family: str, node: str, dit_scope: str, skip_first_blocks: int,
                     skip_last_blocks: int) -> tuple[str, frozenset]:
    """The scope a node's settings get on ``model`` and, at the block scope, the keys of the blocks they reduce.
    A family the block scope does not cover gets the attention scope, with a warning."""
    check_choice("dit_scope", dit_scope, DIT_SCOPES)
    check_range("skip_first_blocks", skip_first_blocks, 0, MAX_SKIP_BLOCKS)
    check_range("skip_last_blocks", skip_last_blocks, 0, MAX_SKIP_BLOCKS)
    if dit_scope == SCOPE_ATTENTION:
        return SCOPE_ATTENTION, frozenset()
    from .comfyui_dit_block import BLOCK_FAMILIES, block_keys, chosen_blocks  # it imports this module's helpers

    keys = block_keys(model, family)
    if keys is None:
        log.warning("%s: dit_scope 'block' does not reach %s's blocks yet (the block scope covers %s); reducing "
                    "inside its attention calls instead (dit_scope 'attention')", node, type(model.model).__name__,
                    ", ".join(BLOCK_FAMILIES))
        return SCOPE_ATTENTION, frozenset()
    blocks = chosen_blocks(keys, skip_first_blocks, skip_last_blocks)
    if not blocks:
        log.warning("%s: skip_first_blocks %d and skip_last_blocks %d leave none of this model's %d blocks to "
                    "reduce at the block scope: nothing is reduced", node, skip_first_blocks, skip_last_blocks,
                    len(keys))
    return SCOPE_BLOCK, blocks


def apply_todo_dit(model, *, downsample_factor: int, method: str = NEAREST, time_factor: int = 1,
                   start_percent: float = 0.0, end_percent: float = 1.0, keep_norms: bool = True,
                   dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
                   skip_last_blocks: int = SKIP_LAST_BLOCKS):
    """Clone ``model`` (a DiT) with ToDo's key/value pooling in its image self-attention.

    ``downsample_factor`` pools ``factor x factor`` cells of the image grid,
    ``time_factor`` (video) that many frames too; both 1 removes an earlier
    ToDo. A second call replaces the first. ``keep_norms`` (no node offers
    it) False pools keys by their plain mean with ``average``, shorter than
    they are (``tome.norms``; the quality bench measures what that costs).
    ``dit_scope`` ``block``: the image tokens are pooled at the entry of each
    block but the first ``skip_first_blocks`` and last ``skip_last_blocks``,
    the whole block runs on them, and each token gets its cell's change
    (``comfyui_dit_block``).
    """
    family = known_family(model, "Apply ToDo")
    if family is None:
        return model
    check_range("downsample_factor", downsample_factor, 1, 8)
    check_range("time_factor", time_factor, 1, 8)
    check_choice("method", method, METHODS)
    scope, blocks = scope_and_blocks(model, family, "Apply ToDo", dit_scope, skip_first_blocks, skip_last_blocks)
    current = base_reduction(model)
    todo = None
    if downsample_factor > 1 or time_factor > 1:
        todo = DiTToDo(downsample_factor, time_factor, method,
                       Reach(1, *sigma_window(model, start_percent, end_percent)), keep_norms=keep_norms,
                       scope=scope, blocks=blocks)
    if todo is None and current.todo is None:
        return model
    return with_reduction(model, family, dataclasses.replace(current, todo=todo))


def apply_tome_dit(model, *, ratio: float, stride_x: int = 2, stride_y: int = 2, seed: int = 0,
                   use_rand: bool = True, merge: str = MERGE_QKV, start_percent: float = 0.0,
                   end_percent: float = 1.0, reduce: str = MEAN, keep_norms: bool = True,
                   dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
                   skip_last_blocks: int = SKIP_LAST_BLOCKS, reuse_blocks: int = 1, reuse_steps: int = 1):
    """Clone ``model`` (a DiT) with ToMe in its image self-attention: the image tokens of q, k and v (or those
    ``merge`` names) merged per frame, the queries unmerged after. Ratio 0 removes an earlier ToMe; a second
    call replaces the first. ``dit_scope`` ``block``: the image tokens are merged at the entry of each block but
    the first ``skip_first_blocks`` and last ``skip_last_blocks`` (matched on the block's input), the whole block
    runs on them, and each token gets its merged token's change (``comfyui_dit_block``; ``merge`` has no meaning
    there). No node offers ``reduce``, ``MEAN`` (ToMe) or ``PRUNE`` (the same tokens dropped: the quality bench's
    baseline), and ``keep_norms``: False merges keys by their plain mean, shorter than they are (``tome.norms``;
    the quality bench measures what that costs). At the block scope, ``reuse_blocks`` consecutive blocks of a
    model call share one matching (made at the first of them) and a block's matching serves ``reuse_steps``
    consecutive steps."""
    family = known_family(model, "Apply ToMe")
    if family is None:
        return model
    check_range("ratio", ratio, 0.0, 0.99)
    check_range("reuse_blocks", reuse_blocks, 1, MAX_REUSE_BLOCKS)
    check_range("reuse_steps", reuse_steps, 1, 20)
    check_range("stride_x", stride_x, 1, 8)
    check_range("stride_y", stride_y, 1, 8)
    check_choice("merge", merge, MERGE_MODES)
    check_choice("reduce", reduce, REDUCTIONS)
    scope, blocks = scope_and_blocks(model, family, "Apply ToMe", dit_scope, skip_first_blocks, skip_last_blocks)
    if scope == SCOPE_BLOCK and merge != MERGE_QKV and ratio > 0.0:
        log.warning("Apply ToMe: merge=%r has no meaning at dit_scope 'block' (the whole block runs on the merged "
                    "tokens) and is ignored", merge)
    if scope == SCOPE_ATTENTION and ratio > 0.0:
        for name, value in (("reuse_steps", reuse_steps), ("reuse_blocks", reuse_blocks)):
            if value > 1:
                log.warning("Apply ToMe: %s=%d has no meaning at dit_scope 'attention' (every attention call matches "
                            "afresh) and is ignored", name, value)
    current = base_reduction(model)
    if ratio <= 0.0 and current.tome is None:
        return model
    ratio = capped_ratio(ratio, stride_x, stride_y)
    tome = None
    if ratio > 0.0:
        tome = DiTToMe(ratio, stride_x, stride_y, Reach(1, *sigma_window(model, start_percent, end_percent)),
                       seed=seed, use_rand=use_rand, merge=merge, reduce=reduce, keep_norms=keep_norms,
                       scope=scope, blocks=blocks, **({"reuse_blocks": reuse_blocks, "reuse_steps": reuse_steps}
                                                      if scope == SCOPE_BLOCK else {}))
    return with_reduction(model, family, dataclasses.replace(current, tome=tome))
