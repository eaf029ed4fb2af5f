"""What each setting costs in image quality, on the small models trained here (``bench/train_models.py``).

    .venv/bin/python bench/quality_bench.py                       # every judge and setting (an hour or more)
    .venv/bin/python bench/quality_bench.py --layout sd15 --smoke  # seconds: one photograph and seed, 2 steps
    .venv/bin/python bench/quality_bench.py --depth                # each block's change of the image tokens
    .venv/bin/python bench/quality_bench.py --findings bench/records/quality/*.json  # both generations' findings
    .venv/bin/python bench/quality_bench.py --tables bench/records/quality/flux-512.json  # a run's tables again
    .venv/bin/python bench/quality_bench.py --picture docs/quality.png   # the README's picture too

The judges are the models of the real footprint (``tm.GENERATIONS``); ``--layout`` names any trained
model, the first small ones too (``sd15``, ``flux``, ...), for the figures of both side by side.
Everything runs in the real host: ComfyUI in-process (PyTorch SDPA attention, CPU, fp32), the pack as
ComfyUI loads it, the trained weights in ComfyUI's own model classes, sampling through ``comfy.sample``.
On the held-out photographs (``tome_harness.photos.HELD_OUT``), for each setting against no patch:

- (a) x0: the model's x0 prediction from the photograph noised to 25%, 50% and 75% of the schedule (one
  sampler step that returns the prediction). "x0 error": its squared error against the photograph over the
  unpatched model's (1.00: no cost; below 1 happens: a reduction that smooths a blurry prediction can land
  nearer the photograph). "x0 change": its squared distance from the unpatched prediction over the
  unpatched model's error (0: no change): what the setting does to the model, free of that luck;
- (b) img2img: denoise 0.5 of 20 euler steps from each photograph: PSNR and SSIM against the unpatched
  output, PSNR against the photograph;
- (c) from noise: 20 euler steps from pure noise, fixed seeds: PSNR against the unpatched sample, and the
  transformer block calls that ran (a step cache such as core EasyCache skips whole model calls).

Every figure is a mean with its standard deviation over photographs and seeds. Pruning (``reduce=PRUNE``)
drops the very tokens ToMe would merge: merging's gain over it is what averaging buys. On DiTs, the "plain
mean" rows (``keep_norms=False``) merge and pool keys by their plain mean, as the pack did before this bench
showed that the mean shortens them (``tome.norms``). JSON rows go to ``--out``, Markdown
tables to standard output. The rows behind docs/QUALITY.md are committed in ``bench/records/quality/`` (one
file per run, named by its judges), so that ``--findings`` can set both generations side by side without
rerunning them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tome_harness import comfyui as comfyui_host
from tome_harness import photos
from tome_harness import trained_models as tm

STEPS = 20
DENOISE = 0.5
SAMPLER, SCHEDULER = "euler", "simple"
NOISE_SEEDS = (0, 1)  # per photograph, for (a) and (b)
SAMPLE_SEEDS = (0, 1, 2, 3)  # for (c)


@dataclass(frozen=True)
class Setting:
    """One row of the bench: a name, the families it applies to, and how it patches a model."""

    name: str
    patch: Callable  # (pack, model, layout) -> patched model
    unet_only: bool = False
    video_only: bool = False
    dit_only: bool = False

    def applies_to(self, layout: tm.Layout) -> bool:
        return ((layout.is_unet or not self.unet_only) and (layout.frames > 0 or not self.video_only)
                and not (layout.is_unet and self.dit_only))


def tome(ratio: float, **inputs) -> Callable:
    return lambda pack, model, layout: pack.models.apply_tome(model, ratio=ratio, **inputs)


def todo(factor: int, method: str = "nearest", **inputs) -> Callable:
    """ToDo with ``method`` named: the rows keep their meaning whatever the node's ``auto`` picks."""
    return lambda pack, model, layout: pack.models.apply_todo(model, downsample_factor=factor, method=method,
                                                              **inputs)


def block_reuse(**inputs) -> Callable:
    """ToMe 0.5 at the block scope with one matching for several blocks (``reuse_blocks``: no node input)."""
    from tome.hosts.comfyui_dit import SCOPE_BLOCK

    return lambda pack, model, layout: pack.dit.apply_tome_dit(model, ratio=0.5, dit_scope=SCOPE_BLOCK, **inputs)


def core(ratio: float) -> Callable:
    return lambda pack, model, layout: pack.nodes_module.NODE_CLASS_MAPPINGS["TomePatchModel"].execute(
        model, ratio=ratio).result[0]


def easycache(then: Callable | None = None) -> Callable:
    """ComfyUI's core EasyCache with its defaults, on top of ``then`` (a pack setting) where given: it skips
    whole model calls, which only the runs of several steps show ("sample block calls")."""
    def patch(pack, model, layout):
        patched = then(pack, model, layout) if then else model
        return pack.nodes_module.NODE_CLASS_MAPPINGS["EasyCache"].execute(
            patched, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False).result[0]
    return patch


def settings() -> list[Setting]:
    from tome.downsample import AVERAGE
    from tome.hosts.comfyui_dit import MAX_REUSE_BLOCKS, SCOPE_BLOCK
    from tome.hosts.comfyui_models import AUTO
    from tome.hosts.comfyui_unet import MERGE_KV, MERGE_Q, SCOPE_ALL, SCOPE_CROSS
    from tome.merge import PRUNE

    return [
        Setting("none", lambda pack, model, layout: model),
        Setting("ToMe 0.3", tome(0.3)),
        Setting("ToMe 0.5", tome(0.5)),
        Setting("ToMe 0.7", tome(0.7)),
        Setting("ToMe 0.75", tome(0.75), video_only=True),  # the README's fast Wan setting before this bench
        Setting("ToMe 0.75 k and v only", tome(0.75, merge=MERGE_KV), video_only=True),  # as fast as ToDo 2
        # DiTs merged and average-pooled keys by their plain mean before this bench found what it costs
        # (tome.norms).
        Setting("ToMe 0.5 plain mean", lambda pack, model, layout: pack.dit.apply_tome_dit(
            model, ratio=0.5, keep_norms=False), dit_only=True),
        Setting("prune 0.3", tome(0.3, reduce=PRUNE)),
        Setting("prune 0.5", tome(0.5, reduce=PRUNE)),
        Setting("prune 0.7", tome(0.7, reduce=PRUNE)),
        Setting("ToMe 0.5 k and v only", tome(0.5, merge=MERGE_KV)),
        Setting("ToMe 0.5 q only", tome(0.5, merge=MERGE_Q)),
        Setting("ToMe 0.5 widest scope", tome(0.5, scope=SCOPE_ALL), unet_only=True),
        # The README's fast U-Net settings before this bench: deeper levels and more modules.
        Setting("ToMe 0.5 self+cross, max_downsample 2", tome(0.5, scope=SCOPE_CROSS, max_downsample="2"),
                unet_only=True),
        Setting("ToMe 0.5 widest scope, max_downsample 4", tome(0.5, scope=SCOPE_ALL, max_downsample="4"),
                unet_only=True),
        Setting("core TomePatchModel 0.5", core(0.5), unet_only=True),
        Setting("ToDo 2", todo(2)),
        Setting("ToDo 3", todo(3)),
        Setting("ToDo 2 average", todo(2, method=AVERAGE)),
        Setting("ToDo 2 average plain mean", lambda pack, model, layout: pack.dit.apply_todo_dit(
            model, downsample_factor=2, method=AVERAGE, keep_norms=False), dit_only=True),
        Setting("ToDo 2 time_factor 2", todo(2, time_factor=2), video_only=True),
        Setting("ToDo 2 from 0.3", todo(2, start_percent=0.3)),
        # The block scope (dit_scope block): whole blocks on the reduced image tokens. Its default skips the
        # first and last 2 blocks; "all blocks" skips none, "from 0.2" spares the first fifth of the schedule.
        Setting("ToMe 0.3 block", tome(0.3, dit_scope=SCOPE_BLOCK), dit_only=True),
        Setting("ToMe 0.5 block", tome(0.5, dit_scope=SCOPE_BLOCK), dit_only=True),
        Setting("ToMe 0.5 block, all blocks", tome(0.5, dit_scope=SCOPE_BLOCK, skip_first_blocks=0,
                                                   skip_last_blocks=0), dit_only=True),
        Setting("ToMe 0.5 block from 0.2", tome(0.5, dit_scope=SCOPE_BLOCK, start_percent=0.2), dit_only=True),
        # The share of blocks reduced: the default skips reduce 4 of sd35-512's 8 blocks but 20 of SD3.5 medium's
        # 24; sparing one block at each end reduces 6 of 8, nearer a deep model's share.
        Setting("ToMe 0.5 block, skip 1:1", tome(0.5, dit_scope=SCOPE_BLOCK, skip_first_blocks=1,
                                                 skip_last_blocks=1), dit_only=True),
        Setting("ToMe 0.3 block, all blocks", tome(0.3, dit_scope=SCOPE_BLOCK, skip_first_blocks=0,
                                                   skip_last_blocks=0), dit_only=True),
        # One matching serving several blocks of a model call, or a block's matching several steps (issue 33:
        # reuse where the bench shows it free).
        Setting("ToMe 0.5 block, one matching a call", block_reuse(reuse_blocks=MAX_REUSE_BLOCKS), dit_only=True),
        Setting("ToMe 0.5 block, skip 1:1, one matching a call", block_reuse(
            reuse_blocks=MAX_REUSE_BLOCKS, skip_first_blocks=1, skip_last_blocks=1), dit_only=True),
        Setting("ToMe 0.5 block, reuse 2 steps", tome(0.5, dit_scope=SCOPE_BLOCK, reuse_steps=2), dit_only=True),
        Setting("ToMe 0.5 block, reuse 4 steps", tome(0.5, dit_scope=SCOPE_BLOCK, reuse_steps=4), dit_only=True),
        Setting("prune 0.5 block", tome(0.5, dit_scope=SCOPE_BLOCK, reduce=PRUNE), dit_only=True),
        Setting("ToDo 2 block", todo(2, dit_scope=SCOPE_BLOCK), dit_only=True),
        Setting("ToDo 2 average block", todo(2, method=AVERAGE, dit_scope=SCOPE_BLOCK), dit_only=True),
        # A step cache alone and stacked with the README's DiT setting, for the DiT frontier pictures.
        Setting("EasyCache", easycache(), dit_only=True),
        Setting("EasyCache + ToDo 2 auto", easycache(todo(2, method=AUTO)), dit_only=True),
    ]


# Sampling through the real host.

def first_prediction(model, x, sigmas, extra_args=None, callback=None, disable=None):
    """A sampler function (``comfy.samplers.KSAMPLER``) that returns the model's x0 prediction at the first
    sigma: one model call through the whole sampling path, wrappers and patches included."""
    return model(x, sigmas[0] * x.new_ones([x.shape[0]]), **(extra_args or {}))


def vae_space(model, latent: torch.Tensor) -> torch.Tensor:
    """A model-space latent (what ``tm.to_latent`` makes) as the LATENT a sampler takes: the sampler applies
    ``process_latent_in`` to it, which gives the model-space latent back."""
    return model.model.process_latent_out(latent)


def to_pixels(model, samples: torch.Tensor, layout: tm.Layout) -> torch.Tensor:
    return tm.to_pixels(model.model.process_latent_in(samples), layout)


def noise_like(latent: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))


def predict_x0(model, layout, latent, percent: float, seed: int) -> torch.Tensor:
    import comfy.sample
    import comfy.samplers

    sigma = model.model.model_sampling.percent_to_sigma(percent)
    return comfy.sample.sample_custom(model, noise_like(latent, seed), 1.0, comfy.samplers.KSAMPLER(first_prediction),
                                      torch.tensor([sigma, 0.0]), *conditioning(layout), vae_space(model, latent),
                                      disable_pbar=True, seed=seed)


def sample(model, layout, latent, noise: int | torch.Tensor, steps: int, denoise: float) -> torch.Tensor:
    """``steps`` euler steps (of which ``denoise`` runs) from ``latent`` with ``noise`` (a tensor, or a seed)."""
    import comfy.sample

    if isinstance(noise, int):
        noise = noise_like(latent, noise)
    return comfy.sample.sample(model, noise, steps, 1.0, SAMPLER, SCHEDULER, *conditioning(layout),
                               vae_space(model, latent), denoise=denoise, disable_pbar=True)


def conditioning(layout: tm.Layout) -> tuple[list, list]:
    """Positive and negative: the empty prompt both (cfg 1 runs the positive alone)."""
    prompt = tm.empty_prompt(layout)
    return prompt, prompt


# Image measures.

def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Of images in [0, 1]; 100 dB for identical ones."""
    mse = float((a - b).square().mean())
    return 100.0 if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Of ``[3, H, W]`` images (or ``[3, T, H, W]`` clips: the mean over frames)."""
    from skimage.metrics import structural_similarity

    if a.ndim == 4:
        return statistics.fmean(ssim(a[:, t], b[:, t]) for t in range(a.shape[1]))
    return float(structural_similarity(a.numpy(), b.numpy(), channel_axis=0, data_range=1.0))


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per batch element."""
    return (a - b).square().flatten(1).mean(1)


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


@dataclass
class Run:
    """The sizes of one run: the sampling steps, the held-out latents, the seeds and the noise levels."""

    steps: int
    photos: torch.Tensor  # model-space latents of the held-out photographs
    noise_seeds: tuple[int, ...]
    sample_seeds: tuple[int, ...]
    percents: tuple[float, ...]


def outputs(model, layout: tm.Layout, run: Run) -> dict[str, torch.Tensor]:
    """Everything a setting is compared on: x0 predictions, img2img pixels and samples from noise."""
    out = {}
    for percent in run.percents:
        for seed in run.noise_seeds:
            out[f"x0 {percent} {seed}"] = model.model.process_latent_in(predict_x0(model, layout, run.photos,
                                                                                   percent, seed))
    for seed in run.noise_seeds:
        out[f"img2img {seed}"] = to_pixels(model, sample(model, layout, run.photos, seed, run.steps, DENOISE), layout)
    empty = torch.zeros((len(run.sample_seeds), *run.photos.shape[1:]))
    noise = torch.cat([noise_like(empty[:1], seed) for seed in run.sample_seeds])  # one batch, a seed each
    calls = []  # the transformer block calls that ran: a step cache skips whole model calls, every block of them
    counting = [module.register_forward_pre_hook(lambda *_: calls.append(1))
                for module in model.model.diffusion_model.modules() if type(module).__name__ in BLOCK_IMAGE]
    try:
        samples = to_pixels(model, sample(model, layout, empty, noise, run.steps, 1.0), layout)
    finally:
        for handle in counting:
            handle.remove()
    for index, seed in enumerate(run.sample_seeds):
        out[f"sample {seed}"] = samples[index:index + 1]
    out["sample block calls"] = len(calls)
    return out


def measures(run: Run, got: dict, reference: dict, photographs: torch.Tensor) -> dict:
    """One setting's figures against the unpatched ``reference`` outputs, each with its spread."""
    row = {}
    for percent in run.percents:
        errors, changes = [], []
        for seed in run.noise_seeds:
            ours, base = got[f"x0 {percent} {seed}"], reference[f"x0 {percent} {seed}"]
            base_error = mse(base, run.photos)
            errors += (mse(ours, run.photos) / base_error).tolist()
            changes += (mse(ours, base) / base_error).tolist()
        row[f"x0 error {percent}"] = spread(errors)
        row[f"x0 change {percent}"] = spread(changes)
    pairs = [(got[f"img2img {s}"][i], reference[f"img2img {s}"][i], photographs[i])
             for s in run.noise_seeds for i in range(len(photographs))]
    row["img2img PSNR"] = spread([psnr(a, b) for a, b, _ in pairs])
    row["img2img SSIM"] = spread([ssim(a, b) for a, b, _ in pairs])
    row["img2img PSNR to photo"] = spread([psnr(a, p) for a, _, p in pairs])
    row["sample PSNR"] = spread([psnr(got[f"sample {s}"][0], reference[f"sample {s}"][0]) for s in run.sample_seeds])
    row["sample block calls"] = {"ran": got["sample block calls"], "unpatched": reference["sample block calls"]}
    return row


def bench_layout(pack, layout: tm.Layout, run: Run, photographs: torch.Tensor, chosen: list[Setting]) -> list[dict]:
    model = tm.trained(layout)
    reference = outputs(model, layout, run)
    rows = []
    for setting in chosen:
        got = reference if setting.name == "none" else outputs(setting.patch(pack, model, layout), layout, run)
        rows.append({"layout": layout.name, "setting": setting.name, **measures(run, got, reference, photographs)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# Why a setting costs what it costs.

def attention_locality(model, layout: tm.Layout, latents: torch.Tensor) -> dict[str, float]:
    """How local the model's image self-attention is, over one x0 prediction at half the schedule: the
    attention mass a query puts on its own key and on its 3x3 neighbourhood (a video's first frame), averaged
    over queries, heads, photographs and the calls whose queries and keys end with the image (every DiT layout
    measured here: the image is the last tokens of each sequence that holds it). ToDo's ``nearest`` keeps one
    key in four: it costs most where this mass is high."""
    patch = layout.config["patch_size"]
    side = layout.size // (patch[-1] if isinstance(patch, (tuple, list)) else patch)
    n_image, frames = side * side, max(layout.frames, 1)
    rows, cols = torch.arange(n_image) // side, torch.arange(n_image) % side
    near = ((rows[:, None] - rows).abs() <= 1) & ((cols[:, None] - cols).abs() <= 1)
    masses = []

    def heads_major(t, heads, skip_reshape):
        return t if skip_reshape else t.reshape(*t.shape[:2], heads, -1).transpose(1, 2)

    def recorder(func, q, k, v, heads, *args, **kwargs):
        q_, k_ = (heads_major(t, heads, kwargs.get("skip_reshape", False)) for t in (q, k))
        if q_.shape[2] == k_.shape[2] >= n_image * frames:  # self-attention over the image
            start = q_.shape[2] - n_image * frames
            scores = q_[:, :, start:start + n_image] @ k_.transpose(-1, -2) / q_.shape[-1] ** 0.5
            image = scores.float().softmax(-1)[..., start:start + n_image]
            masses.append((float(image.diagonal(dim1=-2, dim2=-1).mean()), float((image * near).sum(-1).mean())))
        return func(q, k, v, heads, *args, **kwargs)

    recording = model.clone()
    recording.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = recorder
    predict_x0(recording, layout, latents, 0.5, seed=0)
    return {"own key": statistics.fmean(m[0] for m in masses), "3x3": statistics.fmean(m[1] for m in masses),
            "uniform 3x3": 9 / (n_image * frames), "calls": len(masses)}


# Each transformer block class the trained models use: where its image tokens come in (from the call's positional
# and keyword arguments, as ComfyUI 0.3.75 calls it) and go out. A DiT's image tokens are the last tokens of what
# a block holds (Flux's single-stream blocks hold [text | image]; the others the image alone).
BLOCK_IMAGE = {
    "DoubleStreamBlock": (lambda args, kwargs: kwargs["img"], lambda out: out[0]),
    "SingleStreamBlock": (lambda args, kwargs: args[0], lambda out: out),
    "JointBlock": (lambda args, kwargs: args[1], lambda out: out[1]),
    "WanAttentionBlock": (lambda args, kwargs: args[0], lambda out: out),
    "BasicTransformerBlock": (lambda args, kwargs: args[0], lambda out: out),
}


def block_changes(model, layout: tm.Layout, latents: torch.Tensor) -> list[float]:
    """How much each transformer block changes the image tokens, in the order the blocks run, over one x0
    prediction at half the schedule: ``|out - in| / |in|`` over the batch. Deep real models change their
    hidden states by a small part at each block (what block caches rely on); a setting whose error grows with a
    block's change is judged harshly by a model whose blocks change them a lot. The input is copied before the
    block runs: ComfyUI's blocks add into it in place."""
    tokens = 0 if layout.is_unet else (layout.size // 2) ** 2 * max(layout.frames, 1)
    changes, handles = [], []

    def image(x):
        return x[:, -tokens:] if tokens else x

    for module in model.model.diffusion_model.modules():
        found = BLOCK_IMAGE.get(type(module).__name__)
        if found is None:
            continue
        taken_in, given_out = found
        seen = {}

        def before(_, args, kwargs, taken_in=taken_in, seen=seen):
            seen["in"] = image(taken_in(args, kwargs)).clone()

        def after(_, args, kwargs, out, given_out=given_out, seen=seen):
            start = seen.pop("in")
            changes.append(float((image(given_out(out)) - start).norm() / start.norm()))

        handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                    module.register_forward_hook(after, with_kwargs=True)]
    try:
        predict_x0(model, layout, latents, 0.5, seed=0)
    finally:
        for handle in handles:
            handle.remove()
    return changes


def token_redundancy(layout: tm.Layout, ratio: float = 0.5) -> dict[str, float]:
    """How alike neighbouring tokens are where the model sees the held-out photographs: the share of the tokens'
    variance (about their mean) lost by merging ``ratio`` of them (ToMe's matching, 2x2 stride, on the tokens
    themselves) and unmerging, on latent tokens of the size the model's first patched level sees (a DiT's 2x2
    patches of latent pixels, SDXL's level 2 likewise; SD1.5's latent pixels) and on the raw pixel patches those
    tokens stand for. ToMe costs less where it is low. A clip counts by its first frame."""
    import torch.nn.functional as F

    from tome.merge import build_plan

    pixels = tm.held_out_pixels(layout)
    pixels = pixels[:, :, 0] if layout.frames else pixels
    latent = tm.to_latent(pixels, layout)
    patch = 1 if layout.config_class == "SD15" else 2  # latent pixels per token side
    side = layout.size // patch

    def lost(tokens: torch.Tensor) -> float:
        plan = build_plan(tokens, side, side, 2, 2, int(tokens.shape[1] * ratio),
                          generator=torch.Generator().manual_seed(0))
        centred = tokens - tokens.mean(1, keepdim=True)
        return float((plan.unmerge(plan.merge(tokens)) - tokens).square().sum() / centred.square().sum())

    def tokens_of(x: torch.Tensor, factor: int) -> torch.Tensor:
        return F.pixel_unshuffle(x, factor).flatten(2).transpose(1, 2)

    return {"latent tokens": lost(tokens_of(latent, patch)),
            "pixel patches": lost(tokens_of(pixels * 2 - 1, patch * layout.pixel_factor))}


def merged(rows: list[dict], later: list[dict]) -> list[dict]:
    """``rows`` completed by ``later`` ones (a row of the same judge and setting replaced), each judge's rows in
    the order of ``settings()``; the judges in the order they first appear. The unpatched reference is
    recomputed by every run, identically: a later ``none`` row replaces the earlier."""
    by_key = {(row["layout"], row["setting"]): row for row in rows + later}
    order = {setting.name: index for index, setting in enumerate(settings())}
    layouts = list(dict.fromkeys(row["layout"] for row in rows + later))
    return sorted(by_key.values(),
                  key=lambda row: (layouts.index(row["layout"]), order.get(row["setting"], len(order))))


# Reports.

def cell(figure: dict, digits: int) -> str:
    return f"{figure['mean']:.{digits}f} ± {figure['std']:.{digits}f}"


def change_digits(changes: list[float]) -> int:
    """Three decimals for x0 changes, five where every one is under 0.01 (a judge that barely moves)."""
    return 3 if max(changes, default=0) >= 0.01 else 5


def markdown(rows: list[dict], percents=tm.EVAL_PERCENTS) -> str:
    """One table per layout."""
    head = (["setting"] + [f"x0 error at {round(p * 100)}%" for p in percents]
            + [f"x0 change at {round(p * 100)}%" for p in percents]
            + ["img2img PSNR (dB)", "img2img SSIM", "PSNR to photo (dB)", "sample PSNR (dB)"])
    out = []
    for name in dict.fromkeys(r["layout"] for r in rows):
        out += [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        digits = change_digits([r[f"x0 change {p}"]["mean"] for r in rows if r["layout"] == name for p in percents])
        for r in (r for r in rows if r["layout"] == name):
            calls = r.get("sample block calls", {})  # rows of runs before it was counted lack it
            skipped = f" ({calls['ran'] / calls['unpatched']:.0%} of the block calls)" if calls.get(
                "ran") != calls.get("unpatched") else ""
            cells = [r["setting"] + skipped] + [cell(r[f"x0 error {p}"], 2) for p in percents]
            cells += [cell(r[f"x0 change {p}"], digits) for p in percents]
            cells += [cell(r["img2img PSNR"], 1) if r["setting"] != "none" else "-",
                      cell(r["img2img SSIM"], 3) if r["setting"] != "none" else "-",
                      cell(r["img2img PSNR to photo"], 1),
                      cell(r["sample PSNR"], 1) if r["setting"] != "none" else "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


FAMILY_NAMES = {"SD15": "SD1.5", "SDXL": "SDXL", "SD3": "SD3.5", "Flux": "Flux", "WAN21_T2V": "Wan 2.1"}


@dataclass(frozen=True)
class Finding:
    """One of the bench's findings, as a claim that the first of ``settings`` is the cheapest by ``metric``."""

    claim: str
    metric: str  # a key of a row
    settings: tuple[str, ...]
    higher_is_better: bool = False  # PSNR; x0 change is better low


FINDINGS = (
    *(Finding(f"merging costs less than pruning, ratio {r}", "x0 change 0.5", (f"ToMe {r}", f"prune {r}"))
      for r in (0.3, 0.5, 0.7)),
    *(Finding(f"merging costs less than pruning over img2img, ratio {r}", "img2img PSNR", (f"ToMe {r}", f"prune {r}"),
              higher_is_better=True) for r in (0.3, 0.5, 0.7)),
    Finding("merged keys at their tokens' length cost less than their plain mean", "x0 change 0.5",
            ("ToMe 0.5", "ToMe 0.5 plain mean")),
    Finding("k and v only is ToMe's cheapest (then q only, then q, k and v)", "x0 change 0.5",
            ("ToMe 0.5 k and v only", "ToMe 0.5 q only", "ToMe 0.5")),
    Finding("a window sparing the first steps costs less (samples from noise)", "sample PSNR",
            ("ToDo 2 from 0.3", "ToDo 2"), higher_is_better=True),
    Finding("ToDo average costs less than nearest", "x0 change 0.5", ("ToDo 2 average", "ToDo 2")),
    Finding("the default scope costs less than the widest", "x0 change 0.5", ("ToMe 0.5", "ToMe 0.5 widest scope")),
    Finding("the attention scope costs less than the block scope", "x0 change 0.5", ("ToMe 0.5", "ToMe 0.5 block")),
)


def finding_cell(finding: Finding, rows: dict[str, dict]) -> str | None:
    """The figures of ``finding``'s settings in one layout's ``rows`` (by setting), and whether the claim holds
    there; None where the layout lacks one of the settings or one of them did nothing there."""
    if not all(name in rows for name in finding.settings):
        return None
    if any(rows[name]["x0 change 0.5"]["mean"] == 0 for name in finding.settings):
        return None  # a setting that changes nothing on this judge (the block scope's skips reach every block)
    values = [rows[name][finding.metric]["mean"] for name in finding.settings]
    digits = 2 if finding.higher_is_better else change_digits(values)
    holds = all((a > b) if finding.higher_is_better else (a < b) for a, b in itertools.pairwise(values))
    return " / ".join(f"{v:.{digits}f}" for v in values) + (" holds" if holds else " **fails**")


def findings_table(rows: list[dict]) -> str:
    """Each finding on each family, on the first (small) judges and on the judges of the real footprint side by
    side, from one or more runs' JSON rows."""
    by_layout: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_layout.setdefault(row["layout"], {})[row["setting"]] = row
    pairs = {}  # family: (small layout, real-footprint layout)
    for small, real in zip(tm.GENERATIONS["small"], tm.GENERATIONS["real footprint"], strict=True):
        pairs[FAMILY_NAMES[tm.LAYOUTS[small].config_class]] = (small, real)
    out = ["| finding | figure | family | small judges | real-footprint judges |", "|---|---|---|---|---|"]
    for finding in FINDINGS:
        for family, (small, real) in pairs.items():
            cells = [finding_cell(finding, by_layout[name]) if name in by_layout else None for name in (small, real)]
            if cells == [None, None]:
                continue
            figure = f"{finding.metric}: " + " / ".join(finding.settings)
            out.append(f"| {finding.claim} | {figure} | {family} | {cells[0] or '-'} | {cells[1] or '-'} |")
    return "\n".join(out)


# Each node's main setting: Apply ToMe 0.5, Apply ToDo 2 with each method its auto picks, the core node.
PICTURE_SETTINGS = ("ToMe 0.5", "ToDo 2", "ToDo 2 average", "core TomePatchModel 0.5")
DIFFERENCE_GAIN = 8  # the difference maps: |setting - no patch| per pixel, times this


def noised_pixels(model, layout: tm.Layout, latent: torch.Tensor, seed: int) -> torch.Tensor:
    """What an img2img run of ``sample(..., denoise=DENOISE)`` starts from, in pixels: the photograph's latent
    noised to the first sigma of its schedule."""
    import comfy.samplers

    sampling = model.model.model_sampling
    sigma = comfy.samplers.calculate_sigmas(sampling, SCHEDULER, int(STEPS / DENOISE))[-(STEPS + 1)]
    return tm.to_pixels(tm.noised(model.model, latent, sigma.view(1), noise_like(latent, seed)), layout)


def picture(pack, path: Path, layouts: list[tm.Layout], names=PICTURE_SETTINGS, tile: int = 192) -> None:
    """The README's picture: one held-out photograph per layout (a row each; a clip's middle frame), the
    noisy input of an img2img run (denoise 0.5 of 20 steps), its output with no patch, and with each setting
    of ``names`` beside an amplified map of where it differs from no patch; the PSNR of each output against
    the unpatched one under it."""
    from PIL import Image, ImageDraw

    label, margin = 14, 76
    by_name = {s.name: s for s in settings()}
    columns = ["photograph", "noisy input", "no patch"]
    for name in names:
        short = name.replace("core TomePatchModel", "core")
        columns += [short, f"x{DIFFERENCE_GAIN} difference"]
    sheet = Image.new("RGB", (margin + tile * len(columns), label + (tile + label) * len(layouts)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, name in enumerate(columns):
        draw.text((margin + i * tile + 4, 0), name, fill="black")

    def frame(image: torch.Tensor) -> torch.Tensor:
        return image[:, image.shape[1] // 2] if image.ndim == 4 else image

    for row, layout in enumerate(layouts):
        model = tm.trained(layout)
        photo = tm.held_out_pixels(layout)[:1]
        latent = tm.to_latent(photo, layout)
        y = label + row * (tile + label)
        draw.text((4, y + tile // 2), layout.name, fill="black")
        reference = to_pixels(model, sample(model, layout, latent, 0, STEPS, DENOISE), layout)[0]
        tiles = [(photo[0], ""), (noised_pixels(model, layout, latent, 0)[0], ""), (reference, "")]
        for name in names:
            setting = by_name[name]
            if not setting.applies_to(layout):
                tiles += [(None, ""), (None, "")]
                continue
            out = to_pixels(model, sample(setting.patch(pack, model, layout), layout, latent, 0, STEPS, DENOISE),
                            layout)[0]
            difference = ((out - reference).abs().mean(0, keepdim=True) * DIFFERENCE_GAIN).clamp(0, 1).expand(3,
                                                                                                        *out.shape[1:])
            tiles += [(out, f"{psnr(out, reference):.1f} dB"), (difference, "")]
        for col, (image, text) in enumerate(tiles):
            if image is None:
                continue
            array = (frame(image).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            sheet.paste(Image.fromarray(array).resize((tile, tile), Image.LANCZOS), (margin + col * tile, y))
            draw.text((margin + col * tile + 4, y + tile), text, fill="black")
    sheet.quantize(colors=256).save(path, optimize=True)  # a third of the size; the README shows it


@torch.inference_mode()  # as ComfyUI runs a prompt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", choices=list(tm.LAYOUTS),
                        help="repeatable; default: the committed judges of the real footprint")
    parser.add_argument("--setting", action="append", help="a setting by name (repeatable; default: all)")
    parser.add_argument("--smoke", action="store_true", help="one photograph, one seed, one noise level, 2 steps")
    parser.add_argument("--out", type=Path, help="write the JSON rows here")
    parser.add_argument("--into", type=Path, metavar="JSON",
                        help="merge the rows into this run's rows instead (a committed record completed by a "
                             "later run of some settings: a row of the same judge and setting is replaced)")
    parser.add_argument("--picture", type=Path, help="also draw the README's picture here (PNG)")
    parser.add_argument("--locality", action="store_true",
                        help="instead: how local each DiT's image self-attention is (what ToDo nearest costs)")
    parser.add_argument("--depth", action="store_true",
                        help="instead: how much each transformer block changes the image tokens")
    parser.add_argument("--redundancy", action="store_true",
                        help="instead: how much of the tokens' variance merging half of them and unmerging loses")
    parser.add_argument("--findings", type=Path, nargs="+", metavar="JSON",
                        help="instead: the findings table from these runs' rows (both generations side by side)")
    parser.add_argument("--tables", type=Path, nargs="+", metavar="JSON",
                        help="instead: the tables of every setting from these runs' rows (one per judge)")
    args = parser.parse_args(argv)
    if args.findings:
        print(findings_table([row for path in args.findings for row in json.loads(path.read_text())]))
        return 0
    if args.tables:
        print(markdown([row for path in args.tables for row in json.loads(path.read_text())]))
        return 0
    nodes = comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes", attention="sdpa")

    class Pack:
        models = comfyui_host.pack_module("tome.hosts.comfyui_models")
        dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
        nodes_module = nodes

    chosen = [s for s in settings() if args.setting is None or s.name in args.setting]
    layouts = [tm.LAYOUTS[name] for name in args.layout or tm.committed(tm.GENERATIONS["real footprint"])]
    if args.locality:
        print("| model | attention on the own key | on the 3x3 neighbourhood | 3x3 if uniform |\n|---|---|---|---|")
        for layout in (layout for layout in layouts if not layout.is_unet):
            found = attention_locality(tm.trained(layout), layout, tm.held_out_latents(layout))
            print(f"| {layout.name} | {found['own key']:.3f} | {found['3x3']:.3f} | {found['uniform 3x3']:.3f} |")
        return 0
    if args.redundancy:
        print("| model | footprint | variance lost, latent tokens | variance lost, pixel patches |\n|---|---|---|---|")
        for layout in layouts:
            found = token_redundancy(layout)
            print(f"| {layout.name} | {layout.footprint} | {found['latent tokens']:.2%} | "
                  f"{found['pixel patches']:.2%} |")
        return 0
    if args.depth:
        print("| model | footprint | blocks | change of the image tokens per block | median |\n|---|---|---|---|---|")
        for layout in layouts:
            found = block_changes(tm.trained(layout), layout, tm.held_out_latents(layout))
            print(f"| {layout.name} | {layout.footprint} | {len(found)} | {', '.join(f'{c:.2f}' for c in found)} | "
                  f"{statistics.median(found):.2f} |")
        return 0
    rows = []
    for layout in layouts:
        count = 1 if args.smoke else len(photos.HELD_OUT)
        pixels = tm.held_out_pixels(layout)[:count]
        run = Run(steps=2 if args.smoke else STEPS, photos=tm.to_latent(pixels, layout),
                  noise_seeds=NOISE_SEEDS[:1] if args.smoke else NOISE_SEEDS,
                  sample_seeds=SAMPLE_SEEDS[:1] if args.smoke else SAMPLE_SEEDS,
                  percents=(0.5,) if args.smoke else tm.EVAL_PERCENTS)
        rows += bench_layout(Pack, layout, run, pixels, [s for s in chosen if s.applies_to(layout)])
    print(markdown(rows, (0.5,) if args.smoke else tm.EVAL_PERCENTS))
    if args.into:
        rows = merged(json.loads(args.into.read_text()), rows)
    for path in (p for p in (args.out, args.into) if p):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")
    if args.picture:
        picture(Pack, args.picture, layouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
