"""The benchmarks' code runs (tiny sizes, no timing asserted): CI catches a broken benchmark early."""

import importlib.util
import json

import pytest
import random_models
import torch
from comfyui_host import ROOT
from helpers import forward, self_attention_calls


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_bench_runs_and_writes_its_table(tmp_path, monkeypatch):
    bench = _load("merge_bench")
    monkeypatch.setattr(bench, "SIZES", [(256, 8), (1024, 16)])
    rows = bench.run(repeats=1)
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert bench.markdown(rows).count("\n") == 3
    assert bench.pieces(repeats=1).count("\n") == 3


def test_unet_bench_variants_cut_the_same_tokens_and_plot(comfy_nodes, pack, tmp_path):
    bench = _load("unet_bench")
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
    bench = _load("unet_bench")
    attn1, attn1_output = bench.ideal_patches(ratio, 1)
    options = {"original_shape": [1, 4, 16, 16]}
    n = torch.randn(1, 256, 8)
    kept, _, _ = attn1(n, n, n, options)
    assert kept.shape[1] == 256 - int(256 * ratio)
    assert attn1_output(kept, options).shape == n.shape


def test_sampler_bench_runs_every_variant(comfy_nodes, pack):
    bench = _load("sampler_bench")
    rows = bench.run(bench.parse_args(["--px", "64", "--steps", "2", "--reuse", "2"]), comfy_nodes)
    assert [r["variant"] for r in rows] == ["none", "core", "ours", "ours reuse 2"]
    assert rows[0]["distance"] == 0.0 and all(r["seconds"] > 0 for r in rows)
    assert len(bench.markdown(rows).splitlines()) == 6
