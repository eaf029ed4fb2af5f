"""Apply ToMe (Advanced)'s ``scope``: merged tokens in cross-attention and the MLP too, on the real ComfyUI."""

import pytest
import torch
from helpers import (
    forward,
    loaded,
    random_context,
    random_latent,
    sample,
    sd15_level,
    sdxl_conds,
    self_attention_calls,
    token_counts,
)
from tomesd.merge import bipartite_soft_matching_random2d as tomesd_merge

SELF, CROSS, ALL = "self-attention", "self- and cross-attention", "self-attention, cross-attention and MLP"


def advanced(pack, model, scope, max_downsample="auto", ratio=0.5, use_rand=True):
    return pack.nodes.ApplyToMeAdvanced.execute(model=model, ratio=ratio, stride_x=2, stride_y=2,
                                                max_downsample=max_downsample, seed=0, use_rand=use_rand,
                                                merge="q, k and v", start_percent=0.0, end_percent=1.0,
                                                scope=scope).result[0]


def counts_by_module(model, x, context, **conds):
    """Token counts reaching self-attention, cross-attention (queries) and the MLP, per block."""
    with loaded(model), self_attention_calls(model) as attn1, token_counts(model, ".attn2") as attn2, \
            token_counts(model, ".ff.net") as ff:
        forward(model, x, 5.0, context, **conds)
    block = lambda name: name.rsplit(".attn1", 1)[0]  # noqa: E731
    return ({block(c.module): c.queries for c in attn1},
            {name.rsplit(".attn2", 1)[0]: n for name, n in attn2},
            {name.rsplit(".ff.net", 1)[0]: n for name, n in ff})


@pytest.mark.parametrize(("scope", "merged"), [(SELF, {"attn1"}), (CROSS, {"attn1", "attn2"}),
                                               (ALL, {"attn1", "attn2", "ff"})])
def test_sd15_scope_decides_which_modules_see_merged_tokens(pack, sd15, scope, merged):
    patched = advanced(pack, sd15, scope)
    attn1, attn2, ff = counts_by_module(patched, random_latent(2, 32, 32), random_context(2))
    assert attn1.keys() == attn2.keys() == ff.keys() and len(attn1) == 16
    for name, counts in {"attn1": attn1, "attn2": attn2, "ff": ff}.items():
        for block, n in counts.items():
            full = 1024 // sd15_level(block) ** 2
            assert n == (full // 2 if name in merged and full == 1024 else full), (name, block)


@pytest.mark.parametrize("max_downsample", ["4", "8"])
def test_sdxl_deep_stacks_merge_every_module_with_max_downsample_4_and_8(pack, sdxl, max_downsample):
    patched = advanced(pack, sdxl, ALL, max_downsample)
    attn1, attn2, ff = counts_by_module(patched, random_latent(1, 32, 32), random_context(1), **sdxl_conds(1))
    assert attn1 == attn2 == ff
    assert set(attn1.values()) == {128, 32}  # 256 tokens at downsample 2, 64 at downsample 4 (and the middle)
    # SDXL: 2 + 2 blocks down and 3 x 2 up at downsample 2; 2 x 10 down, 3 x 10 up and 10 in the middle at 4.
    assert sum(n == 128 for n in attn1.values()) == 10 and sum(n == 32 for n in attn1.values()) == 60


@pytest.mark.parametrize("seed", [0, 5])
def test_scope_all_block_equals_tomesd_merge_around_attn1_attn2_and_mlp(pack, sd15, seed):
    ratio, block_id, h, w = 0.6, ("input", 1), 24, 24
    patched = advanced(pack, sd15, ALL, ratio=ratio, use_rand=False)
    x = torch.randn(2, h * w, 32, generator=torch.Generator().manual_seed(seed))
    context = random_context(2)
    options = {"patches": patched.model_options["transformer_options"]["patches"],
               "original_shape": [2, 4, h, w], "activations_shape": [2, 32, h, w],
               "block": block_id, "block_index": 0, "sigmas": torch.tensor([3.0, 3.0])}
    with loaded(patched), torch.inference_mode():
        block = patched.model.diffusion_model.input_blocks[1][1].transformer_blocks[0]
        ours = block(x, context=context, transformer_options=options)
    with torch.inference_mode():
        block = sd15.model.diffusion_model.input_blocks[1][1].transformer_blocks[0]  # unpatched again
        n = block.norm1(x)
        merge, unmerge = tomesd_merge(n, w, h, 2, 2, int(h * w * ratio), no_rand=True)
        merged = merge(n)
        ref = unmerge(block.attn1(merged, context=merged, value=merged)) + x
        ref = unmerge(block.attn2(merge(block.norm2(ref)), context=context)) + ref
        ref = unmerge(block.ff(merge(block.norm3(ref)))) + ref
        assert type(block.ff).__name__ == "FeedForward"
    torch.testing.assert_close(ours, ref)


def test_input_model_stays_untouched_and_ratio_zero_removes_the_mlp_swap(pack, comfy_nodes, sd15):
    x, context = random_latent(1, 16, 16), random_context(1)
    before = forward(sd15, x, 5.0, context)
    patched = advanced(pack, sd15, ALL)
    sample(comfy_nodes, patched)
    sample(comfy_nodes, sd15)
    assert not sd15.object_patches
    assert all(type(m).__name__ == "FeedForward" for name, m in sd15.model.diffusion_model.named_modules()
               if name.endswith(".ff"))
    assert torch.equal(forward(sd15, x, 5.0, context), before)

    off = advanced(pack, patched, ALL, ratio=0.0)
    assert not off.object_patches and not pack.comfyui.has_patches(off, pack.unet.TOME_PATCH_TYPES)
    assert len(patched.object_patches) == 16  # one feed-forward per transformer block


def _ff_lora(rank=4, seed=0):
    """A kohya-format LoRA on the feed-forward of the full-resolution blocks (32 channels, GEGLU: 256 wide)."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for block in ("input_blocks_1_1", "input_blocks_2_1", "output_blocks_9_1"):
        for layer, (out_dim, in_dim) in {"ff_net_0_proj": (256, 32), "ff_net_2": (32, 128)}.items():
            key = f"lora_unet_{block}_transformer_blocks_0_{layer}"
            lora[f"{key}.lora_up.weight"] = torch.randn(out_dim, rank, generator=generator)
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, in_dim, generator=generator)
    return lora


def test_lora_on_the_mlp_still_acts_through_the_swapped_feed_forward(pack, comfy_nodes, sd15):
    import comfy.sd

    lora = _ff_lora()
    tome_only = advanced(pack, sd15, ALL)
    tome_then_lora = comfy.sd.load_lora_for_models(tome_only, None, lora, 1.0, 0)[0]
    lora_then_tome = advanced(pack, comfy.sd.load_lora_for_models(sd15, None, lora, 1.0, 0)[0], ALL)
    assert len(tome_then_lora.patches) == len(lora_then_tome.patches) == 6  # every LoRA key found
    with token_counts(tome_then_lora, ".ff.net") as ff:
        with_lora = sample(comfy_nodes, tome_then_lora)
    assert 128 in {n for _, n in ff}, "the MLP must still see merged tokens"
    assert not torch.allclose(with_lora, sample(comfy_nodes, tome_only)), "the LoRA must still act"
    torch.testing.assert_close(with_lora, sample(comfy_nodes, lora_then_tome))


def test_other_attn2_patches_before_and_after_keep_working(pack, sd15):
    seen = {"before": [], "after": []}

    def recorder(label):
        def attn2(n, context, value, extra_options):
            seen[label].append(n.shape[1])
            return n, context, value
        return attn2

    earlier = sd15.clone()
    earlier.set_model_attn2_patch(recorder("before"))
    patched = advanced(pack, earlier, CROSS)
    patched.set_model_attn2_patch(recorder("after"))
    forward(patched, random_latent(1, 16, 16), 5.0, random_context(1))
    assert 256 in seen["before"] and 128 not in seen["before"]
    assert 128 in seen["after"] and 256 not in seen["after"]
