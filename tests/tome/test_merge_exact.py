"""Our merge math against the reference, tomesd 0.1.3, bit for bit (CPU)."""

import itertools

import pytest
import torch
from tomesd.merge import bipartite_soft_matching_random2d as reference

import tome.merge as merge_module
from tome.merge import bipartite_soft_matching_random2d

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BATCHES = [1, 2, 3, 4]
STRIDES = [(2, 2), (1, 2), (2, 1), (4, 2), (3, 3)]
# (w, h): divisible by every stride above, and three that several strides do not divide.
GRIDS = [(24, 24), (65, 63), (33, 97), (40, 30)]
RATIOS = [0.0, 0.3, 0.5, 0.9]  # 0.9 asks for more tokens than there are sources: capped.

FACTORS = (DTYPES, BATCHES, STRIDES, GRIDS, RATIOS, [False, True])


def _case(indices):
    """One case of the full product (what --full and CI run). The default run keeps a quarter of it: for each
    combination of the other factors one batch size, chosen by the sum of all the indices, so that every batch
    size still meets every value of every other factor."""
    values = [factor[i] for factor, i in zip(FACTORS, indices, strict=True)]
    batch_index = indices[1]
    in_default = batch_index == (sum(indices) - batch_index) % len(BATCHES)
    return pytest.param(*values, marks=() if in_default else pytest.mark.slow)


CASES = [_case(indices) for indices in itertools.product(*(range(len(factor)) for factor in FACTORS))]


def _inputs(dtype, batch, w, h, seed):
    g = torch.Generator().manual_seed(seed)
    n = w * h
    # Few distinct values: many tied similarities, so tie-breaking is exercised too.
    metric = torch.randint(-3, 4, (batch, n, 16), generator=g).to(dtype)
    x = torch.randn(batch, n, 40, generator=g).to(dtype)
    return metric, x


def _both(metric, w, h, sx, sy, r, no_rand, seed):
    ours = bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=no_rand,
                                            generator=torch.Generator().manual_seed(seed))
    ref = reference(metric, w, h, sx, sy, r, no_rand=no_rand,
                    generator=torch.Generator().manual_seed(seed))
    return ours, ref


def _case_id(value):
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value).replace("torch.", "")


@pytest.mark.parametrize("dtype,batch,stride,grid,ratio,no_rand", CASES, ids=_case_id)
def test_merge_and_unmerge_equal_tomesd_bit_for_bit(dtype, batch, stride, grid, ratio, no_rand):
    (sx, sy), (w, h) = stride, grid
    seed = hash((batch, sx, sy, w, h)) % 2**31
    metric, x = _inputs(dtype, batch, w, h, seed)
    r = int(w * h * ratio)
    (merge, unmerge), (ref_merge, ref_unmerge) = _both(metric, w, h, sx, sy, r, no_rand, seed)

    for mode in ("mean", "sum"):
        merged = merge(x, mode=mode)
        expected = ref_merge(x, mode=mode)
        assert merged.dtype == expected.dtype
        assert torch.equal(merged, expected), mode
        assert torch.equal(unmerge(merged), ref_unmerge(expected)), mode
    if r > 0:
        assert merge(x).shape[1] < w * h, "a real merge must remove tokens"


@pytest.mark.parametrize("w,h,sx,sy", [(8, 1, 2, 2), (1, 8, 2, 2), (1, 33, 2, 1), (3, 3, 4, 4)])
def test_grids_that_crash_tomesd_merge_nothing(w, h, sx, sy):
    metric = torch.randn(2, w * h, 8)
    with pytest.raises((RuntimeError, IndexError)):  # tomesd: empty gathers and bad views
        ref_merge, _ = reference(metric, w, h, sx, sy, 2, generator=torch.Generator())
        ref_merge(metric)
    merge, unmerge = bipartite_soft_matching_random2d(metric, w, h, sx, sy, 2, generator=torch.Generator())
    assert merge(metric) is metric
    assert unmerge(metric) is metric


def test_missing_generator_is_a_clear_error_not_the_global_rng():
    with pytest.raises(ValueError, match="generator"):
        bipartite_soft_matching_random2d(torch.randn(1, 16, 4), 4, 4, 2, 2, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("grid", [(65, 63), (33, 97)], ids=_case_id)
@pytest.mark.parametrize("no_rand", [False, True])
def test_blocked_scoring_equals_tomesd_bit_for_bit(monkeypatch, dtype, grid, no_rand):
    """The shortest score blocks allowed (the last one longer) still give tomesd's merge exactly."""
    monkeypatch.setattr(merge_module, "SCORE_BLOCK_BYTES", 7 * 4 * 1024)
    (w, h), batch = grid, 3
    metric, x = _inputs(dtype, batch, w, h, seed=11)
    (merge, unmerge), (ref_merge, ref_unmerge) = _both(metric, w, h, 2, 2, w * h // 2, no_rand, seed=11)
    assert torch.equal(merge(x), ref_merge(x))
    assert torch.equal(unmerge(merge(x)), ref_unmerge(ref_merge(x)))


@pytest.mark.parametrize(("rows", "block", "blocks"), [
    (10, 1, [(0, 10)]), (130, 7, [(0, 64), (64, 130)]), (200, 100, [(0, 100), (100, 200)]),
    (250, 100, [(0, 100), (100, 250)]), (300, 100, [(0, 100), (100, 200), (200, 300)]),
])
def test_row_blocks_are_never_shorter_than_the_minimum(rows, block, blocks):
    assert merge_module.row_blocks(rows, block) == blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
def test_best_destinations_blocks_large_products_and_keeps_every_score(dtype):
    """At 96x96 tokens (a 768 px SD1.5 grid) the default block size splits the product; nothing changes."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 6912, 64, generator=g).to(dtype)
    b = torch.randn(2, 2304, 64, generator=g).to(dtype)
    whole_product_bytes = a.shape[0] * a.shape[1] * b.shape[1] * a.element_size()
    assert merge_module.SCORE_BLOCK_BYTES < whole_product_bytes, "must split"
    best, index = merge_module.best_destinations(a, b)
    expected_best, expected_index = (a @ b.transpose(-1, -2)).max(dim=-1)
    assert torch.equal(best, expected_best)
    assert torch.equal(index, expected_index)
