"""The speed-quality frontier of each family with a trained judge (SD1.5, SDXL, SD3.5, Flux, Wan): a forward's
speed-up at real width against what the setting costs on the family's judge, one picture per family.

    .venv/bin/python bench/frontier.py                       # every family: its table, and docs/frontier-*.png
    .venv/bin/python bench/frontier.py --family Flux --no-pictures
    .venv/bin/python bench/frontier.py --steps 8 --no-pictures  # the runs of 8 steps (the few-step models' count)
    .venv/bin/python bench/frontier.py --step-count --steps 8  # the settings against the step count, with verdicts

Nothing is measured here: the speed-ups are the committed rows of ``bench/dit_bench.py`` and, for the U-Nets at
1024 px, of ``bench/unet_bench.py`` (``bench/records/speed``: random weights of the real widths, a 2-core CPU,
PyTorch SDPA; each family's from one run on one machine), the costs the committed rows of
``bench/quality_bench.py`` (``bench/records/quality``). Each family's picture has four panels:

- a forward's speed-up against the x0 change at half the schedule (the README's rule: the fast row is the fastest
  setting whose x0 change is at most 0.25, the line drawn);
- three of a 20-step run's speed-up (the forward's, times the block calls a step cache leaves out: core
  EasyCache alone and stacked with the family's recommended setting, on the DiTs) against a measure of its
  outputs: its samples' PSNR against the unpatched ones, its img2img PSNR against the photograph, its samples'
  patch distance to the photographs (a step cache changes no single prediction, so only a run of steps can place
  it). A setting that starts later in the schedule (``start_percent``, "from 0.2") runs its first steps whole:
  its run's speed-up is ``1 / (start + (1 - start) / s)``, and it is placed on these panels only (at half the
  schedule it is its whole-schedule twin, the same point of the first panel). So is a token cache (Apply ToMe
  (Advanced)'s ``token_cache``): its whole steps (the first 2, and every refresh) at 1x, the rest at the speed of
  a forward past them; a single prediction outside a run it leaves whole. It is timed in a run of its own
  (``dit_bench.py --token-cache``, maybe on another machine than its family's: the table says so), beside its
  ToMe twin, which is the fair comparison of the two. A ratio that changes over the steps
  (``tome_harness.step_schedule``: "ToMe 0.7 to 0.3 block") is placed by its run alone too: each step of a
  20-step run at the speed of a forward at its ratio (the block scope timed at 0.3, 0.5 and 0.7 in a run of its
  own, ``dit_bench.py --ratio 0.3 0.5 0.7 --token-cache``; a forward's time taken as linear between them), a
  whole step at 1x.

The unpatched model at fewer steps ("no patch, 10 steps": the quality bench's fewer-steps rows) is what every
user can already do: a run of N steps of the base 20 is 20 / N times faster. It is drawn as a grey line on each
run panel, on each measure: beside the samples' PSNR against the unpatched ones (identity), the img2img PSNR
against the photograph (the truth) and the samples' patch distance to the held-out photographs over the
unpatched samples' (realism; rows measured since issue 42 only). The rule's second half: a setting is
recommended only where no run with fewer steps at the same or a higher speed beats it on the quality measures
(``beaten_by``: at least as near the photograph and as real, and better on one of them). A setting measured
by its x0 change alone (``quality_bench.py --x0-only``) has no quality measure to hold against the step count:
it is unjudged, and the rule passes it over.

A block setting with skips is measured on the judge with its skips, but timed at real width on every block: its
speed-up is the every-block one over the share of blocks the setting reduced on the judge (a block's share of
the forward taken as equal): ``1 / (whole + reduced / s)``, drawn hollow. A setting that reuses a matching
("one matching a call": one for every block of a model call; "reuse N steps": a block's for N steps) is timed
as its twin less the matchings it leaves out: ``s / (1 - m (1 - kept))``, ``m`` the matching's share of the
twin's forward in the same run, ``kept`` the share of matchings still made (1 / the real model's reduced blocks;
1 / N). On SD3.5 medium this gave 2.96x where the forward measured 3.02x, on its first 4 blocks 3.18x and 3.18x
(``bench/records/speed/sd35m-1024px-bf16-epyc-block-reuse.json`` and ``docs/DITS.md``). Reusing a block's
matching over steps changes no single prediction: like a step window, it is placed by its run alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tome_harness import trained_models as tm
from tome_harness.step_schedule import Schedule

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "bench" / "records"
FAST_RULE = 0.25  # the README's rule: the fast row's x0 change at half the schedule is at most this
BASE_STEPS = 20  # the quality bench's runs; a row without its steps is of such a run
DEFAULT_SKIPS = (2, 2)  # the block scope's skip_first_blocks and skip_last_blocks


@dataclass(frozen=True)
class Point:
    """One setting of the quality bench, placed by a timed variant of the speed bench."""

    setting: str  # the quality bench's name
    variant: str  # the speed bench's variant, in its family's run
    skips: tuple[int, int] | None = None  # a block setting's skips on the judge (None: not a block setting)
    start: float = 0.0  # the share of a run's steps it leaves whole: its start_percent, a token cache's whole steps
    one_matching: bool = False  # one matching serves every block of a model call (reuse_blocks)
    reuse_steps: int = 1  # a block's matching serves this many steps
    record: str | None = None  # the speed bench's run that timed it, where not its family's
    schedule: Schedule | None = None  # its ratio over the steps: ``variant`` names each ratio's variant ({})


@dataclass(frozen=True)
class Family:
    name: str
    judge: str  # the trained layout whose rows give the costs
    recommended: str  # the README's conservative row on this family (its quality bench name)
    run: str  # the speed bench's run its points are timed in: its record's name in bench/records/speed
    depth: int  # the real model's blocks (one matching a call leaves out all but one of its reduced blocks')
    points: tuple[Point, ...]

    @property
    def picture(self) -> Path:
        return ROOT / "docs" / f"frontier-{self.name.lower().replace('.', '')}.png"


def _family(name: str, judge: str, recommended: str, run: str, depth: int, attention: dict[str, str],
            block: dict[str, str], token_cache: str | None = None, schedule: str | None = None) -> Family:
    """Every point timed in the speed bench's ``run``. ``attention``: setting -> its variant, timed as it runs;
    ``block``: setting -> the every-block variant of a block setting, placed with the skips its name says (the
    default where it names none) and the reuse of a matching it names; each with the start its name says
    ("from 0.2"; else 0). ``token_cache``: the run that timed the token cache, whose settings (``TOKEN_CACHE``)
    are placed with the default skips and their whole steps as a window's. ``schedule``: the run that timed the
    block scope at several ratios, where the settings with a schedule over the steps (``SCHEDULES``) are placed."""
    points = [Point(setting, variant, start=start_of(setting)) for setting, variant in attention.items()]
    for setting, variant in block.items():
        skips = (0, 0) if "all blocks" in setting else (1, 1) if "skip 1:1" in setting else DEFAULT_SKIPS
        steps = int(setting.split("reuse ")[1].split()[0]) if "reuse " in setting else 1
        points.append(Point(setting, variant, skips, start_of(setting), "one matching a call" in setting, steps))
    if token_cache is not None:
        points += [Point(setting, variant, DEFAULT_SKIPS, whole / BASE_STEPS, record=token_cache)
                   for setting, (variant, whole) in TOKEN_CACHE.items()]
    if schedule is not None:
        points += [Point(setting, variant, DEFAULT_SKIPS, whole / BASE_STEPS, record=schedule, schedule=steps)
                   for setting, (variant, steps, whole) in SCHEDULES.items()]
    return Family(name, judge, recommended, run, depth, tuple(points))


def start_of(setting: str) -> float:
    """The start_percent a quality bench setting's name gives ("ToDo 2 from 0.3": 0.3)."""
    return float(setting.split(" from ")[1].split()[0]) if " from " in setting else 0.0


# The block settings, each timed by its every-block variant.
BLOCK = {"ToMe 0.3 block": "tome-0.3-block-skip0-0", "ToMe 0.3 block, all blocks": "tome-0.3-block-skip0-0",
         "ToMe 0.5 block": "tome-0.5-block-skip0-0", "ToMe 0.5 block, skip 1:1": "tome-0.5-block-skip0-0",
         "ToMe 0.5 block, all blocks": "tome-0.5-block-skip0-0", "ToMe 0.5 block from 0.2": "tome-0.5-block-skip0-0",
         "ToMe 0.5 block, one matching a call": "tome-0.5-block-skip0-0",
         "ToMe 0.5 block, skip 1:1, one matching a call": "tome-0.5-block-skip0-0",
         "ToMe 0.5 block, reuse 2 steps": "tome-0.5-block-skip0-0", "ToMe 0.5 block, reuse 4 steps":
         "tome-0.5-block-skip0-0", "ToDo 2 block": "todo-2-block-skip0-0"}
# The token cache's settings (``TokenCaching``): the variant timing a step past its whole steps, and
# how many of a 20-step run's steps it runs whole (the first 2; "refresh every 4": steps 4, 8, 12 and 16 too).
# "combined" is not timed: its pairing of every reused token with a computed one is a cost of its own.
TOKEN_CACHE = {"token cache 0.5 block": ("tokencache-0.5-block-skip0-0", 2),
               "token cache 0.5 block, max age 2": ("tokencache-0.5-block-skip0-0", 2),
               "token cache 0.5 block, refresh every 4": ("tokencache-0.5-block-skip0-0", 6),
               "token cache 0.7 block": ("tokencache-0.7-block-skip0-0", 2)}
# The settings with a schedule over the steps (``tome_harness.step_schedule``): their variant at each ratio, the
# schedule, and the first steps they run whole (a token cache's 2). A run's speed is that of its steps, each at its
# ratio (the simple scheduler's step ``i`` of 20 lies at ``i / 20`` of the schedule), a forward's time linear
# between the ratios the run timed.
SCHEDULES = {"ToMe 0.7 to 0.3 block": ("tome-{}-block-skip0-0", Schedule(0.7, 0.3), 0),
             "ToMe 0.3 to 0.7 block": ("tome-{}-block-skip0-0", Schedule(0.3, 0.7), 0),
             "ToMe 0.625 block, every 5th step whole": ("tome-{}-block-skip0-0", Schedule(0.625, 0.625, 5), 0),
             "token cache 0.7 to 0.3 block": ("tokencache-{}-block-skip0-0", Schedule(0.7, 0.3), 2),
             "token cache 0.3 to 0.7 block": ("tokencache-{}-block-skip0-0", Schedule(0.3, 0.7), 2)}
ATTENTION = {"ToDo 2": "todo-2", "ToDo 2 from 0.3": "todo-2", "ToMe 0.3": "tome-0.3-qkv", "ToMe 0.5": "tome-0.5-qkv",
             "ToMe 0.5 k and v only": "tome-0.5-kv"}
# The U-Nets' settings, by the variant of ``bench/unet_bench.py`` (``--ratio 0.5 --todo 2 3 --scope-grid``) that
# times them (the ToDo methods take the same time, and a fixed destination is the same merge); a scope at the
# ``auto`` max_downsample by its level: 1 on SD1.5, 2 on SDXL (whose level 1 has no transformer blocks).
def _unet(auto: int) -> dict[str, str]:
    return {"ToMe 0.5": "ours-qkv", "ToMe 0.5 fixed destination": "ours-qkv", "ToMe 0.5 k and v only": "ours-kv",
            "ToMe 0.5 q only": "ours-q", "core TomePatchModel 0.5": "core", "ToDo 2": "todo-2",
            "ToDo 2 average": "todo-2", "ToDo 2 from 0.3": "todo-2", "ToDo 3": "todo-3",
            "ToMe 0.5 self+cross": f"self+cross-ds{auto}", "ToMe 0.5 widest scope": f"all-ds{auto}",
            "ToMe 0.5 max_downsample 2": "self-ds2", "ToMe 0.5 max_downsample 4": "self-ds4",
            "ToMe 0.5 self+cross, max_downsample 2": "self+cross-ds2",
            "ToMe 0.5 widest scope, max_downsample 4": "all-ds4"}


FAMILIES = (
    _family("SD1.5", "sd15-512", "ToDo 2", "sd15-1024px-fp32-sdpa", 0, _unet(1), {}),
    _family("SDXL", "sdxl-1024", "ToDo 2", "sdxl-1024px-fp32-sdpa", 0, _unet(2), {}),
    _family("SD3.5", "sd35-512", "ToDo 2", "sd35m-1024px-bf16-amx", 24, ATTENTION, BLOCK,
            "sd35m-1024px-bf16-epyc-token-cache", "sd35m-1024px-bf16-epyc-schedule"),
    _family("Flux", "flux-512", "ToDo 2 average", "flux-2d4s-1024px-fp32", 57,
            ATTENTION | {"ToDo 2 average": "todo-2-average"}, BLOCK, "flux-1d2s-1024px-fp32-epyc-token-cache",
            "flux-1d2s-1024px-fp32-epyc-schedule"),
    # Wan's run timed ToDo's nearest pooling alone; average takes the same time (the U-Nets' rows and Flux's).
    _family("Wan", "wan21-512", "ToDo 2 average", "wan13b-81f-1block-fp32", 30,
            ATTENTION | {"ToDo 2 time_factor 2": "todo-2-t2", "ToDo 2 average": "todo-2",
                         "ToDo 2 average time_factor 2": "todo-2-t2"}, BLOCK,
            "wan13b-81f-1block-fp32-epyc-token-cache", "wan13b-81f-1block-fp32-epyc-schedule"),
)
# The step cache's rows: EasyCache alone runs every forward at full speed; stacked, at the recommended setting's.
CACHE_ALONE, CACHE_STACKED = "EasyCache", "EasyCache + ToDo 2 auto"


def speed_rows() -> dict[str, dict[str, dict]]:
    """Every committed speed row, by run (a record of ``bench/records/speed``, by its name), then variant."""
    return {path.stem: {row["variant"]: row for row in json.loads(path.read_text())["rows"]}
            for path in sorted((RECORDS / "speed").glob("*.json"))}


def quality_rows(steps: int = BASE_STEPS) -> dict[tuple[str, str], dict]:
    """Every committed quality row of runs of ``steps``, by judge and setting; a setting measured in several
    records gets the figures of all of them (a later run adds the measures an earlier one had not)."""
    rows: dict[tuple[str, str], dict] = {}
    for path in sorted((RECORDS / "quality").glob("*.json")):
        for row in json.loads(path.read_text()):
            if row.get("steps", BASE_STEPS) == steps:
                rows.setdefault((row["layout"], row["setting"]), {}).update(row)
    return rows


FEWER_STEPS = "no patch, "  # the quality bench's fewer-steps settings: "no patch, 10 steps"


def fewer_steps_of(setting: str) -> int | None:
    """The steps of a fewer-steps setting ("no patch, 10 steps": 10), else ``None``."""
    return int(setting.removeprefix(FEWER_STEPS).split()[0]) if setting.startswith(FEWER_STEPS) else None


def judge_blocks(judge: str) -> int:
    """The transformer blocks of a DiT judge, in the order the block scope counts them for its skips (a U-Net
    judge: 0, it has no block settings)."""
    if tm.LAYOUTS[judge].is_unet:
        return 0
    config = tm.LAYOUTS[judge].config
    if "num_blocks" in config:  # MMDiT
        return config["num_blocks"]
    return config.get("depth", 0) + config.get("depth_single_blocks", 0) or config["num_layers"]


def reduced_share(point: Point, blocks: int) -> float:
    first, last = point.skips
    return max(blocks - first - last, 0) / blocks


def timed_ratios(template: str, run: dict[str, dict]) -> list[tuple[float, float]]:
    """Each ratio ``run`` timed the variant ``template`` (``{}`` for its ratio) at, with its seconds, ascending."""
    prefix, suffix = template.split("{}")
    return sorted((float(variant[len(prefix):len(variant) - len(suffix)]), row["seconds"])
                  for variant, row in run.items() if variant.startswith(prefix) and variant.endswith(suffix))


def speed_at(template: str, run: dict[str, dict], ratio: float) -> float:
    """The forward's speed-up of the variant ``template`` at ``ratio``: its time linear between the two timed
    ratios around it."""
    timed = timed_ratios(template, run)
    if not timed[0][0] <= ratio <= timed[-1][0]:
        raise ValueError(f"{template}: ratio {ratio} lies outside the timed {timed[0][0]} to {timed[-1][0]}")
    (low, low_s), (high, high_s) = next((a, b) for a, b in itertools.pairwise(timed) if a[0] <= ratio <= b[0])
    return run["none"]["seconds"] / (low_s + (high_s - low_s) * (ratio - low) / (high - low))


def timed(point: Point, run: dict[str, dict]) -> bool:
    """Whether ``run`` timed ``point`` (a schedule: at two ratios at least)."""
    return len(timed_ratios(point.variant, run)) > 1 if point.schedule else point.variant in run


def forward_speed(point: Point, run: dict[str, dict], blocks: int, depth: int) -> float:
    """The forward's speed-up of ``point`` in ``run`` (its family's speed rows by variant; a block setting's over
    its share of blocks, less the matchings it reuses: averaged over a run's forwards; a schedule's over the
    forwards of a run of ``BASE_STEPS`` past its whole first steps (``start``), each at its step's ratio, a whole
    step at 1x)."""
    if point.schedule is not None:
        share = reduced_share(point, blocks)
        times = [1.0 if ratio is None else (1 - share) + share / speed_at(point.variant, run, ratio)
                 for ratio in point.schedule.ratios(BASE_STEPS)[round(point.start * BASE_STEPS):]]
        return len(times) / sum(times)
    every = run[point.variant]["speed-up"]
    if point.skips is None:
        return every
    share = reduced_share(point, blocks)
    kept = 1 / max(round(share * depth), 1) if point.one_matching else 1.0
    kept /= point.reuse_steps
    every /= 1 - run[point.variant]["matching share"] * (1 - kept)
    return 1 / ((1 - share) + share / every)


@dataclass(frozen=True)
class Placed:
    setting: str
    forward: float  # speed-up of one forward
    run: float  # speed-up of a 20-step run from noise (the forward's times the calls a step cache leaves out)
    x0_change: float  # at half the schedule
    sample_psnr: float | None  # None: a row of x0 alone (``quality_bench.py --x0-only``), on the first panel only
    estimated: bool  # a block setting's speed taken over its share of blocks
    recommended: bool
    step_cache: bool = False  # changes no single prediction
    start: float = 0.0  # a step window's start: at half the schedule it is its whole-schedule twin
    reuse_steps: int = 1  # a matching reused over steps: at half the schedule it is its twin too
    fewer_steps: bool = False  # the unpatched model at fewer steps: the baseline every user has
    photo_psnr: float | None = None  # img2img PSNR against the photograph (dB)
    realism: float | None = None  # the samples' patch distance to the photographs over the unpatched samples'
    own_run: bool = False  # timed in a speed run of its own (``Point.record``), not its family's
    scheduled: bool = False  # its ratio changes over the steps: its forward is a run's mean

    @property
    def run_only(self) -> bool:
        """Placed by its run alone: the rule and the x0 panel leave it out."""
        return self.step_cache or self.start > 0 or self.reuse_steps > 1 or self.fewer_steps or self.scheduled

    @property
    def judged(self) -> bool:
        """Has a quality measure to hold against the step count (a row of x0 alone has none)."""
        return self.photo_psnr is not None or self.realism is not None


def place(family: Family, speeds: dict, costs: dict) -> list[Placed]:
    """Every point of ``family`` that both benches have measured, and the step cache's rows."""
    blocks, family_run = judge_blocks(family.judge), speeds.get(family.run, {})
    placed = []

    def calls_saved(row: dict) -> float:
        calls = row.get("sample block calls")
        return calls["unpatched"] / calls["ran"] if calls else 1.0

    def add(setting: str, row: dict, forward: float, start: float = 0.0, **marks) -> None:
        # The quality bench samples with the simple scheduler, whose steps are spaced evenly in the timesteps
        # start_percent counts in: a window from ``start`` runs that share of the steps whole. A run of fewer
        # steps makes fewer block calls: its speed-up is what they leave out.
        run_speed = 1 / (start + (1 - start) / forward) * calls_saved(row)
        placed.append(Placed(setting, forward, run_speed, row["x0 change 0.5"]["mean"], mean_of(row, "sample PSNR"),
                             start=start, photo_psnr=mean_of(row, "img2img PSNR to photo"),
                             realism=mean_of(row, "sample patch distance ratio to no patch"), **marks))

    by_setting = {point.setting: point for point in family.points}
    for point in family.points:
        row = costs.get((family.judge, point.setting))
        run = family_run if point.record is None else speeds.get(point.record, {})
        if row is None or not timed(point, run):
            continue
        add(point.setting, row, forward_speed(point, run, blocks, family.depth), point.start,
            estimated=point.skips not in (None, (0, 0)), recommended=point.setting == family.recommended,
            reuse_steps=point.reuse_steps, own_run=point.record is not None, scheduled=point.schedule is not None)
    for setting, under in ((CACHE_ALONE, None), (CACHE_STACKED, family.recommended)):
        row = costs.get((family.judge, setting))
        if row is None or (under is not None and under not in by_setting):
            continue
        forward = 1.0 if under is None else forward_speed(by_setting[under], family_run, blocks, family.depth)
        add(setting, row, forward, estimated=False, recommended=False, step_cache=True)
    for (judge, setting), row in sorted(costs.items()):
        if judge == family.judge and fewer_steps_of(setting) is not None:
            add(setting, row, 1.0, estimated=False, recommended=False, fewer_steps=True)
    return placed


def mean_of(row: dict, key: str) -> float | None:
    return row[key]["mean"] if key in row else None


def beaten_by(point: Placed, placed: list[Placed]) -> Placed | None:
    """The fastest run with fewer steps, at least as fast as ``point``'s run, that beats it on the quality
    measures both have: at least as near the photograph (img2img PSNR against it) and as real (patch distance
    ratio), and better on one. Identity (PSNR against the unpatched output) counts for neither side."""

    def beats(fewer: Placed) -> bool:
        pairs = [(a, b) for a, b in ((fewer.photo_psnr, point.photo_psnr),
                                     (None if fewer.realism is None else -fewer.realism,
                                      None if point.realism is None else -point.realism))
                 if a is not None and b is not None]
        return bool(pairs) and all(a >= b for a, b in pairs) and any(a > b for a, b in pairs)

    rivals = [p for p in placed if p.fewer_steps and p.run >= point.run and beats(p)]
    return max(rivals, key=lambda p: p.run, default=None)


def fast_choice(placed: list[Placed]) -> Placed | None:
    """The README's rule on these points: the fastest forward whose x0 change is at most ``FAST_RULE`` (step
    caches and windows aside: at half the schedule a cache changes nothing and a window is its twin), measured
    by a quality measure, and that no run with fewer steps beats (``beaten_by``)."""
    eligible = [p for p in placed if not p.run_only and p.judged and p.x0_change <= FAST_RULE
                and beaten_by(p, placed) is None]
    return max(eligible, key=lambda p: p.forward, default=None)


def table(family: Family, placed: list[Placed], steps: int = BASE_STEPS) -> str:
    fast = fast_choice(placed)
    out = [f"**{family.name}** (judge `{family.judge}`, runs of {steps} steps; speed at real width: "
           f"`bench/records/speed/{family.run}.json`)",
           "",
           f"| setting | forward speed-up | {steps}-step run speed-up | x0 change at 50% | sample PSNR (dB) | "
           "img2img PSNR to photo (dB) | sample patch distance / no patch | |",
           "|---|---|---|---|---|---|---|---|"]
    for p in sorted(placed, key=lambda p: p.run if p.fewer_steps else p.forward):
        beaten = None if p.fewer_steps else beaten_by(p, placed)
        marks = [m for m, on in (("conservative row", p.recommended), ("fastest under the rule", p is fast),
                                 ("speed over its share of blocks", p.estimated),
                                 (f"{p.start:.0%} of the steps whole", p.start > 0),
                                 ("at 50% its twin: placed by its run", p.reuse_steps > 1),
                                 ("a ratio over the steps: placed by its run", p.scheduled),
                                 ("timed in a run of its own", p.own_run),
                                 ("the step count, the baseline", p.fewer_steps),
                                 ("x0 alone: unjudged against the step count", not p.judged),
                                 (f"beaten by {beaten.setting.removeprefix(FEWER_STEPS)}" if beaten else "",
                                  beaten is not None)) if on]
        forward = "" if p.fewer_steps else f"{p.forward:.2f}x"
        x0 = "" if p.fewer_steps else f"{p.x0_change:.3f}"
        out.append(f"| {p.setting} | {forward} | {p.run:.2f}x | {x0} | {optional(p.sample_psnr, 1)} | "
                   f"{optional(p.photo_psnr, 1)} | {optional(p.realism, 2)} | {', '.join(marks)} |")
    return "\n".join(out) + "\n"


def step_count_table(family: Family, placed: list[Placed], costs: dict, steps: int = BASE_STEPS) -> str:
    """The judge's settings measured against the step count (the rows with the measures of quality), by their
    run's speed-up, each with its verdict: beaten by a run of fewer steps, or not."""
    rows = {setting: row for (judge, setting), row in costs.items()
            if judge == family.judge and "sample patch distance ratio to no patch" in row}
    out = [f"**{family.judge}, {steps} steps**", "",
           "| setting | run speed-up | sample PSNR vs no patch (dB) | img2img PSNR to photo (dB) | img2img SSIM to "
           "photo | samples' patch distance / no patch's | samples' detail / no patch's | against the step count |",
           "|---|---|---|---|---|---|---|---|"]

    def cells(row):
        return (f"{cell_of(row, 'img2img PSNR to photo', 2)} | {row['img2img SSIM to photo']['mean']:.3f} | "
                f"{cell_of(row, 'sample patch distance ratio to no patch', 2)} | "
                f"{row['sample detail ratio to no patch']['mean']:.2f}")

    if "none" in rows:
        out.append(f"| none | 1.00x | | {cells(rows['none'])} | |")
    for p in sorted((p for p in placed if p.setting in rows and p.setting != "none"), key=lambda p: p.run):
        beaten = None if p.fewer_steps else beaten_by(p, placed)
        verdict = "the baseline" if p.fewer_steps else (
            f"beaten by {beaten.setting.removeprefix(FEWER_STEPS)}" if beaten else "not beaten")
        out.append(f"| {p.setting} | {p.run:.2f}x | {p.sample_psnr:.1f} | {cells(rows[p.setting])} | {verdict} |")
    return "\n".join(out) + "\n"


def cell_of(row: dict, key: str, digits: int) -> str:
    return f"{row[key]['mean']:.{digits}f} ± {row[key]['std']:.{digits}f}"


def optional(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def draw(family: Family, placed: list[Placed], path: Path) -> None:
    """Four panels: a forward against the x0 change (the rule), and a 20-step run against each measure of its
    samples and img2img outputs, the step count's line on each; points numbered, their settings listed beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    fast = fast_choice(placed)
    number = {p.setting: i + 1 for i, p in enumerate(sorted((p for p in placed if not p.fewer_steps),
                                                             key=lambda p: p.run))}
    panels = ((axes[0][0], lambda p: None if p.run_only else p.x0_change, lambda p: p.forward,
               "x0 change at half the schedule (log; lower: nearer no patch)", "speed-up of a forward"),
              (axes[0][1], lambda p: p.sample_psnr, lambda p: p.run,
               "sample PSNR against no patch (dB, 20 steps; identity)", "speed-up of a 20-step run"),
              (axes[1][0], lambda p: p.photo_psnr, lambda p: p.run,
               "img2img PSNR against the photograph (dB; the truth)", "speed-up of a 20-step run"),
              (axes[1][1], lambda p: p.realism, lambda p: p.run,
               "sample patch distance to the photographs / no patch's (realism)", "speed-up of a 20-step run"))
    numbered = {axis: [] for axis, *_ in panels}  # each panel's (x, y, number), labelled once the scales are set
    for axis, x_of, y_of, x_label, y_label in panels:
        steps = sorted((p for p in placed if p.fewer_steps and x_of(p) is not None), key=lambda p: p.run)
        if steps:
            axis.plot([x_of(p) for p in steps], [y_of(p) for p in steps], color="grey", marker="s", markersize=4,
                      linewidth=1, zorder=2, label="no patch, fewer steps")
            for p in steps:
                axis.annotate(p.setting.removeprefix(FEWER_STEPS), (x_of(p), y_of(p)), fontsize=7, color="grey",
                              xytext=(4, -9), textcoords="offset points")
        for p in placed:
            if p.fewer_steps or x_of(p) is None:
                continue
            colour = "tab:red" if p.step_cache else ("tab:blue" if " block" in p.setting else "tab:green")
            marker, size = ("*", 140) if p.recommended else ("D", 60) if p is fast else ("o", 40)
            axis.scatter(x_of(p), y_of(p), s=size, marker=marker, facecolors="none" if p.estimated else colour,
                         edgecolors=colour, zorder=3)
            numbered[axis].append((x_of(p), y_of(p), number[p.setting]))
        axis.set_xlabel(x_label, fontsize=8)
        axis.set_ylabel(y_label, fontsize=8)
        axis.grid(alpha=0.3)
    left = axes[0][0]
    left.set_xscale("log")
    left.axvline(FAST_RULE, color="grey", linestyle="--", linewidth=1)
    left.annotate("the fast rule's limit", (FAST_RULE, left.get_ylim()[1]), fontsize=7, ha="right", va="top",
                  rotation=90)
    for axis in (axes[0][1], axes[1][0]):
        axis.invert_xaxis()  # costlier to the right in every panel
    legend = "\n".join(f"{n}  {setting}" for setting, n in sorted(number.items(), key=lambda item: item[1]))
    fig.text(0.995, 0.5, legend, fontsize=7, va="center", ha="right", family="monospace")
    kinds = ("green: a setting of Apply ToMe, Apply ToDo or the core node" if tm.LAYOUTS[family.judge].is_unet else
             "green: attention scope; blue: block scope (hollow: timed over its share of blocks); red: a step cache")
    fig.suptitle(f"{family.name}: speed at real width (run {family.run}: a 2-core CPU, random weights) against the "
                 f"cost on the trained judge {family.judge}\n{kinds}; grey: no patch at fewer steps (20 / N times "
                 f"faster)\nstar: the README's conservative row; diamond: the fastest under the rule", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.76, 1))
    for axis, points in numbered.items():  # once the panels have their final size
        label_points(axis, points)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def label_points(axis, points: list[tuple[float, float, int]]) -> None:
    """Each point's number beside it; labels that would be printed over one another become one ("5, 6"), until
    none overlaps, so that every number can be read."""
    renderer = axis.figure.canvas.get_renderer()
    labels = [(axis.annotate(str(number), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"), [number])
              for x, y, number in points]

    def overlapping():
        for (a, _), (b, numbers) in itertools.permutations(labels, 2):
            if a.get_window_extent(renderer).overlaps(b.get_window_extent(renderer)):
                return a, b, numbers
        return None

    while (found := overlapping()) is not None:
        kept, dropped, numbers = found
        kept_numbers = next(n for label, n in labels if label is kept)
        kept_numbers += numbers
        kept.set_text(", ".join(str(n) for n in sorted(kept_numbers)))
        dropped.remove()
        labels = [(label, n) for label, n in labels if label is not dropped]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=[f.name for f in FAMILIES])
    parser.add_argument("--no-pictures", action="store_true", help="the tables alone")
    parser.add_argument("--step-count", action="store_true",
                        help="instead: each judge's settings measured against the step count, with the verdicts")
    parser.add_argument("--steps", type=int, default=BASE_STEPS,
                        help="the quality bench's runs of this many steps (the pictures: 20 alone)")
    args = parser.parse_args(argv)
    speeds, costs = speed_rows(), quality_rows(args.steps)
    for family in (f for f in FAMILIES if args.family is None or f.name in args.family):
        placed = place(family, speeds, costs)
        if args.step_count:
            print(step_count_table(family, placed, costs, args.steps))
            continue
        print(table(family, placed, args.steps))
        if not args.no_pictures and args.steps == BASE_STEPS:
            draw(family, placed, family.picture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
