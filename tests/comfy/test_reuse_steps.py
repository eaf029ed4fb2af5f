"""Apply ToMe (Advanced)'s ``reuse_steps``: one matching serves several consecutive sampling steps."""

import copy

import pytest
import torch
from helpers import SAMPLER_STEPS, sample


def make_patch(pack, reuse_steps, sigma_end=0.0):
    reach = pack.attn_patch.Reach(1, sigma_end=sigma_end)
    return pack.attn_patch.ToMeAttn1Patch(pack.attn_patch.ToMeSettings(0.5, 2, 2, reach, reuse_steps=reuse_steps))


def plans(patch, sigmas, block=("input", 1)):
    n = torch.randn(1, 256, 8, generator=torch.Generator().manual_seed(0))
    return [patch.plan(n, {"original_shape": [1, 4, 16, 16], "sigmas": torch.tensor([sigma]), "block": block})
            for sigma in sigmas]


def test_a_plan_serves_reuse_steps_steps_then_a_fresh_one_is_made(pack):
    # Steps 0 (cond and uncond as separate calls), 1, 2, 3, 4: fresh plans at steps 0, 2 and 4.
    p = plans(make_patch(pack, 2), [10.0, 10.0, 8.0, 6.0, 4.0, 2.0])
    assert p[0] is p[1] is p[2]
    assert p[3] is p[4] and p[3] is not p[0]
    assert p[5] is not p[3]
    assert len({id(plan) for plan in plans(make_patch(pack, 1), [10.0, 10.0, 8.0])}) == 3


def test_a_new_run_and_another_block_do_not_reuse(pack):
    patch = make_patch(pack, 5)
    first = plans(patch, [10.0, 8.0])
    again = plans(patch, [10.0])  # a higher sigma: the next sampling run
    assert first[0] is first[1] and again[0] is not first[0]
    assert plans(patch, [10.0], block=("output", 9))[0] is not again[0]


def test_a_reused_plan_still_stops_at_the_window(pack):
    p = plans(make_patch(pack, 10, sigma_end=7.0), [10.0, 8.0, 6.0])
    assert p[0] is p[1] and p[2] is pack.attn_patch.IDENTITY


def test_copies_start_with_an_empty_cache(pack):
    patch = make_patch(pack, 3)
    plans(patch, [10.0])
    assert patch.cache and not copy.deepcopy(patch).cache


class CountingSigmas(torch.Tensor):
    """A sigma tensor that counts how often its value is read (each read is a GPU sync on CUDA)."""

    reads = 0

    def flatten(self, *args, **kwargs):
        CountingSigmas.reads += 1
        return super().flatten(*args, **kwargs)


@pytest.mark.parametrize("reuse_steps", [1, 3])
def test_a_block_call_reads_the_sigma_once(pack, reuse_steps):
    """The window, the step counter and the seed all need the sigma; the tensor is read once per call."""
    CountingSigmas.reads = 0
    sigmas = torch.tensor([5.0]).as_subclass(CountingSigmas)
    n = torch.randn(1, 256, 8)
    options = {"original_shape": [1, 4, 16, 16], "sigmas": sigmas, "block": ("input", 1)}
    merged, _, _ = make_patch(pack, reuse_steps)(n, n, n, options)
    assert merged.shape[1] == 128
    assert CountingSigmas.reads == 1


def test_ksampler_with_reuse_steps_is_finite_reproducible_and_differs(pack, comfy_nodes, sd15):
    def advanced(reuse_steps):
        return pack.nodes.ApplyToMeAdvanced().patch(sd15, 0.5, 2, 2, "auto", 0, True, "q, k and v", 0.0, 1.0,
                                                    "self-attention", reuse_steps)[0]

    reused = sample(comfy_nodes, advanced(SAMPLER_STEPS))
    assert torch.isfinite(reused).all()
    assert torch.equal(reused, sample(comfy_nodes, advanced(SAMPLER_STEPS)))
    assert not torch.equal(reused, sample(comfy_nodes, advanced(1)))
