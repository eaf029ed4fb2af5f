"""Averaging keys without shortening them (``tome.norms.keeping_norms``), through ToMe's merge and ToDo's
average pooling on a DiT."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tome.hosts.dit_tokens import pool_grid
from tome.merge import IDENTITY, MEAN, build_plan
from tome.norms import keeping_norms


def expected(members: torch.Tensor) -> torch.Tensor:
    """``members [n, H, D]`` averaged: the mean's direction at the members' mean length, head by head."""
    mean = members.mean(dim=0)
    return mean / mean.norm(dim=-1, keepdim=True) * members.norm(dim=-1).mean(dim=0)[:, None]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 2), st.floats(0.0, 1.0), st.integers(1, 3),
       st.integers(0, 2**31 - 1))
def test_a_merge_gives_each_head_of_a_merged_token_its_mean_direction_at_its_members_mean_length(w, h, batch, ratio,
                                                                                               heads, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, w * h, heads, 4, generator=g, dtype=torch.float64)
    plan = build_plan(x.flatten(2), w, h, 2, 2, int(w * h * ratio), generator=g)

    def merge(t):
        return plan.merge(t, MEAN)

    merged = keeping_norms(merge, x.flatten(2), heads)
    torch.testing.assert_close(keeping_norms(merge, x, heads), merged.unflatten(2, (heads, 4)))  # [B, N, H, D] too
    out = plan.unmerge(merged).unflatten(2, (heads, 4))
    dest = torch.arange(w * h).repeat(batch, 1) if plan is IDENTITY else plan.destination_of()
    for b in range(batch):
        for group in dest[b].unique():
            members = x[b, dest[b] == group]
            torch.testing.assert_close(out[b, dest[b] == group], expected(members).expand_as(members))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 7), st.integers(1, 7), st.integers(1, 3), st.integers(1, 2),
       st.integers(0, 2**31 - 1))
def test_average_pooling_gives_each_cell_its_mean_direction_at_its_tokens_mean_length(t, h, w, factor, time_factor,
                                                                                      seed):
    x = torch.randn(1, t * h * w, 2, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pooled = keeping_norms(lambda y: pool_grid(y, (t, h, w), factor, time_factor, "average"), x, 2)
    cells = x.unflatten(1, (t, h, w))
    rows = [(ti, hi, wi) for ti in range(0, t, time_factor) for hi in range(0, h, factor) for wi in range(0, w, factor)]
    assert pooled.shape == (1, len(rows), 2, 4)
    for index, (ti, hi, wi) in enumerate(rows):
        members = cells[0, ti:ti + time_factor, hi:hi + factor, wi:wi + factor].flatten(0, 2)  # partial edge cells
        torch.testing.assert_close(pooled[0, index], expected(members))


def test_large_half_precision_vectors_stay_finite_and_keep_their_length():
    x = (torch.randn(1, 64, 2 * 128, generator=torch.Generator().manual_seed(1)) * 300).half()  # squares > fp16 max
    plan = build_plan(x.float(), 8, 8, 2, 2, 32, generator=torch.Generator().manual_seed(0))
    merged = keeping_norms(lambda t: plan.merge(t, MEAN), x, 2)
    assert merged.dtype == torch.float16 and torch.isfinite(merged).all()
    lengths = merged.float().unflatten(2, (2, 128)).norm(dim=-1)
    assert lengths.min() > 2800  # 300 * sqrt(128) = 3394 on average; the plain mean of two is about 2400
