"""The quality bench's trained models and its measures, in the real host.

The models are the committed ones (``tome_harness/weights``), loaded into ComfyUI's own classes; nothing is
trained or downloaded here. The photographs are Debian's ``mate-backgrounds`` and scikit-image's.
"""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import load_bench

from tome_harness import trained_models as tm
from tome_harness.comfyui import ROOT

LAYOUTS = list(tm.LAYOUTS)
TRAINED = tm.committed(LAYOUTS)
REAL_FOOTPRINT = tm.GENERATIONS["real footprint"]
# The class of each family's network in ComfyUI, where the trained weights must land.
NETWORKS = {"SD15": "UNetModel", "SDXL": "UNetModel", "SD3": "OpenAISignatureMMDITWrapper", "Flux": "Flux",
            "WAN21_T2V": "WanModel"}


@pytest.mark.parametrize("name", tm.GENERATIONS["small"])
def test_the_small_judges_pixel_map_gives_every_photograph_back(name):
    layout = tm.LAYOUTS[name]
    pixels = tm.held_out_pixels(layout)
    latent = tm.to_latent(pixels, layout)
    assert latent.shape == tm.LAYOUTS[name].latent_shape(len(pixels))
    torch.testing.assert_close(tm.to_pixels(latent, layout), pixels, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", REAL_FOOTPRINT)
def test_the_real_footprint_maps_each_8x8_patch_to_a_latent_pixel_and_keeps_the_photograph(name):
    """The latent has the family's real grid (a latent pixel per 8x8 patch) and channels; decoding gives the
    photograph back as well as the recorded held-out PSNR of the patch map says, and re-encoding a decoded
    latent gives it back (decoding loses nothing a latent holds)."""
    layout = tm.LAYOUTS[name]
    pixels = tm.held_out_pixels(layout)
    latent = tm.to_latent(pixels, layout)
    assert latent.shape == layout.latent_shape(len(pixels))
    assert layout.pixels == 8 * layout.size
    recorded = json.loads((tm.WEIGHTS / "training.json").read_text())["patch maps"][str(layout.latent_channels)]
    floor = min(recorded["held-out PSNR"].values())
    decoded = tm.to_pixels(latent, layout)
    for image, original in zip(decoded, pixels, strict=True):
        assert 10 * torch.log10(1 / (image - original).square().mean()) > floor - 1.0
    patch_map = tm.patch_map(layout.latent_channels)
    image = latent[:1, :, 0] if layout.frames else latent[:1]  # a clip's first frame
    torch.testing.assert_close(patch_map.encode(patch_map.decode(image)), image, rtol=0, atol=1e-4)


# The judges of the real footprint take seconds each (4096 tokens a block): the full run (CI) checks them.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in REAL_FOOTPRINT else name
                                  for name in TRAINED])
def test_each_trained_model_loads_into_comfyuis_class_and_beats_its_untrained_twin(comfy_nodes, name):
    layout = tm.LAYOUTS[name]
    model = tm.trained(layout)
    network = model.model.diffusion_model
    assert type(network).__name__ == NETWORKS[layout.config_class]
    assert type(network).__module__.startswith("comfy.ldm.")
    held_out = tm.held_out_latents(layout)
    trained = tm.held_out_error(model.model, layout, held_out)
    untrained = tm.held_out_error(tm.untrained(layout).model, layout, held_out)
    for percent in tm.EVAL_PERCENTS:
        assert trained[percent]["model"] < 0.5 * untrained[percent]["model"], percent
        assert trained[percent]["model"] < trained[percent]["noisy input"], percent


def test_a_weights_file_that_does_not_match_its_hash_is_refused(comfy_nodes, tmp_path, monkeypatch):
    layout = tm.LAYOUTS["sd15"]
    (tmp_path / "sd15.safetensors").write_bytes(tm.weights_path(layout).read_bytes()[:-1] + b" ")
    (tmp_path / "SHA256SUMS").write_text((tm.WEIGHTS / "SHA256SUMS").read_text())
    monkeypatch.setattr(tm, "WEIGHTS", tmp_path)
    with pytest.raises(RuntimeError, match="does not match its hash"):
        tm.trained(layout)


@pytest.mark.parametrize("name", LAYOUTS)
def test_training_mode_leaves_the_forward_bit_for_bit(comfy_nodes, name):
    layout = tm.LAYOUTS[name]
    model = tm.untrained(layout).model
    x0 = tm.held_out_latents(layout)[:2, ..., :16, :16]  # a corner: the rewrite does not depend on the size
    sigma, noise = torch.tensor([1.0, 0.5]), torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tm.denoise(model, layout, x0, sigma, noise)
        with tm.OutOfPlaceAdds():
            rewritten = tm.denoise(model, layout, x0, sigma, noise)
    torch.testing.assert_close(rewritten, plain, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_the_bench_tells_merging_from_pruning_the_same_tokens(comfy_nodes, pack, name):
    """At ratio 0.5, averaging the merged tokens moves the x0 prediction less than dropping them, on every
    held-out photograph."""
    bench = load_bench("quality_bench")
    layout = tm.LAYOUTS[name]

    class Pack:
        models = pack.models

    model = tm.trained(layout)
    latents = tm.held_out_latents(layout)
    by_name = {s.name: s for s in bench.settings()}

    def prediction(setting):
        patched = by_name[setting].patch(Pack, model, layout)
        return model.model.process_latent_in(bench.predict_x0(patched, layout, latents, 0.5, seed=0))

    none = prediction("none")
    merged, pruned = bench.mse(prediction("ToMe 0.5"), none), bench.mse(prediction("prune 0.5"), none)
    assert (merged > 0).all()  # the patch acted
    assert (merged < pruned).all()


def test_a_layouts_head_width_reaches_comfyuis_class_which_otherwise_fixes_its_own(comfy_nodes):
    """ComfyUI's SD1.5 and SDXL classes set the heads whatever a config says (8 heads; heads of 64): the
    retrained SDXL judge's heads of 32 are set on the class's config, and the other U-Net judges keep the
    class's."""
    import comfy.ldm.modules.attention as attention

    def heads(name):
        model = tm.model_config(tm.LAYOUTS[name]).get_model({}, device="cpu")
        return {(module.heads, module.dim_head) for module in model.diffusion_model.modules()
                if isinstance(module, attention.CrossAttention)}

    assert heads("sdxl-1024") == {(1, 32), (2, 32)}  # levels 2 and 3: 32 and 64 wide
    assert heads("sdxl") == {(1, 64)}
    assert heads("sd15-512") == {(8, 4), (8, 8)}


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_the_knocked_out_blocks_give_their_image_tokens_back_and_no_other_block_does(comfy_nodes, pack, name):
    """The sensitivity measure's knock-out (docs/QUALITY.md): the blocks a default setting reduces (the small
    SD1.5's five at its top level, the first two and last three to run; Flux's all but two at each end) hand
    their image tokens on as they came, every other block still changes them, the prediction moves, and once the
    hooks are gone it is the model's own bit for bit."""
    bench = load_bench("quality_bench")
    layout = tm.LAYOUTS[name]
    model = tm.trained(layout)
    latents = tm.held_out_latents(layout)[:1]
    levels = pack.unet.transformer_downsamples(model) if layout.is_unet else []
    own = bench.predict_x0(model, layout, latents, 0.5, seed=0)
    handles = bench.knocked_out(model, layout, levels)
    try:
        changes = bench.block_changes(model, layout, latents)
        knocked = bench.predict_x0(model, layout, latents, 0.5, seed=0)
    finally:
        for handle in handles:
            handle.remove()
    idle = [index for index, change in enumerate(changes) if change == 0]
    expected = [0, 1, len(changes) - 3, len(changes) - 2, len(changes) - 1] if layout.is_unet else \
        list(range(2, len(changes) - 2))
    assert idle == expected
    assert not torch.equal(knocked, own)
    assert torch.equal(bench.predict_x0(model, layout, latents, 0.5, seed=0), own)


def test_the_trained_flux_attends_locally_sd35_and_wan_evenly_and_sdxl_tells_queries_apart(comfy_nodes, pack):
    """Why ToDo's nearest pooling costs the Flux layout most (docs/QUALITY.md): its image queries put several
    times the uniform share of their attention on their 3x3 neighbourhood, which nearest thins to one key in
    four; SD3.5's and Wan's spread theirs about evenly. And why the SDXL judge responds since its retraining: at
    the level the pack reduces, each query gets an output of its own, as SD1.5's do at the same token grid (the
    first SDXL judge gave every query the same average of the values, 0.02% of the energy off its mean, which
    merging keeps)."""
    bench = load_bench("quality_bench")

    def locality(name):
        layout = tm.LAYOUTS[name]
        model = tm.trained(layout)
        return bench.attention_locality(model, layout, tm.held_out_latents(layout)[:1],
                                        bench.image_side(model, layout, pack))

    local = {name: locality(name) for name in ("flux", "sd35", "wan21", "sd15-512", "sdxl-1024")}
    assert local["flux"]["3x3"] > 3 * local["flux"]["uniform 3x3"]
    for name in ("sd35", "wan21"):
        assert local[name]["3x3"] < 1.5 * local[name]["uniform 3x3"], name
    for name in ("sdxl-1024", "sd15-512"):
        assert local[name]["output off its mean"] > 0.3, name
    assert local["sdxl-1024"]["calls"] == 10 and local["sd15-512"]["calls"] == 5  # the transformer blocks there


@pytest.mark.slow
def test_the_quality_bench_smoke_run_measures_every_setting(comfy_nodes, tmp_path):
    out = tmp_path / "quality.json"
    layouts = [arg for name in TRAINED for arg in ("--layout", name)]
    subprocess.run([sys.executable, str(ROOT / "bench" / "quality_bench.py"), "--smoke", "--out", str(out), *layouts],
                   check=True, cwd=ROOT, capture_output=True, timeout=1800)
    rows = json.loads(out.read_text())
    bench = load_bench("quality_bench")
    expected = sum(1 for name in TRAINED for s in bench.settings() if s.applies_to(tm.LAYOUTS[name]) and
                   s.min_steps <= 2)  # the smoke run's steps: the step caches' rows need longer runs
    assert len(rows) == expected
    # The block scope leaves the first and last few blocks whole (2 and 2 by default, none with "all blocks",
    # "skip F:L" names them): nothing on a model of that many blocks or fewer.
    blocks = {name: sum(type(m).__name__ in bench.BLOCK_IMAGE
                        for m in tm.untrained(tm.LAYOUTS[name]).model.diffusion_model.modules()) for name in TRAINED}

    def skipped(setting):
        if "all blocks" in setting:
            return 0
        named = re.search(r"skip (\d+):(\d+)", setting)
        return int(named[1]) + int(named[2]) if named else 4

    for row in rows:
        assert row["x0 error 0.5"]["mean"] > 0
        # Every transformer block ran once a step (cfg 1: one model call a step); two steps are too few for the
        # step cache to skip one.
        assert row["sample block calls"] == {"ran": 2 * blocks[row["layout"]], "unpatched": 2 * blocks[row["layout"]]}
        # Every setting moves the prediction but no patch, the core node on SDXL, where it merges nothing, the
        # block scope where its skips leave no block, and a step cache alone (it never skips a first call).
        idle_blocks = " block" in row["setting"] and blocks[row["layout"]] <= skipped(row["setting"])
        if row["setting"].startswith("token cache"):  # a run's first step computes every token: one prediction
            assert row["x0 change 0.5"]["mean"] < 1e-9, row["layout"] + ": " + row["setting"]
            continue
        acts = row["setting"] not in ("none", "EasyCache") and not idle_blocks and not (
            row["setting"].startswith("core") and tm.LAYOUTS[row["layout"]].config_class == "SDXL")
        assert (row["x0 change 0.5"]["mean"] > 0) == acts, row["layout"] + ": " + row["setting"]
    none = [r for r in rows if r["setting"] == "none"]
    assert all(r["img2img PSNR"]["mean"] == 100.0 for r in none)  # a setting compared with itself


def test_the_findings_table_sets_each_claim_on_both_generations_side_by_side():
    """A claim is marked where the figures break it; a family whose layout lacks a setting gets no cell."""
    bench = load_bench("quality_bench")

    def row(layout, setting, change):
        return {"layout": layout, "setting": setting, "x0 change 0.5": {"mean": change, "std": 0.0}}

    rows = [row("flux", "ToDo 2 average", 0.1), row("flux", "ToDo 2", 0.7),
            row("flux-512", "ToDo 2 average", 0.3), row("flux-512", "ToDo 2", 0.2)]
    table = bench.findings_table(rows).splitlines()
    todo = [line for line in table if line.startswith("| ToDo average costs less than nearest")]
    assert todo == ["| ToDo average costs less than nearest | x0 change 0.5: ToDo 2 average / ToDo 2 | Flux | "
                    "0.100 / 0.700 holds | 0.300 / 0.200 **fails** |"]
    assert len(table) == 3  # the header, its rule and the one finding these rows hold


def test_a_later_run_of_some_settings_completes_a_record_in_the_benchs_order(comfy_nodes):
    bench = load_bench("quality_bench")

    def row(layout, setting, change):
        return {"layout": layout, "setting": setting, "x0 change 0.5": {"mean": change, "std": 0.0}}

    record = [row("a", "none", 0.0), row("a", "ToMe 0.5", 0.2), row("b", "none", 0.0), row("b", "ToDo 2", 0.1)]
    later = [row("a", "none", 0.0), row("a", "ToMe 0.3", 0.1), row("b", "ToDo 2", 0.3), row("c", "none", 0.0)]
    merged = [(r["layout"], r["setting"], r["x0 change 0.5"]["mean"]) for r in bench.merged(record, later)]
    assert merged == [("a", "none", 0.0), ("a", "ToMe 0.3", 0.1), ("a", "ToMe 0.5", 0.2), ("b", "none", 0.0),
                      ("b", "ToDo 2", 0.3), ("c", "none", 0.0)]


# The one node input whose choices do the same work, so that the cheaper in quality is the only choice that is
# never the dearest: Apply ToDo's method (the other inputs trade quality for speed: ratio, merge, scope, window).
# The bench row measuring each choice:
TODO_METHOD_ROWS = {"nearest": "ToDo 2", "average": "ToDo 2 average"}
FAMILY_OF_CONFIG = {"SD15": None, "SDXL": None, "SD3": "sd3", "Flux": "flux", "WAN21_T2V": "wan"}


def test_no_node_default_is_its_dearest_measured_choice_on_a_trained_family(pack):
    """On each trained family's judge (the real footprint's where its rows are committed in
    ``bench/records/quality``, else the small one's), the method Apply ToDo's default (``auto``) picks for the
    family moves the x0 prediction at half the schedule no further than the other."""
    rows = {(row["layout"], row["setting"]): row["x0 change 0.5"]["mean"]
            for path in sorted((ROOT / "bench" / "records" / "quality").glob("*.json"))
            for row in json.loads(path.read_text())}
    for small, real in zip(tm.GENERATIONS["small"], REAL_FOOTPRINT, strict=True):
        judge = real if (real, "ToDo 2") in rows else small
        picked = pack.models.todo_method("auto", FAMILY_OF_CONFIG[tm.LAYOUTS[judge].config_class])
        costs = {method: rows[judge, setting] for method, setting in TODO_METHOD_ROWS.items()}
        assert costs[picked] == min(costs.values()), (judge, costs)


def test_every_frontier_point_names_a_committed_speed_row_and_a_quality_bench_setting(comfy_nodes):
    """``bench/frontier.py`` draws from committed rows only: each point it places must name a variant the speed
    records hold (its family's run, or the run of its own it names) and a setting the quality bench runs on the
    family's judge, and each family's recommended setting is placed; the DiTs' step cache rows are judged too."""
    frontier, bench = load_bench("frontier"), load_bench("quality_bench")
    speeds, costs = frontier.speed_rows(), frontier.quality_rows()
    assert {tm.LAYOUTS[family.judge].is_unet for family in frontier.FAMILIES} == {True, False}
    for family in frontier.FAMILIES:
        judged = {s.name for s in bench.settings() if s.applies_to(tm.LAYOUTS[family.judge])}
        assert tm.LAYOUTS[family.judge].is_unet or {frontier.CACHE_ALONE, frontier.CACHE_STACKED} <= judged
        for point in family.points:
            assert frontier.timed(point, speeds[point.record or family.run]), (family.name, point)
            assert point.setting in judged, (family.name, point.setting)
        placed = {p.setting: p for p in frontier.place(family, speeds, costs)}
        assert placed[family.recommended].recommended


def test_a_block_setting_is_timed_over_the_share_of_blocks_it_reduced_on_its_judge():
    """Every block reduced: the every-block speed-up itself; the default skips (2 and 2) on the 9-block Flux
    judge reduce 5: 1 / (4/9 + 5/9 / s); a run's speed-up multiplies a forward's by the block calls a step cache
    left out."""
    frontier = load_bench("frontier")
    speeds = {"m": {"v": {"speed-up": 2.5, "matching share": 0.04}}}
    every = frontier.Point("ToMe 0.5 block, all blocks", "v", (0, 0))
    default = frontier.Point("ToMe 0.5 block", "v", frontier.DEFAULT_SKIPS)
    assert frontier.judge_blocks("flux-512") == 9
    assert frontier.forward_speed(every, speeds["m"], 9, 57) == pytest.approx(2.5)
    assert frontier.forward_speed(default, speeds["m"], 9, 57) == pytest.approx(1 / (4 / 9 + 5 / 9 / 2.5))
    family = frontier.Family("F", "flux-512", "ToMe 0.5 block, all blocks", "m", 57, (every,))
    row = {"x0 change 0.5": {"mean": 0.1}, "sample PSNR": {"mean": 30.0}, "img2img PSNR to photo": {"mean": 19.0}}
    costs = {("flux-512", every.setting): row,
             ("flux-512", frontier.CACHE_STACKED): dict(row, **{"sample block calls": {"ran": 90, "unpatched": 180}})}
    placed = {p.setting: p for p in frontier.place(family, speeds, costs)}
    assert placed[every.setting].run == pytest.approx(2.5)
    assert placed[frontier.CACHE_STACKED].run == pytest.approx(5.0)
    assert frontier.fast_choice(list(placed.values())).setting == every.setting  # a cache row is never the fast one


def test_a_step_window_runs_its_first_steps_whole_and_is_placed_by_its_run_alone():
    """"from 0.2": the first fifth of a run's steps whole, the rest at the forward's speed-up; at half the schedule
    it is its whole-schedule twin, so the rule passes it over even where it is cheaper."""
    frontier = load_bench("frontier")
    assert frontier.start_of("ToMe 0.5 block from 0.2") == 0.2 and frontier.start_of("ToDo 2") == 0.0
    speeds = {"m": {"v": {"speed-up": 2.5, "matching share": 0.0}}}
    window = frontier.Point("ToDo 2 from 0.3", "v", start=0.3)
    twin = frontier.Point("ToDo 2", "v")
    family = frontier.Family("F", "flux-512", "ToDo 2", "m", 57, (window, twin))
    photo = {"img2img PSNR to photo": {"mean": 19.0}}
    costs = {("flux-512", "ToDo 2 from 0.3"): {"x0 change 0.5": {"mean": 0.1}, "sample PSNR": {"mean": 30.0}, **photo},
             ("flux-512", "ToDo 2"): {"x0 change 0.5": {"mean": 0.2}, "sample PSNR": {"mean": 20.0}, **photo}}
    placed = {p.setting: p for p in frontier.place(family, speeds, costs)}
    assert placed["ToDo 2 from 0.3"].forward == pytest.approx(2.5)
    assert placed["ToDo 2 from 0.3"].run == pytest.approx(1 / (0.3 + 0.7 / 2.5))
    assert placed["ToDo 2"].run == pytest.approx(2.5)
    assert frontier.fast_choice(list(placed.values())).setting == "ToDo 2"


def test_a_token_cache_is_timed_in_its_own_run_and_placed_by_its_run_with_its_whole_steps():
    """A token cache's speed comes from its own record (``dit_bench --token-cache``), over the judge's share of
    blocks at the default skips; its whole steps (2 of 20; "refresh every 4": 6) run at 1x; at half the schedule
    it changes nothing, so the rule passes it over."""
    frontier = load_bench("frontier")
    speeds = {"m": {"v": {"speed-up": 1.5, "matching share": 0.0}},
              "m-cache": {"tokencache-0.5-block-skip0-0": {"speed-up": 2.0, "matching share": 0.0}}}
    family = frontier._family("F", "flux-512", "ToDo 2", "m", 57, {"ToDo 2": "v"}, {}, "m-cache")
    row = {"x0 change 0.5": {"mean": 0.0}, "img2img PSNR to photo": {"mean": 19.0}}
    costs = {("flux-512", "token cache 0.5 block"): row, ("flux-512", "token cache 0.5 block, refresh every 4"): row,
             ("flux-512", "ToDo 2"): dict(row, **{"x0 change 0.5": {"mean": 0.1}})}
    placed = {p.setting: p for p in frontier.place(family, speeds, costs)}
    forward = 1 / (4 / 9 + 5 / 9 / 2.0)  # flux-512's 9 blocks, 5 reduced at the default skips
    assert placed["token cache 0.5 block"].forward == pytest.approx(forward)
    assert placed["token cache 0.5 block"].run == pytest.approx(1 / (0.1 + 0.9 / forward))
    assert placed["token cache 0.5 block, refresh every 4"].run == pytest.approx(1 / (0.3 + 0.7 / forward))
    assert placed["token cache 0.5 block"].run_only and placed["token cache 0.5 block"].estimated
    assert placed["token cache 0.5 block"].own_run and not placed["ToDo 2"].own_run
    assert frontier.fast_choice(list(placed.values())).setting == "ToDo 2"


def test_a_schedule_over_the_steps_is_placed_by_its_run_each_step_at_its_ratio():
    """A ratio from 0.7 to 0.3: each of the 20 steps at its own ratio (step i at i / 20 of the schedule), a
    forward's time linear between the ratios its run timed, over the judge's share of blocks; every 5th step whole
    at 1x, and a token cache's first 2; at half the schedule it is ToMe near 0.5, so it is placed by its run
    alone. A ratio outside the timed ones is refused, naming the variant."""
    frontier = load_bench("frontier")
    run = {"none": {"seconds": 12.0}, **{f"{kind}-{ratio}-block-skip0-0": {"seconds": seconds} for kind in (
        "tome", "tokencache") for ratio, seconds in ((0.3, 8.0), (0.5, 6.0), (0.7, 3.0))}}
    speeds = {"m": {"v": {"speed-up": 1.5, "matching share": 0.0}}, "m-schedule": run}
    family = frontier._family("F", "flux-512", "ToDo 2", "m", 57, {"ToDo 2": "v"}, {}, schedule="m-schedule")
    row = {"x0 change 0.5": {"mean": 0.05}, "img2img PSNR to photo": {"mean": 19.0}}
    costs = {("flux-512", "ToMe 0.7 to 0.3 block"): row, ("flux-512", "ToMe 0.625 block, every 5th step whole"): row,
             ("flux-512", "token cache 0.7 to 0.3 block"): row,
             ("flux-512", "ToDo 2"): dict(row, **{"x0 change 0.5": {"mean": 0.1}})}
    placed = {p.setting: p for p in frontier.place(family, speeds, costs)}

    def seconds(ratio):  # linear between the timed ratios
        return 8.0 - 10.0 * (ratio - 0.3) if ratio <= 0.5 else 6.0 - 15.0 * (ratio - 0.5)

    def step(ratio):  # a forward at the judge's share: 5 of flux-512's 9 blocks reduced
        return 1.0 if ratio is None else 4 / 9 + 5 / 9 * seconds(ratio) / 12.0

    falling = [step(0.7 - 0.4 * i / 20) for i in range(20)]
    assert placed["ToMe 0.7 to 0.3 block"].run == pytest.approx(20 / sum(falling))
    every_5th = [step(None if i % 5 == 4 else 0.625) for i in range(20)]
    assert placed["ToMe 0.625 block, every 5th step whole"].run == pytest.approx(20 / sum(every_5th))
    cached = [step(0.7 - 0.4 * i / 20) for i in range(2, 20)]  # a token cache's first 2 steps whole
    assert placed["token cache 0.7 to 0.3 block"].run == pytest.approx(1 / (0.1 + 0.9 / (18 / sum(cached))))
    assert placed["ToMe 0.7 to 0.3 block"].run_only and placed["ToMe 0.7 to 0.3 block"].own_run
    assert frontier.fast_choice(list(placed.values())).setting == "ToDo 2"
    with pytest.raises(ValueError, match="tome-{}-block-skip0-0: ratio 0.8"):
        frontier.speed_at("tome-{}-block-skip0-0", run, 0.8)


def test_a_reused_matching_is_timed_as_its_twin_less_the_matchings_it_leaves_out():
    """One matching a call on every block of a 24-block model keeps 1 of 24 matchings; reuse 2 steps keeps half
    of them, and at half the schedule it is its twin, so it is placed by its run alone (as a window is)."""
    frontier = load_bench("frontier")
    names = {"ToMe 0.5 block, all blocks": "v", "ToMe 0.5 block, one matching a call": "v",
             "ToMe 0.5 block, reuse 2 steps": "v"}
    family = frontier._family("F", "sd35-512", "ToMe 0.5 block, all blocks", "m", 24, {}, names)
    points = {p.setting: p for p in family.points}
    one, steps = points["ToMe 0.5 block, one matching a call"], points["ToMe 0.5 block, reuse 2 steps"]
    assert (one.one_matching, one.reuse_steps, steps.one_matching, steps.reuse_steps) == (True, 1, False, 2)
    run = {"v": {"speed-up": 2.0, "matching share": 0.06}}
    every = frontier.Point("ToMe 0.5 block, all blocks", "v", (0, 0), one_matching=True)
    assert frontier.forward_speed(every, run, 8, 24) == pytest.approx(2.0 / (1 - 0.06 * 23 / 24))
    twin_row = {"x0 change 0.5": {"mean": 0.2}, "sample PSNR": {"mean": 20.0}}
    costs = {("sd35-512", name): twin_row for name in names}
    placed = {p.setting: p for p in frontier.place(family, {"m": run}, costs)}
    assert placed["ToMe 0.5 block, reuse 2 steps"].run_only
    assert not placed["ToMe 0.5 block, one matching a call"].run_only
    assert frontier.fast_choice([placed["ToMe 0.5 block, reuse 2 steps"]]) is None  # the rule passes it over
    twin = frontier.forward_speed(frontier.Point("ToMe 0.5 block", "v", (2, 2)), run, 8, 24)
    reused = placed["ToMe 0.5 block, reuse 2 steps"].forward
    assert reused == pytest.approx(1 / (0.5 + 0.5 / (2.0 / (1 - 0.06 / 2)))) and reused > twin


def test_fewer_steps_are_placed_at_the_step_ratio_and_a_setting_they_beat_is_not_the_fast_row():
    """"no patch, 10 steps" of a 20-step run is 2x; a setting no faster that lies farther from the photograph and
    is less real is beaten by it, and the rule passes it over; identity (PSNR against no patch) counts for
    neither side, and a setting the fewer steps do not beat on every measure stays. A faster setting measured by
    its x0 change alone is unjudged, and the rule passes it over too."""
    frontier = load_bench("frontier")
    speeds = {"m": {"slow": {"speed-up": 1.5, "matching share": 0.0}, "fast": {"speed-up": 1.9,
                                                                               "matching share": 0.0}}}
    worse, better = frontier.Point("ToMe 0.5", "fast"), frontier.Point("ToDo 2", "slow")
    unjudged = frontier.Point("ToMe 0.3", "fast")

    def row(change, sample_psnr, photo_psnr, realism, steps=None):
        out = {"x0 change 0.5": {"mean": change}, "sample PSNR": {"mean": sample_psnr},
               "img2img PSNR to photo": {"mean": photo_psnr},
               "sample patch distance ratio to no patch": {"mean": realism}}
        return out if steps is None else dict(out, steps=steps)

    costs = {("flux-512", "ToMe 0.5"): row(0.1, 40.0, 18.0, 1.3),  # nearer no patch, but worse on both measures
             ("flux-512", "ToDo 2"): row(0.2, 20.0, 19.5, 1.0),  # nearer the photograph than 10 steps
             ("flux-512", "ToMe 0.3"): {"x0 change 0.5": {"mean": 0.05}},  # quality_bench.py --x0-only
             ("flux-512", "no patch, 10 steps"): dict(row(0.0, 25.0, 19.0, 1.1, steps=20),
                                                      **{"sample block calls": {"ran": 90, "unpatched": 180}})}
    family = frontier.Family("F", "flux-512", "ToDo 2", "m", 57, (worse, better, unjudged))
    placed = {p.setting: p for p in frontier.place(family, speeds, costs)}
    steps = placed["no patch, 10 steps"]
    assert not placed["ToMe 0.3"].judged and frontier.beaten_by(placed["ToMe 0.3"], list(placed.values())) is None
    assert steps.fewer_steps and steps.run_only and steps.run == pytest.approx(2.0)
    assert frontier.beaten_by(placed["ToMe 0.5"], list(placed.values())) is steps
    assert frontier.beaten_by(placed["ToDo 2"], list(placed.values())) is None
    assert frontier.fast_choice(list(placed.values())).setting == "ToDo 2"
    assert frontier.fewer_steps_of("no patch, 10 steps") == 10 and frontier.fewer_steps_of("ToDo 2") is None
    assert "beaten by 10 steps" in frontier.table(family, list(placed.values()))
    assert "x0 alone: unjudged against the step count" in frontier.table(family, list(placed.values()))
