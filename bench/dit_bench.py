"""DiT benchmark: one forward of a random-weight DiT at its real width, no patch vs ToDo vs ToMe, side by side.

Models (ComfyUI's own classes, configurations as ComfyUI detects the real checkpoints):
  sd35m   SD3.5 medium (MMDiT, 24 joint blocks of width 1536, image-only attn2 in the first 13) at 1024 px:
          64x64 = 4096 image tokens after 333 text tokens
  wan13b  Wan 2.1 1.3B (30 blocks of width 1536) at 480x832 x ``--frames`` frames (17: 5 x 30 x 52 = 7800
          video tokens; 33: 9 x 30 x 52 = 14040), 512 text tokens for cross-attention
  flux    Flux at its real width (3072, 24 heads), ``--flux-blocks`` double and single blocks (all 19 + 38 do not
          fit this machine's memory), at each of ``--px``: 512 text tokens, then (px/16)^2 image tokens
  tiny    each of the test models of ``tome_harness.dit_models`` at a 32x32 latent: a smoke check on the CPU

Variants, run round-robin in one process (minimum of ``--repeats``): ``none``, ``todo-2`` (keys and values
pooled over 2x2 cells, nearest), ``tome-R-qkv`` and ``tome-R-kv`` (ratio R, q, k and v merged / k and v only).
The ``none`` row also has the share of the forward spent in image self-attention (timed call by call with the
device synchronised, in a separate forward).

    .venv/bin/python bench/dit_bench.py --model sd35m wan13b            # on a GPU: bf16, PyTorch SDPA
    .venv/bin/python bench/dit_bench.py --model tiny --dtype fp32 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tome.hosts.comfyui_unet import MERGE_KV, MERGE_QKV
from tome_harness import comfyui as comfyui_host
from tome_harness import dit_models
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
    conds: dict = field(default_factory=dict)  # name -> shape of a zero tensor


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
}
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
    if "num_layers" in config:  # Wan
        config["num_layers"] = blocks
    else:  # MMDiT: its image-only attention sits in the first blocks
        config["depth"] = blocks
        config["x_block_self_attn_layers"] = [i for i in config["x_block_self_attn_layers"] if i < blocks]
    return dataclasses.replace(case, name=f"{case.name}-{blocks}blocks", config=config)


def cases_of(args) -> list[Case]:
    """The cases the command line asks for, in its order."""
    cases = []
    for name in args.model:
        if name == "tiny":
            cases += tiny_cases()
        elif name == "wan13b":
            wan = REAL_CASES["wan13b"]
            cases += [with_blocks(Case(f"wan13b-{n}f", wan.model_class, wan.config,
                                       (1, 16, (n - 1) // 4 + 1, 60, 104), wan.text), args.blocks)
                      for n in args.frames]
        elif name == "flux":
            double, single = args.flux_blocks
            config = dict(FLUX_CONFIG, depth=double, depth_single_blocks=single)
            cases += [Case(f"flux-{double}d{single}s-{px}px", "Flux", config, (1, 16, px // 8, px // 8), (512, 4096),
                           {"y": (1, 768)}) for px in args.px]
        else:
            cases.append(with_blocks(REAL_CASES[name], args.blocks))
    return cases


def tiny_cases() -> list[Case]:
    """The test models, on a 32x32 latent (Wan: 3 frames of it)."""
    cases = []
    for family in dit_models.FAMILIES:
        model_class, config = dit_models.DIT_CONFIGS[family]
        latent = {"wan21": (1, 16, 3, 32, 32), "qwen_image": (1, 16, 1, 32, 32)}.get(family, (1, 16, 32, 32))
        conds = {"num_tokens": 7} if family == "lumina2" else {}
        cases.append(Case(f"tiny-{family}", model_class, config, latent, (7, dit_models.CONTEXT_DIM), conds))
    return cases


def build(case: Case, dtype: torch.dtype, device: torch.device):
    """A ``ModelPatcher`` of ``case`` with seeded random weights, moved to ``device``."""
    import comfy.model_patcher
    import comfy.supported_models

    model_config = getattr(comfy.supported_models, case.model_class)(dict(case.config))
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, device="cpu")
    dit_models.randomize(model.diffusion_model)
    dit_models.fill_norm_scales(model.diffusion_model)
    dit_models.fill_position_embedding(model.diffusion_model, 0)
    model.eval().to(device)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))


def variants(dit, model, ratios) -> dict:
    """The models to time, by name."""
    out = {"none": model, "todo-2": dit.apply_todo_dit(model, downsample_factor=2)}
    for ratio in ratios:
        out[f"tome-{ratio}-qkv"] = dit.apply_tome_dit(model, ratio=ratio, merge=MERGE_QKV)
        out[f"tome-{ratio}-kv"] = dit.apply_tome_dit(model, ratio=ratio, merge=MERGE_KV)
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def forward(model, inputs, device, override=None):
    """One model call as the sampler makes it: the patcher's transformer options and wrappers, this sigma."""
    x, sigma, context, conds = inputs
    options = dict(model.model_options["transformer_options"], wrappers=model.wrappers, sigmas=sigma)
    if override is not None:
        options["optimized_attention_override"] = override
    with torch.inference_mode():
        out = model.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **conds)
    synchronize(device)
    return out


def self_attention_share(model, inputs, device) -> float:
    """The share of an unpatched forward spent in self-attention (queries as many as keys), timed call by call."""
    spent = [0.0]

    def timed(func, *args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        synchronize(device)
        seq = 2 if kwargs.get("skip_reshape") else 1
        if args[0].shape[seq] == args[1].shape[seq]:
            spent[0] += time.perf_counter() - start
        return out

    start = time.perf_counter()
    forward(model, inputs, device, override=timed)
    return spent[0] / (time.perf_counter() - start)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(case.latent, generator=generator).to(device)
    context = torch.randn(1, *case.text, generator=generator).to(device, dtype)
    conds = {name: (value if isinstance(value, int) else torch.zeros(value, device=device, dtype=dtype))
             for name, value in case.conds.items()}
    return x, torch.tensor([0.7], device=device), context, conds


def run_case(dit, case: Case, args, device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    model = build(case, dtype, device)
    inputs = make_inputs(case, dtype, device)
    models = variants(dit, model, args.ratio)
    baseline = forward(model, inputs, device).float()
    distance, peaks = {}, {}
    for name, m in models.items():  # warm-up, output distance, peak memory
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = forward(m, inputs, device).float()
        distance[name] = float((out - baseline).norm() / baseline.norm())
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    share = self_attention_share(model, inputs, device)
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            start = time.perf_counter()
            forward(m, inputs, device)
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in models:
        best = min(times[name])
        rows.append({"model": case.name, "latent": list(case.latent), "dtype": args.dtype, "device": device.type,
                     "variant": name, "seconds": best, "speed-up": min(times["none"]) / best,
                     "self-attention share": share if name == "none" else None, "peak MiB": peaks[name],
                     "relative distance": distance[name]})
        print(json.dumps(rows[-1]), flush=True)
    del model, models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | latent | variant | time (s) | vs no patch | self-attention share | output distance "
             "| peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "" if r["self-attention share"] is None else f"{r['self-attention share']:.0%}"
        peak = "n/a" if r["peak MiB"] is None else f"{r['peak MiB']:.0f}"
        lines.append(f"| {r['model']} {r['dtype']} | {'x'.join(map(str, r['latent']))} | {r['variant']} "
                     f"| {r['seconds']:.3f} | {r['speed-up']:.2f}x | {share} | {r['relative distance']:.3f} "
                     f"| {peak} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=[*REAL_CASES, "flux", "tiny"], default=list(REAL_CASES),
                        help="which models (see the module docstring)")
    parser.add_argument("--frames", type=int, nargs="+", default=[17], help="wan13b: video lengths in frames")
    parser.add_argument("--blocks", type=int, help="sd35m, wan13b: run only this many of the model's blocks")
    parser.add_argument("--px", type=int, nargs="+", default=[1024], help="flux: image sizes in pixels")
    parser.add_argument("--flux-blocks", type=int, nargs=2, default=[2, 4], metavar=("DOUBLE", "SINGLE"),
                        help="flux: how many double and single blocks (the real model has 19 and 38)")
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.5], help="ToMe ratios")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights and activations")
    parser.add_argument("--no-sdpa", dest="sdpa", action="store_false",
                        help="ComfyUI's default attention instead of PyTorch SDPA")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the minimum is reported")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for JSON and Markdown")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=device.type == "cpu",
                                 sdpa=args.sdpa)
    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    rows = [row for case in cases_of(args) for row in run_case(dit, case, args, device)]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"dit_{'_'.join(args.model)}_{args.dtype}_{'sdpa' if args.sdpa else 'default'}"
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    (args.out / f"{stem}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    table = markdown(rows)
    (args.out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
