"""The block scope on HunyuanVideo (and 1.5, HunyuanImage 2.1), LTX-Video and Mochi, through the real sampler.

Tiny random-weight models of the real layouts (``tome_harness.dit_models``):
3 frames of a 5x6 grid (90 tokens; HunyuanImage 2.1: one frame of 30), cond
and uncond of 7 and 5 text tokens. ToMe at ratio 0.5 leaves 15 tokens a frame,
ToDo at factor 2 a 3x3 grid of 9. HunyuanVideo's blocks put the text after the
image (double blocks apart, single blocks joined), LTX-Video's text is
cross-attention context, Mochi's joint attention takes the video and its
prompt's tokens (the T5 mask cuts the padding).
"""


import pytest
import torch
from helpers import (
    BYT5,
    COND_TEXT,
    MOCHI_PROMPT,
    UNCOND_TEXT,
    VISION,
    another_nodes_replacement,
    check_block_scope_is_seeded_and_not_the_attention_scope,
    check_block_scope_off_is_the_model,
    check_block_scope_reached_without_a_warning,
    dit_family_conds,
    record_lengths,
)

from tome_harness import dit_models

MERGED, POOLED = 15, 9
BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)
# Per model: its latent, its frames of 5x6 patches, and the text tokens each of cond and uncond brings to the
# blocks' joint sequence (none: LTX-Video's text is cross-attention context).
MODELS = {
    "hunyuan_video": ((1, 16, 3, 10, 12), 3, {COND_TEXT: COND_TEXT, UNCOND_TEXT: UNCOND_TEXT}),
    "hunyuan_video15": ((1, 32, 3, 10, 12), 3, {text: VISION + BYT5 + text for text in (COND_TEXT, UNCOND_TEXT)}),
    "hunyuan_image21": ((1, 64, 5, 6), 1, {COND_TEXT: COND_TEXT, UNCOND_TEXT: UNCOND_TEXT}),
    "ltxv": ((1, 128, 3, 5, 6), 3, None),
    "mochi": ((1, 12, 3, 10, 12), 3, MOCHI_PROMPT),
}
APPLY = {"tome": lambda pack: lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
         "todo": lambda pack: lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS)}


@pytest.fixture(scope="module")
def models(comfy_nodes):
    return {name: dit_models.build_dit_model(name) for name in MODELS}


def sample(comfy_nodes, model, family, seed=3, extra=None, latent=None):
    """A real KSampler run at cfg 2, 2 steps; ``extra``: more conds for both; ``latent``: in place of zeros."""
    generator = torch.Generator().manual_seed(5)
    positive, negative = ([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator),
                            {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM),
                             **dit_family_conds(family, text, dit_models.CONTEXT_DIM), **(extra or {})}]]
                           for text in (COND_TEXT, UNCOND_TEXT))
    latent = latent or {"samples": torch.zeros(MODELS[family][0])}
    (out,) = comfy_nodes.KSampler().sample(model, seed, 2, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


def block_tokens(family, kind, args, kwargs):
    """``(kind, image stream tokens, text tokens or None)`` of one block call, from its forward's arguments."""
    if family.startswith("hunyuan"):
        if kind == "double":
            return kind, kwargs["img"].shape[1], kwargs["txt"].shape[1]
        return kind, args[0].shape[1], None
    if family == "mochi":
        return kind, args[0].shape[1], args[2].shape[1]
    return kind, args[0].shape[1], None


def block_lists(net, family):
    if family.startswith("hunyuan"):
        return (("double", net.double_blocks), ("single", net.single_blocks))
    return (("double", net.blocks if family == "mochi" else net.transformer_blocks),)


def traced(comfy_nodes, model, apply, family, **run):
    """Sample ``apply(model)`` (an attention recorder on the model first): the sample, every block call's tokens
    and every attention call's (query, key) lengths."""
    attention, blocks = [], []
    recorded = model.clone()
    recorded.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        record_lengths(attention)
    net = model.get_model_object("diffusion_model")
    handles = [module.register_forward_pre_hook(
        lambda m, a, k, kind=kind: blocks.append(block_tokens(family, kind, a, k)), with_kwargs=True)
        for kind, modules in block_lists(net, family) for module in modules]
    try:
        out = sample(comfy_nodes, apply(recorded), family, **run)
    finally:
        for handle in handles:
            handle.remove()
    return out, blocks, attention


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("node", ["tome", "todo"])
def test_every_block_and_its_attention_run_on_the_reduced_video_and_the_whole_text(comfy_nodes, pack, models,
                                                                                  family, node):
    """Every block call gets the reduced video and the whole text (HunyuanVideo's single blocks: joined after the
    video); its joint attention sees both, LTX-Video's self-attention the video alone and its cross-attention
    the video's queries and the text's keys. No call sees the whole video."""
    _, frames, joint = MODELS[family]
    kept = (MERGED if node == "tome" else POOLED) * frames
    out, blocks, attention = traced(comfy_nodes, models[family], APPLY[node](pack), family)
    assert torch.isfinite(out).all()
    if family.startswith("hunyuan"):
        assert set(blocks) == {("double", kept, text) for text in joint.values()} | \
            {("single", kept + text, None) for text in joint.values()}
    elif family == "mochi":  # the text stream is the T5 context as given; attention takes the prompt's tokens
        assert set(blocks) == {("double", kept, text) for text in (COND_TEXT, UNCOND_TEXT)}
    else:
        assert set(blocks) == {("double", kept, None)}
    modules = sum(len(m) for _, m in block_lists(models[family].get_model_object("diffusion_model"), family))
    assert len(blocks) == modules * 2 * 2  # every block, cond and uncond, 2 steps
    if joint is None:
        assert set(attention) == {(kept, kept), (kept, COND_TEXT), (kept, UNCOND_TEXT)}
    else:
        image_calls = {call for call in attention if call[0] > max(joint.values())}
        assert image_calls == {(kept + text, kept + text) for text in joint.values()}


@pytest.mark.parametrize("family", list(MODELS))
def test_ratio_0_factor_1_and_steps_outside_the_window_are_the_model_bit_for_bit(comfy_nodes, pack, models, family):
    check_block_scope_off_is_the_model(pack, models[family], lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family", list(MODELS))
def test_same_seed_same_video_and_not_the_attention_scopes(comfy_nodes, pack, models, family):
    check_block_scope_is_seeded_and_not_the_attention_scope(pack, models[family],
                                                            lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family,key,text", [("hunyuan_video", ("single_block", 0), {COND_TEXT, UNCOND_TEXT}),
                                             ("ltxv", ("double_block", 1), {0}), ("mochi", ("double_block", 1), {0})])
@pytest.mark.parametrize("when", ["before", "after"])
def test_another_nodes_block_replacement_runs_on_the_reduced_tokens(comfy_nodes, pack, models, family, key, text,
                                                                     when):
    put, replaced = another_nodes_replacement(key)
    apply = APPLY["tome"](pack)
    model = models[family]
    patched = apply(put(model)) if when == "before" else put(apply(model))
    assert torch.isfinite(sample(comfy_nodes, patched, family)).all()
    assert set(replaced) == {3 * MERGED + t for t in text} and len(replaced) == 2 * 2


def test_hunyuan_i2v_reference_stays_whole_ahead_of_the_reduced_video(comfy_nodes, pack, models):
    """HunyuanVideo I2V's reference latent (one 10x12 frame: 30 tokens) goes ahead of the video in the image
    stream: it enters every block whole, the video pooled behind it."""
    extra = {"ref_latent": torch.randn(1, 16, 1, 10, 12, generator=torch.Generator().manual_seed(4))}
    out, blocks, _ = traced(comfy_nodes, models["hunyuan_video"], APPLY["todo"](pack), "hunyuan_video",
                            extra=extra)
    assert torch.isfinite(out).all()
    assert {image for kind, image, _ in blocks if kind == "double"} == {30 + 3 * POOLED}


@pytest.mark.parametrize("node,first", [("tome", MERGED), ("todo", POOLED)])
def test_hunyuan_i2v_first_frame_modulation_follows_the_reduced_first_frame(comfy_nodes, pack, models, node, first):
    """HunyuanVideo I2V's token-replace mode (``guiding_frame_index``) modulates the first frame's tokens apart:
    the blocks get the range over the reduced first frame (15 merged or 9 pooled tokens)."""
    seen = []

    def inner(args, extra):  # put after our node: inside ours, what the block gets
        dims = args.get("modulation_dims_img", args.get("modulation_dims"))
        seen.append((args["img"].shape[1], tuple(dims)))
        return extra["original_block"](args)

    patched = APPLY[node](pack)(models["hunyuan_video"]).clone()
    patched.set_model_patch_replace(inner, "dit", "double_block", 0)
    out = sample(comfy_nodes, patched, "hunyuan_video", extra={"guiding_frame_index": 0})
    assert torch.isfinite(out).all()
    assert set(seen) == {(3 * first, ((0, first, 0), (first, None, 1)))}


def test_hunyuans_text_padding_mask_reaches_the_reduced_blocks(comfy_nodes, pack, models):
    """A text with padding (its mask's last two tokens 0) gives HunyuanVideo's blocks a mask over [video | text]:
    the reduced blocks get it over the merged video, one row per batch element."""
    seen = []

    def inner(args, extra):
        seen.append((args["img"].shape[1], tuple(args["attention_mask"].shape)))
        return extra["original_block"](args)

    mask = {text: torch.ones(1, text, dtype=torch.long) for text in (COND_TEXT, UNCOND_TEXT)}
    for m in mask.values():
        m[:, -2:] = 0
    patched = APPLY["tome"](pack)(models["hunyuan_video"]).clone()
    patched.set_model_patch_replace(inner, "dit", "double_block", 0)
    generator = torch.Generator().manual_seed(5)
    positive, negative = ([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator),
                            {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM), "attention_mask": mask[text]}]]
                          for text in (COND_TEXT, UNCOND_TEXT))
    latent = {"samples": torch.zeros(MODELS["hunyuan_video"][0])}
    (out,) = comfy_nodes.KSampler().sample(patched, 3, 2, 2.0, "euler", "normal", positive, negative, latent)
    assert torch.isfinite(out["samples"]).all()
    assert set(seen) == {(45, (1, 1, 45 + text)) for text in (COND_TEXT, UNCOND_TEXT)}


def test_ltxv_keyframe_guides_stay_whole_behind_the_reduced_video(comfy_nodes, pack, models):
    """LTX-Video's guide (a fourth latent frame, named by its 30 tokens' pixel coordinates) follows the video in
    every block whole; the video's 3 frames are merged."""
    latent = {"samples": torch.zeros(1, 128, 4, 5, 6)}
    out, blocks, attention = traced(comfy_nodes, models["ltxv"], APPLY["tome"](pack), "ltxv",
                                    extra={"keyframe_idxs": torch.zeros(1, 3, 30)}, latent=latent)
    assert torch.isfinite(out).all()
    assert set(blocks) == {("double", 3 * MERGED + 30, None)}


def test_ltxv_per_token_timestep_follows_the_tokens(comfy_nodes, pack, models):
    """A start image's noise mask (frame 0 kept) runs LTX-Video's tokens at timesteps of their own, one
    modulation per token: the blocks get one per reduced token."""
    seen = []

    def inner(args, extra):
        seen.append((args["img"].shape[1], tuple(args["vec"].shape[:2])))
        return extra["original_block"](args)

    mask = torch.ones(1, 1, 3, 5, 6)
    mask[:, :, 0] = 0.0
    latent = {"samples": torch.randn(1, 128, 3, 5, 6, generator=torch.Generator().manual_seed(3)),
              "noise_mask": mask}
    patched = APPLY["todo"](pack)(models["ltxv"]).clone()
    patched.set_model_patch_replace(inner, "dit", "double_block", 0)
    assert torch.isfinite(sample(comfy_nodes, patched, "ltxv", latent=latent)).all()
    assert set(seen) == {(3 * POOLED, (1, 3 * POOLED))}


def test_todo_gives_these_families_the_block_scope_without_a_warning(pack, models, caplog):
    check_block_scope_reached_without_a_warning(pack, [models[family] for family in MODELS], caplog)
