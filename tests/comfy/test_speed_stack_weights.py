"""fp8 weights and a LoRA under the pack's nodes, on the tiny SD1.5 U-Net.

The model is loaded as ``UNETLoader`` loads one with ``weight_dtype`` fp8_e4m3fn (weights stored in fp8, cast
per layer to float32 on the CPU: ``random_models.build_fp8_unet_model``), and a random LoRA on every linear
layer of its transformer blocks is applied through ``comfy.sd.load_lora_for_models`` with no CLIP, which is
what ``LoraLoaderModelOnly`` runs once it has read the file. ComfyUI merges the LoRA into the fp8 weights
when the sampler loads the model (computed in float32, rounded back to fp8). Loading and sampling run under
``torch.inference_mode()``, as ComfyUI's executor runs every prompt (the fp8 rounding of a LoRA-patched weight
needs it: outside it, the weights would carry autograd).
"""

from __future__ import annotations

import pytest
import torch
from helpers import conditioning, sd15_level, self_attention_calls
from test_speed_stack_caches import todo, tome

from tome_harness import random_models

STEPS = 2
WIDEST = "self-attention, cross-attention and MLP"
FF_WEIGHT = "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight"  # a 16x16 block's feed-forward


def tome_widest(pack, model):
    (out,) = pack.nodes.ApplyToMeAdvanced.execute(
        model=model, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
        merge="q, k and v", start_percent=0.0, end_percent=1.0, scope=WIDEST, reuse_steps=1).result
    return out


NODES = {"ApplyToMe": tome, "ApplyToMeAdvanced (widest scope)": tome_widest, "ApplyToDo": todo}
KEYS = {"ApplyToMe": 128, "ApplyToMeAdvanced (widest scope)": 128, "ApplyToDo": 64}  # at the 16x16 blocks


@pytest.fixture(scope="module")
def fp8_lora(comfy_nodes):
    """The fp8 SD1.5 (32 channels, 32-wide text), the same with the LoRA, and one feed-forward weight as stored
    (read now: once sampled, the shared model stays loaded with the LoRA merged into its weights)."""
    import comfy.sd

    with torch.inference_mode():
        fp8 = random_models.build_fp8_unet_model("sd15", channels=32, context_dim=32)
        lora = random_models.random_lora(fp8)
        with_lora, _ = comfy.sd.load_lora_for_models(fp8, None, lora, 1.0, 0.0)
        stored = fp8.model.diffusion_model.state_dict()[FF_WEIGHT].clone()
    return fp8, with_lora, stored


def sample(comfy_nodes, model):
    positive, negative = conditioning()
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    with torch.inference_mode():
        (out,) = comfy_nodes.KSampler().sample(model, 3, STEPS, 4.0, "euler", "normal", positive, negative,
                                               latent)
    return out["samples"]


def test_the_model_is_fp8_and_the_lora_patches_every_transformer_linear(fp8_lora):
    fp8, with_lora, stored = fp8_lora
    unet = fp8.model.diffusion_model
    assert stored.dtype == torch.float8_e4m3fn
    assert fp8.model.manual_cast_dtype == torch.float32  # computed in float32 on the CPU, as ComfyUI picks
    linears = {f"diffusion_model.{n}" for n, p in unet.named_parameters()
               if ".transformer_blocks." in n and n.endswith(".weight") and p.ndim == 2}
    assert set(with_lora.patches) == linears and not fp8.patches


# The widest scope's run is also made, and checked, by the feed-forward test below: here it is slow only.
@pytest.mark.parametrize("node", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("(widest scope)") else n
                                  for n in NODES])
def test_each_node_runs_on_fp8_weights_with_a_lora(comfy_nodes, pack, fp8_lora, node):
    _, with_lora, _ = fp8_lora
    patched = NODES[node](pack, with_lora)
    with self_attention_calls(patched) as calls:
        out = sample(comfy_nodes, patched)
    assert torch.isfinite(out).all()
    finest = [c for c in calls if sd15_level(c.module) == 1]
    assert finest and {c.keys for c in finest} == {KEYS[node]}
    assert len({c.sigma for c in calls}) == STEPS


def test_the_widest_scope_merges_around_the_lora_patched_fp8_feed_forward(comfy_nodes, pack, fp8_lora):
    """The feed-forward of a 16x16 block computes on the merged tokens, with the LoRA-patched fp8 weights: its
    output equals that module's own ``net`` (the patched, fp8-cast layers) run on ``plan.merge(x)`` and
    unmerged, computed inside the same call."""
    _, with_lora, stored = fp8_lora
    patched = tome_widest(pack, with_lora)
    unet = patched.model.diffusion_model
    ff = unet.get_submodule(FF_WEIGHT.rsplit(".ff.", 1)[0] + ".ff")
    feed_forward_plan = pack.unet._FEED_FORWARD_PLAN  # the plan the block's attn1 patch left for its ff
    seen = []

    def before(module, args):
        seen.append({"plan": feed_forward_plan.get(), "x": args[0]})

    def after(module, args, output):
        call = seen[-1]
        plan, x = call["plan"], call["x"]
        call.update(out=output, weight=module.net[0].proj.weight.detach().clone(), cls=type(module).__name__,
                    reference=plan.unmerge(module.net(plan.merge(x))), merged_tokens=plan.merge(x).shape[1])

    hooks = [ff.register_forward_pre_hook(before), ff.register_forward_hook(after)]
    try:
        out = sample(comfy_nodes, patched)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.isfinite(out).all()
    assert len(seen) == STEPS  # the feed-forward of this block ran, merged, on every step
    for call in seen:
        assert call["cls"] == "ToMeFeedForward" and call["merged_tokens"] == 128 and call["x"].shape[1] == 256
        assert call["weight"].dtype == torch.float8_e4m3fn  # still fp8 while it ran ...
        assert not torch.equal(call["weight"].float(), stored.float())  # ... with the LoRA merged in
        torch.testing.assert_close(call["out"], call["reference"], rtol=0, atol=0)
