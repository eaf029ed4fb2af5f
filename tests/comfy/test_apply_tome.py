"""Apply ToMe inside the real ComfyUI: what reaches self-attention, reproducibility, composition, bad input."""

import logging

import pytest
import torch
from helpers import (
    expected_tokens,
    forward,
    random_context,
    random_latent,
    sd15_level,
    sdxl_conds,
    self_attention_calls,
)
from tomesd.merge import bipartite_soft_matching_random2d as tomesd_merge

from tome_harness import random_models


def test_sd15_merges_queries_and_keys_only_at_full_resolution(pack, sd15):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)
    with self_attention_calls(patched) as calls:
        forward(patched, random_latent(2, 32, 32), 5.0, random_context(2))
    assert len(calls) == 16
    for call in calls:
        n = 32 * 32 // sd15_level(call.module) ** 2
        want = expected_tokens(n, 0.5) if n == 1024 else n
        assert (call.queries, call.keys) == (want, want), call
    assert sum(c.queries == 512 for c in calls) == 5  # input 1, 2 and output 9, 10, 11


@pytest.mark.parametrize("max_downsample,levels", [("auto", {2}), ("2", {2}), ("4", {2, 4}), ("1", set())])
def test_sdxl_merges_at_its_highest_resolution_transformer_level(pack, sdxl, max_downsample, levels, caplog):
    patched = pack.unet.apply_tome(model=sdxl, ratio=0.5, max_downsample=max_downsample)
    with self_attention_calls(patched) as calls:
        forward(patched, random_latent(1, 32, 32), 5.0, random_context(1), **sdxl_conds(1))
    merged_levels = set()
    for call in calls:
        n = {2: 256, 4: 64}[_level_from_shape(call)]
        if call.queries < n:
            assert call.queries == call.keys == expected_tokens(n, 0.5)
            merged_levels.add(_level_from_shape(call))
        else:
            assert call.queries == call.keys == n
    assert merged_levels == levels
    if max_downsample == "1":
        assert "reaches no transformer block" in caplog.text


def _level_from_shape(call):
    n = max(call.queries, call.keys)
    return 2 if n > 64 else 4


def test_core_node_for_contrast_leaves_the_keys_full(comfy_nodes, sd15):
    core = comfy_nodes.NODE_CLASS_MAPPINGS["TomePatchModel"].execute(sd15, ratio=0.5).result[0]
    with self_attention_calls(core) as calls:
        forward(core, random_latent(2, 32, 32), 5.0, random_context(2))
    full_res = [c for c in calls if c.keys == 1024]
    assert len(full_res) == 5
    assert all(c.queries == 512 for c in full_res)


@pytest.mark.parametrize("seed", [0, 7])
def test_patched_block_equals_tomesd_merge_wrapped_around_the_same_block(pack, sd15, seed):
    """Our merged self-attention, block for block, against the reference merge functions."""
    ratio, sigma, block_id = 0.6, 3.25, ("input", 1)
    patched = pack.unet.apply_tome(model=sd15, ratio=ratio, seed=seed, use_rand=True, merge="q, k and v")
    block = patched.model.diffusion_model.input_blocks[1][1].transformer_blocks[0]
    h = w = 24
    x = torch.randn(2, h * w, 32, generator=torch.Generator().manual_seed(3))
    context = random_context(2)
    options = {
        "patches": patched.model_options["transformer_options"]["patches"],
        "original_shape": [2, 4, h, w], "activations_shape": [2, 32, h, w],
        "block": block_id, "block_index": 0, "sigmas": torch.tensor([sigma, sigma]),
    }
    with torch.inference_mode():
        ours = block(x, context=context, transformer_options=options)

        n = block.norm1(x)
        generator = torch.Generator().manual_seed(pack.grid.derive_seed(seed, sigma, block_id, 0))
        merge, unmerge = tomesd_merge(n, w, h, 2, 2, int(h * w * ratio), generator=generator)
        merged = merge(n)
        ref = unmerge(block.attn1(merged, context=merged, value=merged)) + x
        ref = block.attn2(block.norm2(ref), context=context) + ref
        ref = block.ff(block.norm3(ref)) + ref
    torch.testing.assert_close(ours, ref)
    unpatched = block(x, context=context, transformer_options={})
    assert not torch.allclose(ours, unpatched), "the merge must change the block's output"


@pytest.mark.parametrize("mode,queries,keys", [("q, k and v", 512, 512), ("q only", 512, 1024),
                                               ("k and v only", 1024, 512)])
def test_merge_modes(pack, sd15, mode, queries, keys):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5, max_downsample="1", seed=0, use_rand=True, merge=mode)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(1, 32, 32), 5.0, random_context(1))
    full_resolution = {(c.queries, c.keys) for c in calls if sd15_level(c.module) == 1}
    assert full_resolution == {(queries, keys)}
    assert torch.isfinite(out).all()


def test_same_seed_same_output_and_global_rng_untouched(pack, sd15):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)
    x, context = random_latent(2, 32, 32), random_context(2)
    before = torch.get_rng_state()
    first = forward(patched, x, 5.0, context)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, forward(patched, x, 5.0, context))
    other_seed = pack.unet.apply_tome(model=sd15, ratio=0.5, seed=1, use_rand=True, merge="q, k and v")
    assert not torch.equal(first, forward(other_seed, x, 5.0, context))


def test_cond_and_uncond_share_the_partition_when_run_as_separate_batches(pack, sd15):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)
    x, context = random_latent(2, 32, 32), random_context(2)
    together = forward(patched, x, 5.0, context)
    apart = torch.cat([forward(patched, x[i:i + 1], 5.0, context[i:i + 1]) for i in range(2)])
    # Batching only reorders float sums; a different partition would move the output by orders more.
    torch.testing.assert_close(together, apart, atol=1e-4, rtol=1e-3)


def test_each_step_draws_a_fresh_partition(pack, sd15):
    plan_patch = pack.unet.ToMeAttn1Patch(pack.unet.ToMeSettings(0.5, 2, 2, pack.comfyui.Reach(1)))
    n = torch.randn(1, 256, 8)

    def destinations(sigma, block=("input", 1)):
        options = {"original_shape": [1, 4, 16, 16], "sigmas": torch.tensor([sigma]), "block": block}
        return plan_patch.plan(n, options).dst_pos.flatten().tolist()

    assert destinations(5.0) == destinations(5.0)
    assert destinations(5.0) != destinations(4.0)
    assert destinations(5.0) != destinations(5.0, ("output", 9))


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_every_batch_size_merges(pack, sd15, batch):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(batch, 16, 16), 5.0, random_context(batch))
    assert sum(c.queries == c.keys == 128 for c in calls) == 5
    assert torch.isfinite(out).all()


def test_sizes_the_stride_does_not_divide(pack, sd15):
    """520x776 px: a 65x97 latent, levels of 33x49 and 17x25."""
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(1, 97, 65), 5.0, random_context(1))
    n = 65 * 97
    assert sum(c.queries == c.keys == expected_tokens(n, 0.5) for c in calls) == 5
    assert all(c.queries == c.keys for c in calls)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(pack, comfy_nodes, dtype):
    model = random_models.build_unet_model("sd15", dtype=dtype, channels=32, context_dim=32)
    patched = pack.unet.apply_tome(model=model, ratio=0.5)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(2, 16, 16), 5.0, random_context(2))
    assert sum(c.queries == c.keys == 128 for c in calls) == 5
    assert torch.isfinite(out).all()


def test_input_model_stays_untouched_and_a_second_node_replaces_the_first(pack, sd15):
    before = repr(sd15.model_options)
    first = pack.unet.apply_tome(model=sd15, ratio=0.3)
    second = pack.unet.apply_tome(model=first, ratio=0.6)
    assert repr(sd15.model_options) == before
    assert "tome" not in repr(sd15.model_options).lower()
    patches = second.model_options["transformer_options"]["patches"]
    assert len(patches["attn1_patch"]) == len(patches["attn1_output_patch"]) == 1
    assert patches["attn1_patch"][0].settings.ratio == 0.6
    assert first.model_options["transformer_options"]["patches"]["attn1_patch"][0].settings.ratio == 0.3
    with self_attention_calls(second) as calls:
        forward(second, random_latent(1, 16, 16), 5.0, random_context(1))
    assert sum(c.queries == expected_tokens(256, 0.6) for c in calls) == 5


def test_ratio_zero_returns_the_model_and_turns_off_an_earlier_tome(pack, sd15):
    assert pack.unet.apply_tome(model=sd15, ratio=0.0) is sd15
    off = pack.unet.apply_tome(model=pack.unet.apply_tome(model=sd15, ratio=0.5), ratio=0.0)
    patches = off.model_options["transformer_options"]["patches"]
    assert patches["attn1_patch"] == [] and patches["attn1_output_patch"] == []


def test_ratio_above_the_stride_cap_is_capped_with_a_warning(pack, sd15, caplog):
    with caplog.at_level(logging.WARNING):
        patched = pack.unet.apply_tome(model=sd15, ratio=0.9)
    assert "above the 2x2 stride's cap of 0.750" in caplog.text
    assert patched.model_options["transformer_options"]["patches"]["attn1_patch"][0].settings.ratio == 0.75


def test_a_stride_larger_than_the_grid_skips_the_block(pack, sd15):
    patched = pack.unet.apply_tome(model=sd15, ratio=0.5, stride_x=8, stride_y=8)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(1, 6, 6), 5.0, random_context(1))
    assert all(c.queries == c.keys for c in calls)
    assert any(c.queries == 36 for c in calls)
    assert torch.isfinite(out).all()


def test_start_after_end_is_rejected_before_anything_is_patched(pack, sd15):
    before = repr(sd15.model_options)
    with pytest.raises(ValueError, match=r"start_percent \(0.8\) must not be greater than end_percent \(0.2\)"):
        pack.unet.apply_tome(model=sd15, ratio=0.5, start_percent=0.8, end_percent=0.2)
    assert repr(sd15.model_options) == before


@pytest.mark.parametrize(("inputs", "message"), [
    ({"ratio": 1.2}, "ratio must be between 0.0 and 0.99, not 1.2"),
    ({"stride_x": 0}, "stride_x must be between 1 and 8, not 0"),
    ({"reuse_steps": 0}, "reuse_steps must be between 1 and 20, not 0"),
    ({"max_downsample": "3"}, "max_downsample must be one of auto, 1, 2, 4, 8, not '3'"),
    ({"merge": "q and k"}, "merge must be one of q, k and v, q only, k and v only, not 'q and k'"),
    ({"scope": "everything"}, "scope must be one of self-attention, .*, not 'everything'"),
])
def test_bad_input_is_an_error_naming_it_before_anything_is_patched(pack, sd15, inputs, message):
    before = repr(sd15.model_options)
    with pytest.raises(ValueError, match=message):
        pack.unet.apply_tome(sd15, **{"ratio": 0.5, **inputs})
    assert repr(sd15.model_options) == before


class NotADiffusionModel(torch.nn.Module):
    """A model the pack does not know: no U-Net transformer blocks, no DiT family."""

    def __init__(self):
        super().__init__()
        self.diffusion_model = torch.nn.Linear(4, 4)


def test_a_model_the_pack_does_not_know_passes_through_both_nodes_with_a_warning(pack, comfy_nodes, caplog):
    import comfy.model_patcher

    model = comfy.model_patcher.ModelPatcher(NotADiffusionModel(), load_device=torch.device("cpu"),
                                             offload_device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        assert pack.nodes.ApplyToMe.execute(model=model, ratio=0.5, stride_x=2, stride_y=2,
                                            max_downsample="auto").result[0] is model
        assert pack.nodes.ApplyToDo.execute(model=model, downsample_factor=2, max_downsample="auto",
                                            method="nearest", start_percent=0.0, end_percent=1.0).result[0] is model
    assert caplog.text.count("NotADiffusionModel is neither a U-Net with transformer blocks nor a DiT") == 2


def recording_patches():
    """Another pack's attn1 and attn1_output patches: pass everything through, note the lengths they saw.

    Plain functions, as the model patcher deep-copies patch objects on clone.
    """
    seen, seen_out = [], []

    def attn1(n, context, value, extra_options):
        seen.append((n.shape[1], context.shape[1]))
        return n, context, value

    def attn1_output(out, extra_options):
        seen_out.append(out.shape[1])
        return out

    return attn1, attn1_output, seen, seen_out


def test_other_packs_patches_before_and_after_keep_working(pack, sd15):
    earlier, earlier_out, earlier_seen, earlier_out_seen = recording_patches()
    with_earlier = sd15.clone()
    with_earlier.set_model_attn1_patch(earlier)
    with_earlier.set_model_attn1_output_patch(earlier_out)
    patched = pack.unet.apply_tome(model=with_earlier, ratio=0.5)
    later, later_out, later_seen, later_out_seen = recording_patches()
    patched.set_model_attn1_patch(later)
    patched.set_model_attn1_output_patch(later_out)

    x, context = random_latent(1, 16, 16), random_context(1)
    out = forward(patched, x, 5.0, context)
    # The earlier patch sees the full block input; the later one what attention will get.
    assert (256, 256) in earlier_seen and (256, 256) not in later_seen and (128, 128) in later_seen
    # Output patches run in order: the earlier one sees merged tokens, the later one the unmerged block.
    assert 128 in earlier_out_seen and 256 in later_out_seen and 128 not in later_out_seen
    torch.testing.assert_close(out, forward(pack.unet.apply_tome(model=sd15, ratio=0.5), x, 5.0, context))
