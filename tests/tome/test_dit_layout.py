"""The DiT adapter without ComfyUI: each family's layout on its real token order, the token-major pooling and
merging, and the attention override on plain tensors."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tome.downsample import AVERAGE, MAX, METHODS, NEAREST, downsample_tokens
from tome.hosts import comfyui_dit as dit
from tome.hosts.comfyui import Reach
from tome.hosts.comfyui_unet import MERGE_KV, MERGE_Q, MERGE_QKV


def test_flux_text_then_image_then_kontext_references():
    # A 10x13 latent pads to 10x14: 5x7 patches; a 6x8 reference adds 3x4.
    layout = dit.flux_layout((2, 16, 10, 13), 2, text=7, references=[(1, 16, 6, 8)])
    assert layout.grid == (1, 5, 7)
    assert layout.starts == {7 + 35 + 12: 7}


def test_sd3_registers_and_text_before_the_image_and_an_image_only_attn2():
    layout = dit.sd3_layout((1, 16, 128, 96), 2, text=333, registers=2)
    assert layout.grid == (1, 64, 48)
    assert layout.starts == {2 + 333 + 64 * 48: 335, 64 * 48: 0}


def test_wan_video_after_the_fun_reference_frame_and_no_text():
    # 21 latent frames of 60x104 (480x832); Fun's reference is one unpadded frame of patches.
    layout = dit.wan_layout((1, 16, 21, 60, 104), (1, 2, 2), contexts=[512, 257], reference=(1, 16, 60, 104))
    assert layout.grid == (21, 30, 52)
    assert layout.starts == {30 * 52 + 21 * 30 * 52: 30 * 52}


def test_wan_frames_appended_in_time_count_as_video():
    layout = dit.wan_layout((1, 16, 5, 8, 8), (1, 2, 2), contexts=[512], extra_frames=2)
    assert layout.grid == (7, 4, 4)
    assert layout.starts == {7 * 16: 0}


def test_wan_leaves_self_attention_alone_when_the_text_is_as_long_as_the_video():
    """A cross-attention call with 64 text keys for 64 video queries looks like self-attention."""
    layout = dit.wan_layout((1, 16, 4, 8, 8), (1, 2, 2), contexts=[64])
    assert layout.starts == {}


def test_qwen_image_text_then_image_then_edit_references():
    layout = dit.qwen_image_layout((1, 16, 1, 10, 12), 2, text=20, references=[(1, 16, 1, 10, 12)] * 2)
    assert layout.grid == (1, 5, 6)
    assert layout.starts == {20 + 30 + 60: 20}


@pytest.mark.parametrize(("text", "pad", "starts"), [
    (7, None, {7 + 30: 7, 30: 0}),
    (7, 8, {8 + 32: 8, 32: 0}),
    (30, 32, {32 + 32: 32}),  # the image-only refiner is as long as the text-only one: left alone
])
def test_lumina2_padded_text_then_padded_image_and_the_refiners(text, pad, starts):
    layout = dit.lumina2_layout((1, 16, 10, 12), 2, text=text, pad_multiple=pad)
    assert layout.grid == (1, 5, 6)
    assert layout.starts == starts


def test_a_sequence_of_another_length_has_no_image():
    layout = dit.flux_layout((1, 16, 8, 8), 2, text=4)
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
    torch.testing.assert_close(dit.pool_grid(x, grid, factor, time_factor, method),
                               reference_pool(x, grid, factor, time_factor, method))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("w", "h"), [(8, 6), (7, 5), (1, 4)])
def test_pool_grid_is_the_u_net_downsample_on_images(w, h, method):
    x = torch.randn(2, w * h, 6, generator=torch.Generator().manual_seed(w + h))
    torch.testing.assert_close(dit.pool_grid(x, (1, h, w), 2, 1, method), downsample_tokens(x, w, h, 2, method))


def test_pool_grid_takes_flux_single_blocks_strided_views():
    """Flux hands q, k, v of ``qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)``: pooled in the token-major view."""
    batch, heads, length, dim = 2, 3, 24, 4
    qkv = torch.randn(batch, length, 3 * heads * dim)
    _, k, _ = qkv.view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    pooled = dit.pool_grid(dit.token_major(k, True), (1, 4, 6), 2, 1, AVERAGE)
    torch.testing.assert_close(pooled, dit.pool_grid(k.transpose(1, 2).contiguous(), (1, 4, 6), 2, 1, AVERAGE))


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

EVERYWHERE = Reach(1)


def options(layout, sigma=1.0):
    return {dit.LAYOUT_KEY: layout, "sigmas": torch.tensor([sigma])}


def qkv(batch, heads, length, dim, heads_major, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, length, dim) if heads_major else (batch, length, heads * dim)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("heads_major", [True, False])
def test_todo_pools_the_image_keys_and_values_and_keeps_text_and_queries(heads_major):
    layout = dit.flux_layout((1, 16, 12, 16), 2, text=5)  # 6x8 image tokens after 5 text tokens
    q, k, v = qkv(2, 2, 5 + 48, 4, heads_major)
    override = dit.DiTReduction(todo=dit.DiTToDo(2, 1, NEAREST, EVERYWHERE))
    sdpa.calls.clear()
    seen = []

    def recording(q_, k_, v_, heads, **kwargs):
        seen.append((q_, k_, v_))
        return sdpa(q_, k_, v_, heads, **kwargs)

    out = override(recording, q, k, v, 2, skip_reshape=heads_major, transformer_options=options(layout))
    q_seen, k_seen, _ = (dit.token_major(t, heads_major) for t in seen[0])
    k_tokens = dit.token_major(k, heads_major)
    assert q_seen.shape[1] == 53 and k_seen.shape[1] == 5 + 12
    torch.testing.assert_close(q_seen, dit.token_major(q, heads_major))
    torch.testing.assert_close(k_seen[:, :5], k_tokens[:, :5])
    torch.testing.assert_close(k_seen[:, 5:], k_tokens[:, 5:].unflatten(1, (6, 8))[:, ::2, ::2].flatten(1, 2))
    assert out.shape == (2, 53, 8)


def test_cross_attention_masked_calls_and_unknown_lengths_are_left_alone():
    layout = dit.wan_layout((1, 16, 2, 4, 4), (1, 2, 2), contexts=[7])
    override = dit.DiTReduction(todo=dit.DiTToDo(2, 1, NEAREST, EVERYWHERE),
                                tome=dit.DiTToMe(0.5, 2, 2, EVERYWHERE))
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
    layout = dit.lumina2_layout((1, 16, 8, 12), 2, text=6, pad_multiple=4)  # 8 text, 4x6 image, 0 image padding
    q, k, v = qkv(2, 2, 32, 4, heads_major)
    override = dit.DiTReduction(tome=dit.DiTToMe(0.5, 2, 2, EVERYWHERE, seed=3, merge=merge))
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


def test_tome_on_video_merges_frame_by_frame():
    layout = dit.wan_layout((1, 16, 3, 4, 8), (1, 2, 2))  # 3 frames of 2x4
    _, k, _ = qkv(1, 2, 24, 4, False)
    tome = dit.DiTToMe(0.5, 2, 2, EVERYWHERE, use_rand=False)
    plan = dit.DiTReduction.plan(tome, k, layout.grid, 0, {})
    merged, restored = plan.merge(k), plan.unmerge(plan.merge(k))
    assert merged.shape == (1, 12, 8)
    for frame in range(3):
        tokens = k[:, frame * 8:(frame + 1) * 8]
        one = dit.DiTReduction.plan(tome, tokens, (1, 2, 4), 0, {})
        torch.testing.assert_close(merged[:, frame * 4:(frame + 1) * 4], one.merge(tokens))
        torch.testing.assert_close(restored[:, frame * 8:(frame + 1) * 8], one.unmerge(one.merge(tokens)))


def test_the_override_already_on_the_model_is_called_instead_of_the_attention():
    layout = dit.sd3_layout((1, 16, 8, 8), 2, text=3)
    seen = []

    def earlier(func, *args, **kwargs):
        seen.append(args[1].shape[1])
        return func(*args, **kwargs)

    override = dit.DiTReduction(todo=dit.DiTToDo(2, 1, AVERAGE, EVERYWHERE), inner=earlier)
    q, k, v = qkv(1, 2, 19, 4, False)
    override(sdpa, q, k, v, 2, transformer_options=options(layout))
    override(sdpa, q, k, v, 2, transformer_options={})
    assert seen == [3 + 4, 19]


def test_outside_the_window_nothing_is_reduced():
    layout = dit.sd3_layout((1, 16, 8, 8), 2, text=3)
    override = dit.DiTReduction(todo=dit.DiTToDo(2, 1, MAX, Reach(1, sigma_start=5.0, sigma_end=2.0)))
    q, k, v = qkv(1, 2, 19, 4, False)
    for sigma, keys in [(9.0, 19), (3.0, 7), (1.0, 19)]:
        sdpa.calls.clear()
        override(sdpa, q, k, v, 2, transformer_options=options(layout, sigma))
        assert sdpa.calls[0][1][1] == keys
