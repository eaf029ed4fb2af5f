"""The DiT adapter without ComfyUI: each family's layout on its real token order, the token-major pooling and
merging, and the attention override on plain tensors."""

import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from tome.downsample import AVERAGE, MAX, METHODS, NEAREST, downsample_tokens
from tome.hosts import dit_families as families
from tome.hosts.comfyui import MERGE_KV, MERGE_Q, MERGE_QKV, RUN_KEY, SamplingRun, Window
from tome.hosts.comfyui_dit_attention import DiTReduction, token_major
from tome.hosts.dit_settings import LAYOUT_KEY, DiTToDo, DiTToMe
from tome.hosts.dit_tokens import frame_plan, pool_grid


def test_flux_text_then_image_then_kontext_references():
    # A 10x13 latent pads to 10x14: 5x7 patches; a 6x8 reference adds 3x4.
    layout = families.flux_layout((2, 16, 10, 13), 2, text=7, references=[(1, 16, 6, 8)])
    assert layout.grid == (1, 5, 7)
    assert layout.starts == {7 + 35 + 12: 7}


def test_sd3_registers_and_text_before_the_image_and_an_image_only_attn2():
    layout = families.sd3_layout((1, 16, 128, 96), 2, text=333, registers=2)
    assert layout.grid == (1, 64, 48)
    assert layout.starts == {2 + 333 + 64 * 48: 335, 64 * 48: 0}


def test_wan_video_after_the_fun_reference_frame_and_no_text():
    # 21 latent frames of 60x104 (480x832); Fun's reference is one unpadded frame of patches.
    layout = families.wan_layout((1, 16, 21, 60, 104), (1, 2, 2), contexts=[512, 257], reference=(1, 16, 60, 104))
    assert layout.grid == (21, 30, 52)
    assert layout.starts == {30 * 52 + 21 * 30 * 52: 30 * 52}


def test_wan_frames_appended_in_time_count_as_video():
    layout = families.wan_layout((1, 16, 5, 8, 8), (1, 2, 2), contexts=[512], extra_frames=2)
    assert layout.grid == (7, 4, 4)
    assert layout.starts == {7 * 16: 0}


@pytest.mark.parametrize("channels", [16, 48], ids=["16-channel latent", "48-channel latent"])
def test_vace_reference_frames_are_the_leading_frames_with_a_zero_reactive_half_and_mask(channels):
    """``vace_context [B, contexts, 2C + 64, T, H, W]``: a reference frame has only its inactive half set; a
    control frame whose mask is 0 still has a reactive latent (an encoded grey frame, never exactly 0)."""
    context = torch.randn(1, 2, 2 * channels + 64, 5, 4, 4)
    assert families.vace_reference_frames(context) == 0
    context[:, :, channels:, :2] = 0  # two reference frames ...
    context[:, :, 2 * channels:, 3] = 0  # ... and a masked-out control frame after a video frame
    assert families.vace_reference_frames(context) == 2
    layout = families.wan_layout((1, 16, 5, 8, 8), (1, 2, 2), contexts=[7], reference_frames=2)
    assert layout.grid == (3, 4, 4)
    assert layout.starts == {5 * 16: 2 * 16}


def test_wan_leaves_self_attention_alone_when_the_text_is_as_long_as_the_video():
    """A cross-attention call with 64 text keys for 64 video queries looks like self-attention."""
    layout = families.wan_layout((1, 16, 4, 8, 8), (1, 2, 2), contexts=[64])
    assert layout.starts == {}


def test_qwen_image_text_then_image_then_edit_references():
    layout = families.qwen_image_layout((1, 16, 1, 10, 12), 2, text=20, references=[(1, 16, 1, 10, 12)] * 2)
    assert layout.grid == (1, 5, 6)
    assert layout.starts == {20 + 30 + 60: 20}


@pytest.mark.parametrize(("text", "pad", "starts"), [
    (7, None, {7 + 30: 7, 30: 0}),
    (7, 8, {8 + 32: 8, 32: 0}),
    (30, 32, {32 + 32: 32}),  # the image-only refiner is as long as the text-only one: left alone
])
def test_lumina2_padded_text_then_padded_image_and_the_refiners(text, pad, starts):
    layout = families.lumina2_layout((1, 16, 10, 12), 2, text=text, pad_multiple=pad)
    assert layout.grid == (1, 5, 6)
    assert layout.starts == starts


def test_hunyuan_video_reference_then_video_then_every_text_token():
    # 33 frames at 480x848: 9 latent frames of 60x106, 1x2x2 patches; 1.5's joint text is LLM + ByT5 + vision.
    layout = families.hunyuan_video_layout((1, 16, 9, 60, 106), (1, 2, 2), text=256 + 64 + 729, refined_text=256,
                                      reference=(1, 16, 1, 60, 106))
    assert layout.grid == (9, 30, 53)
    assert layout.starts == {30 * 53 + 9 * 30 * 53 + 256 + 64 + 729: 30 * 53}
    assert layout.recognises(256) and not layout.recognises(255)  # the token refiner's text-only calls


def test_hunyuan_video_spec_counts_byt5_and_vision_tokens_only_where_the_model_takes_them():
    x = torch.zeros(1, 16, 3, 8, 8)
    conds = {"txt_byt5": torch.zeros(1, 5, 1472), "clip_fea": torch.zeros(1, 9, 1152)}
    hunyuan15 = families.DiTSpec(families.HUNYUAN_VIDEO, (1, 2, 2), byt5=True, vision=True)
    assert hunyuan15.layout(x.shape, 7, conds).starts == {48 + 7 + 5 + 9: 0}
    assert families.DiTSpec(families.HUNYUAN_VIDEO, (1, 2, 2)).layout(x.shape, 7, conds).starts == {48 + 7: 0}


def test_ltxv_video_then_whole_guide_frames():
    # 33 frames at 480x832 under LTX-Video's VAE (8x32x32): 5 latent frames of 15x26, a guide frame appended.
    layout = families.ltxv_layout((1, 128, 6, 15, 26), (1, 1, 1), contexts=[128], guides=15 * 26)
    assert layout.grid == (5, 15, 26)
    assert layout.starts == {6 * 15 * 26: 0}  # the guide's 390 tokens follow the video and are kept whole


def test_ltxv_guides_that_are_not_whole_frames_are_not_recognised():
    layout = families.ltxv_layout((1, 128, 3, 4, 4), (1, 1, 1), contexts=[7], guides=5)
    assert layout.starts == {} and not layout.recognises(48)


def test_hidream_image_then_t5_and_the_llm_twice():
    spec = families.DiTSpec(families.HIDREAM, (1, 2, 2))
    llama = torch.zeros(1, 48, 128, 4096)  # [B, LLM layers, tokens, width]
    layout = spec.layout((1, 16, 128, 128), 128, {"encoder_hidden_states_llama3": llama})
    assert layout.starts == {64 * 64 + 128 + 2 * 128: 0} and layout.row_stride is None


@pytest.mark.parametrize("edit_width,row", [(128, 128), (96, 112), (97, 113)])
def test_hidream_e1_rows_of_image_then_edit_patches_then_the_text(edit_width, row):
    """E1 joins the edit latent to the image along the width, then pads to whole patches: each of the 64 rows
    of patches is the image's 64 and the edit's (``row - 64``, its last one padded where its width is odd)."""
    spec = families.DiTSpec(families.HIDREAM, (1, 2, 2))
    llama = torch.zeros(1, 48, 128, 4096)
    layout = spec.layout((1, 16, 128, 128), 128, {"encoder_hidden_states_llama3": llama,
                                                  "image_cond": torch.zeros(1, 16, 128, edit_width)})
    assert layout.grid == (1, 64, 64) and layout.row_stride == row
    assert layout.starts == {64 * row + 128 + 2 * 128: 0}


def test_hidream_e1_with_an_odd_latent_width_is_not_recognised():
    """A 127-wide latent: patch 63 of each row holds the image's last column and the edit's first."""
    spec = families.DiTSpec(families.HIDREAM, (1, 2, 2))
    llama = torch.zeros(1, 48, 128, 4096)
    layout = spec.layout((1, 16, 128, 127), 128, {"encoder_hidden_states_llama3": llama,
                                                  "image_cond": torch.zeros(1, 16, 128, 127)})
    assert layout.starts == {} and not layout.recognises(64 * 127 + 128 + 2 * 128)


def test_cosmos_predict2_video_alone_as_wan():
    spec = families.DiTSpec(families.COSMOS, (1, 2, 2))
    layout = spec.layout((1, 16, 5, 10, 12), 7, {})
    assert layout.grid == (5, 5, 6) and layout.starts == {150: 0}


def test_wan22_5b_latent_has_the_same_token_layout_as_wan21():
    """TI2V-5B: 48 channels at 16x spatial compression, so 480x832 is a 30x52 latent (Wan 2.1's is 60x104), and
    the same 1x2x2 patches: a quarter of the tokens, in the same layout."""
    layout = families.wan_layout((1, 48, 9, 30, 52), (1, 2, 2), contexts=[512])
    assert layout.grid == (9, 15, 26) and layout.starts == {9 * 15 * 26: 0}


def test_a_sequence_of_another_length_has_no_image():
    layout = families.flux_layout((1, 16, 8, 8), 2, text=4)
    assert layout.start(20) == 4
    assert layout.start(19) is None


# Pooling.

def reference_pool(x, grid, factor, time_factor, method):
    """One token per cell, walked frame-cell by row by column; a partial cell uses the tokens it has."""
    t, h, w = grid
    cells = x.reshape(x.shape[0], t, h, w, -1)
    out = []
    for f0, r0, c0 in itertools.product(range(0, t, time_factor), range(0, h, factor), range(0, w, factor)):
        cell = cells[:, f0:f0 + time_factor, r0:r0 + factor, c0:c0 + factor].flatten(1, 3)
        out.append({NEAREST: cell[:, 0], AVERAGE: cell.mean(1), MAX: cell.amax(1)}[method])
    return torch.stack(out, 1).reshape(x.shape[0], len(out), *x.shape[2:])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("grid", "factor", "time_factor"), [
    ((1, 6, 8), 2, 1), ((1, 5, 7), 2, 1), ((1, 7, 5), 3, 1), ((4, 4, 6), 2, 2), ((5, 3, 5), 2, 3), ((3, 4, 4), 1, 2),
    ((1, 5, 7), 2, 2),  # an image under a time factor
])
def test_pool_grid_matches_the_cell_by_cell_reference(grid, factor, time_factor, method):
    x = torch.randn(2, math.prod(grid), 3, 4, generator=torch.Generator().manual_seed(sum(grid)))
    torch.testing.assert_close(pool_grid(x, grid, factor, time_factor, method),
                               reference_pool(x, grid, factor, time_factor, method))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("w", "h"), [(8, 6), (7, 5), (1, 4)])
def test_pool_grid_is_the_u_net_downsample_on_images(w, h, method):
    x = torch.randn(2, w * h, 6, generator=torch.Generator().manual_seed(w + h))
    torch.testing.assert_close(pool_grid(x, (1, h, w), 2, 1, method), downsample_tokens(x, w, h, 2, method))


def test_pool_grid_takes_flux_single_blocks_strided_views():
    """Flux hands q, k, v of ``qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)``: pooled in the token-major view."""
    batch, heads, length, dim = 2, 3, 24, 4
    qkv = torch.randn(batch, length, 3 * heads * dim)
    _, k, _ = qkv.view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    pooled = pool_grid(token_major(k, True), (1, 4, 6), 2, 1, AVERAGE)
    torch.testing.assert_close(pooled, pool_grid(k.transpose(1, 2).contiguous(), (1, 4, 6), 2, 1, AVERAGE))


# The attention override on plain tensors.

def sdpa(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """ComfyUI's attention convention: ``[B, H, L, D]`` with skip_reshape, else ``[B, L, H*D]``; output
    ``[B, L, H*D]`` unless skip_output_reshape. Records the shapes it got."""
    sdpa.calls.append((q.shape, k.shape, v.shape))
    if not skip_reshape:
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


sdpa.calls = []

EVERYWHERE = Window()


def options(layout, sigma=1.0):
    return {LAYOUT_KEY: layout, "sigmas": torch.tensor([sigma])}


def qkv(batch, heads, length, dim, heads_major, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, length, dim) if heads_major else (batch, length, heads * dim)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("heads_major", [True, False])
def test_todo_pools_the_image_keys_and_values_and_keeps_text_and_queries(heads_major):
    layout = families.flux_layout((1, 16, 12, 16), 2, text=5)  # 6x8 image tokens after 5 text tokens
    q, k, v = qkv(2, 2, 5 + 48, 4, heads_major)
    override = DiTReduction(todo=DiTToDo(2, 1, NEAREST, EVERYWHERE))
    sdpa.calls.clear()
    seen = []

    def recording(q_, k_, v_, heads, **kwargs):
        seen.append((q_, k_, v_))
        return sdpa(q_, k_, v_, heads, **kwargs)

    out = override(recording, q, k, v, 2, skip_reshape=heads_major, transformer_options=options(layout))
    q_seen, k_seen, _ = (token_major(t, heads_major) for t in seen[0])
    k_tokens = token_major(k, heads_major)
    assert q_seen.shape[1] == 53 and k_seen.shape[1] == 5 + 12
    torch.testing.assert_close(q_seen, token_major(q, heads_major))
    torch.testing.assert_close(k_seen[:, :5], k_tokens[:, :5])
    torch.testing.assert_close(k_seen[:, 5:], k_tokens[:, 5:].unflatten(1, (6, 8))[:, ::2, ::2].flatten(1, 2))
    assert out.shape == (2, 53, 8)


def test_cross_attention_masked_calls_and_unknown_lengths_are_left_alone():
    layout = families.wan_layout((1, 16, 2, 4, 4), (1, 2, 2), contexts=[7])
    override = DiTReduction(todo=DiTToDo(2, 1, NEAREST, EVERYWHERE),
                            tome=DiTToMe(0.5, 2, 2, EVERYWHERE))
    q, _, _ = qkv(1, 2, 32, 4, False)
    _, k, v = qkv(1, 2, 7, 4, False, seed=1)
    for args, kwargs in [((q, k, v, 2), {}),  # cross-attention
                         ((q, q, q, 2), {"mask": torch.ones(32, 32, dtype=torch.bool)}),
                         ((q[:, :31], q[:, :31], q[:, :31], 2), {})]:
        sdpa.calls.clear()
        override(sdpa, *args, transformer_options=options(layout), **kwargs)
        assert sdpa.calls == [(args[0].shape, args[1].shape, args[2].shape)]


@pytest.mark.parametrize("heads_major", [True, False])
@pytest.mark.parametrize("merge", [MERGE_QKV, MERGE_KV, MERGE_Q])
def test_tome_merges_image_tokens_per_frame_and_restores_every_query(heads_major, merge):
    layout = families.lumina2_layout((1, 16, 8, 12), 2, text=6, pad_multiple=4)  # 8 text, 4x6 image, 0 image padding
    q, k, v = qkv(2, 2, 32, 4, heads_major)
    override = DiTReduction(tome=DiTToMe(0.5, 2, 2, EVERYWHERE, seed=3, merge=merge))
    sdpa.calls.clear()
    out = override(sdpa, q, k, v, 2, skip_reshape=heads_major, transformer_options=options(layout))
    seq = 2 if heads_major else 1
    q_len, k_len = sdpa.calls[0][0][seq], sdpa.calls[0][1][seq]
    assert q_len == (20 if merge != MERGE_KV else 32)
    assert k_len == (20 if merge != MERGE_Q else 32)
    assert out.shape == (2, 32, 8)
    if merge == MERGE_KV:
        return
    if merge == MERGE_Q:  # whole keys and values: the text queries' outputs are plain attention's
        torch.testing.assert_close(out[:, :8], sdpa(q, k, v, 2, skip_reshape=heads_major)[:, :8])
    # r = 12 of the 24 image queries were merged away and take their destination's output back.
    assert len({tuple(row.tolist()) for row in out[0, 8:]}) == 24 - 12


def strided_and_gathered(heads_major):
    """A HiDream E1 sequence (2 rows of 4x3 image patches, each followed by 3 edit patches, then 5 text tokens)
    as ``(layout, q, k, v)``, and the same tokens reordered image first with a one-span layout: ``(layout, q,
    k, v, order)``, ``order`` the positions of the reordered tokens in the E1 sequence."""
    layout = families.hidream_layout((1, 16, 4, 6), 2, text=5, edit=(1, 16, 4, 6))  # 2x3 image, rows of 6
    assert (layout.grid, layout.row_stride, layout.starts) == ((1, 2, 3), 6, {17: 0})
    order = torch.tensor([0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11, 12, 13, 14, 15, 16])
    seq = 2 if heads_major else 1
    tensors = qkv(2, 2, 17, 4, heads_major)
    return (layout, *tensors), (families.image_layout((1, 2, 3), {17: 0}),
                                *(t.index_select(seq, order) for t in tensors), order)


@pytest.mark.parametrize("heads_major", [True, False])
@pytest.mark.parametrize("reduction", [DiTReduction(todo=DiTToDo(2, 1, AVERAGE, EVERYWHERE)),
                                       *(DiTReduction(tome=DiTToMe(0.5, 2, 1, EVERYWHERE, seed=3, merge=m))
                                         for m in (MERGE_QKV, MERGE_KV, MERGE_Q))],
                         ids=["todo", "tome q k v", "tome k v", "tome q"])
def test_an_image_in_rows_between_edit_tokens_is_reduced_as_the_same_tokens_in_one_span(heads_major, reduction):
    """HiDream E1: the override gathers the image's rows, reduces them as it would one span, and hands every
    query its output in its own place: the output is the one-span sequence's, put back in E1's order."""
    (strided, q, k, v), (span, q1, k1, v1, order) = strided_and_gathered(heads_major)
    sdpa.calls.clear()
    out = reduction(sdpa, q, k, v, 2, skip_reshape=heads_major, transformer_options=options(strided))
    reference = reduction(sdpa, q1, k1, v1, 2, skip_reshape=heads_major, transformer_options=options(span))
    seq = 2 if heads_major else 1
    assert sdpa.calls[0] == sdpa.calls[1] and min(shape[seq] for shape in sdpa.calls[0]) < 17  # reduced alike
    torch.testing.assert_close(out[:, order], reference, rtol=0, atol=0)


def test_tome_on_video_merges_frame_by_frame():
    layout = families.wan_layout((1, 16, 3, 4, 8), (1, 2, 2))  # 3 frames of 2x4
    _, k, _ = qkv(1, 2, 24, 4, False)
    tome = DiTToMe(0.5, 2, 2, EVERYWHERE, use_rand=False)
    plan = frame_plan(tome, k, layout.grid, 0, {})
    merged, restored = plan.merge(k), plan.unmerge(plan.merge(k))
    assert merged.shape == (1, 12, 8)
    for frame in range(3):
        tokens = k[:, frame * 8:(frame + 1) * 8]
        one = frame_plan(tome, tokens, (1, 2, 4), 0, {})
        torch.testing.assert_close(merged[:, frame * 4:(frame + 1) * 4], one.merge(tokens))
        torch.testing.assert_close(restored[:, frame * 8:(frame + 1) * 8], one.unmerge(one.merge(tokens)))


def test_an_unknown_self_attention_length_is_left_whole_and_warned_about_once_per_run(caplog):
    layout = families.flux_layout((1, 16, 8, 8), 2, text=4)  # 4 + 16 tokens
    override = DiTReduction(todo=DiTToDo(2, 1, NEAREST, EVERYWHERE))
    q, k, v = qkv(1, 2, 22, 4, False)
    with caplog.at_level(logging.WARNING):
        for run in (SamplingRun(), SamplingRun()):
            for _ in range(3):
                sdpa.calls.clear()
                override(sdpa, q, k, v, 2, transformer_options=dict(options(layout), **{RUN_KEY: run}))
                assert sdpa.calls == [(q.shape, k.shape, v.shape)]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "a self-attention call of 22 tokens" in messages[0] and "20 tokens with the image at 4" in messages[0]


def test_the_layouts_own_image_free_lengths_and_cross_attention_raise_no_warning(caplog):
    layout = families.lumina2_layout((1, 16, 8, 8), 2, text=6, pad_multiple=4)  # text-only refiner: 8 tokens
    override = DiTReduction(todo=DiTToDo(2, 1, NEAREST, EVERYWHERE))
    with caplog.at_level(logging.WARNING):
        for q_len, k_len in [(8, 8), (16, 8)]:
            q, _, _ = qkv(1, 2, q_len, 4, False)
            _, k, v = qkv(1, 2, k_len, 4, False)
            override(sdpa, q, k, v, 2, transformer_options=dict(options(layout), **{RUN_KEY: SamplingRun()}))
    assert not caplog.records


def test_the_override_already_on_the_model_is_called_instead_of_the_attention():
    layout = families.sd3_layout((1, 16, 8, 8), 2, text=3)
    seen = []

    def earlier(func, *args, **kwargs):
        seen.append(args[1].shape[1])
        return func(*args, **kwargs)

    override = DiTReduction(todo=DiTToDo(2, 1, AVERAGE, EVERYWHERE), inner=earlier)
    q, k, v = qkv(1, 2, 19, 4, False)
    override(sdpa, q, k, v, 2, transformer_options=options(layout))
    override(sdpa, q, k, v, 2, transformer_options={})
    assert seen == [3 + 4, 19]


def test_outside_the_window_nothing_is_reduced():
    layout = families.sd3_layout((1, 16, 8, 8), 2, text=3)
    override = DiTReduction(todo=DiTToDo(2, 1, MAX, Window(sigma_start=5.0, sigma_end=2.0)))
    q, k, v = qkv(1, 2, 19, 4, False)
    for sigma, keys in [(9.0, 19), (3.0, 7), (1.0, 19)]:
        sdpa.calls.clear()
        override(sdpa, q, k, v, 2, transformer_options=options(layout, sigma))
        assert sdpa.calls[0][1][1] == keys


def test_wan_animate_keeps_its_first_latent_frame_the_reference_image_whole():
    spec = families.DiTSpec(families.WAN_ANIMATE, (1, 2, 2))
    layout = spec.layout((1, 16, 21, 60, 104), 512, {})
    assert layout.grid == (20, 30, 52)
    assert layout.starts == {21 * 30 * 52: 30 * 52}


def test_wan_s2v_video_then_reference_then_motion_packed_at_three_scales():
    # 480x832: 60x104 latent, 30x52 patches; the motion: 30x52 + 15x26 + 4 frames of 7x13.
    assert families.s2v_motion_tokens((1, 16, 19, 60, 104)) == 30 * 52 + 15 * 26 + 4 * 7 * 13
    spec = families.DiTSpec(families.WAN_S2V, (1, 2, 2), blocks_without_options=True)
    conds = {"reference_latent": torch.zeros(1, 16, 1, 60, 104), "reference_motion": torch.zeros(1, 16, 19, 60, 104)}
    layout = spec.layout((1, 16, 20, 60, 104), 512, conds)
    assert layout.grid == (20, 30, 52)
    assert layout.starts == {20 * 30 * 52 + 30 * 52 + families.s2v_motion_tokens((60, 104)): 0}


def test_humo_video_then_its_unpadded_reference_and_the_audio_keys_are_no_self_attention():
    # An odd latent: the video is padded to whole patches, the reference (36 channels: 17B's) is not.
    layout = families.DiTSpec(families.WAN_HUMO, (1, 2, 2)).layout((1, 16, 3, 11, 13), 7,
                                                                   {"reference_latent": torch.zeros(1, 36, 1, 11, 13)})
    assert layout.grid == (3, 6, 7)
    assert layout.starts == {3 * 6 * 7 + 5 * 6: 0}
    assert layout.recognises(families.HUMO_AUDIO_TOKENS) and layout.start(families.HUMO_AUDIO_TOKENS) is None


def test_mochi_joins_the_video_to_the_text_its_t5_mask_leaves_and_to_256_tokens_without_one():
    # 848x480, 31 frames: a 12-channel 6x60x106 latent, 30x53 patches; the prompt padded to 256 T5 tokens.
    spec = families.DiTSpec(families.MOCHI, (1, 2, 2))
    assert spec.layout((1, 12, 6, 60, 106), 256, {"num_tokens": 12}).starts == {6 * 30 * 53 + 12: 0}
    assert spec.layout((1, 12, 6, 60, 106), 300, {}).starts == {6 * 30 * 53 + families.MOCHI_TEXT_TOKENS: 0}


def test_cosmos1_self_attention_is_the_video_alone_and_its_text_keys_no_self_attention():
    # 1280x704, 121 frames: a 16x88x160 latent (8x8x8 compression), 1x2x2 patches.
    layout = families.DiTSpec(families.COSMOS1, (1, 2, 2)).layout((1, 16, 16, 88, 160), 512, {})
    assert layout.grid == (16, 44, 80)
    assert layout.starts == {16 * 44 * 80: 0}
    assert layout.recognises(512) and layout.start(512) is None
