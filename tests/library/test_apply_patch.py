"""``tome.apply_patch`` / ``remove_patch`` on random-weight diffusers models, against tomesd 0.1.3's."""


import pytest
import tomesd
import torch

import tome

diffusers = pytest.importorskip("diffusers", reason="diffusers is a test dependency: run scripts/setup.sh")

SD_LIKE = {  # SD1.5's shape, narrow: transformer blocks at downsample 1 and 2
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
}
SDXL_LIKE = {  # SDXL's shape: no transformer block at full resolution, text_time conditioning
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 2), "use_linear_projection": True,
    "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 6 * 8 + 32,
}
SCOPES = [  # merge_attn, merge_crossattn, merge_mlp
    {"merge_attn": True},
    {"merge_attn": True, "merge_crossattn": True, "merge_mlp": True},
]


def make_unet(layout: dict, seed: int = 0):
    torch.manual_seed(seed)  # diffusers initialises its layers from the global RNG
    unet = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 32, 64), layers_per_block=1,
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, **layout)
    return unet.eval()


def run(unet, batch=2, size=32, seed=1, width=None):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, size, width or size, generator=g)
    context = torch.randn(batch, 7, 32, generator=g)
    kwargs = {}
    if unet.config.addition_embed_type == "text_time":
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, 32, generator=g),
                                       "time_ids": torch.randn(batch, 6, generator=g)}
    with torch.no_grad():
        return unet(sample, 10, encoder_hidden_states=context, **kwargs).sample


def attn1_lengths(unet, batch=2, size=32):
    """The query lengths of every self-attention call in one forward."""
    lengths = []
    hooks = [m.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
             for name, m in unet.named_modules() if name.endswith("attn1")]
    run(unet, batch, size)
    for hook in hooks:
        hook.remove()
    return lengths


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("use_rand", [False, True])
@pytest.mark.parametrize(("layout", "ours_downsample", "tomesd_downsample"),
                         [(SD_LIKE, 1, 1), (SD_LIKE, 2, 2), (SDXL_LIKE, "auto", 2)])
def test_equals_tomesd(layout, ours_downsample, tomesd_downsample, use_rand, scope):
    ours, theirs = make_unet(layout), make_unet(layout)
    tome.apply_patch(ours, ratio=0.5, max_downsample=ours_downsample, use_rand=use_rand, seed=7, **scope)
    tomesd.apply_patch(theirs, ratio=0.5, max_downsample=tomesd_downsample, use_rand=use_rand, **scope)
    theirs._tome_info["args"]["generator"] = torch.Generator().manual_seed(7)  # the same generator state

    unpatched = run(make_unet(layout))
    for _ in range(2):  # the second forward draws on from the same generator on both sides
        out = run(ours)
        torch.testing.assert_close(out, run(theirs), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, unpatched)


def test_merges_where_asked_and_remove_patch_restores_the_exact_output():
    unet = make_unet(SD_LIKE)
    before = run(unet)
    tome.apply_patch(unet, ratio=0.5)
    assert sorted(set(attn1_lengths(unet))) == [64, 256, 512]  # 32x32 latent: 1024 tokens merged to 512
    tome.remove_patch(unet)
    assert torch.equal(run(unet), before)
    assert not any(name.startswith("_tome") for m in unet.modules() for name in vars(m))


def test_applying_twice_reconfigures_instead_of_nesting():
    unet = make_unet(SD_LIKE)
    tome.apply_patch(unet, ratio=0.5)
    tome.apply_patch(unet, ratio=0.25)
    assert sorted(set(attn1_lengths(unet))) == [64, 256, 768]
    tome.remove_patch(unet)
    assert sorted(set(attn1_lengths(unet))) == [64, 256, 1024]


def test_sdxl_auto_merges_at_downsample_2():
    unet = make_unet(SDXL_LIKE)
    tome.apply_patch(unet, ratio=0.5, max_downsample="auto")
    assert sorted(set(attn1_lengths(unet))) == [64, 128]  # 32x32 latent: 256 tokens at downsample 2


def test_a_one_wide_grid_where_tomesd_crashes_merges_nothing():
    """An 8x1 latent: the full-resolution grid is one token wide, with no room for a 2x2 cell's sources."""
    theirs = tomesd.apply_patch(make_unet(SD_LIKE), ratio=0.5, use_rand=False)
    with pytest.raises(IndexError):  # no destination: its similarity matrix has no column
        run(theirs, size=8, width=1)
    ours = tome.apply_patch(make_unet(SD_LIKE), ratio=0.5, use_rand=False)
    torch.testing.assert_close(run(ours, size=8, width=1), run(make_unet(SD_LIKE), size=8, width=1))


def test_global_rng_is_never_advanced():
    unet = make_unet(SD_LIKE)
    tome.apply_patch(unet, ratio=0.5)
    state = torch.get_rng_state()
    attn1_lengths(unet)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ratio": 1.0}, r"ratio must be in \[0, 1\)"),
    ({"ratio": -0.1}, r"ratio must be in \[0, 1\)"),
    ({"max_downsample": 3}, "max_downsample must be 'auto' or one of"),
    ({"sx": 0}, "sx must be an integer of at least 1"),
])
def test_bad_arguments_are_named_and_leave_an_earlier_patch_as_it_was(kwargs, message):
    unet = make_unet(SD_LIKE)
    tome.apply_patch(unet, ratio=0.25)
    with pytest.raises(ValueError, match=message):
        tome.apply_patch(unet, **kwargs)
    assert sorted(set(attn1_lengths(unet))) == [64, 256, 768]


def test_a_model_without_transformer_blocks_is_rejected():
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=8, block_out_channels=(32, 32), norm_num_groups=8,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"))
    with pytest.raises(ValueError, match="model: no BasicTransformerBlock found in UNet2DModel"):
        tome.apply_patch(unet)
