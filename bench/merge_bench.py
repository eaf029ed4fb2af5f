"""Merge micro-benchmark: one block's plan, merge of q, k and v, and unmerge, ours against tomesd 0.1.3.

Both run in one process, round-robin (so drift in machine load hits both
alike), and each cell reports the minimum over ``--repeats`` runs.

    .venv/bin/python bench/merge_bench.py [--repeats 15] [--out bench/results]

``--pieces`` instead times the parts of our merge separately, batch 1: the plan (partition and the
similarity matching), one merge, one unmerge, beside a feed-forward of the SD width on all tokens and on
the merged ones, to show where the time goes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tome.merge import build_plan
from tome_harness import machine

SIZES = [(4096, 320), (4096, 640), (16384, 320), (16384, 640)]  # (tokens, channels)
RATIO = 0.5


def ours(metric, q, k, v, side, r, seed):
    plan = build_plan(metric, side, side, 2, 2, r, generator=torch.Generator().manual_seed(seed))
    q, k, v = plan.merge(q), plan.merge(k), plan.merge(v)
    return plan.unmerge(q)


def reference(metric, q, k, v, side, r, seed):
    from tomesd.merge import bipartite_soft_matching_random2d

    merge, unmerge = bipartite_soft_matching_random2d(metric, side, side, 2, 2, r,
                                                      generator=torch.Generator().manual_seed(seed))
    q, k, v = merge(q), merge(k), merge(v)
    return unmerge(q)


VARIANTS = {"ours": ours, "tomesd 0.1.3": reference}


def run(repeats: int) -> list[dict]:
    rows = []
    for n_tokens, channels in SIZES:
        side = int(n_tokens ** 0.5)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, n_tokens, channels, generator=g) for _ in range(3))
        r = int(n_tokens * RATIO)
        times = {name: [] for name in VARIANTS}
        with torch.inference_mode():
            for fn in VARIANTS.values():  # warm-up
                fn(q, q, k, v, side, r, 0)
            for i in range(repeats):
                for name, fn in VARIANTS.items():
                    start = time.perf_counter()
                    fn(q, q, k, v, side, r, i)
                    times[name].append(time.perf_counter() - start)
        row = {"tokens": n_tokens, "channels": channels, "batch": 2, "ratio": RATIO,
               **{f"{name} ms": min(t) * 1e3 for name, t in times.items()}}
        row["speed-up"] = row["tomesd 0.1.3 ms"] / row["ours ms"]
        rows.append(row)
        print(f"N={n_tokens} C={channels}: ours {row['ours ms']:.2f} ms, "
              f"tomesd {row['tomesd 0.1.3 ms']:.2f} ms", flush=True)
    return rows


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def piece_times(n_tokens: int, channels: int, repeats: int) -> list[float]:
    """Milliseconds for the plan, one merge, one unmerge, and an SD feed-forward on all and on merged tokens."""
    side = int(n_tokens ** 0.5)
    x = torch.randn(1, n_tokens, channels, generator=torch.Generator().manual_seed(0))
    up, down = torch.nn.Linear(channels, channels * 8), torch.nn.Linear(channels * 4, channels)

    def feed_forward(t):  # SD's GEGLU feed-forward
        a, gate = up(t).chunk(2, dim=-1)
        return down(a * torch.nn.functional.gelu(gate))

    def plan():
        return build_plan(x, side, side, 2, 2, int(n_tokens * RATIO), generator=torch.Generator().manual_seed(0))

    with torch.inference_mode():
        made = plan()
        merged = made.merge(x)
        return [best_ms(f, repeats) for f in (plan, lambda: made.merge(x), lambda: made.unmerge(merged),
                                              lambda: feed_forward(x), lambda: feed_forward(merged))]


def pieces(repeats: int) -> str:
    """A Markdown table: where one block's merge spends its time."""
    lines = ["| tokens | channels | plan (ms) | merge (ms) | unmerge (ms) | feed-forward, all tokens (ms) "
             "| feed-forward, merged (ms) |", "|---|---|---|---|---|---|---|"]
    for n_tokens, channels in SIZES:
        cells = piece_times(n_tokens, channels, repeats)
        lines.append(f"| {n_tokens} | {channels} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| tokens | channels | ours (ms) | tomesd 0.1.3 (ms) | ours vs tomesd |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['tokens']} | {row['channels']} | {row['ours ms']:.2f} | "
                     f"{row['tomesd 0.1.3 ms']:.2f} | {row['speed-up']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="runs per cell; the minimum is reported")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the JSON and Markdown")
    parser.add_argument("--pieces", action="store_true", help="time plan, merge and unmerge separately")
    args = parser.parse_args()
    if args.pieces:
        print(pieces(args.repeats))
        return
    rows = run(args.repeats)
    table = markdown(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_bench.json").write_text(json.dumps({"machine": machine.describe(), "rows": rows}, indent=2))
    (args.out / "merge_bench.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
