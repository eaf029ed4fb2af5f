"""U-Net benchmark: one forward of a random-weight SD1.5/SDXL U-Net, every variant side by side.

Variants, run round-robin in one process (minimum of ``--repeats``):
  none         no patch
  core         ComfyUI's core TomePatchModel (merges the queries only)
  ours-qkv     Apply ToMe, q, k and v merged (the paper)
  ours-q       Apply ToMe, q only
  ours-kv      Apply ToMe, k and v only
  ideal        self-attention on N - r tokens with merge and unmerge (almost) free: the limit
  todo-F       Apply ToDo, keys and values pooled by F x F (nearest), for each F of ``--todo``; they do not
               depend on the ratio, so they run with the first ratio only (their rows have no ratio)
  S-dsD        with ``--scope-grid``: Apply ToMe (q, k and v) with scope S (self, self+cross, all) at
               max_downsample D, for each D of ``--max-downsample``

``--variants`` picks among the fixed ones (none is always run); at 1024 px a full set takes long. Besides the
time of a whole forward, each row has the seconds spent inside the attention patch callbacks during the
warm-up forward ("in patches"): the merge overhead itself.

    .venv/bin/python bench/unet_bench.py --family sd15 --px 512 768 --ratio 0.5 [--todo 2 3] [--sdpa] [--dtype bf16]
    .venv/bin/python bench/unet_bench.py --family sdxl --px 1024 --variants core --todo --scope-grid \
        --max-downsample 2 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.append(str(ROOT))  # appended: the pack's nodes.py must not shadow ComfyUI's nodes module

import comfyui_host  # noqa: E402

from tome.grid import block_downsample  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIXED_VARIANTS = ("core", "ours-qkv", "ours-q", "ours-kv", "ideal")
SCOPES = {"self": "self-attention", "self+cross": "self- and cross-attention",
          "all": "self-attention, cross-attention and MLP"}


def ideal_patches(ratio, max_downsample):
    """Self-attention on the first N - r tokens, padded back: attention's saving without the merge's cost."""
    def attn1(n, context, value, extra_options):
        original_h, original_w = extra_options["original_shape"][-2:]
        if block_downsample(n.shape[1], original_h, original_w) > max_downsample:
            return n, context, value
        kept = n[:, : n.shape[1] - int(n.shape[1] * ratio)]
        extra_options["ideal_removed"] = n.shape[1] - kept.shape[1]
        return kept, kept, kept

    def attn1_output(out, extra_options):
        removed = extra_options.pop("ideal_removed", 0)
        return torch.nn.functional.pad(out, (0, 0, 0, removed)) if removed else out

    return attn1, attn1_output


def variants(nodes_module, core_cls, model, ratio, max_downsample, todo_factors=(), fixed=FIXED_VARIANTS,
             scope_downsamples=()):
    """The models to time, by name: ``none`` and the ``fixed`` ones, ToDo for each factor, and Apply ToMe for
    each scope at each of ``scope_downsamples``."""
    def ours(mode, scope="self-attention", downsample=max_downsample):
        return nodes_module.apply_tome(model, ratio, 2, 2, str(downsample), seed=0, use_rand=True, merge=mode,
                                       scope=scope)

    def ideal():
        patched = model.clone()
        attn1, attn1_output = ideal_patches(ratio, max_downsample)
        patched.set_model_attn1_patch(attn1)
        patched.set_model_attn1_output_patch(attn1_output)
        return patched

    makers = {
        "core": lambda: core_cls.execute(model, ratio=ratio).result[0],
        "ours-qkv": lambda: ours("q, k and v"),
        "ours-q": lambda: ours("q only"),
        "ours-kv": lambda: ours("k and v only"),
        "ideal": ideal,
    }
    return {
        "none": model,
        **{name: makers[name]() for name in fixed},
        **{f"todo-{f}": nodes_module.apply_todo(model, f, str(max_downsample)) for f in todo_factors},
        **{f"{short}-ds{d}": ours("q, k and v", scope, d)
           for d in scope_downsamples for short, scope in SCOPES.items()},
    }


def load(model):
    """Make ``model`` the loaded one, as the sampler does before its first step: this applies its object
    patches (the MLP swap of scope "all") and takes those of the previously loaded clone off. Untimed."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])


PATCH_KINDS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch")


def with_patch_timer(model, device):
    """A clone of ``model`` whose attention patch callbacks add their seconds to the returned list's one entry:
    the merge overhead itself (plan, merge, unmerge), free of a whole forward's run-to-run noise. The MLP merge
    of scope "all" runs inside the feed-forward, not in a callback, and is not counted."""
    spent = [0.0]

    def timed(patch):
        def call(*args):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = patch(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent[0] += time.perf_counter() - start
            return result
        return call

    timed_model = model.clone()
    patches = timed_model.model_options["transformer_options"].get("patches", {})
    for kind in PATCH_KINDS:
        if kind in patches:
            patches[kind] = [timed(p) for p in patches[kind]]
    return timed_model, spent


def forward(model, x, sigma, context, conds, device):
    options = dict(model.model_options["transformer_options"], sigmas=sigma)
    with torch.inference_mode():
        out = model.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **conds)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nodes = comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=device.type == "cpu",
                                         sdpa=args.sdpa)
    import comfy.ldm.modules.attention as attention
    import random_models

    attention_name = attention.optimized_attention.__name__
    ours_nodes = comfyui_host.pack_module("nodes")
    core_cls = nodes.NODE_CLASS_MAPPINGS["TomePatchModel"]
    model = random_models.build_unet_model(args.family, dtype=DTYPES[args.dtype])
    model.model.to(device)
    context_dim = random_models.UNET_CONFIGS[args.family]["context_dim"]
    max_downsample = ours_nodes.transformer_downsamples(model)[0]
    rows = []
    for px in args.px:
        latent = px // 8
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 4, latent, latent, generator=g).to(device)
        context = torch.randn(1, 77, context_dim, generator=g).to(device)
        sigma = torch.tensor([5.0], device=device)
        conds = {}
        if args.family == "sdxl":
            conds["y"] = torch.zeros(1, random_models.UNET_CONFIGS["sdxl"]["adm_in_channels"], device=device)
        for i, ratio in enumerate(args.ratio):
            models = variants(ours_nodes, core_cls, model, ratio, max_downsample, args.todo if i == 0 else (),
                              args.variants, args.max_downsample if args.scope_grid else ())
            load(models["none"])
            baseline = forward(models["none"], x, sigma, context, conds, device).float()
            times = {name: [] for name in models}
            peaks = {}
            distance = {}
            in_patches = {}
            for name, m in models.items():  # warm-up, output distance, peak memory and time in the patches
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                timed_model, spent = with_patch_timer(m, device)
                load(timed_model)
                out = forward(timed_model, x, sigma, context, conds, device).float()
                distance[name] = float((out - baseline).norm() / baseline.norm())
                peaks[name] = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
                in_patches[name] = spent[0]
            for _ in range(args.repeats):
                for name, m in models.items():
                    load(m)
                    start = time.perf_counter()
                    forward(m, x, sigma, context, conds, device)
                    times[name].append(time.perf_counter() - start)
            for name in models:
                best = min(times[name])
                rows.append({"family": args.family, "px": px, "dtype": args.dtype,
                             "ratio": None if name.startswith("todo") else ratio,
                             "attention": attention_name, "device": device.type, "variant": name,
                             "seconds": best, "speed-up": min(times["none"]) / best,
                             "vs core": min(times["core"]) / best if "core" in times else None,
                             "peak MiB": peaks[name], "in patches": in_patches[name],
                             "relative distance": distance[name]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | px | ratio | variant | time (s) | vs no patch | vs core node | in patches (s) "
             "| output distance | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "n/a" if r["peak MiB"] is None else f"{r['peak MiB']:.0f}"
        ratio = "-" if r["ratio"] is None else r["ratio"]
        vs_core = "n/a" if r["vs core"] is None else f"{r['vs core']:.2f}x"
        lines.append(f"| {r['family']} {r['dtype']} | {r['px']} | {ratio} | {r['variant']} | {r['seconds']:.2f} "
                     f"| {r['speed-up']:.2f}x | {vs_core} | {r['in patches']:.2f} | {r['relative distance']:.3f} "
                     f"| {peak} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for px in sorted({r["px"] for r in rows}):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            points = sorted((r["ratio"], r["speed-up"]) for r in rows if r["px"] == px and r["variant"] == variant
                            and r["ratio"] is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{variant} {px}px")
            else:  # ToDo: no ratio, a level line across the plot
                (speed_up,) = [r["speed-up"] for r in rows if r["px"] == px and r["variant"] == variant]
                ax.axhline(speed_up, linestyle="--", linewidth=1, label=f"{variant} {px}px",
                           color=f"C{len(ax.lines) % 10}")
    ax.set_xlabel("ratio")
    ax.set_ylabel("speed-up over no patch")
    ax.set_title(f"{rows[0]['family']} U-Net forward, {rows[0]['device']}, {rows[0]['attention']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["sd15", "sdxl"], default="sd15")
    parser.add_argument("--px", type=int, nargs="+", default=[512])
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.5])
    parser.add_argument("--todo", type=int, nargs="*", default=[2, 3],
                        help="ToDo downsample factors to run (default 2 3; --todo alone: none)")
    parser.add_argument("--variants", nargs="*", choices=FIXED_VARIANTS, default=list(FIXED_VARIANTS),
                        help="which fixed variants to run beside no patch")
    parser.add_argument("--scope-grid", action="store_true", help="Apply ToMe at every scope and max_downsample")
    parser.add_argument("--max-downsample", type=int, nargs="+", default=[1, 2, 4],
                        help="the max_downsample values of --scope-grid")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--sdpa", action="store_true", help="PyTorch SDPA attention (ComfyUI's CUDA default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"unet_{args.family}_{args.dtype}_{'sdpa' if args.sdpa else 'default'}"
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    (args.out / f"{stem}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    table = markdown(rows)
    (args.out / f"{stem}.md").write_text(table + "\n")
    plot(rows, args.out / f"{stem}.png")
    print(table)


if __name__ == "__main__":
    main()
