"""DiT benchmark: one forward of a random-weight DiT at its real width, no patch vs ToDo vs ToMe, side by side.

Models (ComfyUI's own classes, configurations as ComfyUI detects the real checkpoints):
  sd35m   SD3.5 medium (MMDiT, 24 joint blocks of width 1536, image-only attn2 in the first 13) at 1024 px:
          64x64 = 4096 image tokens after 333 text tokens
  wan13b  Wan 2.1 1.3B (30 blocks of width 1536) at 480x832 x ``--frames`` frames (17: 5 x 30 x 52 = 7800
          video tokens; 33: 9 x 30 x 52 = 14040), 512 text tokens for cross-attention
  flux    Flux at its real width (3072, 24 heads), ``--flux-blocks`` double and single blocks (all 19 + 38 do not
          fit this machine's memory), at each of ``--px``: 512 text tokens, then (px/16)^2 image tokens
  hunyuan HunyuanVideo (13B: width 3072, 24 heads; 20 double and 40 single blocks; ``--blocks``: that many
          double blocks alone, whose joint attention over every token the single blocks repeat) at
          480x832 x ``--frames`` (33: 9 x 30 x 52 = 14040 video tokens, then 256 text tokens)
  wan22animate  Wan 2.2 Animate 14B (40 blocks of width 5120, 40 heads) at 480x832 x ``--frames`` (81: the
          reference frame, then 21 video frames: 22 x 30 x 52 = 34320 tokens), as WanAnimateToVideo feeds it
          (i2v's concat of 4 mask and 16 image channels over every frame, pose latents over the video's, CLIP
          vision's 257 tokens beside 512 text tokens); no face video (optional; its adapter, run after blocks
          0, 5, 10, ..., has a layer per 5 blocks: none with fewer)
  ltxv    LTX-Video 2B (28 blocks of width 2048, 32 heads) at 480x832 x ``--frames`` (33: 5 latent frames of
          15 x 26, one token each: 1950 video tokens), 128 text tokens for cross-attention
  wan14b  Wan 2.1 14B (40 blocks of width 5120, 40 heads) text to video, otherwise as wan13b
  wan22ti2v  Wan 2.2 TI2V-5B (30 blocks of width 3072, 24 heads; its VAE compresses 16x16 in space into 48
          channels) at ``--size`` 1280x704 x 121 frames: 31 x 22 x 40 = 27280 video tokens
  zimage  Z-Image (a Lumina 2 of width 3840, 30 heads, 30 layers) at 1024 px: 128 text tokens, then 4096 image
          tokens (each padded to 32s)
  hidream HiDream I1 (16 double- and 32 single-stream blocks of width 2560, mixture-of-experts MLPs; ``--blocks``:
          a third of them double) at 1024 px: 4096 image tokens, then T5's 128 and the LLM's 128 tokens twice
  qwen    Qwen-Image (60 double-stream blocks of width 3072, 24 heads of 128; 20B parameters: ``--blocks`` a few
          of them) at each of ``--px``: 256 text tokens (of width 3584), then (px/16)^2 image tokens

Video sizes: ``--size WIDTHxHEIGHT`` in pixels, as ComfyUI's empty-latent nodes take them (default: each
model's own, 832x480 for all but wan22ti2v); the latent is that over the VAE's compression (8x8 in space; 16x16
for wan22ti2v; 32x32 for ltxv), patched 2x2 (ltxv: 1x1).
  tiny    each of the test models of ``tome_harness.dit_models`` at a 32x32 latent: a smoke check on the CPU
          (``--blocks N``: N blocks in the models of the families the block scope reaches, a third of Flux's
          double blocks; the other families keep their own depth)

Full length (issue 27: the lengths people render), one block each, fp32 on a CPU (minutes a row):

    .venv/bin/python bench/dit_bench.py --model wan13b wan14b --frames 81 --blocks 1 --repeats 0 \
        --ratio 0.5 0.75 --merge kv --time-factor 2 --dtype fp32
    .venv/bin/python bench/dit_bench.py --model hunyuan --size 848x480 --frames 61 --blocks 1 --repeats 0 ...
    .venv/bin/python bench/dit_bench.py --model wan22ti2v --frames 121 --blocks 1 --repeats 0 ...
    .venv/bin/python bench/dit_bench.py --model ltxv --size 768x512 --frames 121 --blocks 4 --repeats 0 ...

Variants, run round-robin in one process (minimum of ``--repeats``): ``none``, ``todo-2`` (keys and values
pooled over 2x2 cells, nearest), ``todo-2-average`` (method average, with ``--average``), ``todo-2-tT`` (and
``T`` frames, with ``--time-factor``), ``tome-R-qkv`` and ``tome-R-kv`` (ratio R, q, k and v merged / k and v
only; ``--merge`` picks). Every row has the share of its
own forward spent in self-attention (queries as many as keys; timed call by call with the device synchronised,
in the warm-up forward), and ``ideal``: the speed-up if only self-attention got faster, exactly as much as the
queries times keys reaching it shrank (1 / (1 - s + s * c), s the no-patch share, c that product over the
no-patch one): the limit the reduction could reach with free pooling and merging. ``matching share``: the
share of the forward ToMe spends choosing what to merge (the similarity search and its sort, per frame; issue
27 section 2), timed the same way. ``peak MiB``: the forward's peak memory above what the process held before
it (CUDA: the allocator's peak; CPU: the resident set's high-water mark, which Linux lets a process reset).
Those are the rows of ``--scope attention`` (the default: ``dit_scope`` ``attention``).

``--scope block`` (issue 33; with ``--scope attention block`` beside the rows above): ``dit_scope`` ``block``,
the whole block (projections, attention, MLP) on the reduced image tokens, for Flux, SD3.5, Wan and Qwen-Image
(``tome/hosts/comfyui_dit_block.py``; other models get no block rows). For each pair ``F:L`` of ``--skips``
(default ``0:0`` and the nodes' default ``2:2``: the first F and last L blocks run whole):
``tome-R-block-skipF-L`` (Apply ToMe ratio R of ``--ratio``) and ``todo-D-block-skipF-L`` (Apply ToDo factor D
of ``--block-factor``, method nearest), each followed by its twin ``ideal-<name>``: the same model with the
same blocks run on the same reduced number of image tokens at no cost of reduction. The ideal is a ``dit``
block replacement on exactly the blocks the real row reduces that hands the block its sequence with the last
``n - m`` image tokens cut off (``n`` image tokens, ``m`` as many as the real row's reduction leaves: a view,
no copy, where the image ends the sequence, as in every case here; the rotary table cut the same way) and
hands the next block those tokens back unchanged (one concatenation: a copy of the image tokens, a memory
pass far below a block's cost). So it pays no matching, pooling, position gathering, change subtraction or
expansion: the limit a perfect, free reduction of those blocks would reach. (A model call on a smaller latent
would not do: it would also shrink the embedding and output layers, and the skipped blocks could not run on
all tokens.) Its output distance is that of the cut tokens passing through the block unchanged. A block row's
``ideal`` is the measured speed-up of its twin (the attention rows' ``ideal`` stays the formula above); an
``ideal-`` row's ``ideal`` is its own speed-up. ``block tokens``: the tokens each block ran on, in the order
they run, text included where it comes apart (Flux's double blocks, SD3, Qwen-Image; Flux's single blocks
hold it), counted in the warm-up forward (the Markdown runs them together: ``4608 (2), 2560 (4)``); a block
row and its ideal twin give the same counts. ``--reuse-blocks N``: also ``tome-R-block-skipF-L-reuseN``, ToMe
with one matching for N consecutive blocks of a model call (``tome_harness.block_reuse``, no node offers it:
docs/DITS.md "A matching reused"), beside its twin without it, whose ideal it reads. ``--token-cache``: also
``tokencache-R-block-skipF-L``, token-wise caching (Apply ToMe (Advanced)'s ``token_cache``: docs/DITS.md
"Token-wise caching"), timed as it runs past its whole steps: each call is the fourth step of one sampling run
(``TOKEN_CACHE_SCHEDULE``), its cache filled by one forward before the warm-up, so that its blocks compute the
``1 - R`` of the image tokens it selects and give the rest their cached change; beside its ToMe twin, whose
ideal it reads (as many tokens computed, at no cost of selecting them). With a few of a model's blocks
(``--blocks``, ``--flux-blocks``) the skipped ones weigh more than in the whole model: there ``0:0`` is the
reduced blocks' speed-up x, and the whole model's with S of its K blocks skipped is about
1 / (S/K + (1 - S/K)/x).

    .venv/bin/python bench/dit_bench.py --model sd35m wan13b            # on a GPU: bf16, PyTorch SDPA
    .venv/bin/python bench/dit_bench.py --model hunyuan ltxv --frames 33 --blocks 1 --ratio 0.75 --merge kv
    .venv/bin/python bench/dit_bench.py --model wan22animate --frames 81 --blocks 1 --ratio 0.75 --merge kv
    .venv/bin/python bench/dit_bench.py --model tiny --dtype fp32 --repeats 1
    .venv/bin/python bench/dit_bench.py --model sd35m --scope attention block --merge qkv   # issue 33
    .venv/bin/python bench/dit_bench.py --model tiny --blocks 6 --scope block --dtype fp32 --repeats 0  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from unet_bench import probe_for  # the sibling script (bench/ is on the path: run as a script, and pytest)

from tome.hosts.comfyui import MERGE_KV, MERGE_QKV
from tome.hosts.dit_settings import LAYOUT_KEY, OVERRIDE_KEY, SCOPE_ATTENTION, SCOPE_BLOCK
from tome.merge import IDENTITY, build_plan
from tome_harness import comfyui as comfyui_host
from tome_harness import dit_models, machine
from tome_harness.block_reuse import with_reuse_blocks
from tome_harness.comfyui import ROOT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One model at one size: ComfyUI's model class and config, the latent, the text, the extra conds."""

    name: str
    model_class: str
    config: dict
    latent: tuple[int, ...]
    text: tuple[int, int]  # context tokens and width
    conds: dict = field(default_factory=dict)  # name -> shape of a zero tensor (or the value: None, int, tensor)
    # Zero conds over the latent's frames: name -> (channels, frames fewer than the latent's).
    frame_conds: dict = field(default_factory=dict)
    reference_frames: int = 0  # latent frames ahead of the video's (Wan 2.2 Animate's reference image)
    spatial: int = 8  # pixels per latent cell: the VAE's spatial compression (video models)


REAL_CASES = {
    "sd35m": Case("sd35m", "SD3", {
        "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 24, "input_size": None,
        "adm_in_channels": 2048, "pos_embed_max_size": 384, "num_patches": 384 * 384, "qk_norm": "rms",
        "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 1536}},
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": list(range(13)),
    }, (1, 16, 128, 128), (333, 4096), {"y": (1, 2048)}),
    "wan13b": Case("wan13b", "WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 1536, "out_dim": 16, "num_heads": 12, "ffn_dim": 8960,
        "num_layers": 30, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16,
    }, (1, 16, 5, 60, 104), (512, 4096)),
    "hunyuan": Case("hunyuan", "HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
        "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24,
        "depth": 20, "depth_single_blocks": 40, "axes_dim": [16, 56, 56], "theta": 256, "qkv_bias": True,
        "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
        "vision_in_dim": None,
    }, (1, 16, 5, 60, 104), (256, 4096), {"y": (1, 768), "guidance": (1,)}),
    "wan22animate": Case("wan22animate", "WAN22_Animate", {
        "image_model": "wan2.1", "model_type": "animate", "dim": 5120, "out_dim": 16, "num_heads": 40,
        "ffn_dim": 13824, "num_layers": 40, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
        "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 36,
    }, (1, 16, 6, 60, 104), (512, 4096), {"clip_fea": (1, 257, 1280)},
        frame_conds={"c_concat": (20, 0), "pose_latents": (16, 1)}, reference_frames=1),
    "ltxv": Case("ltxv", "LTXV", {
        "image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 2048, "attention_head_dim": 64,
        "num_attention_heads": 32, "caption_channels": 4096, "num_layers": 28,
    }, (1, 128, 3, 15, 26), (128, 4096), {"attention_mask": None}, spatial=32),
    # Mochi as ComfyUI detects it (model_detection.py); 848x480 (its native size), a prompt of all 256 T5 tokens.
    "mochi": Case("mochi", "GenmoMochi", {
        "image_model": "mochi_preview", "depth": 48, "patch_size": 2, "num_heads": 24, "hidden_size_x": 3072,
        "hidden_size_y": 1536, "mlp_ratio_x": 4.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
        "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
        "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
        "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 4096, "t5_token_length": 256, "rope_theta": 10000.0,
    }, (1, 12, 6, 60, 106), (256, 4096), {"attention_mask": torch.ones(1, 256, dtype=torch.long), "num_tokens": 256}),
}
# Z-Image (turbo, 6B) as ComfyUI detects it (a Lumina 2 of width 3840: model_detection.py), 1024 px, a prompt of
# 128 Qwen3 tokens; its blocks take [text | image], each padded to 32s.
REAL_CASES["zimage"] = Case("zimage", "ZImage", {
    "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560, "n_layers": 30,
    "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
    "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0,
    "pad_tokens_multiple": 32,
}, (1, 16, 128, 128), (128, 2560), {"num_tokens": 128})
# HiDream I1 (17B) as ComfyUI detects it: 16 double- and 32 single-stream blocks of width 2560, mixture-of-experts
# MLPs; 1024 px, T5's 128 tokens and the LLM's 128 tokens of each of its 32 layers.
REAL_CASES["hidream"] = Case("hidream", "HiDream", {
    "image_model": "hidream", "attention_head_dim": 128, "axes_dims_rope": [64, 32, 32],
    "caption_channels": [4096, 4096], "max_resolution": [128, 128], "in_channels": 16,
    "llama_layers": list(range(32)) + [31] * 16, "num_attention_heads": 20, "num_routed_experts": 4,
    "num_activated_experts": 2, "num_layers": 16, "num_single_layers": 32, "out_channels": 16, "patch_size": 2,
    "text_emb_dim": 2048,
}, (1, 16, 128, 128), (128, 4096), {"y": (1, 2048), "encoder_hidden_states_llama3": (1, 32, 128, 4096)})
REAL_CASES["wan14b"] = dataclasses.replace(REAL_CASES["wan13b"], name="wan14b", config=dict(
    REAL_CASES["wan13b"].config, dim=5120, num_heads=40, ffn_dim=13824, num_layers=40))
REAL_CASES["wan22ti2v"] = Case("wan22ti2v", "WAN22_T2V", dict(
    REAL_CASES["wan13b"].config, dim=3072, num_heads=24, ffn_dim=14336, num_layers=30, in_dim=48, out_dim=48),
    (1, 48, 31, 44, 80), (512, 4096), spatial=16)
# Qwen-Image as ComfyUI detects it (image_model, in_channels, num_layers) with its network's defaults spelled out;
# its latent is Wan 2.1's, one frame. The latent's size comes from --px.
QWEN_CONFIG = {
    "image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56),
}
# Latent frames of a video of n frames: Wan and HunyuanVideo's VAEs compress time 4x, Mochi's 6x, LTX-Video's 8x
# (n = 8k + 1).
TIME_COMPRESSION = {"wan13b": 4, "wan14b": 4, "wan22ti2v": 4, "hunyuan": 4, "wan22animate": 4, "ltxv": 8, "mochi": 6}
FLUX_CONFIG = {
    "image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 768,
    "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "axes_dim": [16, 56, 56],
    "theta": 10000, "qkv_bias": True, "guidance_embed": False,
}


def with_blocks(case: Case, blocks: int | None) -> Case:
    """``case`` with only its first ``blocks`` transformer blocks (all where ``None``). Every block of these
    models has the same width and work, so the speed-up of a few blocks is the whole model's, up to the small
    embedding and output layers; it lets the larger inputs run on a small machine."""
    if blocks is None:
        return case
    config = dict(case.config)
    if "num_single_layers" in config:  # HiDream: a third double-stream blocks, as the real model's 16 of 48
        config["num_layers"] = max(1, blocks // 3)
        config["num_single_layers"] = blocks - config["num_layers"]
        layers = config["llama_layers"]  # the LLM layer each block reads (as many as blocks: its last repeated)
        config["llama_layers"] = (layers + layers[-1:] * blocks)[:blocks]
    elif "num_layers" in config:  # Wan, LTX-Video, Qwen-Image
        config["num_layers"] = blocks
    elif "n_layers" in config:  # Lumina 2 / Z-Image: its main layers alone (its 2 + 2 refiner layers, which see
        # the text alone and the image alone, and which the block scope does not reach, left out)
        config["n_layers"], config["n_refiner_layers"] = blocks, 0
    elif case.model_class == "Flux":  # a third double blocks, as the real model's 19 of 57
        config["depth"] = max(1, blocks // 3)
        config["depth_single_blocks"] = blocks - config["depth"]
    elif "depth_single_blocks" in config:  # HunyuanVideo: double blocks only, each joint attention over all tokens
        config["depth"], config["depth_single_blocks"] = blocks, 0
    elif case.model_class == "GenmoMochi":  # its last block gives no text back, as the real model's 48th
        config["depth"] = blocks
    else:  # MMDiT: its width is 64 * depth, so depth stays and num_blocks cuts; image-only attention is first
        config["num_blocks"] = blocks
        config["x_block_self_attn_layers"] = [i for i in config["x_block_self_attn_layers"] if i < blocks]
    return dataclasses.replace(case, name=f"{case.name}-{blocks}blocks", config=config)


def cases_of(args) -> list[Case]:
    """The cases the command line asks for, in its order."""
    cases = []
    for name in args.model:
        if name == "tiny":
            cases += tiny_cases(args.blocks)
        elif name in TIME_COMPRESSION:
            video = REAL_CASES[name]
            if args.size is None:
                size, grid = "", video.latent[3:]
            else:
                width, height = args.size
                size, grid = f"-{width}x{height}", (height // video.spatial, width // video.spatial)
            cases += [with_blocks(dataclasses.replace(video, name=f"{name}{size}-{n}f", latent=(
                *video.latent[:2], (n - 1) // TIME_COMPRESSION[name] + 1 + video.reference_frames, *grid)),
                args.blocks) for n in args.frames]
        elif name == "flux":
            double, single = args.flux_blocks
            config = dict(FLUX_CONFIG, depth=double, depth_single_blocks=single)
            cases += [Case(f"flux-{double}d{single}s-{px}px", "Flux", config, (1, 16, px // 8, px // 8), (512, 4096),
                           {"y": (1, 768)}) for px in args.px]
        elif name == "qwen":
            cases += [with_blocks(Case(f"qwen-{px}px", "QwenImage", QWEN_CONFIG, (1, 16, 1, px // 8, px // 8),
                                       (256, 3584)), args.blocks) for px in args.px]
        else:
            cases.append(with_blocks(REAL_CASES[name], args.blocks))
    return cases


# The test models the block scope reaches, whose depth ``--blocks`` sets in the smoke run.
TINY_BLOCK_FAMILIES = ("flux", "sd3", "wan21", "qwen_image", "hunyuan_video", "ltxv", "lumina2", "hidream")


def tiny_cases(blocks: int | None = None) -> list[Case]:
    """The test models, on a 32x32 latent (Wan: 3 frames of it); ``blocks``: that many blocks in the models of
    ``TINY_BLOCK_FAMILIES`` (Flux: a third of them double blocks), the others as they are."""
    cases = []
    for family in (*dit_models.FAMILIES, "hunyuan_video", "ltxv", "hidream", "cosmos_predict2"):
        model_class, config = dit_models.DIT_CONFIGS[family]
        latent = {"wan21": (1, 16, 3, 32, 32), "qwen_image": (1, 16, 1, 32, 32), "hunyuan_video": (1, 16, 3, 32, 32),
                  "ltxv": (1, 128, 3, 16, 16), "cosmos_predict2": (1, 16, 1, 32, 32)}.get(family, (1, 16, 32, 32))
        conds = {"lumina2": {"num_tokens": 7}, "hunyuan_video": {"y": (1, dit_models.CONTEXT_DIM)},
                 "ltxv": {"attention_mask": None},
                 "hidream": {"y": (1, dit_models.CONTEXT_DIM),  # 3 tokens of the LLM's 2 layers
                             "encoder_hidden_states_llama3": (1, 2, 3, dit_models.CONTEXT_DIM)}}.get(family, {})
        case = Case(f"tiny-{family}", model_class, config, latent, (7, dit_models.CONTEXT_DIM), conds)
        cases.append(with_blocks(case, blocks) if family in TINY_BLOCK_FAMILIES else case)
    return cases


def build(case: Case, dtype: torch.dtype, device: torch.device):
    """A ``ModelPatcher`` of ``case`` with seeded random weights, moved to ``device``."""
    import comfy.model_patcher
    import comfy.supported_models

    model_config = getattr(comfy.supported_models, case.model_class)(dict(case.config))
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, device=device).eval().to(device)  # weights drawn there: see randomize
    dit_models.randomize(model.diffusion_model)
    dit_models.fill_norm_scales(model.diffusion_model)
    dit_models.fill_position_embedding(model.diffusion_model, 0)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))


def variants(dit, model, ratios, merges=("qkv", "kv"), time_factor=None, average=False,
             scopes=(SCOPE_ATTENTION,), block_factors=(2,), skips=((0, 0), (2, 2)), reuse_blocks=(),
             token_cache=False) -> dict:
    """The models to time, by name: ``none``, the attention scope's rows (``scopes`` holding it), then the block
    scope's, each followed by its ideal twin (``scopes`` holding it; see the module docstring)."""
    out = {"none": model}
    if SCOPE_ATTENTION in scopes:
        out["todo-2"] = dit.apply_todo_dit(model, downsample_factor=2)
        if average:
            out["todo-2-average"] = dit.apply_todo_dit(model, downsample_factor=2, method="average")
        if time_factor is not None:
            out[f"todo-2-t{time_factor}"] = dit.apply_todo_dit(model, downsample_factor=2, time_factor=time_factor)
        for ratio in ratios:
            for merge in merges:
                out[f"tome-{ratio}-{merge}"] = dit.apply_tome_dit(model, ratio=ratio,
                                                                  merge={"qkv": MERGE_QKV, "kv": MERGE_KV}[merge])
    if SCOPE_BLOCK in scopes:
        out.update(block_variants(dit, model, ratios, block_factors, skips, reuse_blocks, token_cache))
    return out


def scope_module(dit, name: str):
    """The pack's module ``name`` (``comfyui_dit_block``, say) as ComfyUI loaded it, beside ``dit``
    (``comfyui_dit``)."""
    return importlib.import_module(dit.__name__.rsplit(".", 1)[0] + "." + name)


def block_module(dit):
    """``comfyui_dit_block`` as ComfyUI loaded it, beside ``dit`` (``comfyui_dit``)."""
    return scope_module(dit, "comfyui_dit_block")


def block_variants(dit, model, ratios, factors, skips, reuse_blocks=(), token_cache=False) -> dict:
    """``dit_scope`` ``block``: ToMe at each ratio and ToDo at each factor, for each ``(first, last)`` of
    ``skips``, each followed by its ideal twin, then ToMe with each of ``reuse_blocks`` (one matching for that
    many blocks: ``...-reuseN``, whose ideal is its twin's without it) and, with ``token_cache``, token-wise
    caching at each ratio (``tokencache-...``, whose ideal is its ToMe twin's); none for a model the block scope
    does not reach."""
    family = dit.dit_family(model)
    if family not in block_module(dit).BLOCK_FAMILIES:
        print(f"dit_bench: {type(model.model).__name__} has no block scope: no block rows", file=sys.stderr)
        return {}
    out = {}
    for first, last in skips:
        skip = dict(dit_scope=SCOPE_BLOCK, skip_first_blocks=first, skip_last_blocks=last)
        reals = {f"tome-{ratio}-block-skip{first}-{last}": dit.apply_tome_dit(model, ratio=ratio, **skip)
                 for ratio in ratios}
        reals.update({f"todo-{factor}-block-skip{first}-{last}": dit.apply_todo_dit(
            model, downsample_factor=factor, **skip) for factor in factors})
        for name, real in reals.items():
            out[name], out[f"ideal-{name}"] = real, ideal_twin(dit, model, real, family)
        out.update({f"tome-{ratio}-block-skip{first}-{last}-reuse{n}": with_reuse_blocks(
            reals[f"tome-{ratio}-block-skip{first}-{last}"], n) for ratio in ratios for n in reuse_blocks})
        if token_cache:
            caching = scope_module(dit, "dit_settings").TokenCaching()
            out.update({f"tokencache-{ratio}-block-skip{first}-{last}": in_a_sampling_run(dit.apply_tome_dit(
                model, ratio=ratio, token_cache=caching, **skip)) for ratio in ratios})
        if not block_module(dit).chosen_blocks(block_module(dit).block_keys(model, family), first, last):
            print(f"dit_bench: --skips {first}:{last} leaves none of this model's blocks reduced: its block rows "
                  "run as no patch does", file=sys.stderr)
    return out


# A token cache's calls are this run's fourth step (``make_inputs``' sigma is 0.7): past its whole steps.
TOKEN_CACHE_SCHEDULE = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.0])


def in_a_sampling_run(model):
    """``model`` (a fresh clone) with every call in one sampling run whose schedule is ``TOKEN_CACHE_SCHEDULE``,
    as the sampler's wrapper would give it: the run (``SamplingRun``, which holds the token caches) lives as long
    as the model's options, and each forward copies them shallowly (``forward``)."""
    host = comfyui_host.pack_module("tome.hosts.comfyui")
    options = model.model_options["transformer_options"]
    options[host.RUN_KEY], options["sample_sigmas"] = host.SamplingRun(), TOKEN_CACHE_SCHEDULE
    return model


def ideal_of(name: str) -> str:
    """A block row's ideal twin: its own, or its ToMe twin's for a reused matching and a token cache (as many
    tokens computed)."""
    return "ideal-" + name.split("-reuse")[0].replace("tokencache-", "tome-", 1)


# The block scope's ideal: the blocks the real row reduces, run on as many image tokens at no cost of reduction.

@functools.lru_cache(maxsize=64)
def removed_per_frame(h: int, w: int, ratio: float, sx: int, sy: int) -> int:
    """How many of an ``h x w`` frame's tokens ToMe's plan removes (``dit_tokens.frame_plan``'s count: it depends
    on the grid alone, never on the tokens)."""
    plan = build_plan(torch.zeros(1, h * w, 1), w, h, sx, sy, int(h * w * ratio), no_rand=True)
    return 0 if plan is IDENTITY else plan.removed


def reduced_tokens(grid: tuple[int, int, int], todo, tome) -> int:
    """The image tokens a block reduced by ``todo`` (pooled first) and ``tome`` (either may be ``None``) runs on,
    for an image of ``grid (t, h, w)``: as ``BlockScope.reduction`` leaves them."""
    t, h, w = grid
    if todo is not None and todo.factor <= min(h, w):
        t, h, w = -(-t // todo.time_factor), -(-h // todo.factor), -(-w // todo.factor)
    removed = 0 if tome is None else removed_per_frame(h, w, tome.ratio, tome.sx, tome.sy)
    return t * (h * w - removed)


def cut(x: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    """``x`` without its entries ``start:stop`` along ``axis``: a view where they end it."""
    if stop == x.shape[axis]:
        return x.narrow(axis, 0, start)
    return torch.cat([x.narrow(axis, 0, start), x.narrow(axis, stop, x.shape[axis] - stop)], dim=axis)


@dataclass(frozen=True, eq=False)
class IdealBlocks:
    """The ``blocks`` of an ideal twin's ``LayoutWrapper``: at every model call, an ``IdealBlock`` on each block
    of ``blocks`` (the keys the real row reduces), around whatever replacement the call has there. ``forms``:
    the family's ``BlockArgs`` by kind of block; ``todo``, ``tome``: the real row's block-scope settings, which
    say how many image tokens its blocks run on."""

    blocks: frozenset
    family: str
    block: object  # comfyui_dit_block, as ComfyUI loaded it
    todo: object | None
    tome: object | None

    @property
    def forms(self) -> Mapping:
        return self.block.BLOCK_FAMILIES[self.family].args

    def reaches(self, net: torch.nn.Module) -> bool:
        """Whether a model call finds the blocks the twin was made for (``BlockScope.reaches``): always, as this
        bench replaces no forward and no block list."""
        return True

    def install(self, options: dict, net: torch.nn.Module) -> None:
        self.block.replace_blocks(options, self.family, self.blocks, lambda key, inner: IdealBlock(
            self, key, inner, self.block.direct_block(self.family, net, key)))


@dataclass(frozen=True, eq=False)
class IdealBlock:
    """One block of an ideal twin: the block runs on its sequence without the last ``n - m`` image tokens
    (its per-token tables cut alike); those tokens go on to the next block as they came."""

    scope: IdealBlocks
    key: tuple[str, int]
    inner: Callable | None = None
    direct: Callable[[dict], dict] | None = None  # the block itself, as the real row runs it (``direct_block``)

    def run(self, args: dict, extra: dict) -> dict:
        return self.scope.block.run_block(self.inner, self.direct, args, extra)

    def __call__(self, args: dict, extra: dict) -> dict:
        layout = (args.get("transformer_options") or {}).get(LAYOUT_KEY)
        form = self.scope.forms[self.key[0]]
        img = args["img"]
        offset, length = form.sequence(args)  # where img starts in the layout's sequence, and its length
        start = None if layout is None else layout.start(length)
        tables = form.tables(args, length)
        if start is None or start < offset or start - offset + layout.n_tokens > img.shape[1] or tables is None:
            return self.run(args, extra)
        if (form.frame_vec and isinstance(args.get("vec"), torch.Tensor) and args["vec"].ndim == 4
                and args["vec"].shape[1] > 1) or any(args.get(key) is not None for key in form.ranges):
            raise ValueError("dit_bench: the ideal does not cut a per-frame modulation (Wan 2.2 TI2V-5B or "
                             "HunyuanVideo with a start image); run that model without one")
        n = layout.n_tokens
        m = reduced_tokens(layout.grid, self.scope.todo, self.scope.tome)
        if m >= n:
            return self.run(args, extra)
        at = start - offset  # the image in img
        changes = {"img": cut(img, 1, at + m, at + n)}
        for rows, table in tables:
            image_at = rows.image_at(start, offset)
            changes[rows.key] = cut(table, rows.axis, image_at + m, image_at + n)
        out = self.run(dict(args, **changes), extra)
        out_img = out["img"]
        return dict(out, img=torch.cat([out_img[:, :at + m], img[:, at + m:at + n], out_img[:, at + m:]], dim=1))


def ideal_twin(dit, model, real, family: str):
    """A clone of ``model`` whose blocks that ``real`` (a block-scope variant of it) reduces run on as many image
    tokens, cut rather than reduced (``IdealBlock``)."""
    reduction = dit.current_reduction(real) or dit.DiTReduction()  # none: ratio 0 or factor 1, nothing reduced
    todo, tome = (s if s is not None and s.scope == SCOPE_BLOCK else None
                  for s in (reduction.todo, reduction.tome))
    blocks = frozenset().union(*(s.blocks for s in (todo, tome) if s is not None))
    ideal = model.clone()
    scope = IdealBlocks(blocks, family, block_module(dit), todo, tome)
    ideal.add_wrapper_with_key(dit.APPLY_MODEL, dit.WRAPPER_KEY,
                               dit.LayoutWrapper(dit.dit_spec(ideal, family), scope, attention=False))
    return ideal


class BlockTokens:
    """A ``dit`` block replacement that notes in ``seen`` how many tokens its block runs on (the length of its
    sequence: the text too where it comes apart, ``form.sequence``), then runs the block (or ``inner``, the
    replacement that was there)."""

    def __init__(self, form, seen: list, inner: Callable | None = None):
        self.form, self.seen, self.inner = form, seen, inner

    def __call__(self, args: dict, extra: dict) -> dict:
        self.seen.append(self.form.sequence(args)[1])
        return self.inner(args, extra) if self.inner is not None else extra["original_block"](args)


def counting_blocks(dit, model, seen: list) -> Callable[[dict], None] | None:
    """What puts a ``BlockTokens`` on each block of a model call of ``model`` (into the call's options), noting
    into ``seen``; ``None`` for a model the block scope does not reach. The block scope's replacements, and
    the ideal's, are made at each call around these: the counts are of the tokens the blocks receive."""
    family, blocks = dit.dit_family(model), block_module(dit)
    if family not in blocks.BLOCK_FAMILIES:
        return None
    forms, keys = blocks.BLOCK_FAMILIES[family].args, blocks.block_keys(model, family)
    return lambda options: blocks.replace_blocks(options, family, keys,
                                                 lambda key, inner: BlockTokens(forms[key[0]], seen, inner))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def blocks_swapped(model):
    """For the length of a forward, the classes of a swapped family's blocks (Lumina 2, HiDream:
    ``comfyui_dit_swap``) swapped as a block-scope clone's object patches swap them when ComfyUI loads it (this
    bench calls ``apply_model`` without loading), for every variant alike: without a replacement the swapped
    block is the block, so the unpatched and attention-scope rows run as they would, and every row's blocks
    take the counting replacements."""
    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    block, family = block_module(dit), dit.dit_family(model)
    blocks = block.BLOCK_FAMILIES.get(family)
    if blocks is None or blocks.swap is None:
        yield
        return
    swap = importlib.import_module(block.__name__.rsplit(".", 1)[0] + ".comfyui_dit_swap")
    net = model.get_model_object("diffusion_model")
    modules = {key: net.get_submodule(path) for key, path in blocks.swap.paths(net).items()}
    classes = {key: type(module) for key, module in modules.items()}
    for key, module in modules.items():
        module.__class__ = swap.swapped_class(classes[key], blocks.swap.mixin, key)
    try:
        yield
    finally:
        for key, module in modules.items():
            module.__class__ = classes[key]


def forward(model, inputs, device, override=None, replaces=None):
    """One model call as the sampler makes it: the patcher's transformer options and wrappers, this sigma.
    ``replaces``: puts block replacements into the call's options (``counting_blocks``)."""
    x, sigma, context, conds = inputs
    options = dict(model.model_options["transformer_options"], wrappers=model.wrappers, sigmas=sigma)
    if override is not None:
        options["optimized_attention_override"] = override
    if replaces is not None:
        replaces(options)
    with torch.inference_mode(), blocks_swapped(model):
        out = model.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **conds)
    synchronize(device)
    return out


def traced_forward(model, inputs, device, dit):
    """One forward of ``model`` with its attention calls timed: ``(output, seconds, self-attention share, cost,
    matching share, peak bytes, block tokens)``.

    Self-attention: the calls the model makes with queries as many as keys,
    timed with whatever override ``model`` has (ours) inside. ``cost``: the
    queries times keys that reached attention in those calls, over the
    queries times keys the model made. Matching: the time ToMe's plans took
    (``frame_plan`` as the attention and block scopes beside ``dit``, the pack's
    module as ComfyUI loaded it, call it), inside those calls. Peak: above what the process held before the forward.
    Block tokens: the tokens each block ran on, in the order they ran
    (``BlockTokens``; empty for a model the block scope does not reach).
    """
    inner = model.model_options["transformer_options"].get(OVERRIDE_KEY)
    spent, made, reached, matching = [0.0], [0], [0], [0.0]

    def timed(func, *args, **kwargs):
        seq = 2 if kwargs.get("skip_reshape") else 1
        is_self = args[0].shape[seq] == args[1].shape[seq]

        def reaching(*a, **k):
            if is_self:
                reached[0] += a[0].shape[seq] * a[1].shape[seq]
            return func(*a, **k)

        synchronize(device)
        start = time.perf_counter()
        out = reaching(*args, **kwargs) if inner is None else inner(reaching, *args, **kwargs)
        synchronize(device)
        if is_self:
            spent[0] += time.perf_counter() - start
            made[0] += args[0].shape[seq] * args[1].shape[seq]
        return out

    def timed_plan(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        plan = untimed_plan(*args, **kwargs)
        synchronize(device)
        matching[0] += time.perf_counter() - start
        return plan

    scopes = [scope_module(dit, name) for name in ("comfyui_dit_attention", "comfyui_dit_block")]
    untimed_plan = scopes[0].frame_plan
    timing = isinstance(inner, dit.DiTReduction)
    for scope in scopes if timing else ():
        scope.frame_plan = timed_plan
    blocks = []
    replaces = counting_blocks(dit, model, blocks)
    probe = probe_for(device)
    held = probe.current()
    probe.reset()
    try:
        start = time.perf_counter()
        out = forward(model, inputs, device, override=timed, replaces=replaces)
        seconds = time.perf_counter() - start
    finally:
        for scope in scopes if timing else ():
            scope.frame_plan = untimed_plan
    return (out, seconds, spent[0] / seconds, reached[0] / max(made[0], 1), matching[0] / seconds,
            max(probe.peak() - held, 0), blocks)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(case.latent, generator=generator).to(device)
    context = torch.randn(1, *case.text, generator=generator).to(device, dtype)
    conds = {name: (value if value is None or isinstance(value, int) else value.to(device)
                    if isinstance(value, torch.Tensor) else torch.zeros(value, device=device, dtype=dtype))
             for name, value in case.conds.items()}
    for name, (channels, fewer) in case.frame_conds.items():  # [B, C, T, H, W], as the latent
        batch, _, frames, height, width = case.latent
        conds[name] = torch.zeros(batch, channels, frames - fewer, height, width, device=device, dtype=dtype)
    return x, torch.tensor([0.7], device=device), context, conds


def run_case(dit, case: Case, args, device, first: bool) -> list[dict]:
    """The rows of one case; ``first``: the process's first case."""
    dtype = DTYPES[args.dtype]
    model = build(case, dtype, device)
    inputs = make_inputs(case, dtype, device)
    models = variants(dit, model, args.ratio, args.merge, args.time_factor, args.average, args.scope,
                      args.block_factor, args.skips, args.reuse_blocks, args.token_cache)
    if not args.repeats and first:  # the first forward of a process pays one-time costs: not in the timed ones
        forward(model, inputs, device)
    for name, m in models.items():
        if name.startswith("tokencache-"):  # its cache filled: every later call selects and reuses
            forward(m, inputs, device)
    distance, peaks, shares, costs, traced, matching, blocks = {}, {}, {}, {}, {}, {}, {}
    for name, m in models.items():  # warm-up, self-attention share, output distance, peak memory, block tokens
        traced_out = traced_forward(m, inputs, device, dit)
        out, traced[name], shares[name], costs[name], matching[name], peak, blocks[name] = traced_out
        out = out.float()
        if name == "none":
            baseline = out
        distance[name] = float((out - baseline).norm() / baseline.norm())
        peaks[name] = peak / 2**20
    # --repeats 0: the warm-up forward is the one timed, after one untimed forward (on a CPU, where the per-call
    # synchronisation is free and a forward of a large input takes minutes).
    times = {name: [] if args.repeats else [traced[name]] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            start = time.perf_counter()
            forward(m, inputs, device)
            times[name].append(time.perf_counter() - start)
    rows = []
    speed_up = {name: min(times["none"]) / min(times[name]) for name in models}
    for name in models:
        twin = ideal_of(name)
        if name.startswith("ideal-"):  # the block scope's ideal: its own speed-up
            scope, ideal = "ideal", speed_up[name]
        elif twin in models:  # a block row: its ideal twin's measured speed-up
            scope, ideal = SCOPE_BLOCK, speed_up[twin]
        else:  # the attention scope's formula
            scope = None if name == "none" else SCOPE_ATTENTION
            ideal = 1.0 / (1.0 - shares["none"] + shares["none"] * costs[name])
        rows.append({"model": case.name, "latent": list(case.latent), "dtype": args.dtype, "device": device.type,
                     "variant": name, "scope": scope, "seconds": min(times[name]), "speed-up": speed_up[name],
                     "ideal": ideal, "self-attention share": shares[name], "matching share": matching[name],
                     "peak MiB": peaks[name], "relative distance": distance[name], "block tokens": blocks[name]})
        print(json.dumps(rows[-1]), flush=True)
    del model, models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def runs(counts: list[int]) -> str:
    """Block token counts in the order the blocks ran, runs of equal counts together: ``4608 (2), 2560 (4)``."""
    parts = []
    for count in counts:
        if parts and parts[-1][0] == count:
            parts[-1][1] += 1
        else:
            parts.append([count, 1])
    return ", ".join(f"{count} ({times})" for count, times in parts)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | latent | variant | time (s) | vs no patch | ideal | self-attention share | matching share "
             "| output distance | peak MiB | block tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} {r['dtype']} {r['device']} | {'x'.join(map(str, r['latent']))} "
                     f"| {r['variant']} | {r['seconds']:.3f} | {r['speed-up']:.2f}x | {r['ideal']:.2f}x "
                     f"| {r['self-attention share']:.0%} | {r['matching share']:.1%} "
                     f"| {r['relative distance']:.3f} | {r['peak MiB']:.0f} | {runs(r.get('block tokens', []))} |")
    return "\n".join(lines)


def skip_pair(text: str) -> tuple[int, int]:
    """``--skips``: ``FIRST:LAST``, the blocks run whole at each end."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--skips takes FIRST:LAST block counts, such as 2:2, not {text!r}") from None
    if first < 0 or last < 0:
        raise argparse.ArgumentTypeError(f"--skips takes counts of 0 or more, not {text!r}")
    return first, last


def video_size(text: str) -> tuple[int, int]:
    """``--size``: ``WIDTHxHEIGHT`` in pixels."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--size takes WIDTHxHEIGHT in pixels, such as 832x480, not {text!r}") from None
    return width, height


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=[*REAL_CASES, "flux", "qwen", "tiny"],
                        default=["sd35m", "wan13b"], help="which models (see the module docstring)")
    parser.add_argument("--frames", type=int, nargs="+", default=[17],
                        help="the video models (wan13b, wan14b, ...): video lengths in frames")
    parser.add_argument("--size", type=video_size, metavar="WIDTHxHEIGHT",
                        help="video models: the size in pixels (default: each model's own)")
    parser.add_argument("--blocks", type=int,
                        help="sd35m, wan13b, wan14b, wan22ti2v, wan22animate, ltxv, qwen: run only this many of "
                             "the model's blocks (hunyuan: double blocks; tiny: the block scope's families)")
    parser.add_argument("--px", type=int, nargs="+", default=[1024], help="flux, qwen: image sizes in pixels")
    parser.add_argument("--flux-blocks", type=int, nargs=2, default=[2, 4], metavar=("DOUBLE", "SINGLE"),
                        help="flux: how many double and single blocks (the real model has 19 and 38)")
    parser.add_argument("--ratio", type=float, nargs="*", default=[0.5],
                        help="ToMe ratios, at each scope of --scope (none: no ToMe rows)")
    parser.add_argument("--scope", nargs="+", choices=[SCOPE_ATTENTION, SCOPE_BLOCK], default=[SCOPE_ATTENTION],
                        help="dit_scope of the rows: attention (ToDo 2 and --ratio with --merge, the rows before "
                             "issue 33), block (--ratio and --block-factor per --skips, each with its ideal)")
    parser.add_argument("--block-factor", type=int, nargs="*", default=[2],
                        help="--scope block: ToDo factors (none: no ToDo block rows)")
    parser.add_argument("--skips", type=skip_pair, nargs="+", default=[(0, 0), (2, 2)], metavar="FIRST:LAST",
                        help="--scope block: skip_first_blocks:skip_last_blocks of each row (default 0:0 and the "
                             "nodes' default 2:2)")
    parser.add_argument("--reuse-blocks", type=int, nargs="*", default=[],
                        help="--scope block: also ToMe with one matching for this many consecutive blocks "
                             "(reuse_blocks; each beside its twin without it and that twin's ideal)")
    parser.add_argument("--token-cache", action="store_true",
                        help="--scope block: also token-wise caching at each --ratio (beside its ToMe twin and that "
                             "twin's ideal)")
    parser.add_argument("--merge", nargs="+", choices=["qkv", "kv"], default=["qkv", "kv"],
                        help="ToMe: what is merged (q, k and v, or k and v only)")
    parser.add_argument("--time-factor", type=int, help="also ToDo 2 pooling this many frames (video models)")
    parser.add_argument("--average", action="store_true", help="also ToDo 2 with method average")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights and activations")
    parser.add_argument("--no-sdpa", dest="sdpa", action="store_false",
                        help="ComfyUI's default attention instead of PyTorch SDPA")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds; the minimum is reported (0: one untimed forward, then the warm-up "
                             "forward is the one timed)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for JSON and Markdown")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=device.type == "cpu",
                                 sdpa=args.sdpa)
    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    rows = [row for index, case in enumerate(cases_of(args))
            for row in run_case(dit, case, args, device, first=index == 0)]
    scopes = "" if args.scope == [SCOPE_ATTENTION] else "_" + "_".join(args.scope)
    write_rows(args.out, f"dit_{'_'.join(args.model)}{scopes}_{args.dtype}_{'sdpa' if args.sdpa else 'default'}",
               rows, markdown(rows))


def write_rows(out: Path, stem: str, rows: list[dict], table: str) -> None:
    """A run's rows as JSON (with the machine they ran on) and its Markdown table, in ``out``; the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine.describe(), "rows": rows}, indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
