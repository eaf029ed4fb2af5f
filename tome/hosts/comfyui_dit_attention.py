"""The attention scope of ToMe and ToDo on ComfyUI's DiTs (``dit_scope`` ``attention``, the default): the image
tokens reduced inside each image self-attention call.

No DiT calls ``attn1_patch``, but every one of them calls attention through
``wrap_attn``, which hands the call to
``transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)``
when that is set (``comfy/ldm/modules/attention.py``). ``DiTReduction`` is that
override. It cannot see the image grid or the text length: the layout wrapper
(``comfyui_dit``) writes each model call's ``ImageLayout`` into the call's
``transformer_options``, and the override reads it back from its
``transformer_options`` keyword.

Inside an attention call the override finds the image tokens by the length of
the sequence (self-attention: queries as long as keys, a length the layout
knows), and leaves everything else as it is: text, registers, reference images
and padding tokens, cross-attention, masked calls, and Wan VACE's control
blocks (told apart by a ``dit`` block replacement that marks the main blocks
while they run: their sequences have the video's length). A self-attention call
of a length the layout neither places the image in nor knows as image-free (a
variant that adds tokens, another pack's extra tokens) is left alone too, with
one warning per sampling run: the image is never looked for by guess. ToDo pools
the image keys and values over cells of the grid; ToMe merges the image tokens by
bipartite soft matching and, where the queries were merged, gives every merged
query its destination's output back. An image laid out in rows between other
tokens (HiDream E1's edit image shares each row of patches) is first gathered
into one span by reordering the sequence (keys and values attend alike in any
order); merged queries' outputs are put back in their places after.

Tensor layouts differ by model: ``[B, H, L, D]`` with ``skip_reshape`` (Flux,
Qwen-Image, Lumina 2), ``[B, L, H*D]`` (Wan, SD3's q and k) and ``[B, L, H, D]``
(SD3's v). Every operation here works on the tensors in their own layout, along
their token dimension (2 for heads-major ones), so that what reaches the
attention is laid out as the model made it: a reduced heads-major tensor built
token-major would be copied again by the attention call. The image tokens of
Flux's strided single-block views are gathered without copying whole sequences.

There is one override slot: an override already on the model is kept and
called instead of ``func``; one another node puts over ours at run time is
watched (``OverrideWatch``), and a warning says so where it never calls ours.
Patch objects hold only frozen settings (see ``comfyui``). No ComfyUI import.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..downsample import AVERAGE
from ..merge import IDENTITY, MEAN
from ..norms import keeping_norms
from .comfyui import MERGE_KV, MERGE_Q, MERGE_QKV, block_plan, eager, first_in_run, model_call
from .dit_families import ImageLayout
from .dit_settings import LAYOUT_KEY, MAIN_BLOCK_KEY, OVERRIDE_KEY, SCOPE_ATTENTION, DiTToDo, DiTToMe
from .dit_tokens import frame_plan, pool_grid, pools, replace_span

log = logging.getLogger(__name__)


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
        seq = 2 if heads_major else 1  # where the tokens lie: every tensor is reduced in its own layout
        q, k, v = args[:3]
        # Self-attention only: cross-attention has as many keys as context tokens, never as many as queries
        # unless the layout already left that length out.
        length = k.shape[seq]
        self_attention = q.shape[seq] == length == v.shape[seq]
        start = layout.start(length) if self_attention else None
        if start is not None:  # an image self-attention reached the override (a text refiner's is no sign)
            model_call(options).reached.add(SCOPE_ATTENTION)
        todo, tome = (s if s is not None and s.scope == SCOPE_ATTENTION and s.window.in_window(options) else None
                      for s in (self.todo, self.tome))
        if todo is None and tome is None:
            return attention(*args, **kwargs)
        if start is None:
            if self_attention and not layout.recognises(length):
                warn_unrecognised(options, length, layout)
            return attention(*args, **kwargs)
        call_index = model_call(options).next_attention()
        order = image_first(layout, start, length, k.device)
        if order is not None:  # the image one span at 0: keys and values in any order attend alike
            k, v = (t.index_select(seq, order) for t in (k, v))
            start = 0
        n = layout.n_tokens
        plan = IDENTITY
        if tome is not None:
            tokens = token_major(span(k, start, n, seq), heads_major)
            plan = block_plan(options, tome.share_matching, SCOPE_ATTENTION, ("attention", call_index), layout.grid,
                              tokens, tome.reuse_steps, lambda: frame_plan(tome, tokens, layout.grid, call_index,
                                                                           options))
        merge_q = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = plan is not IDENTITY and tome.merge in (MERGE_QKV, MERGE_KV) and todo is None
        heads = heads_of(args, kwargs)
        if todo is not None:
            k = self.pooled(todo, k, start, layout, seq, heads=heads if todo.keep_norms else None)
            v = self.pooled(todo, v, start, layout, seq)
        elif merge_kv:
            k = self.merged(plan, k, start, n, tome.reduce, seq, heads=heads if tome.keep_norms else None)
            v = self.merged(plan, v, start, n, tome.reduce, seq)
        if merge_q:  # the plain mean: a merged query attends more evenly, nearer its tokens' mean output
            q = self.merged(plan, q if order is None else q.index_select(seq, order), start, n, tome.reduce, seq)
        out = attention(q, k, v, *args[3:], **kwargs)
        if not merge_q:
            return out
        out_seq = 2 if heads_major and kwargs.get("skip_output_reshape", False) else 1
        out = self.unmerged(plan, out, start, n, out_seq)
        if order is not None:  # each query's output back to its place in the sequence
            out = torch.empty_like(out).index_copy_(out_seq, order, out)
        return out

    @staticmethod
    def merged(plan, x: torch.Tensor, start: int, n: int, mode: str, seq: int,
               heads: int | None = None) -> torch.Tensor:
        """``x`` with its ``n`` image tokens from ``start`` (along ``seq``) merged by ``plan`` (``mode``: ``MEAN``
        or ``PRUNE``). ``heads``: given for keys, whose lengths the mean keeps (``tome.norms``)."""
        image = span(x, start, n, seq)
        if heads is not None and mode == MEAN:
            image = keeping_norms(lambda t: plan.merge(t, MEAN, seq), image, heads)
        else:
            image = plan.merge(image, mode, seq)
        return with_span(x, start, n, image, seq)

    @staticmethod
    def unmerged(plan, out: torch.Tensor, start: int, n: int, seq: int) -> torch.Tensor:
        """The attention output ``out`` of merged queries (``L - removed`` tokens along ``seq``), every image
        query given its destination's output back: ``L`` tokens."""
        kept = n - plan.removed
        return with_span(out, start, kept, plan.unmerge(span(out, start, kept, seq), seq), seq)

    @staticmethod
    def pooled(todo: DiTToDo, x: torch.Tensor, start: int, layout: ImageLayout, seq: int,
               heads: int | None = None) -> torch.Tensor:
        """``x`` with its image tokens (along ``seq``) pooled, or as it is where the grid is smaller than a cell.
        ``heads``: given for keys, which ``average`` pooling gives their tokens' mean length (``tome.norms``)."""
        if not pools(todo, layout.grid):
            return x

        def pool(t):
            return pool_grid(t, layout.grid, todo.factor, todo.time_factor, todo.method, seq)

        image = span(x, start, layout.n_tokens, seq)
        image = keeping_norms(pool, image, heads) if heads is not None and todo.method == AVERAGE else pool(image)
        return with_span(x, start, layout.n_tokens, image, seq)


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


def span(x: torch.Tensor, start: int, n: int, dim: int) -> torch.Tensor:
    """The ``n`` tokens of ``x`` from ``start`` along ``dim``: ``x`` itself where they are all of it."""
    return x if start == 0 and n == x.shape[dim] else x.narrow(dim, start, n)


def with_span(x: torch.Tensor, start: int, n: int, image: torch.Tensor, dim: int) -> torch.Tensor:
    """``replace_span(x, start, n, image, dim)``, or ``image`` itself where those tokens are all of ``x`` (an
    image-only sequence, as Wan's): an attention call never writes its inputs, so no copy is needed."""
    return image if start == 0 and n == x.shape[dim] else replace_span(x, start, n, image, dim)


def heads_of(args: tuple, kwargs: dict) -> int:
    """The head count of ``wrap_attn``'s call ``func(q, k, v, heads, ...)``: positional, or ``heads=`` (Wan)."""
    return args[3] if len(args) > 3 else kwargs["heads"]


def token_major(x: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """``x [B, H, L, D]`` (``heads_major``) as the view ``[B, L, H, D]``; anything else as it is."""
    return x.transpose(1, 2) if heads_major else x


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


def warn_unrecognised(options, length: int, layout: ImageLayout) -> None:
    """Once per sampling run: a self-attention call of a length the layout does not know."""
    if first_in_run(options, "unrecognised"):
        log.warning("Apply ToDo / Apply ToMe: a self-attention call of %d tokens is not one this model's token "
                    "layout knows (%s, image grid %s); it is left whole, as is every such call in this run",
                    length, ", ".join(f"{n} tokens with the image at {s}" for n, s in layout.starts.items())
                    or "no sequence with the image", "x".join(map(str, layout.grid)))
