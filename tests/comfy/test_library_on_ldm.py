"""``tome.apply_patch`` on an LDM-layout U-Net: ComfyUI's own (random weights), found by class name."""

import torch
from helpers import forward, random_context, random_latent, self_attention_calls

import tome
from tome_harness import random_models


def test_apply_patch_merges_an_ldm_unet_and_remove_patch_restores_it(comfy_nodes):
    model = random_models.build_unet_model("sd15", channels=32, context_dim=32)
    x, context = random_latent(2, 32, 32), random_context(2)
    before = forward(model, x, 5.0, context)

    tome.apply_patch(model, ratio=0.5, max_downsample="auto", seed=0)  # .model.diffusion_model, as tomesd
    with self_attention_calls(model) as calls:
        forward(model, x, 5.0, context)
    assert {c.queries for c in calls if c.module.startswith("input_blocks.1.")} == {512}
    assert {c.queries for c in calls if c.module.startswith("input_blocks.4.")} == {256}

    tome.remove_patch(model)
    assert torch.equal(forward(model, x, 5.0, context), before)
