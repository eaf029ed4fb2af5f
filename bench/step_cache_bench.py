"""A DiT forward under the step caches people install, alone and with this pack's reduction, at real width.

    .venv/bin/python bench/step_cache_bench.py --model flux --flux-blocks 1 2 --cache TeaCache MagCache \
        "First Block Cache"
    .venv/bin/python bench/step_cache_bench.py --model wan13b --frames 17 --blocks 2 --cache TeaCache MagCache
    .venv/bin/python bench/step_cache_bench.py --model sd35m --blocks 4 --cache "First Block Cache"

The models are ``dit_bench``'s (random weights in the real layouts and widths; ``--blocks``, ``--flux-blocks``,
``--frames``, ``--px`` as there). Each cache is the pinned copy of its pack (``tome_harness.step_caches``: TeaCache,
MagCache, First Block Cache), its node applied as a user's graph applies it, with the ``model_type`` of the family.
A forward is one model call as the sampler makes it, through the cache's model wrapper, at a step where the cache
computes: the first step of a run for TeaCache and MagCache (the state a call leaves on the model is dropped
after it), a higher sigma than the last call's for First Block Cache (which resets it). That is the forward a
cache cannot skip, and the one the reduction makes faster; every timed forward is checked to have run every
block. Variants, round-robin in one process (minimum of ``--repeats``): ``none``, each setting of ours alone
(``tome-R-block``: Apply ToMe (Advanced) ratio R at ``dit_scope`` block; ``todo-D-block``: Apply ToDo factor D at
the block scope; ``todo-2``: Apply ToDo 2 at the attention scope), each cache alone and each cache with each
setting. ``speed-up``: over ``none``; ``over the cache``: over the cache alone. Where our node cannot act under a
cache (the attention scope under TeaCache's and MagCache's forwards; the block scope under First Block Cache's
swapped block lists) its row is the cache alone's, and the node's warning says so.

A sampling run's speed-up under a cache is its forward's times the share of model calls the cache leaves out,
which depends on what the model computes: the trained judges count them (``quality_bench.py``'s step-cache
settings); docs/SPEED_STACK.md ("Third-party step caches") puts both together.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from dit_bench import (
    DTYPES,
    blocks_swapped,
    build,
    cases_of,
    make_inputs,
    skip_pair,
    synchronize,
    video_size,
    write_rows,
)

from tome_harness import comfyui as comfyui_host
from tome_harness import step_caches
from tome_harness.comfyui import ROOT

# The test family whose model_type each of dit_bench's models takes in a cache's node.
FAMILY_OF_CLASS = {"Flux": "flux", "WAN21_T2V": "wan21", "SD3": "sd3", "HunyuanVideo": "hunyuan_video",
                   "LTXV": "ltxv", "ZImage": "lumina2", "Lumina2": "lumina2", "HiDream": "hidream",
                   "QwenImage": "qwen_image"}


def settings(nodes, ratios, factors, skips) -> dict:
    """Our settings by name: functions from a model to the model through the real node."""

    def tome(ratio):
        return lambda m: nodes.ApplyToMeAdvanced.execute(
            model=m, ratio=ratio, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
            merge="q, k and v", start_percent=0.0, end_percent=1.0, dit_scope="block", skip_first_blocks=skips[0],
            skip_last_blocks=skips[1]).result[0]

    def todo(factor, dit_scope):
        return lambda m: nodes.ApplyToDo.execute(
            model=m, downsample_factor=factor, max_downsample="auto", method="nearest", start_percent=0.0,
            end_percent=1.0, dit_scope=dit_scope, skip_first_blocks=skips[0], skip_last_blocks=skips[1]).result[0]

    out = {f"tome-{ratio}-block": tome(ratio) for ratio in ratios}
    out.update({f"todo-{factor}-block": todo(factor, "block") for factor in factors})
    out["todo-2"] = todo(2, "attention")
    return out


def variants(classes, nodes, model, family: str, caches, args) -> dict:
    """The models to time, by name: ``none``, ours alone, each cache alone and with each of ours."""
    ours = settings(nodes, args.ratio, args.block_factor, args.skips)
    out = {"none": model, **{name: apply(model) for name, apply in ours.items()}}
    for cache in caches:  # a node of its own for each: First Block Cache keeps its state in the node's closure
        out[cache] = step_caches.cached(classes, cache, model, family)
        out.update({f"{cache} + {name}": step_caches.cached(classes, cache, apply(model), family)
                    for name, apply in ours.items()})
    return out


class BlockCount:
    """Forward pre-hooks on every block of a model (the modules themselves, which a cache's forward calls
    directly or through First Block Cache's cached block): how many ran since the last ``take``."""

    LISTS = ("double_blocks", "single_blocks", "joint_blocks", "blocks", "transformer_blocks", "layers",
             "double_stream_blocks", "single_stream_blocks")

    def __init__(self, net: torch.nn.Module):
        self.blocks = [block for name in self.LISTS for block in getattr(net, name, None) or ()]
        self.ran = 0
        self.hooks = [block.register_forward_pre_hook(self.count) for block in self.blocks]

    def count(self, *_):
        self.ran += 1

    def take(self) -> int:
        ran, self.ran = self.ran, 0
        return ran


STEPS = 20  # the schedule each call's step is the first of


class Calls:
    """Model calls as the sampler makes them, each at the first step of a fresh schedule, every round's sigma above
    the last round's: every cache computes it. ``call(model, round_)``: one, returning its output."""

    def __init__(self, inputs, device: torch.device):
        self.inputs, self.device = inputs, device

    def call(self, model, round_: int):
        x, sigma, context, conds = self.inputs
        sigma = sigma + 1e-3 * round_  # higher than the last round's: First Block Cache starts afresh
        schedule = torch.linspace(1.0, 0.0, STEPS + 1, device=sigma.device) * sigma  # MagCache keeps its first
        # fifth of a run whole (retention_ratio); a shorter one would have it skip the first step
        net = model.get_model_object("diffusion_model")
        state = set(vars(net))
        options = dict(model.model_options["transformer_options"], wrappers=model.wrappers, sigmas=sigma,
                       sample_sigmas=schedule, cond_or_uncond=[0])
        c = {"c_crossattn": context, "transformer_options": options, **conds}
        wrapper = model.model_options.get("model_function_wrapper")
        with torch.inference_mode(), blocks_swapped(model):  # Lumina 2's, HiDream's, as loading the clone would
            if wrapper is None:
                out = model.model.apply_model(x, sigma, **c)
            else:
                out = wrapper(model.model.apply_model, {"input": x, "timestep": sigma, "c": c, "cond_or_uncond": [0]})
        synchronize(self.device)
        for name in set(vars(net)) - state:  # what TeaCache and MagCache keep on the model between steps
            delattr(net, name)
        return out


def run_case(classes, nodes, case, args, device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    model = build(case, dtype, device)
    family = FAMILY_OF_CLASS[case.model_class]
    caches = [cache for cache in args.cache if family in step_caches.PACKS[cache].families and
              family not in step_caches.PACKS[cache].fails]
    models = variants(classes, nodes, model, family, caches, args)
    inputs = make_inputs(case, dtype, device)
    if case.model_class == "Flux":  # the pooled text and Flux dev's guidance, which MagCache's forward requires
        inputs[3].setdefault("y", torch.zeros(1, case.config["vec_in_dim"], device=device, dtype=dtype))
        if case.config.get("guidance_embed"):
            inputs[3].setdefault("guidance", torch.full((1,), 3.5, device=device, dtype=dtype))
    calls = Calls(inputs, device)
    count = BlockCount(model.get_model_object("diffusion_model"))
    times, distance = {name: [] for name in models}, {}
    for round_ in range(args.repeats + 1):  # the first round warms up and is not timed
        for name, m in models.items():
            start = time.perf_counter()
            out = calls.call(m, round_).float()
            seconds = time.perf_counter() - start
            if count.take() != len(count.blocks):
                raise RuntimeError(f"{case.name} {name}: the cache skipped blocks in a forward meant to compute")
            if round_ == 0:
                if name == "none":
                    baseline = out
                distance[name] = float((out - baseline).norm() / baseline.norm())
            else:
                times[name].append(seconds)
    rows = []
    for name in models:
        cache = next((c for c in caches if name == c or name.startswith(f"{c} + ")), None)
        rows.append({"model": case.name, "latent": list(case.latent), "dtype": args.dtype, "device": device.type,
                     "variant": name, "cache": cache, "seconds": min(times[name]),
                     "speed-up": min(times["none"]) / min(times[name]),
                     "over the cache": None if cache is None else min(times[cache]) / min(times[name]),
                     "relative distance": distance[name]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | variant | s | speed-up | over the cache alone | output distance |", "|---|---|---|---|---|---|"]
    for row in rows:
        over = "" if row["over the cache"] is None else f"{row['over the cache']:.2f}x"
        lines.append(f"| {row['model']} | {row['variant']} | {row['seconds']:.2f} | {row['speed-up']:.2f}x | {over} "
                     f"| {row['relative distance']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=["flux", "wan13b", "sd35m", "hunyuan", "ltxv", "zimage",
                                                       "hidream", "qwen", "tiny"], default=["flux"],
                        help="dit_bench's models (tiny: the test models, a smoke run)")
    parser.add_argument("--cache", nargs="+", choices=list(step_caches.PACKS), default=list(step_caches.PACKS),
                        help="the step caches (each only on the families it covers)")
    parser.add_argument("--frames", type=int, nargs="+", default=[17], help="video models: lengths in frames")
    parser.add_argument("--size", type=video_size, metavar="WIDTHxHEIGHT", help="video models: the size in pixels")
    parser.add_argument("--blocks", type=int, help="run only this many of the model's blocks (as dit_bench)")
    parser.add_argument("--px", type=int, nargs="+", default=[1024], help="flux, qwen: image sizes in pixels")
    parser.add_argument("--flux-blocks", type=int, nargs=2, default=[1, 2], metavar=("DOUBLE", "SINGLE"))
    parser.add_argument("--ratio", type=float, nargs="*", default=[0.5], help="ToMe ratios at the block scope")
    parser.add_argument("--block-factor", type=int, nargs="*", default=[2], help="ToDo factors at the block scope")
    parser.add_argument("--skips", type=skip_pair, default=(0, 0), metavar="FIRST:LAST",
                        help="skip_first_blocks:skip_last_blocks of the block scope's settings (default 0:0: with "
                             "a few of a model's blocks, every one is a middle block)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up; the minimum counts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for JSON and Markdown")
    args = parser.parse_args(argv)
    args.merge = args.scope = args.reuse_blocks = None  # dit_bench's cases_of reads only the model's arguments
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nodes_module = comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes",
                                                cpu=device.type == "cpu", sdpa=True)
    classes = step_caches.load(nodes_module)
    nodes = comfyui_host.pack_module("nodes")
    rows = [row for case in cases_of(args) if case.model_class in FAMILY_OF_CLASS
            for row in run_case(classes, nodes, case, args, device)]
    write_rows(args.out, f"step_caches_{'_'.join(args.model)}_{args.dtype}", rows, markdown(rows))


if __name__ == "__main__":
    main()
