"""What each node adds to a model call: host reads, blocking copies, operators (counted on the CPU).

Every node of the pack on SD1.5, SDXL, Flux and Wan 2.1 (small random-weight models of the real layouts,
``tome_harness.host_reads.MODELS``), through ComfyUI's KSampler (euler, 3 steps, cfg 2; cond and uncond in one
model call per step). Each count is the patched run's minus the unpatched run's, over the model calls: what our
code adds. A host read makes a GPU's host wait for every queued kernel; a blocking copy waits as well where it
crosses between host and device. The counts do not depend on the device (see ``tome_harness.host_reads``), so
this runs on the CPU wherever it runs. Then the operators of one U-Net block's self-attention merge (plan,
merge, unmerge, the sigma already read by the model call) against tomesd 0.1.3's merge of the same tokens.

    .venv/bin/python bench/host_reads_bench.py                 # writes bench/results/host_reads/
    .venv/bin/python bench/host_reads_bench.py --models SD1.5  # one model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from tome_harness import comfyui as comfyui_host
from tome_harness import host_reads
from tome_harness.comfyui import ROOT

BLOCK_TOKENS, BLOCK_GRID = (2, 1024, 32), (32, 32)  # SD1.5's first level at 256 px, batch 2 (cond and uncond)


def block_rows(pack_unet, pack_comfyui) -> list[dict]:
    """Operators of one self-attention merge around a U-Net block: ours (Apply ToMe's default) and tomesd's."""
    tokens = torch.randn(*BLOCK_TOKENS, generator=torch.Generator().manual_seed(0))
    model = pack_unet.apply_tome(host_reads.build_model("SD1.5"), ratio=0.5)
    call = pack_comfyui.ModelCall(torch.tensor([5.0]))
    call.sigma()  # the model call's one read, made before its blocks run
    # The grid's destination table is made once per process (tome.partition.cell_positions): counted as every block
    # after the first on that grid finds it.
    host_reads.block_merge_counts(model, tokens, BLOCK_GRID, model_call={pack_comfyui.CALL_KEY: call})
    ours = host_reads.block_merge_counts(model, tokens, BLOCK_GRID, model_call={pack_comfyui.CALL_KEY: call})
    theirs = host_reads.tomesd_block_merge_counts(tokens, BLOCK_GRID)
    return [{"merge": name, "host_reads": c.host_reads, "blocking_copies": c.blocking_copies, "ops": c.n_ops}
            for name, c in (("ours (Apply ToMe)", ours), ("tomesd 0.1.3", theirs))]


def markdown(rows: list[host_reads.Row], blocks: list[dict]) -> str:
    lines = ["| model | node | host reads / model call | blocking copies / model call | operators / model call |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r.model} | {r.node} | {r.host_reads:.2f} | {r.blocking_copies:.2f} | {r.ops:.0f} |" for r in rows]
    lines += ["", f"One SD1.5 block's self-attention merge, tokens {list(BLOCK_TOKENS)}, ratio 0.5, stride 2x2:", "",
              "| merge | host reads | blocking copies | operators |", "|---|---:|---:|---:|"]
    lines += [f"| {b['merge']} | {b['host_reads']} | {b['blocking_copies']} | {b['ops']} |" for b in blocks]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(host_reads.MODELS), default=list(host_reads.MODELS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_reads")
    args = parser.parse_args()
    comfy_nodes = comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes")
    pack_models = comfyui_host.pack_module("tome.hosts.comfyui_models")
    rows = []
    for name in args.models:
        base = host_reads.build_model(name)
        rows += [host_reads.added_per_call(comfy_nodes, pack_models, name, node, base)
                 for node in host_reads.nodes_for(name)]
    blocks = block_rows(comfyui_host.pack_module("tome.hosts.comfyui_unet"),
                        comfyui_host.pack_module("tome.hosts.comfyui"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_reads.json").write_text(json.dumps(
        {"torch": torch.__version__, "rows": [dataclasses.asdict(r) for r in rows], "block": blocks}, indent=1))
    table = markdown(rows, blocks)
    (args.out / "host_reads.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
