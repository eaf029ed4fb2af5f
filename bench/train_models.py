"""Train the quality bench's small models on photographs, or check the committed ones.

    .venv/bin/python bench/train_models.py                 # train all five (about 25 minutes on 2 cores)
    .venv/bin/python bench/train_models.py --layout flux   # one
    .venv/bin/python bench/train_models.py --check         # verify the committed weights: hash, held-out error

Seeded: the same command gives the same weights up to float rounding (thread
counts change summation order). Writes ``tome_harness/weights/<layout>.safetensors``
(fp16), ``SHA256SUMS`` and ``training.json`` (the held-out x0 error per noise level
of the trained model, its untrained twin and the noisy input). Nothing is
downloaded: the photographs come from Debian's ``mate-backgrounds`` and
scikit-image (``tome_harness.photos``). The layouts, the pixel map and the
objective: ``tome_harness.trained_models``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tome_harness import comfyui as comfyui_host
from tome_harness import photos
from tome_harness import trained_models as tm

RECORD = tm.WEIGHTS / "training.json"
CHECK_TOLERANCE = 0.02  # relative: the held-out error a check may differ by (other thread counts, CPUs)


def train(layout: tm.Layout, log_every: int = 25) -> dict:
    """Train ``layout`` from its seeded initial weights; write its weights; return its record."""
    torch.manual_seed(layout.seed)  # nothing in training should draw from it; fixed all the same
    patcher = tm.untrained(layout)
    model = patcher.model
    held_out = tm.held_out_latents(layout)
    before = tm.held_out_error(model, layout, held_out)
    model.train()
    params = [p for p in model.diffusion_model.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=layout.lr, weight_decay=0.0, betas=(0.9, 0.99))
    sampler = photos.CropSampler(layout.pixels, seed=layout.seed)
    generator = torch.Generator().manual_seed(layout.seed + 1)
    start = time.perf_counter()
    losses = []
    for step in range(layout.steps):
        for group in optimizer.param_groups:
            group["lr"] = tm.lr_at(layout, step)
        x0 = tm.training_batch(sampler, layout)
        value = tm.loss(model, layout, x0, generator)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(value.detach()))
        if (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(f"{layout.name} step {step + 1}/{layout.steps} loss {recent:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    for p in params:
        p.requires_grad_(False)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.diffusion_model.state_dict().items()}
    tm.WEIGHTS.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(state, str(tm.weights_path(layout)))
    record_hash(layout)
    after = tm.held_out_error(tm.trained(layout).model, layout, held_out)  # as committed: fp16, reloaded
    return {"steps": layout.steps, "batch": layout.batch, "seconds": round(seconds), "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in params), "final_loss": sum(losses[-50:]) / min(50, len(losses)),
            "held_out": {str(p): {"trained": after[p]["model"], "untrained": before[p]["model"],
                                  "noisy input": before[p]["noisy input"], "sigma": before[p]["sigma"]}
                         for p in tm.EVAL_PERCENTS}}


def record_hash(layout: tm.Layout) -> None:
    """Write the weights' hash into ``SHA256SUMS`` (keeping the other layouts' lines)."""
    sums = tm.WEIGHTS / "SHA256SUMS"
    hashes = tm.recorded_hashes() if sums.exists() else {}
    path = tm.weights_path(layout)
    hashes[path.name] = tm.sha256(path)
    sums.write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(hashes.items())))


def check(layout: tm.Layout, record: dict) -> list[str]:
    """What is wrong with the committed ``layout``: its hash, its held-out error against the record, and
    whether it beats its untrained twin and the noisy input at every level."""
    problems = []
    try:
        model = tm.trained(layout).model
    except (RuntimeError, FileNotFoundError) as error:
        return [str(error)]
    errors = tm.held_out_error(model, layout, tm.held_out_latents(layout))
    for percent, measured in errors.items():
        recorded = record["held_out"][str(percent)]
        if abs(measured["model"] - recorded["trained"]) > CHECK_TOLERANCE * recorded["trained"]:
            problems.append(f"{layout.name} at {percent}: held-out error {measured['model']:.5f}, recorded "
                            f"{recorded['trained']:.5f}")
        if not measured["model"] < min(recorded["untrained"], measured["noisy input"]):
            problems.append(f"{layout.name} at {percent}: does not beat its untrained twin and the noisy input")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", choices=list(tm.LAYOUTS),
                        help="a layout to train or check (repeatable; default: all five)")
    parser.add_argument("--check", action="store_true", help="verify the committed weights instead of training")
    parser.add_argument("--steps", type=int, help="train this many steps instead of the layout's recipe (a trial "
                                                  "run: its weights are not the committed ones)")
    args = parser.parse_args(argv)
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", attention="sdpa")
    names = args.layout or list(tm.LAYOUTS)
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.check:
        problems = [p for name in names for p in check(tm.LAYOUTS[name], records[name])]
        print("\n".join(problems) or f"ok: {', '.join(names)} match their hashes and recorded held-out errors")
        return 1 if problems else 0
    for name in names:
        layout = tm.LAYOUTS[name]
        records[name] = train(layout if args.steps is None else dataclasses.replace(layout, steps=args.steps))
        RECORD.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(json.dumps({name: records[name]["held_out"]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
