"""Bipartite soft matching on a 2D token grid (ToMe for SD, Bolya & Hoffman 2023).

The tokens of a ``w x h`` grid are split into destinations (one per ``sy x sx``
cell) and sources (everything else). Each source finds its most cosine-similar
destination, and the ``r`` best-matched sources are averaged into their
destinations. After the expensive operation ran on ``N - r`` tokens, every
merged source takes its destination's value back.

``build_plan`` does the partition and the matching once and returns a
``MergePlan`` that merges and unmerges any number of tensors sharing that token
layout (q, k and v, say). ``bipartite_soft_matching_random2d`` is the same math
behind tomesd 0.1.3's signature, so code written against tomesd runs unchanged
and gets bit-identical results.

Randomness only ever comes from the ``generator`` argument: the global RNG is
never read, so patching a model cannot shift a sampler's noise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .partition import Partition, draw_partition

MEAN = "mean"  # ToMe: each destination becomes the mean of itself and the sources merged into it
PRUNE = "prune"  # the baseline: the same sources dropped, each destination left as it is
REDUCTIONS = (MEAN, PRUNE)


class MergePlan:
    """The matching of one metric: which sources merge into which destinations.

    Index tensors have batch size ``B`` of the metric (or 1 where they are the
    same for every element) and a trailing singleton channel dimension, ready to
    be expanded over any channel count:

    - ``dst_pos [1, N_dst, 1]``: grid positions of the destinations;
    - ``unm_pos [B, N_unm, 1]``: grid positions of the sources kept as they are;
    - ``src_pos [B, r, 1]``: grid positions of the merged sources;
    - ``dst_of_src [B, r, 1]``: for each merged source, the index (into the
      destination list) of the destination it joins.

    A merged tensor is laid out as ``unmerged sources | destinations``. ``merge``
    and ``unmerge`` take tokens ``[B, N, C]``, or with any other dimensions, the
    tokens along ``dim`` (a DiT's ``[B, heads, N, D]``, merged in its own layout
    rather than copied into another).
    """

    __slots__ = ("n_tokens", "dst_pos", "unm_pos", "src_pos", "dst_of_src", "_kept_pos", "_dst_slot",
                 "_source_index", "_expanded")

    def __init__(self, n_tokens: int, dst_pos: torch.Tensor, unm_pos: torch.Tensor,
                 src_pos: torch.Tensor, dst_of_src: torch.Tensor):
        self.n_tokens = n_tokens
        self.dst_pos = dst_pos
        self.unm_pos = unm_pos
        self.src_pos = src_pos
        self.dst_of_src = dst_of_src
        # Index maps for merge and unmerge, made on first use and kept, and their views expanded to each shape
        # of tokens they met: one plan serves several tensors (q, k and v; the cross-attention and MLP inputs
        # too; a key's lengths), each then one gather (and one scatter) with no index work of its own.
        self._kept_pos = None
        self._dst_slot = None
        self._source_index = None
        self._expanded: dict[tuple, torch.Tensor] = {}

    @property
    def removed(self) -> int:
        """How many tokens ``merge`` removes: ``N - merged length``."""
        return self.src_pos.shape[1]

    def kept_pos(self) -> torch.Tensor:
        """``[B, N - removed, 1]``: the grid position each merged token starts from (unmerged sources, then
        destinations)."""
        if self._kept_pos is None:
            batch = self.unm_pos.shape[0]
            self._kept_pos = torch.cat([self.unm_pos, self.dst_pos.expand(batch, -1, -1)], dim=1)
        return self._kept_pos

    def dst_slot(self) -> torch.Tensor:
        """``[B, removed, 1]``: for each merged source, the merged token (``kept_pos``'s order) it joins."""
        if self._dst_slot is None:
            self._dst_slot = self.dst_of_src + self.unm_pos.shape[1]
        return self._dst_slot

    def source_index(self) -> torch.Tensor:
        """``[B, N, 1]``: for each grid position, the merged token whose value it takes back on unmerge."""
        if self._source_index is None:
            batch = self.unm_pos.shape[0]
            kept = self.kept_pos()
            index = torch.empty(batch, self.n_tokens, 1, dtype=torch.long, device=self.dst_pos.device)
            index.scatter_(1, kept, torch.arange(kept.shape[1], device=index.device).view(1, -1, 1)
                           .expand(batch, -1, -1))
            index.scatter_(1, self.src_pos, self.dst_slot())
            self._source_index = index
        return self._source_index

    def prepare(self) -> None:
        """Make ``unmerge``'s index map now (kept once made): where it must not be made inside a compiled
        graph."""
        self.source_index()

    def _index(self, name: str, index: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``index [B, n, 1]`` viewed and expanded to index the tokens of ``x``, which lie along ``dim`` (``n`` of
        them, every other dimension whole), kept per name, dimension and shape."""
        key = (name, dim, x.shape[:dim], x.shape[dim + 1:])
        expanded = self._expanded.get(key)
        if expanded is None:
            batch, n = index.shape[:2]
            shaped = index if dim == 1 and x.dim() == 3 else index.view(batch, *(1,) * (dim - 1), n,
                                                                         *(1,) * (x.dim() - dim - 1))
            expanded = shaped.expand(*x.shape[:dim], n, *x.shape[dim + 1:])
            if not torch.compiler.is_compiling():  # a traced view is the graph's, never kept for eager calls
                self._expanded[key] = expanded
        return expanded

    def merge(self, x: torch.Tensor, mode: str = "mean", dim: int = 1) -> torch.Tensor:
        """``x [B, N, ...] -> [B, N - removed, ...]`` (the tokens along ``dim``: 2 for a DiT's ``[B, heads, N,
        D]``, merged in its own layout); ``mode`` is a ``scatter_reduce`` reduction, or ``PRUNE``: the merged
        sources are dropped and every destination keeps its own value (the baseline that removes the same
        tokens without averaging them)."""
        merged = x.gather(dim, self._index("kept", self.kept_pos(), x, dim))
        if mode == PRUNE:
            return merged
        src = x.gather(dim, self._index("src", self.src_pos, x, dim))
        return merged.scatter_reduce_(dim, self._index("slot", self.dst_slot(), src, dim), src, reduce=mode)

    def unmerge(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x [B, N - removed, ...] -> [B, N, ...]`` (tokens along ``dim``): every merged source gets its
        destination's value."""
        return x.gather(dim, self._index("source", self.source_index(), x, dim))

    def destination_of(self) -> torch.Tensor:
        """``[B, N]``: the grid position whose value each token has after ``unmerge(merge(x))``.

        Destinations and unmerged sources map to themselves; merged sources map
        to their destination.
        """
        batch = self.unm_pos.shape[0]
        out = torch.arange(self.n_tokens, device=self.dst_pos.device).repeat(batch, 1)
        dst_pos = self.dst_pos[..., 0].expand(batch, -1)
        out.scatter_(1, self.src_pos[..., 0], dst_pos.gather(1, self.dst_of_src[..., 0]))
        return out


class IdentityPlan:
    """A plan that merges nothing: r = 0, or a grid with no destination or no source."""

    removed = 0

    @staticmethod
    def prepare() -> None:
        """Nothing to make."""

    @staticmethod
    def merge(x: torch.Tensor, mode: str = "mean", dim: int = 1) -> torch.Tensor:
        return x

    @staticmethod
    def unmerge(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x


IDENTITY = IdentityPlan()

# Only each source's best score is kept from the (N - N_dst) x N_dst similarity matrix (400 MB for a batch of 2
# at 1024 px, SD1.5). On CPU it is made in blocks of source rows of about this many bytes, so each block is
# still in cache when its maximum is taken: faster on CPUs, with far less memory (measured: bench/merge_bench.py
# --pieces, docs/BENCHMARKS.md). Other devices take the whole product at once.
SCORE_BLOCK_BYTES = 8 * 2**20
# The scores must be tomesd's bit for bit, and MKL computes a product of very few rows (a 1-row block, a short
# last block) with another kernel that rounds differently. Blocks are never shorter than this, the remainder
# joins the last block, and a product of fewer rows is taken whole (tested against the whole product).
MIN_BLOCK_ROWS = 64


def row_blocks(rows: int, block: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks covering ``rows``: ``block`` rows each (at least
    ``MIN_BLOCK_ROWS``), the last one taking the remainder."""
    block = max(block, MIN_BLOCK_ROWS)
    starts = list(range(0, rows, block))
    if len(starts) > 1 and rows - starts[-1] < block:
        starts.pop()
    return [(start, stop) for start, stop in zip(starts, [*starts[1:], rows], strict=True)]


def best_destinations(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``a [B, Na, C]``: the highest dot product with a row of ``b [B, Nb, C]`` and its index."""
    b_t = b.transpose(-1, -2)
    batch, rows, _ = a.shape
    blocks = row_blocks(rows, SCORE_BLOCK_BYTES // (batch * b.shape[1] * a.element_size()))
    # bmm, not @: the same kernel that matmul of two 3-D tensors reaches, without its five views.
    if a.device.type != "cpu" or len(blocks) == 1:
        return torch.bmm(a, b_t).max(dim=-1)
    best = [torch.bmm(a[:, start:stop], b_t).max(dim=-1) for start, stop in blocks]
    return torch.cat([score for score, _ in best], dim=1), torch.cat([index for _, index in best], dim=1)


def match(metric: torch.Tensor, partition: Partition, r: int) -> MergePlan:
    """Match each source of ``partition`` to its most cosine-similar destination.

    ``metric [B, N, C]``; the ``r`` (capped at the number of sources) sources
    with the highest similarity are the ones merged.
    """
    batch, n_tokens, channels = metric.shape
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        # Destinations and sources in one gather (the partition's order), then its two parts.
        ordered = metric.gather(1, partition.order.expand(batch, -1, channels))
        n_dst = partition.dst_pos.shape[1]
        b, a = ordered[:, :n_dst], ordered[:, n_dst:]
        r = min(a.shape[1], r)

        node_max, node_idx = best_destinations(a, b)
        # The same (unstable) sort as tomesd, so ties break the same way.
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge_idx[:, r:], edge_idx[:, :r]
        dst_of_src = node_idx[..., None].gather(1, src_idx)

        src_pos = partition.src_pos.expand(batch, -1, -1)
        return MergePlan(
            n_tokens=n_tokens,
            dst_pos=partition.dst_pos,
            unm_pos=src_pos.gather(1, unm_idx),
            src_pos=src_pos.gather(1, src_idx),
            dst_of_src=dst_of_src,
        )


def build_plan(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, r: int,
               no_rand: bool = False,
               generator: torch.Generator | None = None) -> MergePlan | IdentityPlan:
    """Partition the ``w x h`` grid of ``metric [B, N, C]`` and match ``r`` sources.

    - ``sx, sy``: the destination stride; one destination per ``sy x sx`` cell.
      Cells cut off by the right or bottom edge hold only sources.
    - ``r``: tokens to remove, capped at the number of sources.
    - ``no_rand``: the top-left token of every cell is its destination.
    - ``generator``: draws the destination of every cell (required unless
      ``no_rand``); the same draw serves every element of the batch.

    Merges nothing (returns ``IDENTITY``) for ``r <= 0`` and for grids that
    leave no destination or no source (a stride larger than the grid, 1x1).
    """
    n_tokens = metric.shape[1]
    if n_tokens != w * h:
        raise ValueError(f"metric has {n_tokens} tokens but the grid is {w}x{h} = {w * h}")
    if r <= 0:
        return IDENTITY
    partition = draw_partition(w, h, sx, sy, metric.device, no_rand=no_rand, generator=generator)
    if partition is None:
        return IDENTITY
    return match(metric, partition, r)


def do_nothing(x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    """The identity, with tomesd's ``merge`` signature."""
    return x


def bipartite_soft_matching_random2d(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, r: int,
                                     no_rand: bool = False,
                                     generator: torch.Generator | None = None
                                     ) -> tuple[Callable, Callable]:
    """tomesd 0.1.3's signature over ``build_plan``: returns ``(merge, unmerge)``.

    Bit-identical to tomesd where tomesd works; where it crashes (a stride
    larger than the grid, a 1-wide grid) both functions are the identity.
    """
    plan = build_plan(metric, w, h, sx, sy, r, no_rand=no_rand, generator=generator)
    if plan is IDENTITY:
        return do_nothing, do_nothing
    return plan.merge, plan.unmerge
