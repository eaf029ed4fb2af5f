"""A whole KSampler run, every variant side by side: what ``reuse_steps`` saves and what it costs.

One random-weight U-Net of the real layout, ComfyUI's real KSampler (euler,
cfg 7), variants round-robin in one process, minimum of ``--repeats``:
no patch, the core node, Apply ToMe (q, k and v) with a fresh matching every
step, and Apply ToMe with ``reuse_steps`` for each value given. "distance" is
how far the final latent moves from the unpatched run's, relative to its size.

``--hires PX_FIRST PX_SECOND STEPS``: the hires fix instead, where large images are made and ToMe saves the
most: a first pass at PX_FIRST without ToMe, the latent upscaled to PX_SECOND, and a second pass of STEPS
steps at denoise 0.5, the one timed, with no patch, the core node, Apply ToMe (default) and the README's fast
setting on that pass only (``--variants`` picks among the last three).

``--repeats 0``: no warm-up run; the one run of each variant (the one that gives its latent) is timed. For
second passes of minutes, where one run is all the machine can afford and the first pass has warmed up.
``--attention``: ComfyUI's attention backend (default: ComfyUI's for the device).

    .venv/bin/python bench/sampler_bench.py --px 512 --steps 8 --reuse 2 4
    .venv/bin/python bench/sampler_bench.py --hires 512 1024 8 --steps 8
    .venv/bin/python bench/sampler_bench.py --hires 512 2048 2 --steps 4 --repeats 0 --attention sdpa
    .venv/bin/python bench/sampler_bench.py --family sdxl --hires 1024 2048 1 --steps 1 --variants ours fast \
        --repeats 0 --attention sdpa
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from unet_bench import fast_setting  # the sibling script (bench/ is on the path: run as a script, and pytest)

from tome.hosts.comfyui_unet import MERGE_QKV
from tome_harness import comfyui as comfyui_host
from tome_harness.comfyui import ATTENTION_CHOICES, ROOT

HIRES_DENOISE = 0.5
HIRES_VARIANTS = ("core", "ours", "fast")  # beside "none", which always runs: the speed-ups are against it


class Setup(NamedTuple):
    """The booted host, the random-weight model, the pack's U-Net adapter and the conditioning."""
    nodes: object
    model: object
    unet_adapter: object
    positive: list
    negative: list


def setup(args, nodes=None) -> Setup:
    """Boot ComfyUI unless ``nodes`` (its ``nodes`` module) says it is booted; build the model of ``args``."""
    nodes = nodes or comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=True,
                                                  attention=args.attention)
    from tome_harness import random_models

    unet_adapter = comfyui_host.pack_module("tome.hosts.comfyui_unet")
    model = random_models.build_unet_model(args.family, channels=args.channels, context_dim=args.context_dim)
    config = random_models.unet_config(args.family, context_dim=args.context_dim)
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 77, config["context_dim"], generator=g)
    extra = {"pooled_output": torch.zeros(1, 1280)} if args.family == "sdxl" else {}
    return Setup(nodes, model, unet_adapter, [[context, extra]], [[torch.zeros_like(context), dict(extra)]])


def sampler(s: Setup, steps: int, latent: dict, denoise: float = 1.0):
    """A function of the model: ComfyUI's KSampler (seed 1, euler, cfg 7) on ``latent``, the final latent."""
    def sample(model):
        (out,) = s.nodes.KSampler().sample(model, 1, steps, 7.0, "euler", "normal", s.positive, s.negative, latent,
                                           denoise=denoise)
        return out["samples"]
    return sample


def compare(variants: dict, sample, repeats: int) -> tuple[dict, dict]:
    """A warm-up run of each variant (its final latent), then ``repeats`` round-robin timed runs: the best
    seconds and the distance from the ``none`` variant's latent, by variant. ``repeats`` 0: the warm-up run
    is the one timed."""
    outputs, times = {}, {name: [] for name in variants}
    for name, m in variants.items():
        start = time.perf_counter()
        outputs[name] = sample(m)
        if not repeats:
            times[name].append(time.perf_counter() - start)
    for _ in range(repeats):
        for name, m in variants.items():
            start = time.perf_counter()
            sample(m)
            times[name].append(time.perf_counter() - start)
    base = outputs["none"]
    return ({name: min(t) for name, t in times.items()},
            {name: float((out - base).norm() / base.norm()) for name, out in outputs.items()})


def rows_of(args, best: dict, distance: dict, px, steps: int, **extra) -> list[dict]:
    """The table's rows, one per variant, printed as they are made; ``extra`` goes into each."""
    import comfy.ldm.modules.attention as attention

    rows = []
    for name in best:
        rows.append({"family": args.family, "px": px, "steps": steps, "ratio": args.ratio, "variant": name,
                     "seconds": best[name], "speed-up": best["none"] / best[name], "distance": distance[name],
                     "attention": attention.optimized_attention.__name__, **extra})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args, nodes=None) -> list[dict]:
    """The rows of the table; ``nodes`` is ComfyUI's ``nodes`` module where it is already booted."""
    s = setup(args, nodes)
    if args.hires:
        return run_hires(args, s)

    def advanced(reuse_steps):
        return s.unet_adapter.apply_tome(s.model, ratio=args.ratio, merge=MERGE_QKV, reuse_steps=reuse_steps)

    core = s.nodes.NODE_CLASS_MAPPINGS["TomePatchModel"].execute(s.model, ratio=args.ratio).result[0]
    variants = {"none": s.model, "core": core, "ours": advanced(1),
                **{f"ours reuse {n}": advanced(n) for n in args.reuse}}
    latent = {"samples": torch.zeros(1, 4, args.px // 8, args.px // 8)}
    best, distance = compare(variants, sampler(s, args.steps, latent), args.repeats)
    return rows_of(args, best, distance, args.px, args.steps)


def run_hires(args, s: Setup) -> list[dict]:
    """Hires fix: a first pass at ``PX_FIRST`` without ToMe (untimed), its latent upscaled by ComfyUI's
    ``LatentUpscale`` (nearest-exact) to ``PX_SECOND``, then the timed second pass (``STEPS`` steps, denoise
    0.5) with no patch and, of the core node, Apply ToMe (default) and the fast setting, those in
    ``--variants``, on that pass only."""
    first_px, second_px, second_steps = args.hires
    first = sampler(s, args.steps, {"samples": torch.zeros(1, 4, first_px // 8, first_px // 8)})(s.model)
    (upscaled,) = s.nodes.LatentUpscale().upscale({"samples": first}, "nearest-exact", second_px, second_px,
                                                  "disabled")
    scope, max_downsample = fast_setting(s.model)
    makers = {"core": lambda: s.nodes.NODE_CLASS_MAPPINGS["TomePatchModel"].execute(s.model,
                                                                                    ratio=args.ratio).result[0],
              "ours": lambda: s.unet_adapter.apply_tome(s.model, ratio=args.ratio, merge=MERGE_QKV),
              "fast": lambda: s.unet_adapter.apply_tome(s.model, ratio=args.ratio, merge=MERGE_QKV, scope=scope,
                                                        max_downsample=str(max_downsample))}
    chosen = args.variants or HIRES_VARIANTS
    variants = {"none": s.model, **{name: makers[name]() for name in HIRES_VARIANTS if name in chosen}}
    best, distance = compare(variants, sampler(s, second_steps, upscaled, denoise=HIRES_DENOISE), args.repeats)
    return rows_of(args, best, distance, second_px, second_steps, **{"first px": first_px,
                                                                    "first steps": args.steps,
                                                                    "denoise": HIRES_DENOISE})


def markdown(rows: list[dict]) -> str:
    lines = ["| model | px | steps | variant | time (s) | vs no patch | distance |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        px = f"{r['first px']} -> {r['px']} (2nd pass)" if "first px" in r else r["px"]
        lines.append(f"| {r['family']} | {px} | {r['steps']} | {r['variant']} | {r['seconds']:.1f} "
                     f"| {r['speed-up']:.2f}x | {r['distance']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["sd15", "sdxl"], default="sd15")
    parser.add_argument("--px", type=int, default=512, help="image size (square), in pixels")
    parser.add_argument("--steps", type=int, default=8, help="sampling steps (with --hires: of the first pass)")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe ratio")
    parser.add_argument("--reuse", type=int, nargs="*", default=[2, 4], help="reuse_steps values to run")
    parser.add_argument("--hires", type=int, nargs=3, metavar=("PX_FIRST", "PX_SECOND", "STEPS"),
                        help="hires fix instead: a first pass at PX_FIRST without ToMe, the latent upscaled to "
                             "PX_SECOND, a timed second pass of STEPS steps (denoise 0.5) per variant")
    parser.add_argument("--variants", nargs="+", choices=HIRES_VARIANTS, default=None,
                        help="with --hires: the variants run beside no patch (default: all; the core node "
                             "merges nothing on SDXL, so an SDXL run may leave it out)")
    parser.add_argument("--channels", type=int, default=None,
                        help="narrow the U-Net to this many base channels (layout kept; smoke runs)")
    parser.add_argument("--context-dim", type=int, default=None, help="narrow the text context (smoke runs)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per variant after a warm-up run, the minimum kept; 0: the warm-up run "
                             "is timed")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default=None,
                        help="ComfyUI's attention backend (split, sub-quadratic, sdpa); default: ComfyUI's choice")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for the results")
    args = parser.parse_args(argv)
    if args.variants is not None and not args.hires:
        parser.error("--variants picks the hires pass's variants: give it with --hires")
    return args


def main() -> None:
    args = parse_args()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"sampler_{args.family}_" + ("hires_{}_{}".format(*args.hires[:2]) if args.hires else str(args.px))
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
