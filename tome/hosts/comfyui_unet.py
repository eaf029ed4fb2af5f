"""ToMe and ToDo in ComfyUI's U-Nets (SD1.x, SD2.x, SDXL): the patches, and the rules that register them.

ComfyUI calls ``attn1_patch(n, context, value, extra_options)`` with
``n = norm1(x)`` (and ``context`` and ``value`` equal to it for self-attention)
and ``attn1_output_patch(out, extra_options)`` on the attention output. The
``extra_options`` dict is created afresh for every block call and handed to
both, so the plan made by the first travels to the second inside it. The
block's cross-attention has the same pair of patch points (attn2), so the same
plan reaches it. Its feed-forward has none: for the widest scope each block's
``ff`` changes class, on the patched clone only, to one that merges around it
(``MergedFeedForward``), and the plan reaches it through a context variable
that the block's attn1 patch sets and the feed-forward clears (per thread, so
cond and uncond in two threads never see each other's plan).

Patch objects hold only their frozen settings, as they are shared by every
clone and called from several threads, and every entry point runs ``eager``
outside a compiled graph (see ``comfyui``); ``apply_tome`` and
``apply_todo`` clone the model and register them, with the ``apply_model``
wrapper that gives each model call one ``ModelCall``: the sigma that the step
window, the seed and the step need is read from the device once per model
call, not once per block; and, where the patches want one, the ``outer_sample``
wrapper that starts each run (``wants_run_start``: plans kept across steps, the
warning of ``gpu_rule``). No ComfyUI import.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

import torch

from ..downsample import METHODS, NEAREST, downsample_tokens
from ..levels import is_a, ldm_transformer_downsamples
from ..merge import IDENTITY, MEAN, REDUCTIONS
from .comfyui import (
    MAX_FACTOR,
    MERGE_KV,
    MERGE_Q,
    MERGE_QKV,
    Reach,
    block_plan,
    capped_ratio,
    check_choice,
    check_range,
    check_tome_inputs,
    eager,
    has_patches,
    mixed_class,
    seeded_plan,
    sigma_window,
    wants_model_calls,
    wants_run_state,
    warn_grid_too_small,
    without_patches,
    without_swapped_classes,
)
from .gpu_rule import SELF_ATTENTION, TODO, TOME, WIDER, Setting, gpu_use, unet_family

log = logging.getLogger(__name__)

# Which modules of a patched block work on merged tokens.
SCOPE_SELF = "self-attention"
SCOPE_CROSS = "self- and cross-attention"
SCOPE_ALL = "self-attention, cross-attention and MLP"
SCOPES = (SCOPE_SELF, SCOPE_CROSS, SCOPE_ALL)

DOWNSAMPLE_CHOICES = ("auto", "1", "2", "4", "8")

# In a block call's extra_options: the plan awaiting unmerge after attn1, after attn2, and the block's plan.
PLAN_KEY = "tome_plan"
ATTN2_PLAN_KEY = "tome_attn2_plan"
BLOCK_PLAN_KEY = "tome_block_plan"
# The plan the next feed-forward merges around; each block's attn1 patch sets it, that block's ff clears it.
_FEED_FORWARD_PLAN = contextvars.ContextVar("tome_feed_forward_plan", default=IDENTITY)


@dataclass(frozen=True)
class ToMeSettings:
    """What one Apply ToMe node asked for."""

    ratio: float
    sx: int
    sy: int
    reach: Reach
    seed: int = 0
    use_rand: bool = True
    merge: str = MERGE_QKV
    modules: str = SCOPE_SELF  # the node's ``scope`` input
    reuse_steps: int = 1  # how many consecutive sampling steps one matching serves
    reduce: str = MEAN  # PRUNE: the quality bench's baseline, which drops the tokens ToMe would merge
    share_matching: bool = False  # one matching per model call and token grid, served to every block on it


class ToMeAttn1Patch:
    """Builds the plan from ``norm1(x)`` and merges the self-attention inputs.

    With ``share_matching``, the first block of a model call on a token grid
    matches, and every later block on that grid merges with its plan (the
    call's ``ModelCall`` keeps it; see ``comfyui.block_plan``).

    With ``reuse_steps`` > 1, a block's plan serves the next steps too (the
    matching is the costly part), kept in the sampling run's ``SamplingRun``
    under the batch it was made for: block, shape, device and the conds in the
    batch (``uuids``), so cond and uncond, run together or apart, in one
    thread or two, each get their own. Outside a sampling run (no cache) every
    call makes a fresh plan.
    """

    def __init__(self, settings: ToMeSettings):
        self.settings = settings

    def plan(self, n: torch.Tensor, extra_options):
        """The merge plan for this block call, or ``IDENTITY`` where ToMe must not act."""
        s = self.settings
        grid = s.reach.grid(n.shape[1], extra_options)
        if grid is None:
            return IDENTITY
        block = (extra_options.get("block"), extra_options.get("block_index", 0))
        return block_plan(extra_options, s.share_matching, "unet", block, grid, n, s.reuse_steps,
                          lambda: self.fresh_plan(n, grid, extra_options))

    def fresh_plan(self, n: torch.Tensor, grid: tuple[int, int], extra_options):
        """A new plan from this call's tokens ``n`` over their ``(w, h)`` grid."""
        w, h = grid
        return seeded_plan(self.settings, n, w, h, int(n.shape[1] * self.settings.ratio),
                           extra_options.get("block") or (), extra_options.get("block_index", 0), extra_options)

    @eager
    def __call__(self, n, context, value, extra_options):
        plan = self.plan(n, extra_options)
        if self.settings.modules != SCOPE_SELF:
            extra_options[BLOCK_PLAN_KEY] = plan
        if self.settings.modules == SCOPE_ALL:
            _FEED_FORWARD_PLAN.set(plan)  # IDENTITY too, so a block never sees an earlier block's plan
        if plan is IDENTITY:
            return n, context, value
        n_tokens = n.shape[1]

        def merged(t):
            # Another pack's earlier patch may have swapped in a context of another layout: leave it.
            if t is n:
                return merged_n
            return plan.merge(t, reduce) if t is not None and t.shape[1] == n_tokens else t

        reduce = self.settings.reduce
        merge_q = self.settings.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = self.settings.merge in (MERGE_QKV, MERGE_KV)
        merged_n = plan.merge(n, reduce)
        if merge_q:
            extra_options[PLAN_KEY] = plan
        return (merged_n if merge_q else n,
                merged(context) if merge_kv else context,
                merged(value) if merge_kv else value)


class ToMeUnmergePatch:
    """An attention output patch: gives every merged query token its destination's output back, using the
    plan its input patch left under ``key`` (``PLAN_KEY`` after attn1, ``ATTN2_PLAN_KEY`` after attn2)."""

    def __init__(self, key: str):
        self.key = key

    @eager
    def __call__(self, out, extra_options):
        plan = extra_options.pop(self.key, None)
        return out if plan is None else plan.unmerge(out)


class ToMeAttn2Patch:
    """Merges the queries of cross-attention with the block's plan (the text context stays whole)."""

    @eager
    def __call__(self, n, context, value, extra_options):
        plan = extra_options.get(BLOCK_PLAN_KEY, IDENTITY)
        if plan is IDENTITY or n.shape[1] != plan.n_tokens:
            return n, context, value
        extra_options[ATTN2_PLAN_KEY] = plan
        return plan.merge(n), context, value


class MergedFeedForward:
    """Mixed into the class of a block's feed-forward: runs it on the tokens merged by the block's plan."""

    @eager
    def forward(self, x):
        plan = _FEED_FORWARD_PLAN.get()
        _FEED_FORWARD_PLAN.set(IDENTITY)
        if plan is IDENTITY or x.shape[1] != plan.n_tokens:
            return super().forward(x)
        return plan.unmerge(super().forward(plan.merge(x)))


def merged_class(cls: type) -> type:
    """``cls`` with ``MergedFeedForward`` in front: the class a merged block's feed-forward takes."""
    return mixed_class(cls, MergedFeedForward)


TOME_PATCH_TYPES = (ToMeAttn1Patch, ToMeUnmergePatch, ToMeAttn2Patch)


@dataclass(frozen=True)
class ToDoSettings:
    """What one Apply ToDo node asked for."""

    factor: int
    reach: Reach
    method: str = NEAREST


class ToDoAttn1Patch:
    """Pools the keys and values of self-attention over ``factor x factor`` cells; the queries stay full.

    It acts on the grid-shaped inputs only: keys or values another patch already
    changed (ToMe merged them, say) are passed on untouched.
    """

    def __init__(self, settings: ToDoSettings):
        self.settings = settings

    @eager
    def __call__(self, n, context, value, extra_options):
        s = self.settings
        n_tokens = n.shape[1]
        grid = s.reach.grid(n_tokens, extra_options)
        if grid is None:
            return n, context, value
        w, h = grid
        if s.factor > min(w, h):
            warn_grid_too_small(w, h, s.factor)
            return n, context, value

        def pooled(t):
            return downsample_tokens(t, w, h, s.factor, s.method) if t is not None and t.shape[1] == n_tokens else t

        pooled_context = pooled(context)
        return n, pooled_context, pooled_context if value is context else pooled(value)


# Registration: what the nodes call. Each clones the model; the input model is never touched.

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
        log.warning("%s: %s is neither a U-Net with transformer blocks nor a DiT this pack knows; the model "
                    "passes through unchanged", node, type(model.model).__name__)
    return levels


def pick_downsample(levels: list[int], max_downsample: str, node: str) -> int:
    """The ``max_downsample`` input as a number; ``auto`` is the highest-resolution transformer level."""
    downsample = levels[0] if max_downsample == "auto" else int(max_downsample)
    if downsample < levels[0]:
        log.warning("%s: max_downsample %d reaches no transformer block of this model "
                    "(its highest-resolution blocks are at %d); it does nothing", node, downsample, levels[0])
    return downsample


def feed_forward_class_keys(model) -> list[str]:
    """Object-patch keys of the class of every U-Net transformer block's feed-forward.

    The class, not the module, is patched: the module keeps its weights, so
    LoRA keys still resolve, and a MultiGPU copy of the model, which receives
    the same object patches, changes the class of its own feed-forwards and
    runs its own weights on its own device.
    """
    unet = model.get_model_object("diffusion_model")
    return [f"diffusion_model.{name}.ff.__class__" for name, module in unet.named_modules()
            if is_a(module, "BasicTransformerBlock") and hasattr(module, "ff")]


def without_merged_feed_forwards(model) -> None:
    """Drop an earlier Apply ToMe's feed-forward class swaps from ``model``'s object patches."""
    without_swapped_classes(model, MergedFeedForward)


def wants_run_start(model) -> None:
    """Register the run start that ``model``'s patches want (``comfyui.wants_run_state``), read from them: plans
    kept where its ToMe patch reuses them across steps, the GPU rule's settings (``gpu_rule``) where one of them
    was measured slower on a GPU at some size; none where neither."""
    attn1 = model.model_options["transformer_options"].get("patches", {}).get("attn1_patch", [])
    tome = next((p.settings for p in attn1 if isinstance(p, ToMeAttn1Patch)), None)
    settings = [Setting(TOME, SELF_ATTENTION if tome.modules == SCOPE_SELF else WIDER)] if tome is not None else []
    if any(isinstance(p, ToDoAttn1Patch) for p in attn1):
        settings.append(Setting(TODO, SELF_ATTENTION))
    wants_run_state(model, tome is not None and tome.reuse_steps > 1, gpu_use(unet_family(model), settings))


def apply_tome(model, *, ratio: float, stride_x: int = 2, stride_y: int = 2, max_downsample: str = "auto",
               seed: int = 0, use_rand: bool = True, merge: str = MERGE_QKV, start_percent: float = 0.0,
               end_percent: float = 1.0, scope: str = SCOPE_SELF, reuse_steps: int = 1, reduce: str = MEAN,
               share_matching: bool = False):
    """Clone ``model`` with ToMe patched into the modules of ``scope``; the input model is never touched.
    ``share_matching``: one matching per model call and token grid, shared by the blocks on it.

    ``reduce``: ``MEAN`` (ToMe) or ``PRUNE`` (the same tokens dropped: the quality bench's baseline; no node
    offers it). Every input is checked before anything is cloned: a bad one raises ``ValueError`` naming it."""
    check_tome_inputs(ratio, stride_x, stride_y, reuse_steps, merge, reduce, REDUCTIONS)
    check_choice("max_downsample", max_downsample, DOWNSAMPLE_CHOICES)
    check_choice("scope", scope, SCOPES)
    if reduce != MEAN and scope != SCOPE_SELF:
        raise ValueError(f"reduce {reduce!r} is for scope {SCOPE_SELF!r} only, not {scope!r}")
    levels = unet_levels(model, "Apply ToMe")
    if not levels or (ratio <= 0.0 and not has_patches(model, TOME_PATCH_TYPES)):
        return model
    ratio = capped_ratio(ratio, stride_x, stride_y)
    downsample = pick_downsample(levels, max_downsample, "Apply ToMe")
    settings = ToMeSettings(ratio=ratio, sx=stride_x, sy=stride_y,
                            reach=Reach(downsample, *sigma_window(model, start_percent, end_percent)),
                            seed=seed, use_rand=use_rand, merge=merge, modules=scope, reuse_steps=reuse_steps,
                            reduce=reduce, share_matching=share_matching)

    patched = model.clone()
    without_patches(patched.model_options["transformer_options"].setdefault("patches", {}), TOME_PATCH_TYPES)
    without_merged_feed_forwards(patched)
    if ratio <= 0.0:
        wants_run_start(patched)
        return patched
    patched.set_model_attn1_patch(ToMeAttn1Patch(settings))
    patched.set_model_attn1_output_patch(ToMeUnmergePatch(PLAN_KEY))
    if scope != SCOPE_SELF:
        patched.set_model_attn2_patch(ToMeAttn2Patch())
        patched.set_model_attn2_output_patch(ToMeUnmergePatch(ATTN2_PLAN_KEY))
    if scope == SCOPE_ALL:
        for key in feed_forward_class_keys(patched):
            patched.add_object_patch(key, merged_class(patched.get_model_object(key)))
    wants_model_calls(patched)
    wants_run_start(patched)
    return patched


def apply_todo(model, *, downsample_factor: int, max_downsample: str = "auto", method: str = NEAREST,
               start_percent: float = 0.0, end_percent: float = 1.0):
    """Clone ``model`` with ToDo's key/value pooling patched into its self-attention.

    The ToDo patch goes ahead of any ToMe patch, whichever node came first in
    the chain: it pools the grid-shaped keys and values, then ToMe merges the
    queries (and leaves the keys and values, which no longer share their layout). Every input is checked
    before anything is cloned: a bad one raises ``ValueError`` naming it.
    """
    check_range("downsample_factor", downsample_factor, 1, MAX_FACTOR)
    check_choice("max_downsample", max_downsample, DOWNSAMPLE_CHOICES)
    check_choice("method", method, METHODS)
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
        wants_model_calls(patched)
    wants_run_start(patched)
    return patched
