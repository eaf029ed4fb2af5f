"""Apply ToMe through ComfyUI's real sampling path: KSampler, the step window, LoRA, ControlNet."""

import torch
from helpers import conditioning, sample, sd15_level, self_attention_calls

from tome_harness import random_models


def test_ksampler_output_is_finite_reproducible_and_changed_by_tome(pack, comfy_nodes, sd15):
    patched = pack.nodes.ApplyToMe.execute(model=sd15, ratio=0.5, stride_x=2, stride_y=2,
                                           max_downsample="auto").result[0]
    first = sample(comfy_nodes, patched)
    assert torch.isfinite(first).all()
    assert torch.equal(first, sample(comfy_nodes, patched))
    assert not torch.equal(first, sample(comfy_nodes, sd15))


def test_merging_happens_only_inside_the_step_window(pack, comfy_nodes, sd15):
    patched = pack.nodes.ApplyToMeAdvanced.execute(model=sd15, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto",
                                                   seed=0, use_rand=True, merge="q, k and v", start_percent=0.5,
                                                   end_percent=1.0).result[0]
    sigma_start = sd15.get_model_object("model_sampling").percent_to_sigma(0.5)
    with self_attention_calls(patched) as calls:
        sample(comfy_nodes, patched)
    full_res = [c for c in calls if sd15_level(c.module) == 1]
    outside = [c for c in full_res if c.sigma > sigma_start]
    inside = [c for c in full_res if c.sigma <= sigma_start]
    assert outside and inside
    assert all(c.queries == c.keys == 256 for c in outside)
    assert all(c.queries == c.keys == 128 for c in inside)


def _random_lora(sd15, rank=4, seed=0):
    """A LoRA in the kohya format on the full-resolution self-attention projections."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for block in ("input_blocks_1_1", "input_blocks_2_1", "output_blocks_9_1"):
        for proj in ("to_q", "to_k", "to_v"):
            key = f"lora_unet_{block}_transformer_blocks_0_attn1_{proj}"
            lora[f"{key}.lora_up.weight"] = torch.randn(32, rank, generator=generator)
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, 32, generator=generator)
    return lora


def test_lora_keeps_working_before_and_after_tome(pack, comfy_nodes, sd15):
    import comfy.sd

    lora = _random_lora(sd15)
    tome_only = pack.unet.apply_tome(model=sd15, ratio=0.5)
    lora_then_tome = pack.unet.apply_tome(model=comfy.sd.load_lora_for_models(sd15, None, lora, 1.0, 0)[0], ratio=0.5)
    tome_then_lora = comfy.sd.load_lora_for_models(tome_only, None, lora, 1.0, 0)[0]
    assert len(tome_then_lora.patches) == len(lora_then_tome.patches) == 9  # every LoRA key found

    with self_attention_calls(tome_then_lora) as calls:
        with_lora = sample(comfy_nodes, tome_then_lora)
    assert any(c.queries == c.keys == 128 for c in calls), "ToMe must still merge"
    assert not torch.allclose(with_lora, sample(comfy_nodes, tome_only)), "the LoRA must still act"
    torch.testing.assert_close(with_lora, sample(comfy_nodes, lora_then_tome))


def test_controlnet_keeps_working_with_tome(pack, comfy_nodes, sd15):
    control_net = random_models.build_controlnet("sd15", channels=32, context_dim=32)
    hint = torch.rand(1, 128, 128, 3, generator=torch.Generator().manual_seed(9))  # 8x the 16x16 latent
    controlled = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(*conditioning(), control_net, hint,
                                                                        1.0, 0.0, 1.0)
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)

    with self_attention_calls(patched) as calls:
        with_control = sample(comfy_nodes, patched, positive_negative=controlled)
    assert torch.isfinite(with_control).all()
    assert any(c.queries == c.keys == 128 for c in calls), "ToMe must still merge"
    assert not torch.allclose(with_control, sample(comfy_nodes, patched)), "the ControlNet must still act"
    assert torch.equal(with_control, sample(comfy_nodes, patched, positive_negative=controlled))
