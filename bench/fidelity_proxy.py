"""What one merge and unmerge round trip loses, on real photographs (scikit-image's data images).

No real Stable Diffusion weights can be had here, so this measures the merge
itself on real image statistics: each photo becomes a token grid (one token per
4x4-pixel patch: 48 features), the tokens are merged with their own features as
the similarity metric and unmerged again, and the rebuilt photo is compared with
the original (PSNR, dB; higher is better). Strategies:

  random 2x2   the paper's default: one random destination per 2x2 cell
  fixed 2x2    the top-left token of every 2x2 cell (``use_rand`` off)
  fixed 1x2    the top token of every 1-wide, 2-tall cell (a column stride): at most half can merge
  random 4x4   one random destination per 4x4 cell
  prune 2x2    random 2x2, but the merged tokens are zeroed instead of given their destination's value

This shows what a single merge loses, not what the paper's FID sees: fixed
strides leave structured artifacts over many denoising steps, which one
round trip on pixels cannot show.

    .venv/bin/python bench/fidelity_proxy.py [--grids 64 128] [--ratios 0.3 0.5 0.7]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from tome.merge import IDENTITY, build_plan
from tome_harness.comfyui import ROOT

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field")
PATCH = 4
STRATEGIES = {  # sx, sy, use_rand, prune
    "random 2x2": (2, 2, True, False),
    "fixed 2x2": (2, 2, False, False),
    "fixed 1x2": (1, 2, False, False),
    "random 4x4": (4, 4, True, False),
    "prune 2x2": (2, 2, True, True),
}


def photo_tokens(name: str, grid: int) -> torch.Tensor:
    """``[1, grid*grid, 3*PATCH*PATCH]``: the photo resized to ``grid*PATCH`` px square, cut into patches."""
    import skimage.data
    from PIL import Image

    image = Image.fromarray(getattr(skimage.data, name)()).convert("RGB").resize((grid * PATCH,) * 2,
                                                                                Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # [H, W, 3]
    patches = pixels.reshape(grid, PATCH, grid, PATCH, 3).permute(0, 2, 1, 3, 4)
    return patches.reshape(1, grid * grid, PATCH * PATCH * 3)


def round_trip(tokens: torch.Tensor, grid: int, ratio: float, sx: int, sy: int, use_rand: bool,
               prune: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0) if use_rand else None
    plan = build_plan(tokens, grid, grid, sx, sy, int(tokens.shape[1] * ratio), no_rand=not use_rand,
                      generator=generator)
    rebuilt = plan.unmerge(plan.merge(tokens))
    if prune and plan is not IDENTITY:
        rebuilt = rebuilt.scatter(1, plan.src_pos.expand(-1, -1, tokens.shape[2]), 0.0)
    return rebuilt


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def run(grids, ratios) -> list[dict]:
    rows = []
    for grid in grids:
        tokens = {name: photo_tokens(name, grid) for name in PHOTOS}
        for ratio in ratios:
            for strategy, (sx, sy, use_rand, prune) in STRATEGIES.items():
                scores = [psnr(round_trip(t, grid, ratio, sx, sy, use_rand, prune), t) for t in tokens.values()]
                rows.append({"grid": grid, "ratio": ratio, "strategy": strategy,
                             "merged share": min(ratio, 1 - 1 / (sx * sy)),
                             "psnr mean dB": float(np.mean(scores)), "psnr min dB": float(np.min(scores))})
    return rows


def markdown(rows: list[dict]) -> str:
    strategies = list(STRATEGIES)
    lines = ["| grid | ratio | " + " | ".join(strategies) + " |", "|---|---|" + "---|" * len(strategies)]
    for grid, ratio in dict.fromkeys((r["grid"], r["ratio"]) for r in rows):
        cells = {r["strategy"]: r for r in rows if r["grid"] == grid and r["ratio"] == ratio}
        lines.append(f"| {grid}x{grid} | {ratio} | " + " | ".join(
            f"{cells[s]['psnr mean dB']:.1f}" + ("*" if cells[s]["merged share"] < ratio else "")
            for s in strategies) + " |")
    return "\n".join(lines) + "\n\nPSNR in dB, mean over the photos; * capped: fewer tokens can merge than asked."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    rows = run(args.grids, args.ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity_proxy.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / "fidelity_proxy.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
