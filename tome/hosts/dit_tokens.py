"""The token operations both DiT scopes share: ToDo's pooling of an image's tokens over the cells of its grid,
ToMe's matching of them frame by frame, and putting a span of tokens back into its sequence.

The attention scope (``comfyui_dit_attention``) applies them to the keys, values and queries of one attention
call, the block scope (``comfyui_dit_block``) to the tokens entering a block. Image tokens are ``[B, t*h*w, ...]``,
row-major per frame of a ``(t, h, w)`` grid. No ComfyUI import.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..downsample import MAX, NEAREST
from ..merge import IDENTITY, MEAN
from .comfyui import seeded_plan, warn_grid_too_small
from .dit_settings import DiTToDo, DiTToMe


def pool_grid(x: torch.Tensor, grid: tuple[int, int, int], factor: int, time_factor: int,
              method: str, dim: int = 1) -> torch.Tensor:
    """Image tokens ``x [B, t*h*w, ...]`` (along ``dim``: 2 for a DiT's ``[B, heads, t*h*w, D]``, pooled in its own
    layout) pooled over ``time_factor x factor x factor`` cells of ``grid (t, h, w)``.

    Partial cells at the far edges are kept, pooled over the tokens they have
    (as ``tome.downsample.downsample_tokens`` does). Returns
    ``[B, ceil(t/tf) * ceil(h/f) * ceil(w/f), ...]``. ``nearest`` keeps the
    first token of each cell and copies only those. ``x`` may be a strided view:
    the cells are views of it.
    """
    t, h, w = grid
    if method == NEAREST:
        cells = x.unflatten(dim, (t, h, w))
        firsts = (slice(None),) * dim + (slice(None, None, time_factor), slice(None, None, factor),
                                         slice(None, None, factor))
        return cells[firsts].flatten(dim, dim + 2)
    dims, steps = (t, h, w), (time_factor, factor, factor)
    sizes = [math.ceil(n / step) for n, step in zip(dims, steps, strict=True)]
    if [size * step for size, step in zip(sizes, steps, strict=True)] != list(dims):
        # partial cells at the far edges: padded to whole ones
        return padded_pool(x.movedim(dim, 1), dims, steps, sizes, method).movedim(1, dim)
    blocks = x.unflatten(dim, (sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2]))
    # A mean is the sum over the cell divided by its size, as the padded pooling computes it.
    within = (dim + 1, dim + 3, dim + 5)
    pooled = blocks.amax(dim=within) if method == MAX else blocks.mean(dim=within)
    return pooled.flatten(dim, dim + 2)


def padded_pool(x: torch.Tensor, dims: tuple, steps: tuple, sizes: list, method: str) -> torch.Tensor:
    """``pool_grid`` where partial cells lie at the far edges: every axis padded up to whole cells, each cell
    reduced over the tokens it has."""
    batch, rest = x.shape[0], x.shape[2:]
    # F.pad lists the last axis first: channels, w, h, t.
    pad = [0, 0]
    for n, step, size in zip(dims[::-1], steps[::-1], sizes[::-1], strict=True):
        pad += [0, size * step - n]
    fill = -math.inf if method == MAX else 0.0
    blocks = F.pad(x.reshape(batch, *dims, -1), pad, value=fill)
    blocks = blocks.view(batch, sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2], -1)
    if method == MAX:
        pooled = blocks.amax(dim=(2, 4, 6))
    else:  # a partial cell is the mean of the tokens it has: counted by pooling ones padded as the tokens are,
        # made on the device (a tensor of the counts made on the host would be a blocking copy per call)
        ones = F.pad(x.new_ones(1, *dims, 1), pad, value=0.0)
        count = ones.view(1, sizes[0], steps[0], sizes[1], steps[1], sizes[2], steps[2], 1).sum(dim=(2, 4, 6))
        pooled = blocks.sum(dim=(2, 4, 6)) / count
    return pooled.reshape(batch, -1, *rest)


def pools(todo: DiTToDo, grid: tuple[int, int, int]) -> bool:
    """Whether ``todo``'s cells fit ``grid (t, h, w)``; where they do not, the grid is left as it is, with one
    warning per grid and factor."""
    _, h, w = grid
    if todo.factor > min(h, w):
        warn_grid_too_small(w, h, todo.factor)
        return False
    return True


def replace_span(x: torch.Tensor, start: int, length: int, image: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """A new ``x [B, L, ...]`` with its ``length`` tokens (along ``dim``) from ``start`` replaced by
    ``image [B, L', ...]``."""
    end = start + length
    parts = [x.narrow(dim, 0, start)] if start else []
    parts.append(image)
    if end < x.shape[dim]:
        parts.append(x.narrow(dim, end, x.shape[dim] - end))
    return torch.cat(parts, dim=dim)


class FramePlan:
    """A ``MergePlan`` per frame of a ``(t, h, w)`` grid (frames folded into the batch): merges the image
    tokens ``[B, t*h*w, ...]`` (along ``dim``) to ``[B, t*m, ...]`` and back."""

    def __init__(self, plan, frames: int):
        self.plan = plan
        self.frames = frames

    @property
    def removed(self) -> int:
        """How many image tokens ``merge`` removes, over all frames."""
        return self.plan.removed * self.frames

    def merge(self, x: torch.Tensor, mode: str = MEAN, dim: int = 1) -> torch.Tensor:
        if dim != 1:
            return self.merge(x.movedim(dim, 1), mode).movedim(1, dim)
        batch, n, rest = x.shape[0], x.shape[1], x.shape[2:]
        merged = self.plan.merge(x.reshape(batch * self.frames, n // self.frames, -1), mode)
        return merged.reshape(batch, -1, *rest)

    def prepare(self) -> None:
        """Make ``unmerge``'s index map now (``MergePlan.source_index``, kept once made)."""
        self.plan.source_index()

    def unmerge(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        if dim != 1:
            return self.unmerge(x.movedim(dim, 1)).movedim(1, dim)
        batch, m, rest = x.shape[0], x.shape[1], x.shape[2:]
        return self.plan.unmerge(x.reshape(batch * self.frames, m // self.frames, -1)).reshape(batch, -1, *rest)


def frame_plan(tome: DiTToMe, tokens: torch.Tensor, grid: tuple[int, int, int], call_index: int, options):
    """ToMe's plan for one call, matched on the image tokens ``tokens [B, t*h*w, ...]`` (an attention call's keys,
    a block's input) frame by frame: a ``FramePlan`` (a ``MergePlan`` for one frame), or ``IDENTITY`` where
    nothing is merged. The seed mixes
    ``call_index``, the call's place among the model call's image attention calls or blocks."""
    t, h, w = grid
    metric = tokens.reshape(tokens.shape[0] * t, h * w, -1)
    plan = seeded_plan(tome, metric, w, h, int(h * w * tome.ratio), ("dit",), call_index, options)
    # One frame: the plan itself, which merges tokens of any trailing shape without a reshape (a copy, for a
    # strided view).
    return plan if plan is IDENTITY or t == 1 else FramePlan(plan, t)
