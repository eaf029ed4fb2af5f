"""Apply ToMe (Advanced)'s ``reuse_steps`` inside the real sampler (the plan cache alone: tests/tome)."""

import torch
from helpers import SAMPLER_STEPS, sample


def test_ksampler_with_reuse_steps_is_finite_reproducible_and_differs(pack, comfy_nodes, sd15):
    def advanced(reuse_steps):
        return pack.unet.apply_tome(sd15, ratio=0.5, reuse_steps=reuse_steps)

    reused = sample(comfy_nodes, advanced(SAMPLER_STEPS))
    assert torch.isfinite(reused).all()
    assert torch.equal(reused, sample(comfy_nodes, advanced(SAMPLER_STEPS)))
    assert not torch.equal(reused, sample(comfy_nodes, advanced(1)))


def test_the_sampler_gives_each_run_its_own_cache_through_the_wrapper(pack, comfy_nodes, sd15):
    """The OUTER_SAMPLE wrapper puts a fresh cache into the run's options; the model's options never hold one."""
    patched = pack.unet.apply_tome(sd15, ratio=0.5, reuse_steps=2)
    caches = []

    def spy(n, context, value, extra_options):
        caches.append(extra_options.get(pack.comfyui.RUN_KEY))
        return n, context, value

    patched.set_model_attn1_patch(spy)
    sample(comfy_nodes, patched)
    sample(comfy_nodes, patched)
    runs = {id(c) for c in caches}
    assert None not in caches and len(runs) == 2
    assert pack.comfyui.RUN_KEY not in patched.model_options["transformer_options"]
    (start,) = pack.unet.apply_tome(sd15, ratio=0.5).get_wrappers("outer_sample", "tome")  # the GPU rule's
    assert not start.keeps_plans
