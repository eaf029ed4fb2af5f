"""Invariants of the merge plan, over generated grids, strides, ratios and batches."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tome.merge import IDENTITY, PRUNE, MergePlan, build_plan

grids = st.tuples(st.integers(1, 20), st.integers(1, 20))  # (w, h)
strides = st.tuples(st.integers(1, 4), st.integers(1, 4))  # (sx, sy)


@st.composite
def plan_inputs(draw):
    w, h = draw(grids)
    sx, sy = draw(strides)
    batch = draw(st.integers(1, 4))
    ratio = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    no_rand = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    metric = torch.randn(batch, w * h, 8, generator=g, dtype=torch.float64)
    return metric, w, h, sx, sy, int(w * h * ratio), no_rand, seed


def _plan(metric, w, h, sx, sy, r, no_rand, seed):
    return build_plan(metric, w, h, sx, sy, r, no_rand=no_rand, generator=torch.Generator().manual_seed(seed))


def _expected_removed(w, h, sx, sy, r):
    n_dst = (h // sy) * (w // sx)
    if r <= 0 or n_dst in (0, w * h):
        return 0
    return min(r, w * h - n_dst)


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_shapes_and_removed_count(args):
    metric, w, h, sx, sy, r, no_rand, seed = args
    plan = _plan(*args)
    removed = _expected_removed(w, h, sx, sy, r)
    assert plan.removed == removed
    x = torch.randn(metric.shape[0], w * h, 5, dtype=torch.float64)
    merged = plan.merge(x)
    assert merged.shape == (metric.shape[0], w * h - removed, 5)
    assert plan.unmerge(merged).shape == x.shape


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_round_trip_keeps_unmerged_tokens_and_gives_merged_ones_their_group_mean(args):
    metric, w, h, sx, sy, r, no_rand, seed = args
    plan = _plan(*args)
    x = torch.randn(metric.shape[0], w * h, 5, dtype=torch.float64)
    out = plan.unmerge(plan.merge(x))
    if plan is IDENTITY:
        assert torch.equal(out, x)
        return
    dest = plan.destination_of()
    for b in range(x.shape[0]):
        for group in dest[b].unique():
            members = (dest[b] == group).nonzero()[:, 0]
            if len(members) == 1:
                assert torch.equal(out[b, members[0]], x[b, members[0]])
            else:
                mean = x[b, members].mean(dim=0)
                torch.testing.assert_close(out[b, members], mean.expand(len(members), -1))
    # Exactly the merged sources left their own position, each into a destination.
    moved = dest != torch.arange(w * h)
    assert int(moved.sum(dim=1).max()) == plan.removed
    assert set(dest[moved].tolist()) <= set(plan.dst_pos.flatten().tolist())


@settings(max_examples=200, deadline=None)
@given(plan_inputs())
def test_pruning_drops_the_merged_sources_and_gives_them_their_destinations_own_value(args):
    metric, w, h, sx, sy, r, no_rand, seed = args
    plan = _plan(*args)
    x = torch.randn(metric.shape[0], w * h, 5, dtype=torch.float64)
    pruned = plan.merge(x, PRUNE)
    assert pruned.shape == plan.merge(x).shape
    out = plan.unmerge(pruned)
    if plan is IDENTITY:
        assert torch.equal(out, x)
        return
    dest = plan.destination_of()
    torch.testing.assert_close(out, x.gather(1, dest[..., None].expand(-1, -1, 5)), rtol=0, atol=0)


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_r_zero_is_the_identity(args):
    metric, w, h, sx, sy, _, no_rand, seed = args
    plan = _plan(metric, w, h, sx, sy, 0, no_rand, seed)
    x = torch.randn(metric.shape[0], w * h, 3)
    assert plan is IDENTITY
    assert plan.merge(x) is x and plan.unmerge(x) is x


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_same_seed_same_plan(args):
    first, second = _plan(*args), _plan(*args)
    if isinstance(first, MergePlan):
        for name in ("dst_pos", "unm_pos", "src_pos", "dst_of_src"):
            assert torch.equal(getattr(first, name), getattr(second, name)), name


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_partition_is_shared_by_the_batch(args):
    """Every element gets the same destinations, even where its matching differs."""
    plan = _plan(*args)
    if isinstance(plan, MergePlan):
        assert plan.dst_pos.shape[0] == 1
        batch = args[0].shape[0]
        sources = torch.cat([plan.unm_pos, plan.src_pos], dim=1)[..., 0].sort(dim=1).values
        assert torch.equal(sources, sources[:1].expand(batch, -1))


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_building_a_plan_leaves_the_global_rng_untouched(args):
    before = torch.get_rng_state()
    _plan(*args)
    assert torch.equal(torch.get_rng_state(), before)
