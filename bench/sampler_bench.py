"""A whole KSampler run, every variant side by side: what ``reuse_steps`` saves and what it costs.

One random-weight U-Net of the real layout, ComfyUI's real KSampler (euler,
cfg 7), variants round-robin in one process, minimum of ``--repeats``:
no patch, the core node, Apply ToMe (q, k and v) with a fresh matching every
step, and Apply ToMe with ``reuse_steps`` for each value given. "distance" is
how far the final latent moves from the unpatched run's, relative to its size.

    .venv/bin/python bench/sampler_bench.py --px 512 --steps 8 --reuse 2 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.append(str(ROOT))  # appended: the pack's nodes.py must not shadow ComfyUI's nodes module

import comfyui_host  # noqa: E402


def run(args, nodes=None) -> list[dict]:
    """The rows of the table; ``nodes`` is ComfyUI's ``nodes`` module where it is already booted."""
    nodes = nodes or comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=True)
    import random_models

    ours = comfyui_host.pack_module("nodes")
    model = random_models.build_unet_model(args.family)
    config = random_models.UNET_CONFIGS[args.family]
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 77, config["context_dim"], generator=g)
    extra = {"pooled_output": torch.zeros(1, 1280)} if args.family == "sdxl" else {}
    positive, negative = [[context, extra]], [[torch.zeros_like(context), dict(extra)]]
    latent = {"samples": torch.zeros(1, 4, args.px // 8, args.px // 8)}

    def advanced(reuse_steps):
        return ours.apply_tome(model, args.ratio, 2, 2, "auto", seed=0, use_rand=True, merge="q, k and v",
                               reuse_steps=reuse_steps)

    core = nodes.NODE_CLASS_MAPPINGS["TomePatchModel"].execute(model, ratio=args.ratio).result[0]
    variants = {"none": model, "core": core, "ours": advanced(1),
                **{f"ours reuse {n}": advanced(n) for n in args.reuse}}

    def sample(m):
        (out,) = nodes.KSampler().sample(m, 1, args.steps, 7.0, "euler", "normal", positive, negative, latent)
        return out["samples"]

    outputs = {name: sample(m) for name, m in variants.items()}  # warm-up and distance
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, m in variants.items():
            start = time.perf_counter()
            sample(m)
            times[name].append(time.perf_counter() - start)
    base, rows = outputs["none"], []
    for name in variants:
        rows.append({"family": args.family, "px": args.px, "steps": args.steps, "ratio": args.ratio,
                     "variant": name, "seconds": min(times[name]),
                     "speed-up": min(times["none"]) / min(times[name]),
                     "distance": float((outputs[name] - base).norm() / base.norm())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | px | steps | variant | time (s) | vs no patch | distance |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['px']} | {r['steps']} | {r['variant']} | {r['seconds']:.1f} "
                     f"| {r['speed-up']:.2f}x | {r['distance']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["sd15", "sdxl"], default="sd15")
    parser.add_argument("--px", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--reuse", type=int, nargs="*", default=[2, 4], help="reuse_steps values to run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"sampler_{args.family}_{args.px}.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / f"sampler_{args.family}_{args.px}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
