"""The Apply ToMe nodes: read the inputs, check them, clone the model, register the patches."""

from __future__ import annotations

import logging
import math

from .attn_patch import MERGE_MODES, MERGE_QKV, TOME_PATCH_TYPES, ToMeAttn1OutputPatch, ToMeAttn1Patch, ToMeSettings
from .tome.grid import ratio_cap

log = logging.getLogger(__name__)

CATEGORY = "model_patches/unet"
DOWNSAMPLE_CHOICES = ["auto", "1", "2", "4", "8"]
PATCH_LISTS = ("attn1_patch", "attn1_output_patch")


def transformer_downsamples(model) -> list[int]:
    """Downsample factors of the U-Net levels that hold transformer blocks, highest resolution first.

    Empty for a model that is not a U-Net with ``SpatialTransformer`` blocks (a
    DiT such as SD3 or Flux).
    """
    unet = model.get_model_object("diffusion_model")
    levels = set()
    downsample = 1
    for block in getattr(unet, "input_blocks", ()):
        for layer in block:
            kind = type(layer).__name__
            if kind == "Downsample":
                downsample *= 2
            elif kind == "SpatialTransformer":
                levels.add(downsample)
    return sorted(levels)


def without_tome(patches: dict) -> None:
    """Drop the ToMe patches of an earlier Apply ToMe node, so a second one replaces it."""
    for name in PATCH_LISTS:
        if name in patches:
            patches[name] = [p for p in patches[name] if not isinstance(p, TOME_PATCH_TYPES)]


def has_tome(model) -> bool:
    patches = model.model_options["transformer_options"].get("patches", {})
    return any(isinstance(p, TOME_PATCH_TYPES) for name in PATCH_LISTS for p in patches.get(name, ()))


def sigma_window(model, start_percent: float, end_percent: float) -> tuple[float, float]:
    """The sigmas bounding the sampling window ``[start_percent, end_percent]``, from the model's own schedule."""
    if start_percent > end_percent:
        raise ValueError(f"start_percent ({start_percent}) must not be greater than end_percent ({end_percent})")
    if start_percent <= 0.0 and end_percent >= 1.0:
        return math.inf, 0.0
    sampling = model.get_model_object("model_sampling")
    return sampling.percent_to_sigma(start_percent), sampling.percent_to_sigma(end_percent)


def apply_tome(model, ratio: float, stride_x: int, stride_y: int, max_downsample: str, **advanced):
    """Clone ``model`` with ToMe patched into its self-attention; the input model is never touched."""
    levels = transformer_downsamples(model)
    if not levels:
        log.warning("Apply ToMe: %s has no U-Net transformer blocks (a DiT?); the model passes through unchanged",
                    type(model.model).__name__)
        return model
    if ratio <= 0.0 and not has_tome(model):
        return model
    cap = ratio_cap(stride_x, stride_y)
    if ratio > cap:
        log.warning("Apply ToMe: ratio %.3f is above the %dx%d stride's cap of %.3f; using %.3f",
                    ratio, stride_x, stride_y, cap, cap)
        ratio = cap
    downsample = levels[0] if max_downsample == "auto" else int(max_downsample)
    if downsample < levels[0]:
        log.warning("Apply ToMe: max_downsample %d reaches no transformer block of this model "
                    "(its highest-resolution blocks are at %d); nothing is merged", downsample, levels[0])

    start, end = advanced.pop("start_percent", 0.0), advanced.pop("end_percent", 1.0)
    sigma_start, sigma_end = sigma_window(model, start, end)
    settings = ToMeSettings(ratio=ratio, sx=stride_x, sy=stride_y, max_downsample=downsample,
                            sigma_start=sigma_start, sigma_end=sigma_end, **advanced)

    patched = model.clone()
    without_tome(patched.model_options["transformer_options"].setdefault("patches", {}))
    if ratio > 0.0:
        patched.set_model_attn1_patch(ToMeAttn1Patch(settings))
        patched.set_model_attn1_output_patch(ToMeAttn1OutputPatch())
    return patched


def _common_inputs():
    return {
        "model": ("MODEL", {"tooltip": "The diffusion model to speed up. It is cloned; the input stays unpatched."}),
        "ratio": ("FLOAT", {
            "default": 0.5, "min": 0.0, "max": 0.99, "step": 0.01,
            "tooltip": "Share of tokens merged away before self-attention in the patched blocks. "
                       "0.3 to 0.6 is the useful range (the paper: 0.6 is about 2x faster at 512 px). "
                       "Capped at 1 - 1/(stride_x*stride_y), 0.75 for 2x2. 0 turns ToMe off.",
        }),
        "stride_x": ("INT", {
            "default": 2, "min": 1, "max": 8,
            "tooltip": "Width of the cells that each get one destination token (1 to 8). 2 is the paper's choice.",
        }),
        "stride_y": ("INT", {
            "default": 2, "min": 1, "max": 8,
            "tooltip": "Height of the cells that each get one destination token (1 to 8). 2 is the paper's choice.",
        }),
        "max_downsample": (DOWNSAMPLE_CHOICES, {
            "default": "auto",
            "tooltip": "Patch the transformer blocks at this downsample factor or finer. auto: the model's "
                       "highest-resolution level with transformer blocks (1 on SD1.x/SD2.x, 2 on SDXL). "
                       "Larger values merge more blocks: faster, lower fidelity.",
        }),
    }


class ApplyToMe:
    DESCRIPTION = ("Token Merging for Stable Diffusion (Bolya & Hoffman 2023): merges similar tokens before "
                   "self-attention and unmerges after, so attention runs on fewer queries, keys and values. "
                   "Works on SD1.x, SD2.x and SDXL; reproducible for a fixed seed.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": _common_inputs()}

    def patch(self, model, ratio, stride_x, stride_y, max_downsample):
        return (apply_tome(model, ratio, stride_x, stride_y, max_downsample),)


class ApplyToMeAdvanced:
    DESCRIPTION = ApplyToMe.DESCRIPTION + " The advanced node adds the seed, the merge mode and a sampling window."
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            **_common_inputs(),
            "seed": ("INT", {
                "default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": False,
                "tooltip": "Seeds the random choice of destination tokens (mixed with the step and block). "
                           "Its own generator: the sampler's noise is never affected.",
            }),
            "use_rand": ("BOOLEAN", {
                "default": True,
                "tooltip": "Draw a random destination in each cell (the paper's default). Off: always the "
                           "top-left token, which can leave grid artifacts at high ratios.",
            }),
            "merge": (list(MERGE_MODES), {
                "default": MERGE_QKV,
                "tooltip": "Which self-attention inputs are merged. 'q, k and v': the paper, fastest. "
                           "'q only': like ComfyUI's core ToMe node, more fidelity, less speed. "
                           "'k and v only': queries stay full, nothing to unmerge.",
            }),
            "start_percent": ("FLOAT", {
                "default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                "tooltip": "Start merging at this share of the sampling schedule (0 = first step).",
            }),
            "end_percent": ("FLOAT", {
                "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                "tooltip": "Stop merging after this share of the sampling schedule (1 = last step). "
                           "Must not be below start_percent.",
            }),
        }}

    def patch(self, model, ratio, stride_x, stride_y, max_downsample, seed, use_rand, merge,
              start_percent, end_percent):
        return (apply_tome(model, ratio, stride_x, stride_y, max_downsample, seed=seed, use_rand=use_rand,
                           merge=merge, start_percent=start_percent, end_percent=end_percent),)


NODE_CLASS_MAPPINGS = {
    "ApplyToMe": ApplyToMe,
    "ApplyToMeAdvanced": ApplyToMeAdvanced,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "ApplyToMe": "Apply ToMe",
    "ApplyToMeAdvanced": "Apply ToMe (Advanced)",
}
