"""Train the quality bench's small models on photographs, or check the committed ones.

    .venv/bin/python bench/train_models.py --patch-maps      # fit the real-footprint judges' patch maps first
    .venv/bin/python bench/train_models.py --layout flux-512 # train one (see training.json for each one's time)
    .venv/bin/python bench/train_models.py --check           # verify the committed weights: hash, held-out error

Seeded: the same command gives the same weights up to float rounding (thread
counts change summation order). Writes ``tome_harness/weights/<layout>.safetensors``
(fp16), ``SHA256SUMS`` and ``training.json`` (the held-out x0 error per noise level
of the trained model, its untrained twin and the noisy input; the patch maps'
reconstruction PSNR on the held-out photographs). Nothing is
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
from tome_harness import patch_map as pm
from tome_harness import photos
from tome_harness import trained_models as tm

RECORD = tm.WEIGHTS / "training.json"
CHECK_TOLERANCE = 0.02  # relative: the held-out error a check may differ by (other thread counts, CPUs)
PATCH_MAP_CHANNELS = (4, 16)  # the U-Nets' latent channels and the DiTs'
PATCH_MAP_SIDE, PATCH_MAP_CROPS = 512, 48  # fitted on this many random training crops of this side


def fit_patch_maps() -> dict:
    """Fit, write and hash the patch maps; return their records: each one's reconstruction PSNR (encode then
    decode) on the held-out photographs at 512 px."""
    crops = photos.CropSampler(PATCH_MAP_SIDE, seed=0).batch(PATCH_MAP_CROPS) * 2 - 1
    held_out = photos.held_out_images(PATCH_MAP_SIDE)
    records = {}
    for channels in PATCH_MAP_CHANNELS:
        fitted = pm.fit(crops, channels)
        fitted.save(tm.patch_map_path(channels))
        record_hash(tm.patch_map_path(channels))
        psnrs = pm.reconstruction_psnr(fitted, held_out)
        records[str(channels)] = {"held-out PSNR": dict(zip(photos.HELD_OUT, psnrs, strict=True)),
                                  "crops": PATCH_MAP_CROPS, "side": PATCH_MAP_SIDE}
    return records


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
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout.bf16)
    sampler = photos.CropSampler(layout.pixels, seed=layout.seed)
    generator = torch.Generator().manual_seed(layout.seed + 1)
    start = time.perf_counter()
    losses = []
    for step in range(layout.steps):
        for group in optimizer.param_groups:
            group["lr"] = tm.lr_at(layout, step)
        x0 = tm.training_batch(sampler, layout)
        with autocast:
            value = tm.loss(model, layout, x0, generator).float()
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
    record_hash(tm.weights_path(layout))
    after = tm.held_out_error(tm.trained(layout).model, layout, held_out)  # as committed: fp16, reloaded
    return {"steps": layout.steps, "batch": layout.batch, "seconds": round(seconds), "threads": torch.get_num_threads(),
            "bf16 autocast": layout.bf16,
            "parameters": sum(p.numel() for p in params), "final_loss": sum(losses[-50:]) / min(50, len(losses)),
            "held_out": {str(p): {"trained": after[p]["model"], "untrained": before[p]["model"],
                                  "noisy input": before[p]["noisy input"], "sigma": before[p]["sigma"]}
                         for p in tm.EVAL_PERCENTS}}


def record_hash(path: Path) -> None:
    """Write the hash of ``path`` (in ``tm.WEIGHTS``) into ``SHA256SUMS``, keeping the other files' lines."""
    sums = tm.WEIGHTS / "SHA256SUMS"
    hashes = tm.recorded_hashes() if sums.exists() else {}
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


def check_patch_maps(record: dict) -> list[str]:
    """What is wrong with the committed patch maps: their hashes, and their held-out reconstruction against the
    record."""
    problems = []
    held_out = photos.held_out_images(PATCH_MAP_SIDE)
    for channels in PATCH_MAP_CHANNELS:
        try:
            psnrs = pm.reconstruction_psnr(tm.patch_map(channels), held_out)
        except (RuntimeError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        for name, measured in zip(photos.HELD_OUT, psnrs, strict=True):
            recorded = record[str(channels)]["held-out PSNR"][name]
            if abs(measured - recorded) > 0.01:
                problems.append(f"patch map {channels} on {name}: {measured:.3f} dB, recorded {recorded:.3f}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", choices=list(tm.LAYOUTS),
                        help="a layout to train or check (repeatable; default: train the real-footprint "
                             "judges, check every committed model)")
    parser.add_argument("--patch-maps", action="store_true", help="fit the patch maps (before any real-footprint "
                                                                   "layout is trained: its latent is made by them)")
    parser.add_argument("--check", action="store_true", help="verify the committed weights instead of training")
    parser.add_argument("--steps", type=int, help="train this many steps instead of the layout's recipe (a trial "
                                                  "run: its weights are not the committed ones)")
    args = parser.parse_args(argv)
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", attention="sdpa")
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.patch_maps:
        records["patch maps"] = fit_patch_maps()
        RECORD.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(json.dumps(records["patch maps"], indent=1), flush=True)
        if not args.layout:
            return 0
    # Checked by default: every committed model; trained by default: the current judges.
    names = args.layout or ([name for name in tm.LAYOUTS if name in records] if args.check
                            else list(tm.GENERATIONS["real footprint"]))
    if args.check:
        problems = [p for name in names for p in check(tm.LAYOUTS[name], records[name])]
        problems += check_patch_maps(records["patch maps"])
        print("\n".join(problems) or f"ok: {', '.join(names)} and the patch maps match their hashes and recorded "
                                     "held-out figures")
        return 1 if problems else 0
    for name in names:
        layout = tm.LAYOUTS[name]
        record = train(layout if args.steps is None else dataclasses.replace(layout, steps=args.steps))
        # Read again: a training of another layout may have written its record meanwhile.
        records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        records[name] = record
        RECORD.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(json.dumps({name: record["held_out"]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
