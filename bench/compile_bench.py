"""torch.compile benchmark: no patch, Apply ToMe and Apply ToDo, each uncompiled and compiled, one forward each.

The model is compiled as ComfyUI's ``TorchCompileModel`` of late 2026 does it
(``tome_harness.newest_host.compile_like_newest``: ComfyUI's own
``set_torch_compile_wrapper``, guards on ``transformer_options`` dropped). Every
compiled variant starts from an empty dynamo cache, so its first forward
(reported as "compile s": tracing, code generation and the run) and its count of
compiled graphs are its own, and so are its ``--repeats`` timed forwards after the
second call (the cache holds its graphs alone); then the uncompiled variants
round-robin; the minimum reported. Our patches run outside the
compiled graphs (``tome.hosts.comfyui.eager``): each patched block splits the
graph, and the "graphs" column counts what that costs.

Models: ``sd15`` (the SD1.5 U-Net at its real width) and ``sd35m`` (SD3.5 medium, ``--blocks`` of its 24
joint blocks, as ``dit_bench`` builds it). ComfyUI's default CPU attention (sub-quadratic) reads the free
memory at every call, which dynamo cannot trace (a graph break per attention call with no patch at all):
``--attention sdpa`` (the CUDA default) shows the compiled model as a GPU user gets it.

    .venv/bin/python bench/compile_bench.py --model sd15 --px 1024 --attention sdpa
    .venv/bin/python bench/compile_bench.py --model sd35m --blocks 4 --attention sdpa
    .venv/bin/python bench/compile_bench.py --model sd35m --blocks 4 --attention sdpa --block-scope

``--block-scope`` (sd35m): also ToMe and ToDo at ``dit_scope`` ``block`` on every block, and ToMe with the
first and the last block left whole. Only the block scope's decision runs outside the compiled graph; the blocks
it reduces and those it leaves whole are compiled: its rows say what is kept of compile's gain.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tome_harness import comfyui as comfyui_host
from tome_harness import machine, newest_host
from tome_harness.comfyui import ATTENTION_CHOICES, ROOT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unet_case(args, device):
    """The SD1.5 U-Net, its variants, and one forward at ``args.px`` (``unet_bench``'s inputs)."""
    import unet_bench

    from tome_harness import random_models

    model = random_models.build_unet_model("sd15", dtype=DTYPES[args.dtype])
    context_dim = random_models.unet_config("sd15")["context_dim"]
    inputs = unet_bench.make_inputs("sd15", context_dim, args.px, 1, device)
    adapter = comfyui_host.pack_module("tome.hosts.comfyui_unet")
    variants = {"none": model, f"tome-{args.ratio}": adapter.apply_tome(model, ratio=args.ratio),
                f"todo-{args.todo}": adapter.apply_todo(model, downsample_factor=args.todo)}

    def forward(m):
        # As the sampler calls it: with the patcher's wrappers, among them the compile wrapper.
        options = dict(m.model_options["transformer_options"], wrappers=m.wrappers, sigmas=inputs.sigma)
        with torch.inference_mode():
            return m.model.apply_model(inputs.x, inputs.sigma, c_crossattn=inputs.context,
                                       transformer_options=options, **inputs.conds)

    return variants, forward


def dit_case(args, device):
    """SD3.5 medium with ``args.blocks`` blocks, its variants, and one forward at 1024 px (``dit_bench``'s, which
    runs the patcher's wrappers)."""
    import dit_bench

    case = dit_bench.with_blocks(dit_bench.REAL_CASES["sd35m"], args.blocks)
    dtype = DTYPES[args.dtype]
    model = dit_bench.build(case, dtype, device)
    inputs = dit_bench.make_inputs(case, dtype, device)
    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    variants = {"none": model, f"tome-{args.ratio}": dit.apply_tome_dit(model, ratio=args.ratio),
                f"todo-{args.todo}": dit.apply_todo_dit(model, downsample_factor=args.todo)}
    if args.block_scope:
        every_block = dict(dit_scope=dit.SCOPE_BLOCK, skip_first_blocks=0, skip_last_blocks=0)
        variants[f"tome-{args.ratio}-block"] = dit.apply_tome_dit(model, ratio=args.ratio, **every_block)
        variants[f"todo-{args.todo}-block"] = dit.apply_todo_dit(model, downsample_factor=args.todo, **every_block)
        # The first and the last block whole: what compile gains on the blocks the scope leaves alone.
        variants[f"tome-{args.ratio}-block-skip-1:1"] = dit.apply_tome_dit(
            model, ratio=args.ratio, dit_scope=dit.SCOPE_BLOCK, skip_first_blocks=1, skip_last_blocks=1)
    return variants, lambda m: dit_bench.forward(m, inputs, device)


def compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", cpu=device.type == "cpu",
                                 attention=args.attention)
    import comfy.ldm.modules.attention as attention

    variants, forward = (unet_case if args.model == "sd15" else dit_case)(args, device)
    rows = {name: {"model": args.model, "variant": name} for name in variants}
    times = {(name, kind): [] for name in variants for kind in ("eager", "compiled")}

    def timed(name, kind, model):
        start = time.perf_counter()
        forward(model)
        times[name, kind].append(time.perf_counter() - start)

    # Each compiled variant is timed while the dynamo cache holds its graphs alone: every variant compiles the
    # same diffusion model's code, whose cache they would share, and without the guards on transformer_options
    # a round-robin timed some variants on graphs another variant left (an SD3.5 run with the block scope's
    # variants read compiled ToMe and ToDo at the compiled model's own speed).
    for name, model in variants.items():
        torch._dynamo.reset()
        compiled = newest_host.compile_like_newest(model, args.backend)
        start = time.perf_counter()
        forward(compiled)
        rows[name]["compile s"] = time.perf_counter() - start
        rows[name]["graphs"] = compiled_graphs()
        forward(compiled)  # a second call must reuse what the first compiled
        rows[name]["recompiled graphs"] = compiled_graphs() - rows[name]["graphs"]
        for _ in range(args.repeats):
            timed(name, "compiled", compiled)
    torch._dynamo.reset()
    for model in variants.values():
        forward(model)  # warm-up
    for _ in range(args.repeats):
        for name, model in variants.items():
            timed(name, "eager", model)
    none_eager, none_compiled = min(times["none", "eager"]), min(times["none", "compiled"])
    for name, row in rows.items():
        eager, compiled_s = min(times[name, "eager"]), min(times[name, "compiled"])
        row.update({"attention": attention.optimized_attention.__name__, "eager s": eager,
                    "compiled s": compiled_s, "eager vs none": none_eager / eager,
                    "compiled vs compiled none": none_compiled / compiled_s,
                    "compiled vs eager none": none_eager / compiled_s})
        print(json.dumps(row), flush=True)
    return list(rows.values())


def markdown(rows: list[dict]) -> str:
    lines = ["| model | variant | uncompiled s | vs none | compiled s | vs compiled none | vs uncompiled none "
             "| first call s | graphs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['variant']} | {r['eager s']:.2f} | {r['eager vs none']:.2f}x "
                     f"| {r['compiled s']:.2f} | {r['compiled vs compiled none']:.2f}x "
                     f"| {r['compiled vs eager none']:.2f}x | {r['compile s']:.0f} | {r['graphs']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["sd15", "sd35m"], default="sd15")
    parser.add_argument("--px", type=int, default=1024, help="sd15: image size in pixels (sd35m: 1024)")
    parser.add_argument("--blocks", type=int, default=4, help="sd35m: how many of its 24 joint blocks")
    parser.add_argument("--ratio", type=float, default=0.5, help="Apply ToMe's ratio")
    parser.add_argument("--todo", type=int, default=2, help="Apply ToDo's downsample_factor")
    parser.add_argument("--block-scope", action="store_true",
                        help="sd35m: also ToMe and ToDo at dit_scope block, every block reduced, and ToMe "
                             "with skips 1:1")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, help="ComfyUI's attention (default: the device's)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.block_scope and args.model != "sd35m":
        parser.error("--block-scope is a DiT scope: it takes --model sd35m")
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"compile_{args.model}{'_block' if args.block_scope else ''}_{args.attention or 'default'}"
    (args.out / f"{stem}.json").write_text(json.dumps({"machine": machine.describe(), "args": vars(args) | {
                                                           "out": str(args.out)}, "rows": rows}, indent=2))
    table = markdown(rows)
    (args.out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
