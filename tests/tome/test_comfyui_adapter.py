"""The ComfyUI U-Net adapter's patches alone, called as ComfyUI calls them, without booting ComfyUI."""

import threading

import pytest
import torch

from tome.grid import block_grid
from tome.hosts.comfyui import RUN_KEY, Reach, SamplingRun
from tome.hosts.comfyui_unet import IDENTITY, ToMeAttn1Patch, ToMeSettings

SCHEDULE = torch.tensor([10.0, 8.0, 6.0, 4.0, 2.0, 0.0])


def make_patch(reuse_steps, sigma_end=0.0):
    return ToMeAttn1Patch(ToMeSettings(0.5, 2, 2, Reach(1, sigma_end=sigma_end), reuse_steps=reuse_steps))


def block_call(sigma, cache=None, block=("input", 1), uuids=("cond",), schedule=SCHEDULE):
    """The extra_options of one block call inside a sampling run whose cache is ``cache``."""
    options = {"original_shape": [1, 4, 16, 16], "sigmas": torch.tensor([sigma]), "block": block,
               "uuids": list(uuids), "sample_sigmas": schedule}
    if cache is not None:
        options[RUN_KEY] = cache
    return options


def plans(patch, sigmas, cache, **call):
    n = torch.randn(1, 256, 8, generator=torch.Generator().manual_seed(0))
    return [patch.plan(n, block_call(sigma, cache, **call)) for sigma in sigmas]


def test_a_plan_serves_reuse_steps_steps_then_a_fresh_one_is_made():
    # Steps 0 (cond and uncond as separate calls of the same batch), 1, 2, 3, 4: fresh plans at steps 0, 2, 4.
    p = plans(make_patch(2), [10.0, 10.0, 8.0, 6.0, 4.0, 2.0], SamplingRun())
    assert p[0] is p[1] is p[2]
    assert p[3] is p[4] and p[3] is not p[0]
    assert p[5] is not p[3]
    assert len({id(plan) for plan in plans(make_patch(1), [10.0, 10.0, 8.0], SamplingRun())}) == 3


def test_steps_are_positions_in_the_schedule_not_counted_calls():
    """A sampler that evaluates between schedule sigmas (heun, dpmpp_sde) does not shorten the reuse."""
    p = plans(make_patch(2), [10.0, 9.0, 8.0, 7.0], SamplingRun())
    assert p[0] is p[1]  # 9.0 has one schedule sigma above it: step 1, as 8.0 is
    assert p[2] is p[0] and p[3] is not p[0]


def test_each_batch_block_and_run_has_its_own_plans():
    patch, cache = make_patch(5), SamplingRun()
    cond = plans(patch, [10.0, 8.0], cache)
    assert cond[0] is cond[1]
    assert plans(patch, [8.0], cache, uuids=("uncond",))[0] is not cond[0]
    assert plans(patch, [8.0], cache, block=("output", 9))[0] is not cond[0]
    assert plans(patch, [8.0], SamplingRun())[0] is not cond[0]  # another sampling run


def test_without_a_sampling_run_every_call_makes_a_fresh_plan():
    p = plans(make_patch(5), [10.0, 10.0], cache=None)
    assert p[0] is not p[1]


def test_a_reused_plan_still_stops_at_the_window():
    p = plans(make_patch(10, sigma_end=7.0), [10.0, 8.0, 6.0], SamplingRun())
    assert p[0] is p[1] and p[2] is IDENTITY


def test_the_patch_object_holds_nothing_but_its_settings():
    """Shared by every clone and thread (ComfyUI no longer deep-copies patches): no state to corrupt."""
    patch = make_patch(3)
    plans(patch, [10.0, 8.0], SamplingRun())
    assert vars(patch) == {"settings": patch.settings}


def test_threads_sharing_a_run_cache_get_the_plans_of_their_own_batch():
    patch, cache = make_patch(3), SamplingRun()
    n = {"cond": torch.randn(1, 256, 8, generator=torch.Generator().manual_seed(1)),
         "uncond": torch.randn(1, 256, 8, generator=torch.Generator().manual_seed(2))}
    alone = {}
    for name, x in n.items():
        own = SamplingRun()
        alone[name] = [patch.plan(x, block_call(s, own, uuids=(name,))).dst_of_src for s in (10.0, 8.0)]
    seen = {}
    barrier = threading.Barrier(2)

    def run(name):
        barrier.wait()
        seen[name] = [patch.plan(n[name], block_call(s, cache, uuids=(name,))).dst_of_src for s in (10.0, 8.0)]

    threads = [threading.Thread(target=run, args=(name,)) for name in n]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in n:
        assert all(torch.equal(a, b) for a, b in zip(seen[name], alone[name], strict=True)), name
    assert not torch.equal(seen["cond"][0], seen["uncond"][0])


class CountingSigmas(torch.Tensor):
    """A sigma tensor that counts how often its value is read (each read is a GPU sync on CUDA)."""

    reads = 0

    def flatten(self, *args, **kwargs):
        CountingSigmas.reads += 1
        return super().flatten(*args, **kwargs)


@pytest.mark.parametrize("reuse_steps", [1, 3])
def test_a_block_call_reads_the_sigma_once(reuse_steps):
    """The window, the step and the seed all need the sigma; the tensor is read once per call."""
    CountingSigmas.reads = 0
    options = block_call(5.0, SamplingRun())
    options["sigmas"] = torch.tensor([5.0]).as_subclass(CountingSigmas)
    n = torch.randn(1, 256, 8)
    merged, _, _ = make_patch(reuse_steps)(n, n, n, options)
    assert merged.shape[1] == 128
    assert CountingSigmas.reads == 1


def test_each_step_and_block_draws_a_fresh_partition():
    patch = make_patch(1)

    def destinations(sigma, block=("input", 1)):
        return plans(patch, [sigma], None, block=block)[0].dst_pos.flatten().tolist()

    assert destinations(5.0) == destinations(5.0)
    assert destinations(5.0) != destinations(4.0)
    assert destinations(5.0) != destinations(5.0, ("output", 9))


@pytest.mark.parametrize(("n_tokens", "max_downsample", "grid"), [
    (64 * 64, 1, (64, 64)), (32 * 32, 1, None), (32 * 32, 2, (32, 32)),
    (33 * 49, 2, (33, 49)),  # an odd latent's level rounds up, as tomesd's rule does
    (1000, 8, None),  # no level of the latent holds 1000 tokens: left alone, not merged on a wrong grid
    (2 * 64 * 64, 8, None),  # more tokens than the latent has positions
])
def test_block_grid_is_the_one_rule_for_which_block_is_reduced(n_tokens, max_downsample, grid):
    original_shape = [1, 4, 97, 65] if n_tokens == 33 * 49 else [1, 4, 64, 64]
    assert block_grid(n_tokens, original_shape, max_downsample) == grid
