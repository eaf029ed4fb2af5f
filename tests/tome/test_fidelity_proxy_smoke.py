"""The fidelity proxy's code runs on real photos (a tiny grid; no number asserted beyond sanity)."""

import importlib.util

from tome_harness.comfyui import ROOT


def test_fidelity_proxy_runs_and_pruning_loses_more_than_merging():
    spec = importlib.util.spec_from_file_location("fidelity_proxy", ROOT / "bench" / "fidelity_proxy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run([16], [0.5])
    by_strategy = {r["strategy"]: r["psnr mean dB"] for r in rows}
    assert set(by_strategy) == set(bench.STRATEGIES)
    assert by_strategy["prune 2x2"] < by_strategy["random 2x2"]
    assert "| 16x16 | 0.5 |" in bench.markdown(rows)
