"""The benchmarks' code runs (tiny sizes, no timing asserted): CI catches a broken benchmark early."""

import json
import subprocess

import pytest
import torch
from helpers import (
    expected_tokens,
    forward,
    load_bench,
    loaded,
    random_context,
    random_latent,
    sdxl_conds,
    self_attention_calls,
    token_counts,
)

from tome_harness import random_models
from tome_harness.comfyui import ROOT


def test_merge_bench_runs_and_writes_its_table(tmp_path, monkeypatch):
    bench = load_bench("merge_bench")
    monkeypatch.setattr(bench, "SIZES", [(256, 8), (1024, 16)])
    rows = bench.run(repeats=1)
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert bench.markdown(rows).count("\n") == 3
    assert bench.pieces(repeats=1).count("\n") == 3


def test_unet_bench_variants_cut_the_same_tokens_and_plot(comfy_nodes, pack, tmp_path):
    bench = load_bench("unet_bench")
    model = random_models.build_unet_model("sd15", channels=32, context_dim=32)
    models = bench.variants(pack.nodes, comfy_nodes.NODE_CLASS_MAPPINGS["TomePatchModel"], model, 0.5, 1, (2, 3),
                            scope_downsamples=(1, 2))
    assert set(models) == {"none", "core", "ours-qkv", "ours-q", "ours-kv", "ideal", "todo-2", "todo-3",
                           "self-ds1", "self+cross-ds1", "all-ds1", "self-ds2", "self+cross-ds2", "all-ds2"}
    x, context = torch.randn(1, 4, 16, 16), torch.randn(1, 77, 32)
    lengths = {}
    for name in ("ours-qkv", "ideal", "self-ds1"):
        with self_attention_calls(models[name]) as calls:
            out = forward(models[name], x, 5.0, context)
        lengths[name] = [(c.queries, c.keys) for c in calls]
        assert out.shape == x.shape
    assert lengths["ours-qkv"] == lengths["ideal"] == lengths["self-ds1"]
    for name, counted in (("none", False), ("ours-qkv", True), ("core", True)):
        timed_model, spent = bench.with_patch_timer(models[name], torch.device("cpu"))
        outputs = []
        for m in (timed_model, models[name]):
            torch.manual_seed(0)  # the core node draws from the global RNG
            outputs.append(forward(m, x, 5.0, context))
        assert torch.equal(*outputs), name
        assert (spent[0] > 0) == counted, name
    rows = [{"family": "sd15", "px": 128, "ratio": None if name.startswith("todo") else 0.5, "dtype": "fp32",
             "attention": "test", "device": "cpu",
             "variant": name, "seconds": 1.0, "speed-up": 1.0, "vs core": 1.0, "peak MiB": None, "in patches": 0.1,
             "relative distance": 0.0} for name in models]
    bench.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert len(bench.markdown(rows).splitlines()) == 2 + len(models)
    json.dumps(rows)


@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_ideal_variant_restores_the_token_count(comfy_nodes, pack, ratio):
    bench = load_bench("unet_bench")
    attn1, attn1_output = bench.ideal_patches(ratio, 1)
    options = {"original_shape": [1, 4, 16, 16]}
    n = torch.randn(1, 256, 8)
    kept, _, _ = attn1(n, n, n, options)
    assert kept.shape[1] == 256 - int(256 * ratio)
    assert attn1_output(kept, options).shape == n.shape


def test_sampler_bench_runs_every_variant(comfy_nodes, pack):
    bench = load_bench("sampler_bench")
    rows = bench.run(bench.parse_args(["--px", "64", "--steps", "2", "--reuse", "2"]), comfy_nodes)
    assert [r["variant"] for r in rows] == ["none", "core", "ours", "ours reuse 2"]
    assert rows[0]["distance"] == 0.0 and all(r["seconds"] > 0 for r in rows)
    assert len(bench.markdown(rows).splitlines()) == 6


def _tiny_args(bench, *argv):
    return bench.parse_args(["--channels", "32", "--context-dim", "32", *argv])


def test_unet_bench_fast_variant_is_the_readme_setting(comfy_nodes, pack, sd15, sdxl):
    bench = load_bench("unet_bench")
    core_cls = comfy_nodes.NODE_CLASS_MAPPINGS["TomePatchModel"]
    for model, same_as in ((sd15, "self+cross-ds2"), (sdxl, "all-ds4")):
        models = bench.variants(pack.unet, core_cls, model, 0.5, 1, fixed=("fast",), scope_downsamples=(2, 4))
        fast, same = models["fast"], models[same_as]
        assert fast.model_options["transformer_options"]["patches"].keys() == \
            same.model_options["transformer_options"]["patches"].keys()
        assert fast.object_patches.keys() == same.object_patches.keys()
        assert fast.model_options["transformer_options"]["patches"]["attn1_patch"][0].settings == \
            same.model_options["transformer_options"]["patches"]["attn1_patch"][0].settings


def test_ideal_fast_runs_every_block_of_the_fast_setting_on_n_minus_r_tokens(comfy_nodes, pack, sd15, sdxl):
    bench = load_bench("unet_bench")
    core_cls = comfy_nodes.NODE_CLASS_MAPPINGS["TomePatchModel"]
    x, context = random_latent(1, 16, 16), random_context(1)
    # a 16 x 16 latent: 256 / d^2 tokens at downsample d; the fast setting reaches 2 (SD1.5) and 4 (SDXL)
    for model, conds, halved, whole in ((sd15, {}, [256, 64], [16, 4]), (sdxl, sdxl_conds(1), [64, 16], [])):
        models = bench.variants(pack.unet, core_cls, model, 0.5, 1, fixed=("fast", "ideal-fast"))
        before = forward(model, x, 5.0, context, **conds)
        seen = {}
        for name in ("fast", "ideal-fast"):
            with loaded(models[name]), self_attention_calls(models[name]) as attn1, \
                    token_counts(models[name], ".ff.net") as ff:
                out = forward(models[name], x, 5.0, context, **conds)
            assert out.shape == x.shape and not torch.equal(out, before)
            seen[name] = [c.queries for c in attn1], [n for _, n in ff]
        queries, ff_tokens = seen["ideal-fast"]
        assert set(queries) == set(ff_tokens) == {expected_tokens(n, 0.5) for n in halved} | set(whole)
        if model is sdxl:  # there the fast setting is scope all: the same token counts, merge and unmerge free
            assert seen["fast"] == seen["ideal-fast"]
        assert torch.equal(forward(model, x, 5.0, context, **conds), before)  # unloaded: every block whole again


def test_unet_bench_batches_give_seconds_per_image(comfy_nodes):
    bench = load_bench("unet_bench")
    args = _tiny_args(bench, "--px", "64", "--batch", "1", "2", "--variants", "ours-qkv", "--todo", "--repeats", "1",
                      "--memory", "in-process")
    rows = bench.run(args, comfy_nodes)
    assert [(r["batch"], r["variant"]) for r in rows] == [(1, "none"), (1, "ours-qkv"), (2, "none"), (2, "ours-qkv")]
    assert all(r["s/image"] == r["seconds"] / r["batch"] and r["peak MiB"] is not None for r in rows)
    assert len(bench.markdown(rows).splitlines()) == 6


def test_unet_bench_repeats_0_times_only_the_memory_forward(comfy_nodes):
    bench = load_bench("unet_bench")
    args = _tiny_args(bench, "--px", "64", "--variants", "core", "--todo", "--repeats", "0", "--memory", "in-process")
    rows = bench.run(args, comfy_nodes)
    assert [r["variant"] for r in rows] == ["none", "core"]
    assert all(r["seconds"] > 0 and r["peak MiB"] is not None and r["relative distance"] is None for r in rows)
    assert "| n/a | n/a |" in bench.markdown(rows)


def test_memory_children_see_tome_shrink_attention_and_fail_cleanly_over_a_cap(comfy_nodes):
    bench = load_bench("unet_bench")
    args = _tiny_args(bench, "--px", "256", "--variants", "ours-qkv", "--todo", "--repeats", "0", "--memory", "child")
    none, ours = bench.run(args, comfy_nodes)
    assert (none["variant"], ours["variant"], none["attention"]) == ("none", "ours-qkv", "attention_sub_quad")
    assert 0 < ours["attention MiB"] < none["attention MiB"] / 2 <= none["peak MiB"]
    assert none["seconds"] > 0 and ours["speed-up"] > 0
    capped = bench.run_child(args, "none", 256, 1, 0.5, cap_mib=1)
    assert not capped["ok"] and "allocate" in capped["error"]


def test_cap_search_finds_the_largest_size_that_fits():
    bench = load_bench("unet_bench")
    sizes = list(range(512, 2049, 64))
    largest, tried = bench.largest_under_cap(lambda px: px <= 1000, sizes)
    assert largest == 960 and len(tried) <= 7
    assert bench.largest_under_cap(lambda px: False, sizes) == (None, {512: False})
    assert bench.largest_under_cap(lambda px: True, sizes)[0] == 2048
    row = {"family": "sd15", "dtype": "fp32", "attention": "default", "batch": 1, "variant": "none",
           "cap MiB": 1000.0, "px range": [512, 2048], "largest px": largest,
           "tried": {str(px): ok for px, ok in sorted(tried.items())}}
    assert "| 960 |" in bench.cap_markdown([row])


def test_gpu_table_smoke_runs_on_the_cpu(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_table.sh"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "gpu_table.md").read_text()
    for family in ("sd15", "sdxl"):
        rows = [line for line in table.splitlines() if line.startswith(f"| {family} fp16 |")]
        assert [line.split("|")[5].strip() for line in rows] == ["none", "core", "ours-qkv", "fast", "todo-2"]
    video = [line.split("|") for line in table.splitlines() if line.startswith("| tiny-wan21-4blocks fp32 cpu |")]
    assert [row[3].strip() for row in video] == ["none", "todo-2", "todo-2-t2", "tome-0.5-kv", "tome-0.75-kv"]
    matching = [float(row[8].strip().rstrip("%")) for row in video]
    assert matching[:3] == [0, 0, 0] and min(matching[3:]) > 0  # only ToMe matches
    block = [line.split("|") for line in table.split("## Block scope")[1].splitlines()
             if line.startswith("| tiny-flux-5blocks fp32 cpu |")]
    assert [row[3].strip() for row in block] == ["none", "todo-2", "tome-0.5-qkv", "tome-0.5-kv"] + [
        variant for skips in ("0-0", "2-2", "3-3") for variant in [
            f"{prefix}{name}-block-skip{skips}" for name in ("tome-0.5", "todo-2") for prefix in ("", "ideal-")]
        + [f"tome-0.5-block-skip{skips}-reuse100"]]
    # text 7 + image 256, 128, 64 (ToMe reusing a matching: its twin's counts)
    skipped = ["263 (2), 135 (1), 263 (2)"] * 2 + ["263 (2), 71 (1), 263 (2)"] * 2 + ["263 (2), 135 (1), 263 (2)"]
    assert [row[11].strip() for row in block[-10:-5]] == skipped
    assert [row[11].strip() for row in block[-5:]] == ["263 (5)"] * 5  # 3 and 3 of 5 blocks: none reduced
    assert "| SD1.5 | Apply ToMe | 1.00 | 0.00 |" in table  # the counts: one host read per model call


def _dit_block_rows(pack, families):
    """dit_bench's rows for the tiny models of ``families`` at 5 blocks: both scopes, skips 0:0 and 2:2."""
    bench = load_bench("dit_bench")
    args = bench.parse_args(["--model", "tiny", "--blocks", "5", "--scope", "attention", "block", "--merge", "kv",
                             "--dtype", "fp32", "--repeats", "0"])
    wanted = {f"tiny-{family}" for family in families}  # the block scope's families are named with their depth
    cases = [case for case in bench.cases_of(args) if case.name.removesuffix("-5blocks") in wanted]
    assert len(cases) == len(families)
    return bench, [row for index, case in enumerate(cases)
                   for row in bench.run_case(pack.dit, case, args, torch.device("cpu"), first=index == 0)]


BLOCK_VARIANTS = [f"{prefix}{name}-block-skip{skips}" for skips in ("0-0", "2-2")
                  for name in ("tome-0.5", "todo-2") for prefix in ("", "ideal-")]


@pytest.mark.parametrize(("family", "text", "frames"), [("flux", 7, 1), ("wan21", 0, 3), ("hunyuan_video", 7, 3),
                                                        ("ltxv", 0, 3)])
def test_dit_bench_block_rows_run_on_the_reduced_tokens_beside_their_ideal(pack, family, text, frames):
    # a 32x32 latent: 16x16 image tokens a frame; ToMe 0.5 leaves 128 of them, ToDo 2 64
    bench, rows = _dit_block_rows(pack, [family])
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == ["none", "todo-2", "tome-0.5-kv", *BLOCK_VARIANTS]
    full, tome, todo = (text + frames * n for n in (256, 128, 64))
    assert by_name["none"]["block tokens"] == by_name["todo-2"]["block tokens"] == [full] * 5
    for name, reduced in (("tome-0.5", tome), ("todo-2", todo)):
        assert by_name[f"{name}-block-skip0-0"]["block tokens"] == [reduced] * 5
        assert by_name[f"{name}-block-skip2-2"]["block tokens"] == [full, full, reduced, full, full]
    for name in BLOCK_VARIANTS:
        row = by_name[name]
        if name.startswith("ideal-"):  # the ideal is its own speed-up and runs on the same tokens as its twin
            assert row["scope"] == "ideal" and row["ideal"] == row["speed-up"]
            assert row["block tokens"] == by_name[name.removeprefix("ideal-")]["block tokens"]
            assert row["matching share"] == 0.0
        else:
            assert row["scope"] == "block" and row["ideal"] == by_name[f"ideal-{name}"]["speed-up"]
        assert row["seconds"] > 0 and 0.0 < row["relative distance"] < 1.0
    assert by_name["tome-0.5-block-skip0-0"]["matching share"] > 0 == by_name["todo-2-block-skip0-0"]["matching share"]
    assert by_name["todo-2"]["scope"] == "attention" and by_name["none"]["scope"] is None
    table = bench.markdown(rows)
    assert f"| {full} (2), {tome} (1), {full} (2) |" in table and f"| {todo} (5) |" in table
    json.dumps(rows)


def tiny_block_rows(pack, *flags: str) -> dict[str, dict]:
    """``dit_bench``'s rows, by variant, of the tiny 5-block Flux at the block scope, ToMe 0.5 on every block and
    ``flags`` added."""
    bench = load_bench("dit_bench")
    args = bench.parse_args(["--model", "tiny", "--blocks", "5", "--scope", "block", "--block-factor", "--skips",
                             "0:0", *flags, "--dtype", "fp32", "--repeats", "0"])
    (case,) = [case for case in bench.cases_of(args) if case.name == "tiny-flux-5blocks"]
    return {row["variant"]: row for row in bench.run_case(pack.dit, case, args, torch.device("cpu"), first=True)}


def test_dit_bench_reuse_rows_run_on_their_twins_tokens_and_read_its_ideal(pack):
    by_name = tiny_block_rows(pack, "--reuse-blocks", "5")
    assert list(by_name) == ["none", "tome-0.5-block-skip0-0", "ideal-tome-0.5-block-skip0-0",
                             "tome-0.5-block-skip0-0-reuse5"]
    reused, twin = by_name["tome-0.5-block-skip0-0-reuse5"], by_name["tome-0.5-block-skip0-0"]
    assert reused["scope"] == "block" and reused["ideal"] == by_name["ideal-tome-0.5-block-skip0-0"]["speed-up"]
    assert reused["block tokens"] == twin["block tokens"]
    assert reused["matching share"] > 0 and reused["relative distance"] != twin["relative distance"]  # reused


def test_dit_bench_token_cache_rows_compute_their_twins_count_past_the_whole_steps_and_read_its_ideal(pack):
    """The token cache timed as it runs after its whole steps: its blocks run on as many tokens as its ToMe twin
    leaves (the tokens it selects, text included where it comes apart), its output is not the unpatched one
    (the rest took their cached change), and its ideal is the twin's."""
    by_name = tiny_block_rows(pack, "--token-cache")
    assert list(by_name) == ["none", "tome-0.5-block-skip0-0", "ideal-tome-0.5-block-skip0-0",
                             "tokencache-0.5-block-skip0-0"]
    cached, twin = by_name["tokencache-0.5-block-skip0-0"], by_name["tome-0.5-block-skip0-0"]
    assert cached["scope"] == "block" and cached["ideal"] == by_name["ideal-tome-0.5-block-skip0-0"]["speed-up"]
    assert cached["block tokens"] == twin["block tokens"] != by_name["none"]["block tokens"]
    assert cached["relative distance"] > 0


def test_dit_bench_block_rows_reach_sd3_qwen_image_lumina_and_hidream_and_skip_the_rest(pack):
    """The text beside the image in each block: 7 tokens (SD3, Qwen-Image), padded to 8 (the Z-Image variant of
    Lumina 2), T5's 7 and the LLM's 3 twice (HiDream, whose blocks were swapped for the bench's forwards)."""
    bench, rows = _dit_block_rows(pack, ["sd3", "qwen_image", "lumina2", "hidream", "cosmos_predict2"])
    for model, text in (("tiny-sd3-5blocks", 7), ("tiny-qwen_image-5blocks", 7), ("tiny-lumina2-5blocks", 8),
                        ("tiny-hidream-5blocks", 7 + 2 * 3)):
        by_name = {row["variant"]: row for row in rows if row["model"] == model}
        assert list(by_name)[3:] == BLOCK_VARIANTS
        full = text + 256
        assert by_name["none"]["block tokens"] == [full] * 5
        for name in BLOCK_VARIANTS:
            reduced = text + (128 if "tome" in name else 64)
            expected = [reduced] * 5 if "skip0-0" in name else [full, full, reduced, full, full]
            assert by_name[name]["block tokens"] == expected, (model, name)
    cosmos = [row for row in rows if row["model"] == "tiny-cosmos_predict2"]  # not reached: no block rows
    assert [row["variant"] for row in cosmos] == ["none", "todo-2", "tome-0.5-kv"]
    assert all(row["block tokens"] == [] for row in cosmos)


def test_dit_bench_real_cases_have_the_issues_widths():
    bench = load_bench("dit_bench")
    cases = {case.name: case for case in bench.cases_of(bench.parse_args(
        ["--model", "sd35m", "flux", "qwen", "--blocks", "4", "--flux-blocks", "2", "4"]))}
    cases.update({case.name: case for case in bench.cases_of(bench.parse_args(["--model", "sd35m"]))})
    sd35 = cases["sd35m"].config  # all 24 joint blocks of width 64 * 24, image-only attention in the first 13
    assert sd35["depth"] == 24 and "num_blocks" not in sd35 and sd35["x_block_self_attn_layers"] == list(range(13))
    assert cases["sd35m"].latent == (1, 16, 128, 128)
    flux = cases["flux-2d4s-1024px"]
    assert (flux.config["hidden_size"], flux.config["depth"], flux.config["depth_single_blocks"]) == (3072, 2, 4)
    qwen = cases["qwen-1024px-4blocks"]
    assert qwen.config["num_layers"] == 4 and qwen.config["num_attention_heads"] * qwen.config["attention_head_dim"] \
        == 3072 and qwen.latent == (1, 16, 1, 128, 128) and qwen.text == (256, 3584)
    wan = bench.cases_of(bench.parse_args(["--model", "wan13b", "wan14b", "--frames", "81", "--blocks", "1"]))
    assert [(case.name, case.latent) for case in wan] == [
        ("wan13b-81f-1blocks", (1, 16, 21, 60, 104)), ("wan14b-81f-1blocks", (1, 16, 21, 60, 104))]
    with pytest.raises(SystemExit):
        bench.parse_args(["--skips", "2"])


def test_sampler_bench_hires_times_the_second_pass(comfy_nodes):
    bench = load_bench("sampler_bench")
    args = bench.parse_args(["--hires", "64", "128", "2", "--steps", "2", "--channels", "32", "--context-dim", "32",
                             "--repeats", "0"])
    rows = bench.run(args, comfy_nodes)
    assert all(r["seconds"] > 0 for r in rows)
    assert [r["variant"] for r in rows] == ["none", "core", "ours", "fast"]
    assert all(r["px"] == 128 and r["first px"] == 64 and r["steps"] == 2 and r["denoise"] == 0.5 for r in rows)
    assert "64 -> 128" in bench.markdown(rows)


def test_sampler_bench_hires_runs_only_the_variants_asked_for(comfy_nodes):
    bench = load_bench("sampler_bench")
    args = bench.parse_args(["--hires", "64", "128", "1", "--steps", "1", "--channels", "32", "--context-dim", "32",
                             "--repeats", "0", "--variants", "fast"])
    assert [r["variant"] for r in bench.run(args, comfy_nodes)] == ["none", "fast"]


def test_sampler_bench_variants_needs_hires(capsys):
    bench = load_bench("sampler_bench")
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "ours"])
    err = capsys.readouterr().err
    assert "--variants" in err and "--hires" in err


def test_step_cache_bench_times_computed_forwards_where_the_stack_computes_what_ours_alone_does(comfy_nodes):
    """Under each cache's forward, at a step it computes, the block scope computes what our node alone computes
    (the same output distance from no patch), and the attention scope, out of reach under TeaCache's and
    MagCache's forwards and First Block Cache's Flux forward, computes the cache alone's."""
    from tome_harness import comfyui as comfyui_host
    from tome_harness import step_caches

    bench = load_bench("step_cache_bench")
    args = bench.parse_args(["--model", "tiny", "--blocks", "3", "--repeats", "1"])
    (case,) = [case for case in bench.cases_of(args) if case.name == "tiny-flux-3blocks"]
    rows = bench.run_case(step_caches.load(comfy_nodes), comfyui_host.pack_module("nodes"), case, args,
                          torch.device("cpu"))
    by_name = {row["variant"]: row for row in rows}
    ours = ("tome-0.5-block", "todo-2-block", "todo-2")
    assert list(by_name) == ["none", *ours, *(f"{cache}{f' + {name}' if name else ''}" for cache in step_caches.PACKS
                                              for name in ("", *ours))]
    for cache in step_caches.PACKS:
        assert by_name[cache]["relative distance"] == pytest.approx(0.0, abs=1e-5)
        assert by_name[cache]["over the cache"] == 1.0 and by_name[f"{cache} + todo-2"]["cache"] == cache
        for name in ("tome-0.5-block", "todo-2-block"):
            alone = by_name[name]["relative distance"]
            assert by_name[f"{cache} + {name}"]["relative distance"] == pytest.approx(alone, abs=1e-5) and alone > 0.01
        assert by_name[f"{cache} + todo-2"]["relative distance"] == pytest.approx(0.0, abs=1e-5)
    assert "| tiny-flux-3blocks | TeaCache + tome-0.5-block |" in bench.markdown(rows)
