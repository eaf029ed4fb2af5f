"""The SDXL example workflow's sampling half on the full-size SDXL U-Net (random weights), in-process.

A whole random SDXL checkpoint (U-Net, both text encoders, VAE: about 7 GB in
float16) is too heavy for the 2-core CI machine, so the SDXL workflow is run
with the SDXL U-Net alone: its Apply ToMe, EmptyLatentImage and KSampler nodes,
with their inputs as the JSON gives them (scaled down to 64 px and 2 steps),
on the real SDXL layout at full width, with random text conditioning in place
of the encoders.
"""

import gc
import json

import pytest
import torch
from helpers import self_attention_calls

from tome_harness import random_models
from tome_harness.comfyui import ROOT

WORKFLOW = json.loads((ROOT / "workflows" / "api" / "sdxl_tome.json").read_text())


def node_inputs(class_type: str) -> dict:
    (node,) = [node for node in WORKFLOW.values() if node["class_type"] == class_type]
    return {name: value for name, value in node["inputs"].items() if not isinstance(value, list)}


@pytest.fixture
def sdxl_full(comfy_nodes):
    import comfy.model_management

    yield random_models.build_unet_model("sdxl")
    comfy.model_management.unload_all_models()  # the sampler registered it as loaded: let its 10 GB go
    gc.collect()


def test_sdxl_workflow_samples_with_tome_on_the_full_size_sdxl_unet(pack, comfy_nodes, sdxl_full):
    (patched,) = pack.nodes.ApplyToMe.execute(model=sdxl_full, **node_inputs("ApplyToMe")).result
    (latent,) = comfy_nodes.EmptyLatentImage().generate(**dict(node_inputs("EmptyLatentImage"), width=64, height=64))
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(1, 77, 2048, generator=generator)
    positive = [[context, {"pooled_output": torch.randn(1, 1280, generator=generator)}]]
    negative = [[torch.zeros_like(context), {"pooled_output": torch.zeros(1, 1280)}]]

    with self_attention_calls(patched) as calls:
        (out,) = comfy_nodes.KSampler().sample(patched, positive=positive, negative=negative, latent_image=latent,
                                               **dict(node_inputs("KSampler"), steps=2))
    assert torch.isfinite(out["samples"]).all()
    # 64 px: an 8x8 latent; SDXL's first transformer level (downsample 2) has 4x4 = 16 tokens, merged to 8.
    tokens = {(c.queries, c.keys) for c in calls}
    assert (8, 8) in tokens, tokens
    assert all(c.queries == c.keys == 8 for c in calls if c.module.startswith(("input_blocks.4.", "input_blocks.5.")))
