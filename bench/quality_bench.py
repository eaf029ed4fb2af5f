"""What each setting costs in image quality, on the small models trained here (``bench/train_models.py``).

    .venv/bin/python bench/quality_bench.py                       # every judge and setting (an hour or more)
    .venv/bin/python bench/quality_bench.py --layout sd15 --smoke  # seconds: one photograph and seed, 2 steps
    .venv/bin/python bench/quality_bench.py --layout sd15-512 --steps 8 --setting none --setting "ToMe 0.5"
    .venv/bin/python bench/quality_bench.py --layout wan21-512 --x0-only  # (a) alone: every setting in minutes
    .venv/bin/python bench/quality_bench.py --known-orders --layout sd15  # what the measures of quality must show
    .venv/bin/python bench/quality_bench.py --depth                # each block's change of the image tokens
    .venv/bin/python bench/quality_bench.py --sensitivity          # the x0 change with the reduced blocks out
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
- (b) img2img: denoise 0.5 and 0.75 of 20 euler steps (``--steps``) from each photograph: PSNR and SSIM
  against the unpatched output and against the photograph, and the output's detail (high-frequency energy,
  ``tome_harness.quality_measures.detail``) over the unpatched output's and over the photograph's;
- (c) from noise: 20 euler steps from pure noise, fixed seeds: PSNR against the unpatched sample, detail over
  the unpatched sample's and over the photographs', the distance of each sample's 8x8 patches from the held-out
  photographs' (``patch_distance``: how real its textures are, no network needed) beside its floor, a training
  photograph's distance, and the transformer block calls that ran (a step cache such as core EasyCache skips
  whole model calls).

Detail and patch distance see the photographs through the judge's pixel map, as its outputs are made (the real
footprint's keeps 4 or 16 components of each 8x8 patch): they measure the model, not the map. The unpatched
model at fewer steps ("no patch, 10 steps": ``--fewer-steps``, by default 14, 10 and 7 at 20 steps and 6, 4
and 3 at 8) is measured as a setting, against the unpatched run at ``--steps``: the baseline a speed-up must
beat.

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
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tome_harness import comfyui as comfyui_host
from tome_harness import photos, step_caches
from tome_harness import quality_measures as qm
from tome_harness import trained_models as tm

STEPS = 20  # the default of --steps
DENOISE = 0.5  # the img2img strength of the rows recorded first: its figures keep their keys unsuffixed
DENOISES = (DENOISE, 0.75)
# The unpatched model at fewer steps for a run of 20 or 8 (--steps): about 0.7, 0.5 and 0.35 of them, what a user
# can already do to go faster.
FEWER_STEPS = {20: (14, 10, 7), 8: (6, 4, 3)}
SAMPLER, SCHEDULER = "euler", "simple"
NOISE_SEEDS = (0, 1)  # per photograph, for (a) and (b)
SAMPLE_SEEDS = (0, 1, 2, 3)  # for (c)


@dataclass(frozen=True)
class Setting:
    """One row of the bench: a name, the families it applies to, and how it patches a model."""

    name: str
    patch: Callable  # (pack, model, layout) -> patched model
    steps: int | None = None  # sample with these steps, not the run's (still compared with the run's unpatched)
    unet_only: bool = False
    video_only: bool = False
    dit_only: bool = False
    families: tuple[str, ...] = ()  # the judges' config classes it applies to (none named: every one)
    min_steps: int = 1  # runs of fewer steps leave it out (a step cache needs a run to skip in; MagCache, 20)

    def applies_to(self, layout: tm.Layout) -> bool:
        return ((layout.is_unet or not self.unet_only) and (layout.frames > 0 or not self.video_only)
                and not (layout.is_unet and self.dit_only)
                and (not self.families or layout.config_class in self.families))


def tome(ratio: float, **inputs) -> Callable:
    return lambda pack, model, layout: pack.models.apply_tome(model, ratio=ratio, **inputs)


def todo(factor: int, method: str = "nearest", **inputs) -> Callable:
    """ToDo with ``method`` named: the rows keep their meaning whatever the node's ``auto`` picks."""
    return lambda pack, model, layout: pack.models.apply_todo(model, downsample_factor=factor, method=method,
                                                              **inputs)


def one_matching_a_call(**inputs) -> Callable:
    """ToMe 0.5 with one matching for every block of a model call (Apply ToMe (Advanced)'s ``share_matching``);
    ``inputs``: the node's others (the block scope and its skips)."""
    return tome(0.5, share_matching=True, **inputs)


def token_cache(ratio: float, **caching) -> Callable:
    """ToMe's block scope at ``ratio`` computing ``1 - ratio`` of the image tokens in each reduced block and giving
    the rest their own cached change (Apply ToMe (Advanced)'s ``token_cache``; ``caching``: ``TokenCaching``'s
    fields, which the node leaves at their defaults)."""
    from tome.hosts.comfyui_dit import SCOPE_BLOCK

    return lambda pack, model, layout: pack.dit.apply_tome_dit(
        model, ratio=ratio, dit_scope=SCOPE_BLOCK, token_cache=pack.dit.TokenCaching(**caching))


def proportional_attention(ratio: float) -> Callable:
    """ToMe's block scope at ``ratio`` with each merged image key weighed by the tokens it stands for
    (``tome_harness.proportional_attention``: no node offers it)."""
    from tome.hosts.comfyui_dit import SCOPE_BLOCK
    from tome_harness.proportional_attention import with_proportional_attention

    return lambda pack, model, layout: with_proportional_attention(
        pack.dit.apply_tome_dit(model, ratio=ratio, dit_scope=SCOPE_BLOCK))


def scheduled(schedule, cache: bool = False) -> Callable:
    """ToMe's block scope (its token cache where ``cache``) at the ratio of ``schedule`` (a
    ``tome_harness.step_schedule.Schedule``: no node offers it)."""
    from tome.hosts.comfyui_dit import SCOPE_BLOCK
    from tome_harness.step_schedule import with_schedule

    return lambda pack, model, layout: with_schedule(pack.dit.apply_tome_dit(
        model, ratio=max(schedule.first, schedule.last), dit_scope=SCOPE_BLOCK,
        token_cache=pack.dit.TokenCaching() if cache else None), schedule)


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


FBCACHE_SKIPPING = 0.3  # a First Block Cache threshold at which it skips steps on the SD3.5 judge
CACHE_MIN_STEPS = 4  # a third-party step cache's rows need a run this long (the smoke run's 2 steps leave them out)
# The families of the pinned third-party step caches (``tome_harness.step_caches``) by the judges' config class.
CACHE_FAMILY = {"Flux": "flux", "WAN21_T2V": "wan21", "SD3": "sd3"}


def step_cache(name: str, then: Callable | None = None, threshold: float | None = None) -> Callable:
    """A pinned third-party step cache (TeaCache, MagCache, First Block Cache: its node at ``threshold``, else the
    pack's default, with the family's ``model_type``) on top of ``then`` (a pack setting) where given: it skips
    whole model calls (First Block Cache: all but the first block), which the block calls of the runs from noise
    count."""
    def patch(pack, model, layout):
        patched = then(pack, model, layout) if then else model
        return step_caches.cached(step_caches.load(pack.nodes_module), name, patched,
                                  CACHE_FAMILY[layout.config_class], threshold)
    return patch


def step_cache_settings(scope_block: str) -> list[Setting]:
    """Each pinned step cache alone on the judges of the families it covers, and stacked with what of ours acts
    under it there (docs/SPEED_STACK.md): the block scope's ToMe 0.5 under TeaCache and MagCache (their forwards
    leave the attention override out of reach) and under First Block Cache's Flux forward; the attention scope's
    ToDo 2 under First Block Cache on SD3.5 (its cached block leaves the block scope out)."""
    from tome.hosts.comfyui_models import AUTO
    from tome_harness.step_caches import FIRST_BLOCK_CACHE, MAGCACHE, PACKS, TEACACHE

    block = tome(0.5, dit_scope=scope_block)
    out = []
    for cache, stacked in ((TEACACHE, ("Flux", "WAN21_T2V")), (MAGCACHE, ("Flux", "WAN21_T2V")),
                           (FIRST_BLOCK_CACHE, ("Flux",))):
        covered = tuple(c for c, family in CACHE_FAMILY.items() if family in PACKS[cache].families)
        least = max(CACHE_MIN_STEPS, PACKS[cache].min_steps)
        out += [Setting(cache, step_cache(cache), dit_only=True, families=covered, min_steps=least),
                Setting(f"{cache} + ToMe 0.5 block", step_cache(cache, block), dit_only=True, families=stacked,
                        min_steps=least)]
    # First Block Cache decides from the first block's residual, which the attention scope changes: at its default
    # it skips nothing on the SD3.5 judge, so also at a threshold where it skips.
    todo_auto = todo(2, method=AUTO)
    out.append(Setting(f"{FIRST_BLOCK_CACHE} + ToDo 2 auto", step_cache(FIRST_BLOCK_CACHE, todo_auto),
                       dit_only=True, families=("SD3",), min_steps=CACHE_MIN_STEPS))
    for then, suffix in ((None, ""), (todo_auto, " + ToDo 2 auto")):
        out.append(Setting(f"{FIRST_BLOCK_CACHE} {FBCACHE_SKIPPING}{suffix}",
                           step_cache(FIRST_BLOCK_CACHE, then, FBCACHE_SKIPPING), dit_only=True, families=("SD3",),
                           min_steps=CACHE_MIN_STEPS))
    return out


def unpatched(pack, model, layout):
    return model


def fewer_steps(counts: Iterable[int]) -> list[Setting]:
    """The unpatched model sampled with each of ``counts`` steps ("no patch, 10 steps"), compared with the unpatched
    model at the run's steps: the baseline every speed-up is judged against."""
    return [Setting(f"no patch, {count} steps", unpatched, steps=count) for count in counts]


def settings() -> list[Setting]:
    from tome.downsample import AVERAGE
    from tome.hosts.comfyui_dit import SCOPE_BLOCK
    from tome.hosts.comfyui_models import AUTO
    from tome.hosts.comfyui_unet import MERGE_KV, MERGE_Q, SCOPE_ALL, SCOPE_CROSS
    from tome.merge import PRUNE
    from tome_harness.step_schedule import Schedule

    return [
        Setting("none", unpatched),
        Setting("ToMe 0.3", tome(0.3)),
        Setting("ToMe 0.5", tome(0.5)),
        Setting("ToMe 0.7", tome(0.7)),
        Setting("ToMe 0.75", tome(0.75)),  # the README's fast Wan setting before this bench; ToDo's paper's mark
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
        # The ToMe paper's ablations on SD1.5 (docs/QUALITY.md, "What the papers found"): the modules merged for,
        # the levels reduced, and one fixed destination per cell instead of a random one.
        Setting("ToMe 0.5 self+cross", tome(0.5, scope=SCOPE_CROSS), unet_only=True),
        Setting("ToMe 0.5 max_downsample 2", tome(0.5, max_downsample="2"), unet_only=True),
        Setting("ToMe 0.5 max_downsample 4", tome(0.5, max_downsample="4"), unet_only=True),
        Setting("ToMe 0.5 fixed destination", tome(0.5, use_rand=False), unet_only=True),
        Setting("ToDo 2", todo(2)),
        Setting("ToDo 3", todo(3)),
        Setting("ToDo 2 average", todo(2, method=AVERAGE)),
        Setting("ToDo 2 average plain mean", lambda pack, model, layout: pack.dit.apply_todo_dit(
            model, downsample_factor=2, method=AVERAGE, keep_norms=False), dit_only=True),
        Setting("ToDo 2 time_factor 2", todo(2, time_factor=2), video_only=True),
        Setting("ToDo 2 average time_factor 2", todo(2, method=AVERAGE, time_factor=2), video_only=True),
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
        Setting("ToMe 0.5, one matching a call", one_matching_a_call()),
        Setting("ToMe 0.5 block, one matching a call", one_matching_a_call(dit_scope=SCOPE_BLOCK), dit_only=True),
        Setting("ToMe 0.5 block, skip 1:1, one matching a call", one_matching_a_call(
            dit_scope=SCOPE_BLOCK, skip_first_blocks=1, skip_last_blocks=1), dit_only=True),
        Setting("ToMe 0.5 block, reuse 2 steps", tome(0.5, dit_scope=SCOPE_BLOCK, reuse_steps=2), dit_only=True),
        Setting("ToMe 0.5 block, reuse 4 steps", tome(0.5, dit_scope=SCOPE_BLOCK, reuse_steps=4), dit_only=True),
        Setting("prune 0.5 block", tome(0.5, dit_scope=SCOPE_BLOCK, reduce=PRUNE), dit_only=True),
        Setting("ToDo 2 block", todo(2, dit_scope=SCOPE_BLOCK), dit_only=True),
        # Token-wise caching (issue 44): the tokens a reduced block does not compute take their own change from
        # the last step they were computed, not a merged partner's from this one.
        Setting("token cache 0.5 block", token_cache(0.5), dit_only=True),
        Setting("token cache 0.5 block, refresh every 4", token_cache(0.5, refresh_every=4), dit_only=True),
        Setting("token cache 0.5 block, max age 2", token_cache(0.5, max_age=2), dit_only=True),
        Setting("token cache 0.7 block", token_cache(0.7), dit_only=True),
        # The merged tokens' share of attention (issue 44): ToMe's proportional attention at the block scope.
        Setting("ToMe 0.5 block, proportional attention", proportional_attention(0.5), dit_only=True),
        # A schedule over the steps (issue 44, SDTM's): a ratio falling over the run as the detail forms, its
        # reverse, and a full step every few, each removing about half of the tokens over a run.
        Setting("ToMe 0.7 to 0.3 block", scheduled(Schedule(0.7, 0.3)), dit_only=True),
        Setting("ToMe 0.3 to 0.7 block", scheduled(Schedule(0.3, 0.7)), dit_only=True),
        Setting("ToMe 0.625 block, every 5th step whole", scheduled(Schedule(0.625, 0.625, 5)), dit_only=True),
        Setting("token cache 0.7 to 0.3 block", scheduled(Schedule(0.7, 0.3), cache=True), dit_only=True),
        Setting("token cache 0.3 to 0.7 block", scheduled(Schedule(0.3, 0.7), cache=True), dit_only=True),
        Setting("ToDo 2 average block", todo(2, method=AVERAGE, dit_scope=SCOPE_BLOCK), dit_only=True),
        # A step cache alone and stacked with the README's DiT setting, for the DiT frontier pictures.
        Setting("EasyCache", easycache(), dit_only=True),
        Setting("EasyCache + ToDo 2 auto", easycache(todo(2, method=AUTO)), dit_only=True),
        *step_cache_settings(SCOPE_BLOCK),
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
    # The first call of a run of STEPS from that sigma: a step cache sees the first step of a run (MagCache keeps
    # a fifth of a run whole and divides by its steps; a run of one step it cannot take).
    return comfy.sample.sample_custom(model, noise_like(latent, seed), 1.0, comfy.samplers.KSAMPLER(first_prediction),
                                      torch.linspace(sigma, 0.0, STEPS + 1), *conditioning(layout),
                                      vae_space(model, latent), disable_pbar=True, seed=seed)


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


# Measures (of images: ``tome_harness.quality_measures``).

def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per batch element."""
    return (a - b).square().flatten(1).mean(1)


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


@dataclass
class Run:
    """The sizes of one run: the sampling steps, the held-out latents, the seeds, the noise levels and the img2img
    strengths."""

    steps: int
    photos: torch.Tensor  # model-space latents of the held-out photographs
    noise_seeds: tuple[int, ...]
    sample_seeds: tuple[int, ...]
    percents: tuple[float, ...]
    denoises: tuple[float, ...] = DENOISES
    x0_only: bool = False  # (a) alone: no img2img runs, no samples from noise


@dataclass
class Photographs:
    """What a judge's outputs are measured against: the held-out photographs as taken (PSNR, SSIM) and as the
    judge sees them through its pixel map (detail, patch distance: the best its outputs can hold; the real
    footprint's map keeps 4 or 16 components of each 8x8 patch), and the floor of the patch distance."""

    pixels: torch.Tensor
    seen: torch.Tensor
    floor: list[float]  # each training photograph's patch distance to ``seen``, through the map too


def seen_by(layout: tm.Layout, pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` through ``layout``'s pixel map and back."""
    return tm.to_pixels(tm.to_latent(pixels, layout), layout)


def training_pixels(layout: tm.Layout) -> torch.Tensor:
    """The training photographs as the held-out ones are shown to ``layout``: the centred square of each at the
    judge's size (``[N, 3, H, W]``; for a video judge, images to set beside its clips' frames)."""
    side = layout.pixels
    return torch.stack([photos.center_crop(photos.load(name, photos.long_side_for(side)), side)
                        for name in photos.training_names()])


def photographs_for(layout: tm.Layout, pixels: torch.Tensor) -> Photographs:
    """The floor: each training photograph alone against the held-out set, as a sample from noise is."""
    seen = seen_by(layout, pixels)
    return Photographs(pixels, seen, [qm.patch_distance(image, seen)
                                      for image in seen_by(layout, training_pixels(layout))])


def from_noise(model, layout: tm.Layout, run: Run) -> torch.Tensor:
    """``run.steps`` euler steps from pure noise, one batch of a seed each: pixels."""
    empty = torch.zeros((len(run.sample_seeds), *run.photos.shape[1:]))
    noise = torch.cat([noise_like(empty[:1], seed) for seed in run.sample_seeds])
    return to_pixels(model, sample(model, layout, empty, noise, run.steps, 1.0), layout)


def outputs(model, layout: tm.Layout, run: Run) -> dict[str, torch.Tensor]:
    """Everything a setting is compared on: x0 predictions, img2img pixels and samples from noise."""
    out = {}
    for percent in run.percents:
        for seed in run.noise_seeds:
            out[f"x0 {percent} {seed}"] = model.model.process_latent_in(predict_x0(model, layout, run.photos,
                                                                                   percent, seed))
    if run.x0_only:
        return out
    for denoise in run.denoises:
        for seed in run.noise_seeds:
            out[f"img2img {denoise} {seed}"] = to_pixels(model, sample(model, layout, run.photos, seed, run.steps,
                                                                       denoise), layout)
    calls = []  # the transformer block calls that ran: a step cache skips whole model calls, every block of them
    counting = [module.register_forward_pre_hook(lambda *_: calls.append(1))
                for module in model.model.diffusion_model.modules() if type(module).__name__ in BLOCK_IMAGE]
    try:
        samples = from_noise(model, layout, run)
    finally:
        for handle in counting:
            handle.remove()
    for index, seed in enumerate(run.sample_seeds):
        out[f"sample {seed}"] = samples[index:index + 1]
    out["sample block calls"] = len(calls)
    return out


def img2img_measures(run: Run, got: dict, reference: dict, photographs: Photographs, denoise: float) -> dict:
    """The img2img figures at strength ``denoise``, over photographs and seeds: against the unpatched output and
    the photograph, and the detail. Keys end in the strength but at ``DENOISE``."""
    suffix = "" if denoise == DENOISE else f" {denoise}"
    count = len(photographs.pixels)
    outs = [(got[f"img2img {denoise} {s}"][i], reference[f"img2img {denoise} {s}"][i], i)
            for s in run.noise_seeds for i in range(count)]
    figures = {
        "img2img PSNR": [qm.psnr(a, b) for a, b, _ in outs],
        "img2img SSIM": [qm.ssim(a, b) for a, b, _ in outs],
        "img2img PSNR to photo": [qm.psnr(a, photographs.pixels[i]) for a, _, i in outs],
        "img2img SSIM to photo": [qm.ssim(a, photographs.pixels[i]) for a, _, i in outs],
        "img2img detail": [qm.detail(a) for a, _, _ in outs],
        "img2img detail ratio to no patch": [qm.detail(a) / qm.detail(b) for a, b, _ in outs],
        "img2img detail ratio to photo": [qm.detail(a) / qm.detail(photographs.seen[i]) for a, _, i in outs],
    }
    return {name + suffix: spread(values) for name, values in figures.items()}


def sample_measures(run: Run, got: dict, reference: dict, photographs: Photographs) -> dict:
    """The figures of the samples from noise, over seeds: against the unpatched sample of each seed, their detail,
    and how far each sample's patches lie from the held-out photographs' (beside the floor, a training photograph's
    distance; and over the unpatched sample's distance, whose spread says whether a change holds seed by seed)."""
    pairs = [(got[f"sample {s}"], reference[f"sample {s}"]) for s in run.sample_seeds]  # sets of one sample
    photo_detail = qm.detail(photographs.seen)
    distances = [(qm.patch_distance(a, photographs.seen), qm.patch_distance(b, photographs.seen)) for a, b in pairs]
    return {
        "sample PSNR": spread([qm.psnr(a, b) for a, b in pairs]),
        "sample detail": spread([qm.detail(a) for a, _ in pairs]),
        "sample detail ratio to no patch": spread([qm.detail(a) / qm.detail(b) for a, b in pairs]),
        "sample detail ratio to photos": spread([qm.detail(a) / photo_detail for a, _ in pairs]),
        "sample patch distance": spread([ours for ours, _ in distances]),
        "sample patch distance ratio to no patch": spread([ours / base for ours, base in distances]),
        "sample patch distance floor": spread(photographs.floor),
    }


def measures(run: Run, got: dict, reference: dict, photographs: Photographs) -> dict:
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
    if run.x0_only:
        return row
    for denoise in run.denoises:
        row.update(img2img_measures(run, got, reference, photographs, denoise))
    row.update(sample_measures(run, got, reference, photographs))
    row["sample block calls"] = {"ran": got["sample block calls"], "unpatched": reference["sample block calls"]}
    return row


def bench_layout(pack, layout: tm.Layout, run: Run, photographs: Photographs, chosen: list[Setting]) -> list[dict]:
    model = tm.trained(layout)
    reference = outputs(model, layout, run)
    rows = []
    for setting in chosen:
        if setting.name == "none":
            got = reference
        else:
            got = outputs(setting.patch(pack, model, layout), layout, replace(run, steps=setting.steps or run.steps))
        rows.append({"layout": layout.name, "setting": setting.name, "steps": run.steps,  # the base run's
                     **measures(run, got, reference, photographs)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def known_orders(layout: tm.Layout, run: Run, photographs: Photographs) -> dict[str, float]:
    """What the measures must show on a judge, over its samples from noise (the run's steps and seeds): their
    patches nearer the held-out photographs' than its untrained twin's samples are, and less detail in a blur of
    them (``DETAIL_SIGMA``); the blur's patch distance beside theirs and the floor's (a blur can bring samples
    nearer, where they hold more fine detail than the photographs); and the img2img output (denoise ``DENOISE``,
    the run's first noise seed) against the photograph, as it is and blurred: a measure of the truth that a blur
    does not worsen cannot tell smoothing from quality."""
    model = tm.trained(layout)
    trained = from_noise(model, layout, run)
    untrained = from_noise(tm.untrained(layout), layout, run)
    blurred = qm.gaussian_blur(trained, qm.DETAIL_SIGMA)
    img2img = to_pixels(model, sample(model, layout, run.photos, run.noise_seeds[0], run.steps, DENOISE), layout)
    img2img_blurred = qm.gaussian_blur(img2img, qm.DETAIL_SIGMA)

    def distance(samples):
        return statistics.fmean(qm.patch_distance(one, photographs.seen) for one in samples.split(1))

    def to_photo(measure, outs):
        return statistics.fmean(measure(out, photo) for out, photo in zip(outs, photographs.pixels, strict=True))

    return {"floor": statistics.fmean(photographs.floor), "trained": distance(trained),
            "untrained": distance(untrained), "blurred": distance(blurred), "photo detail": qm.detail(photographs.seen),
            "trained detail": qm.detail(trained), "blurred detail": qm.detail(blurred),
            "img2img PSNR to photo": to_photo(qm.psnr, img2img), "blurred PSNR": to_photo(qm.psnr, img2img_blurred),
            "img2img SSIM to photo": to_photo(qm.ssim, img2img), "blurred SSIM": to_photo(qm.ssim, img2img_blurred)}


# Why a setting costs what it costs.

def attention_locality(model, layout: tm.Layout, latents: torch.Tensor, side: int) -> dict[str, float]:
    """How local the model's image self-attention is, over one x0 prediction at half the schedule: the
    attention mass a query puts on its own key and on its 3x3 neighbourhood (a video's first frame), averaged
    over queries, heads, photographs and the calls whose queries and keys end with the image (every DiT layout
    measured here: the image is the last tokens of each sequence that holds it; on a U-Net the self-attention
    of the level of ``side`` x ``side`` tokens). ToDo's ``nearest`` keeps one key in four: it costs most where
    this mass is high. Beside it, how much the attention's output differs between the image queries: the share
    of its energy off its mean over them. Near 0, every query gets the same average of the values, which
    merging keeps: no setting can move such a layer."""
    n_image, frames = side * side, max(layout.frames, 1)
    rows, cols = torch.arange(n_image) // side, torch.arange(n_image) % side
    near = ((rows[:, None] - rows).abs() <= 1) & ((cols[:, None] - cols).abs() <= 1)
    masses, spreads = [], []

    def heads_major(t, heads, skip_reshape):
        return t if skip_reshape else t.reshape(*t.shape[:2], heads, -1).transpose(1, 2)

    def recorder(func, q, k, v, heads, *args, **kwargs):
        q_, k_ = (heads_major(t, heads, kwargs.get("skip_reshape", False)) for t in (q, k))
        if q_.shape[2] == k_.shape[2] >= n_image * frames and (not layout.is_unet or q_.shape[2] == n_image):
            start = q_.shape[2] - n_image * frames
            scores = q_[:, :, start:start + n_image] @ k_.transpose(-1, -2) / q_.shape[-1] ** 0.5
            image = scores.float().softmax(-1)[..., start:start + n_image]
            masses.append((float(image.diagonal(dim1=-2, dim2=-1).mean()), float((image * near).sum(-1).mean())))
            out = func(q, k, v, heads, *args, **kwargs)
            tokens = -2 if kwargs.get("skip_output_reshape", False) else 1
            own = out.narrow(tokens, start, n_image).float()
            spreads.append(float((own - own.mean(tokens, keepdim=True)).square().sum() / own.square().sum()))
            return out
        return func(q, k, v, heads, *args, **kwargs)

    recording = model.clone()
    recording.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = recorder
    predict_x0(recording, layout, latents, 0.5, seed=0)
    return {"own key": statistics.fmean(m[0] for m in masses), "3x3": statistics.fmean(m[1] for m in masses),
            "uniform 3x3": 9 / (n_image * frames), "output off its mean": statistics.fmean(spreads),
            "calls": len(masses)}


def image_side(model, layout: tm.Layout, pack) -> int:
    """The side of the token grid the pack reduces: a DiT's patches, a U-Net's level that Apply ToMe's and
    Apply ToDo's ``auto`` reach (``pack.unet.transformer_downsamples``)."""
    if layout.is_unet:
        return layout.size // pack.unet.transformer_downsamples(model)[0]
    patch = layout.config["patch_size"]
    return layout.size // (patch[-1] if isinstance(patch, (tuple, list)) else patch)


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


# How each kind of block's output is rebuilt with its image tokens as they came in (``knocked_out``).
BLOCK_KNOCKOUT = {
    "DoubleStreamBlock": lambda out, image: (image, out[1]),
    "JointBlock": lambda out, image: (out[0], image),
}


def knocked_out(model, layout: tm.Layout, levels: list[int]) -> list:
    """Hooks on ``model`` (removed by the caller) that set the change to the image tokens to zero in the blocks a
    default setting reduces: on a U-Net the transformer blocks of the highest-resolution level that has them
    (``levels``, the pack's ``transformer_downsamples``: Apply ToMe's and Apply ToDo's ``auto``), on a DiT those
    of the block scope's default (all but the first and last 2). The input is copied before the block runs:
    ComfyUI's blocks add into it in place."""
    tokens = 0 if layout.is_unet else (layout.size // 2) ** 2 * max(layout.frames, 1)
    blocks = [module for module in model.model.diffusion_model.modules() if type(module).__name__ in BLOCK_IMAGE]
    if layout.is_unet:
        grid = (layout.size // levels[0]) ** 2  # the tokens of a block at that level
    else:
        blocks = blocks[2:len(blocks) - 2]
    handles = []
    for module in blocks:
        taken_in, _ = BLOCK_IMAGE[type(module).__name__]
        rebuild = BLOCK_KNOCKOUT.get(type(module).__name__)
        seen = {}

        def before(_, args, kwargs, taken_in=taken_in, seen=seen):
            x = taken_in(args, kwargs)
            seen["in"] = x[:, -tokens:].clone() if tokens else x.clone() if x.shape[1] == grid else None

        def after(_, args, kwargs, out, rebuild=rebuild, seen=seen):
            image = seen.pop("in")
            if image is None:
                return out
            if rebuild is not None:
                return rebuild(out, image)
            out = out.clone()
            out[:, out.shape[1] - image.shape[1]:] = image
            return out

        handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                    module.register_forward_hook(after, with_kwargs=True)]
    return handles


def sensitivity(pack, layout: tm.Layout, run: Run) -> dict:
    """How much a judge's prediction depends on what the blocks a default setting reduces compute: the x0 change
    (as the bench's, a share of the model's own error) when their change to the image tokens is zero
    (``knocked_out``), at each noise level of ``run``. Below 1, the prediction moves by less than the model's own
    error even when those blocks do nothing at all. ``blocks`` names the blocks."""
    model = tm.trained(layout)
    levels = pack.unet.transformer_downsamples(model) if layout.is_unet else []
    found = {"blocks": f"the transformer blocks at downsample {levels[0]}" if levels else
             "all but the first and last 2"}
    for percent in run.percents:
        changes = []
        for seed in run.noise_seeds:
            base = model.model.process_latent_in(predict_x0(model, layout, run.photos, percent, seed))
            handles = knocked_out(model, layout, levels)
            try:
                ours = model.model.process_latent_in(predict_x0(model, layout, run.photos, percent, seed))
            finally:
                for handle in handles:
                    handle.remove()
            changes += (mse(ours, base) / mse(base, run.photos)).tolist()
        found[f"x0 change {percent}"] = spread(changes)
    return found


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
            cells += [cell(r[key], digits) if key in r and (against_photo or r["setting"] != "none") else "-"
                      for key, digits, against_photo in (("img2img PSNR", 1, False), ("img2img SSIM", 3, False),
                                                         ("img2img PSNR to photo", 1, True),
                                                         ("sample PSNR", 1, False))]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out += quality_table([r for r in rows if r["layout"] == name])
    return "\n".join(out)


QUALITY_COLUMNS = (  # the second table's: (header, key, digits), where the rows have it (runs since issue 42)
    ("img2img SSIM to photo", "img2img SSIM to photo", 3),
    ("img2img detail / no patch", "img2img detail ratio to no patch", 2),
    ("img2img detail / photo", "img2img detail ratio to photo", 2),
    ("img2img 0.75 PSNR (dB)", "img2img PSNR 0.75", 1),
    ("img2img 0.75 PSNR to photo (dB)", "img2img PSNR to photo 0.75", 1),
    ("img2img 0.75 SSIM to photo", "img2img SSIM to photo 0.75", 3),
    ("img2img 0.75 detail / photo", "img2img detail ratio to photo 0.75", 2),
    ("sample detail / no patch", "sample detail ratio to no patch", 2),
    ("sample detail / photos", "sample detail ratio to photos", 2),
    ("sample patch distance", "sample patch distance", 4),
    ("sample patch distance / no patch", "sample patch distance ratio to no patch", 2),
)


def quality_table(rows: list[dict]) -> list[str]:
    """One layout's measures of quality, not only of identity: against the photographs, detail (ratios of
    ``quality_measures.detail``), the samples' patch distance to the held-out photographs beside its floor (a
    training photograph's). No lines where the rows lack them."""
    rows = [r for r in rows if "sample patch distance" in r]
    if not rows:
        return []
    floor = rows[0]["sample patch distance floor"]
    head = ["setting"] + [header for header, _, _ in QUALITY_COLUMNS]
    out = [f"measures of quality (patch distance of a training photograph: {cell(floor, 4)})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([r["setting"]] + [cell(r[key], digits) for _, key, digits in QUALITY_COLUMNS])
                   + " |")
    return out + [""]


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
    there; None where the layout lacks one of the settings or its figure (a run of x0 alone), or one of them did
    nothing there."""
    if not all(name in rows and finding.metric in rows[name] for name in finding.settings):
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
            tiles += [(out, f"{qm.psnr(out, reference):.1f} dB"), (difference, "")]
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
    parser.add_argument("--x0-only", action="store_true",
                        help="(a) alone: the x0 predictions, no img2img runs or samples from noise (6 of a "
                             "setting's 76 model calls at 20 steps; the rows lack those figures)")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"sampling steps of the img2img runs and the samples from noise (default {STEPS})")
    parser.add_argument("--fewer-steps", type=int, nargs="*", metavar="N",
                        help="settings of the unpatched model sampled with N steps (\"no patch, N steps\"), compared "
                             "with its run at --steps; default: " + ", ".join(
                                 f"{' '.join(map(str, fewer))} at {steps}" for steps, fewer in FEWER_STEPS.items())
                             + ", none at other steps")
    parser.add_argument("--out", type=Path, help="write the JSON rows here")
    parser.add_argument("--into", type=Path, metavar="JSON",
                        help="merge the rows into this run's rows instead (a committed record completed by a "
                             "later run of some settings: a row of the same judge and setting is replaced)")
    parser.add_argument("--picture", type=Path, help="also draw the README's picture here (PNG)")
    parser.add_argument("--locality", action="store_true",
                        help="instead: how local each judge's image self-attention is (what ToDo nearest costs; on a "
                             "U-Net at the level the pack reduces)")
    parser.add_argument("--known-orders", action="store_true",
                        help="instead: on each judge, the patch distance of its samples, its untrained twin's and a "
                             "blur of its samples to the held-out photographs, and their detail")
    parser.add_argument("--depth", action="store_true",
                        help="instead: how much each transformer block changes the image tokens")
    parser.add_argument("--sensitivity", action="store_true",
                        help="instead: the x0 change with the blocks a default setting reduces knocked out")
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
        unet = comfyui_host.pack_module("tome.hosts.comfyui_unet")
        dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
        nodes_module = nodes

    steps = 2 if args.smoke else args.steps
    candidates = settings() + fewer_steps(FEWER_STEPS.get(steps, ()) if args.fewer_steps is None else args.fewer_steps)
    chosen = [s for s in candidates if (args.setting is None or s.name in args.setting) and s.min_steps <= steps]
    layouts = [tm.LAYOUTS[name] for name in args.layout or tm.committed(tm.GENERATIONS["real footprint"])]
    if args.locality:
        print("| model | attention on the own key | on the 3x3 neighbourhood | 3x3 if uniform | output's energy off "
              "its mean over the queries |\n|---|---|---|---|---|")
        for layout in layouts:
            model = tm.trained(layout)
            found = attention_locality(model, layout, tm.held_out_latents(layout), image_side(model, layout, Pack))
            print(f"| {layout.name} | {found['own key']:.3f} | {found['3x3']:.4f} | {found['uniform 3x3']:.4f} | "
                  f"{found['output off its mean']:.4f} |")
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

    def run_on(layout: tm.Layout) -> tuple[Run, Photographs]:
        pixels = tm.held_out_pixels(layout)[:1 if args.smoke else len(photos.HELD_OUT)]
        run = Run(steps=steps, photos=tm.to_latent(pixels, layout),
                  noise_seeds=NOISE_SEEDS[:1] if args.smoke else NOISE_SEEDS,
                  sample_seeds=SAMPLE_SEEDS[:1] if args.smoke else SAMPLE_SEEDS,
                  percents=(0.5,) if args.smoke else tm.EVAL_PERCENTS, x0_only=args.x0_only)
        return run, photographs_for(layout, pixels)

    if args.sensitivity:
        print("| model | blocks knocked out | " + " | ".join(f"x0 change {p}" for p in tm.EVAL_PERCENTS)
              + " |\n" + "|---" * (2 + len(tm.EVAL_PERCENTS)) + "|")
        for layout in layouts:
            run, _ = run_on(layout)
            found = sensitivity(Pack, layout, run)
            figures = [f"{found[key]['mean']:.3f} ± {found[key]['std']:.3f}" for key in found if key != "blocks"]
            print(f"| {layout.name} | {found['blocks']} | " + " | ".join(figures) + " |")
        return 0
    if args.known_orders:
        print("| model | steps | patch distance: floor | samples | untrained twin's | samples blurred | detail: "
              "photographs | samples | samples blurred | img2img PSNR to photo | blurred | img2img SSIM to photo | "
              "blurred |\n" + "|---" * 13 + "|")
        for layout in layouts:
            found = known_orders(layout, *run_on(layout))
            print(f"| {layout.name} | {steps} | " + " | ".join(f"{found[key]:.4f}" for key in (
                "floor", "trained", "untrained", "blurred", "photo detail", "trained detail", "blurred detail",
                "img2img PSNR to photo", "blurred PSNR", "img2img SSIM to photo", "blurred SSIM")) + " |")
        return 0
    rows = []
    for layout in layouts:
        rows += bench_layout(Pack, layout, *run_on(layout), [s for s in chosen if s.applies_to(layout)])
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
