"""The Apply ToMe and Apply ToDo nodes: read the inputs, check them, clone the model, register the patches."""

from __future__ import annotations

import logging
import math

from .attn_patch import (
    ATTN2_PLAN_KEY,
    MERGE_MODES,
    MERGE_QKV,
    PLAN_KEY,
    SCOPE_ALL,
    SCOPE_SELF,
    SCOPES,
    TOME_PATCH_TYPES,
    MergedFeedForward,
    Reach,
    ToDoAttn1Patch,
    ToDoSettings,
    ToMeAttn1Patch,
    ToMeAttn2Patch,
    ToMeSettings,
    ToMeUnmergePatch,
    merged_feed_forward,
)
from .tome.downsample import METHODS, NEAREST
from .tome.grid import ratio_cap
from .tome.levels import ldm_transformer_downsamples

log = logging.getLogger(__name__)

CATEGORY = "model_patches/unet"
DOWNSAMPLE_CHOICES = ["auto", "1", "2", "4", "8"]
PATCH_LISTS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch")


def transformer_downsamples(model) -> list[int]:
    """Downsample factors of the U-Net levels that hold transformer blocks, highest resolution first.

    Empty for a model that is not a U-Net with ``SpatialTransformer`` blocks (a
    DiT such as SD3 or Flux).
    """
    return ldm_transformer_downsamples(model.get_model_object("diffusion_model"))


def unet_levels(model, node: str) -> list[int]:
    """``transformer_downsamples(model)``, with a warning naming the model where there are none."""
    levels = transformer_downsamples(model)
    if not levels:
        log.warning("%s: %s has no U-Net transformer blocks (a DiT?); the model passes through unchanged",
                    node, type(model.model).__name__)
    return levels


def pick_downsample(levels: list[int], max_downsample: str, node: str) -> int:
    """The ``max_downsample`` input as a number; ``auto`` is the highest-resolution transformer level."""
    downsample = levels[0] if max_downsample == "auto" else int(max_downsample)
    if downsample < levels[0]:
        log.warning("%s: max_downsample %d reaches no transformer block of this model "
                    "(its highest-resolution blocks are at %d); it does nothing", node, downsample, levels[0])
    return downsample


def without_patches(patches: dict, types: tuple) -> None:
    """Drop an earlier node's patches of ``types``, so a second node of the same kind replaces the first."""
    for name in PATCH_LISTS:
        if name in patches:
            patches[name] = [p for p in patches[name] if not isinstance(p, types)]


def has_patches(model, types: tuple) -> bool:
    patches = model.model_options["transformer_options"].get("patches", {})
    return any(isinstance(p, types) for name in PATCH_LISTS for p in patches.get(name, ()))


def sigma_window(model, start_percent: float, end_percent: float) -> tuple[float, float]:
    """The sigmas bounding the sampling window ``[start_percent, end_percent]``, from the model's own schedule."""
    if start_percent > end_percent:
        raise ValueError(f"start_percent ({start_percent}) must not be greater than end_percent ({end_percent})")
    if start_percent <= 0.0 and end_percent >= 1.0:
        return math.inf, 0.0
    sampling = model.get_model_object("model_sampling")
    return sampling.percent_to_sigma(start_percent), sampling.percent_to_sigma(end_percent)


def feed_forward_keys(model) -> list[str]:
    """Object-patch keys of the feed-forward of every U-Net transformer block."""
    unet = model.get_model_object("diffusion_model")
    return [f"diffusion_model.{name}.ff" for name, module in unet.named_modules()
            if type(module).__name__ == "BasicTransformerBlock" and hasattr(module, "ff")]


def without_merged_feed_forwards(model) -> None:
    """Drop an earlier Apply ToMe's feed-forward swaps from ``model``'s object patches."""
    for key in [k for k, v in model.object_patches.items() if isinstance(v, MergedFeedForward)]:
        del model.object_patches[key]


def apply_tome(model, ratio: float, stride_x: int, stride_y: int, max_downsample: str, scope: str = SCOPE_SELF,
               **advanced):
    """Clone ``model`` with ToMe patched into the modules of ``scope``; the input model is never touched."""
    levels = unet_levels(model, "Apply ToMe")
    if not levels or (ratio <= 0.0 and not has_patches(model, TOME_PATCH_TYPES)):
        return model
    cap = ratio_cap(stride_x, stride_y)
    if ratio > cap:
        log.warning("Apply ToMe: ratio %.3f is above the %dx%d stride's cap of %.3f; using %.3f",
                    ratio, stride_x, stride_y, cap, cap)
        ratio = cap
    downsample = pick_downsample(levels, max_downsample, "Apply ToMe")

    start, end = advanced.pop("start_percent", 0.0), advanced.pop("end_percent", 1.0)
    sigma_start, sigma_end = sigma_window(model, start, end)
    settings = ToMeSettings(ratio=ratio, sx=stride_x, sy=stride_y, reach=Reach(downsample, sigma_start, sigma_end),
                            modules=scope, **advanced)

    patched = model.clone()
    without_patches(patched.model_options["transformer_options"].setdefault("patches", {}), TOME_PATCH_TYPES)
    without_merged_feed_forwards(patched)
    if ratio <= 0.0:
        return patched
    patched.set_model_attn1_patch(ToMeAttn1Patch(settings))
    patched.set_model_attn1_output_patch(ToMeUnmergePatch(PLAN_KEY))
    if scope != SCOPE_SELF:
        patched.set_model_attn2_patch(ToMeAttn2Patch())
        patched.set_model_attn2_output_patch(ToMeUnmergePatch(ATTN2_PLAN_KEY))
    if scope == SCOPE_ALL:
        for key in feed_forward_keys(patched):
            patched.add_object_patch(key, merged_feed_forward(patched.get_model_object(key)))
    return patched


def apply_todo(model, downsample_factor: int, max_downsample: str, method: str = NEAREST,
               start_percent: float = 0.0, end_percent: float = 1.0):
    """Clone ``model`` with ToDo's key/value pooling patched into its self-attention.

    The ToDo patch goes ahead of any ToMe patch, whichever node came first in
    the chain: it pools the grid-shaped keys and values, then ToMe merges the
    queries (and leaves the keys and values, which no longer share their layout).
    """
    levels = unet_levels(model, "Apply ToDo")
    if not levels or (downsample_factor <= 1 and not has_patches(model, (ToDoAttn1Patch,))):
        return model
    downsample = pick_downsample(levels, max_downsample, "Apply ToDo")
    settings = ToDoSettings(downsample_factor, Reach(downsample, *sigma_window(model, start_percent, end_percent)),
                            method)

    patched = model.clone()
    patches = patched.model_options["transformer_options"].setdefault("patches", {})
    without_patches(patches, (ToDoAttn1Patch,))
    if downsample_factor > 1:
        attn1 = patches.setdefault("attn1_patch", [])
        first_tome = next((i for i, p in enumerate(attn1) if isinstance(p, TOME_PATCH_TYPES)), len(attn1))
        attn1.insert(first_tome, ToDoAttn1Patch(settings))
    return patched


def _window_inputs(tool: str):
    return {
        "start_percent": ("FLOAT", {
            "default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
            "tooltip": f"Start {tool} at this share of the sampling schedule (0 = first step).",
        }),
        "end_percent": ("FLOAT", {
            "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
            "tooltip": f"Stop {tool} after this share of the sampling schedule (1 = last step). "
                       "Must not be below start_percent.",
        }),
    }


def _max_downsample_input(effect: str):
    return (DOWNSAMPLE_CHOICES, {
        "default": "auto",
        "tooltip": "Patch the transformer blocks at this downsample factor or finer. auto: the model's "
                   "highest-resolution level with transformer blocks (1 on SD1.x/SD2.x, 2 on SDXL). " + effect,
    })


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
        "max_downsample": _max_downsample_input("Larger values merge more blocks: faster, lower fidelity."),
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
    DESCRIPTION = ApplyToMe.DESCRIPTION + (" The advanced node adds the seed, the merge mode, a sampling window, "
                                           "the modules merged (scope) and reuse of a matching across steps.")
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
            **_window_inputs("merging"),
        }, "optional": {
            # Optional, so API graphs saved before they existed still validate; absent means today's behaviour.
            "scope": (list(SCOPES), {
                "default": SCOPE_SELF,
                "tooltip": "Which modules of a patched block run on the merged tokens. self-attention: the "
                           "paper's default. Adding cross-attention (its queries) and the MLP is faster, "
                           "most of all on SDXL with max_downsample 4, at a larger cost in fidelity.",
            }),
            "reuse_steps": ("INT", {
                "default": 1, "min": 1, "max": 20,
                "tooltip": "How many consecutive sampling steps one matching serves. 1: a fresh matching every "
                           "step (the paper). Larger values skip the similarity search on the steps between, "
                           "a small saving, at some cost in fidelity as tokens drift from their match.",
            }),
        }}

    def patch(self, model, ratio, stride_x, stride_y, max_downsample, seed, use_rand, merge,
              start_percent, end_percent, scope=SCOPE_SELF, reuse_steps=1):
        return (apply_tome(model, ratio, stride_x, stride_y, max_downsample, seed=seed, use_rand=use_rand,
                           merge=merge, start_percent=start_percent, end_percent=end_percent, scope=scope,
                           reuse_steps=reuse_steps),)


class ApplyToDo:
    DESCRIPTION = ("Token Downsampling (Smith, Saxena & Saha 2024): self-attention keeps every query and attends "
                   "to keys and values pooled over factor x factor cells of the token grid. No similarity search "
                   "and nothing to unmerge, so its overhead is close to nothing. SD1.x, SD2.x and SDXL.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": _common_inputs()["model"],
            "downsample_factor": ("INT", {
                "default": 2, "min": 1, "max": 8,
                "tooltip": "Keys and values are pooled over cells of this many tokens a side: 2 leaves a quarter "
                           "of them, 3 a ninth. 1 turns ToDo off. A block whose token grid is smaller than the "
                           "factor is left as is.",
            }),
            "max_downsample": _max_downsample_input("Larger values pool in more blocks: faster, lower fidelity."),
            "method": (list(METHODS), {
                "default": NEAREST,
                "tooltip": "How a cell becomes one key/value token. nearest: its top-left token (the paper's "
                           "default); average: the mean of the cell; max: the maximum of each channel.",
            }),
            **_window_inputs("downsampling"),
        }}

    def patch(self, model, downsample_factor, max_downsample, method, start_percent, end_percent):
        return (apply_todo(model, downsample_factor, max_downsample, method, start_percent, end_percent),)


NODE_CLASS_MAPPINGS = {
    "ApplyToMe": ApplyToMe,
    "ApplyToMeAdvanced": ApplyToMeAdvanced,
    "ApplyToDo": ApplyToDo,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "ApplyToMe": "Apply ToMe",
    "ApplyToMeAdvanced": "Apply ToMe (Advanced)",
    "ApplyToDo": "Apply ToDo (Token Downsampling)",
}
