"""The speed-quality frontier of each image DiT family: a forward's speed-up at real width against what the
setting costs on the family's trained judge, one picture per family.

    .venv/bin/python bench/frontier.py                       # every family: its table, and docs/frontier-*.png
    .venv/bin/python bench/frontier.py --family Flux --no-pictures

Nothing is measured here: the speed-ups are the committed rows of ``bench/dit_bench.py`` (``bench/records/speed``:
random weights of the real widths, this 2-core CPU, PyTorch SDPA), the costs the committed rows of
``bench/quality_bench.py`` (``bench/records/quality``). Each family's picture has two panels:

- a forward's speed-up against the x0 change at half the schedule (the README's rule: the fast row is the fastest
  setting whose x0 change is at most 0.25, the line drawn);
- a 20-step run's speed-up (the forward's, times the block calls a step cache leaves out: core EasyCache alone
  and stacked with the family's recommended setting) against the PSNR of its samples from noise against the
  unpatched ones (a step cache changes no single prediction, so only a run of steps can place it).

A block setting with skips is measured on the judge with its skips, but timed at real width on every block: its
speed-up is the every-block one over the share of blocks the setting reduced on the judge (a block's share of
the forward taken as equal): ``1 / (whole + reduced / s)``, drawn hollow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from tome_harness import trained_models as tm

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "bench" / "records"
FAST_RULE = 0.25  # the README's rule: the fast row's x0 change at half the schedule is at most this
DEFAULT_SKIPS = (2, 2)  # the block scope's skip_first_blocks and skip_last_blocks


@dataclass(frozen=True)
class Point:
    """One setting of the quality bench, placed by a timed variant of the speed bench."""

    setting: str  # the quality bench's name
    model: str  # the speed bench's model row
    variant: str  # the speed bench's variant
    skips: tuple[int, int] | None = None  # a block setting's skips on the judge (None: not a block setting)


@dataclass(frozen=True)
class Family:
    name: str
    judge: str  # the trained layout whose rows give the costs
    recommended: str  # the README's row on this family (its quality bench name)
    points: tuple[Point, ...]

    @property
    def picture(self) -> Path:
        return ROOT / "docs" / f"frontier-{self.name.lower().replace('.', '')}.png"


def _family(name: str, judge: str, recommended: str, attention: dict[str, tuple[str, str]],
            block: dict[str, tuple[str, str]]) -> Family:
    """``attention``: setting -> (model, variant) timed as it runs; ``block``: setting -> (model, every-block
    variant) for the block settings, each placed with the skips its name says (the default where it names
    none)."""
    points = [Point(setting, model, variant) for setting, (model, variant) in attention.items()]
    for setting, (model, variant) in block.items():
        skips = (0, 0) if "all blocks" in setting else (1, 1) if "skip 1:1" in setting else DEFAULT_SKIPS
        points.append(Point(setting, model, variant, skips))
    return Family(name, judge, recommended, tuple(points))


SD35_4, SD35, FLUX = "sd35m-4blocks", "sd35m", "flux-2d4s-1024px"
FAMILIES = (
    _family("SD3.5", "sd35-512", "ToDo 2", attention={
        "ToDo 2": (SD35, "todo-2"),
        "ToMe 0.3": (SD35, "tome-0.3-qkv"),
        "ToMe 0.5": (SD35_4, "tome-0.5-qkv"),  # timed on the first 4 blocks only
        "ToMe 0.5 k and v only": (SD35_4, "tome-0.5-kv"),
    }, block={
        "ToMe 0.3 block": (SD35, "tome-0.3-block-skip0-0"),
        "ToMe 0.3 block, all blocks": (SD35, "tome-0.3-block-skip0-0"),
        "ToMe 0.5 block": (SD35_4, "tome-0.5-block-skip0-0"),
        "ToMe 0.5 block, skip 1:1": (SD35_4, "tome-0.5-block-skip0-0"),
        "ToMe 0.5 block, all blocks": (SD35_4, "tome-0.5-block-skip0-0"),
        "ToDo 2 block": (SD35_4, "todo-2-block-skip0-0"),
    }),
    _family("Flux", "flux-512", "ToDo 2 average", attention={
        "ToDo 2": (FLUX, "todo-2"),
        "ToDo 2 average": (FLUX, "todo-2-average"),
        "ToMe 0.3": (FLUX, "tome-0.3-qkv"),
        "ToMe 0.5": (FLUX, "tome-0.5-qkv"),
        "ToMe 0.5 k and v only": (FLUX, "tome-0.5-kv"),
    }, block={
        "ToMe 0.3 block": (FLUX, "tome-0.3-block-skip0-0"),
        "ToMe 0.3 block, all blocks": (FLUX, "tome-0.3-block-skip0-0"),
        "ToMe 0.5 block": (FLUX, "tome-0.5-block-skip0-0"),
        "ToMe 0.5 block, skip 1:1": (FLUX, "tome-0.5-block-skip0-0"),
        "ToMe 0.5 block, all blocks": (FLUX, "tome-0.5-block-skip0-0"),
        "ToDo 2 block": (FLUX, "todo-2-block-skip0-0"),
    }),
)
# The step cache's rows: EasyCache alone runs every forward at full speed; stacked, at the recommended setting's.
CACHE_ALONE, CACHE_STACKED = "EasyCache", "EasyCache + ToDo 2 auto"


def speed_rows() -> dict[tuple[str, str], list[float]]:
    """Every committed speed-up, by (model, variant): a variant timed in several runs has each."""
    found: dict[tuple[str, str], list[float]] = {}
    for path in sorted((RECORDS / "speed").glob("*.json")):
        for row in json.loads(path.read_text())["rows"]:
            found.setdefault((row["model"], row["variant"]), []).append(row["speed-up"])
    return found


def quality_rows() -> dict[tuple[str, str], dict]:
    return {(row["layout"], row["setting"]): row for path in sorted((RECORDS / "quality").glob("*.json"))
            for row in json.loads(path.read_text())}


def judge_blocks(judge: str) -> int:
    """The transformer blocks of a DiT judge, in the order the block scope counts them for its skips."""
    config = tm.LAYOUTS[judge].config
    if "num_blocks" in config:  # MMDiT
        return config["num_blocks"]
    return config.get("depth", 0) + config.get("depth_single_blocks", 0) or config["num_layers"]


def reduced_share(point: Point, blocks: int) -> float:
    first, last = point.skips
    return max(blocks - first - last, 0) / blocks


def forward_speed(point: Point, speeds: dict, blocks: int) -> float:
    """The forward's speed-up of ``point`` (the mean of its timed runs; a block setting over its share)."""
    every = statistics.fmean(speeds[point.model, point.variant])
    if point.skips is None:
        return every
    share = reduced_share(point, blocks)
    return 1 / ((1 - share) + share / every)


@dataclass(frozen=True)
class Placed:
    setting: str
    forward: float  # speed-up of one forward
    run: float  # speed-up of a 20-step run from noise (the forward's times the calls a step cache leaves out)
    x0_change: float  # at half the schedule
    sample_psnr: float
    estimated: bool  # a block setting's speed taken over its share of blocks
    recommended: bool
    step_cache: bool = False  # changes no single prediction: the rule and the x0 panel leave it out


def place(family: Family, speeds: dict, costs: dict) -> list[Placed]:
    """Every point of ``family`` that both benches have measured, and the step cache's rows."""
    blocks = judge_blocks(family.judge)
    placed = []

    def calls_saved(row: dict) -> float:
        calls = row.get("sample block calls")
        return calls["unpatched"] / calls["ran"] if calls else 1.0

    def add(setting: str, row: dict, forward: float, **marks) -> None:
        placed.append(Placed(setting, forward, forward * calls_saved(row), row["x0 change 0.5"]["mean"],
                             row["sample PSNR"]["mean"], **marks))

    by_setting = {point.setting: point for point in family.points}
    for point in family.points:
        row = costs.get((family.judge, point.setting))
        if row is None or (point.model, point.variant) not in speeds:
            continue
        add(point.setting, row, forward_speed(point, speeds, blocks), estimated=point.skips not in (None, (0, 0)),
            recommended=point.setting == family.recommended)
    for setting, under in ((CACHE_ALONE, None), (CACHE_STACKED, family.recommended)):
        row = costs.get((family.judge, setting))
        if row is None or (under is not None and under not in by_setting):
            continue
        forward = 1.0 if under is None else forward_speed(by_setting[under], speeds, blocks)
        add(setting, row, forward, estimated=False, recommended=False, step_cache=True)
    return placed


def fast_choice(placed: list[Placed]) -> Placed | None:
    """The README's rule on these points: the fastest forward whose x0 change is at most ``FAST_RULE`` (step
    caches aside: they change no single prediction)."""
    eligible = [p for p in placed if not p.step_cache and p.x0_change <= FAST_RULE]
    return max(eligible, key=lambda p: p.forward, default=None)


def table(family: Family, placed: list[Placed]) -> str:
    fast = fast_choice(placed)
    out = [f"**{family.name}** (judge `{family.judge}`; speed at real width, this CPU: `bench/records/speed`)", "",
           "| setting | forward speed-up | 20-step run speed-up | x0 change at 50% | sample PSNR (dB) | |",
           "|---|---|---|---|---|---|"]
    for p in sorted(placed, key=lambda p: p.forward):
        marks = [m for m, on in (("recommended", p.recommended), ("fastest under the rule", p is fast),
                                 ("speed over its share of blocks", p.estimated)) if on]
        out.append(f"| {p.setting} | {p.forward:.2f}x | {p.run:.2f}x | {p.x0_change:.3f} | {p.sample_psnr:.1f} | "
                   f"{', '.join(marks)} |")
    return "\n".join(out) + "\n"


def draw(family: Family, placed: list[Placed], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    panels = ((left, lambda p: p.x0_change, lambda p: p.forward, "x0 change at half the schedule (log)",
               "speed-up of a forward"),
              (right, lambda p: p.sample_psnr, lambda p: p.run, "sample PSNR against no patch (dB, 20 steps)",
               "speed-up of a 20-step run"))
    for axis, x_of, y_of, x_label, y_label in panels:
        for p in placed:
            if axis is left and p.step_cache:
                continue  # a step cache changes no single prediction: only the run's panel places it
            colour = "tab:red" if p.step_cache else (
                "tab:blue" if " block" in p.setting else "tab:green")
            axis.scatter(x_of(p), y_of(p), s=140 if p.recommended else 40, marker="*" if p.recommended else "o",
                         facecolors="none" if p.estimated else colour, edgecolors=colour, zorder=3)
            axis.annotate(p.setting, (x_of(p), y_of(p)), fontsize=7, xytext=(4, 3), textcoords="offset points")
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(alpha=0.3)
    left.set_xscale("log")
    left.axvline(FAST_RULE, color="grey", linestyle="--", linewidth=1)
    left.annotate("the fast rule's limit", (FAST_RULE, left.get_ylim()[1]), fontsize=7, ha="right", va="top",
                  rotation=90)
    right.invert_xaxis()  # costlier to the right in both panels
    fig.suptitle(f"{family.name}: speed at real width (this CPU, random weights) against the cost on the trained "
                 f"judge {family.judge}\ngreen: attention scope; blue: block scope (hollow: timed over its share of "
                 f"blocks); red: core EasyCache; star: recommended", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=[f.name for f in FAMILIES])
    parser.add_argument("--no-pictures", action="store_true", help="the tables alone")
    args = parser.parse_args(argv)
    speeds, costs = speed_rows(), quality_rows()
    for family in (f for f in FAMILIES if args.family is None or f.name in args.family):
        placed = place(family, speeds, costs)
        print(table(family, placed))
        if not args.no_pictures:
            draw(family, placed, family.picture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
