"""The patches that run ToMe and ToDo inside ComfyUI's transformer blocks.

ComfyUI calls ``attn1_patch(n, context, value, extra_options)`` with
``n = norm1(x)`` (and ``context`` and ``value`` equal to it for self-attention)
and ``attn1_output_patch(out, extra_options)`` on the attention output. The
``extra_options`` dict is created afresh for every block call and handed to
both, so the plan made by the first travels to the second inside it: no
per-call state is kept on the patch objects, which the model patcher
deep-copies on clone (only ``reuse_steps``'s plan cache, kept for one sampling
run and never copied).
The block's cross-attention has the same pair of patch points (attn2), so the
same plan reaches it. Its feed-forward has none: for the widest scope each
block's ``ff`` is swapped, on the patched clone only, for a copy whose class
merges around it (``merged_feed_forward``), and the plan reaches it through a
context variable that the block's attn1 patch sets and the feed-forward clears.

No ComfyUI import: only the calling convention above.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import logging
import math
from dataclasses import dataclass

import torch

from .tome.downsample import NEAREST, downsample_tokens
from .tome.grid import block_downsample, derive_seed, token_grid
from .tome.merge import IDENTITY, build_plan

log = logging.getLogger(__name__)

# Which of the self-attention inputs are merged.
MERGE_QKV = "q, k and v"
MERGE_Q = "q only"
MERGE_KV = "k and v only"
MERGE_MODES = (MERGE_QKV, MERGE_Q, MERGE_KV)

# Which modules of a patched block work on merged tokens.
SCOPE_SELF = "self-attention"
SCOPE_CROSS = "self- and cross-attention"
SCOPE_ALL = "self-attention, cross-attention and MLP"
SCOPES = (SCOPE_SELF, SCOPE_CROSS, SCOPE_ALL)

# In a block call's extra_options: the plan awaiting unmerge after attn1, after attn2, and the block's plan.
PLAN_KEY = "tome_plan"
ATTN2_PLAN_KEY = "tome_attn2_plan"
BLOCK_PLAN_KEY = "tome_block_plan"
SIGMA_KEY = "tome_sigma"  # the block call's sigma as a float
# The plan the next feed-forward merges around; each block's attn1 patch sets it, that block's ff clears it.
_FEED_FORWARD_PLAN = contextvars.ContextVar("tome_feed_forward_plan", default=IDENTITY)


def _current_sigma(extra_options) -> float | None:
    """The sampler's sigma for this block call, read from the tensor once per call and kept in
    ``extra_options``: on a GPU each read waits for the queued work, and the window, the step counter and the
    seed all need it."""
    if SIGMA_KEY not in extra_options:
        sigmas = extra_options.get("sigmas")
        extra_options[SIGMA_KEY] = None if sigmas is None else float(sigmas.flatten()[0])
    return extra_options[SIGMA_KEY]


@dataclass(frozen=True)
class Reach:
    """Where and when a patch acts: blocks at ``max_downsample`` or finer, while the sampler's sigma lies in
    ``[sigma_end, sigma_start]``."""

    max_downsample: int
    sigma_start: float = math.inf
    sigma_end: float = 0.0

    def grid(self, n_tokens: int, extra_options) -> tuple[int, int] | None:
        """``(w, h)`` of this block call's token grid when the patch acts on it, else ``None``."""
        original_shape = extra_options.get("original_shape")
        if original_shape is None:
            return None
        original_h, original_w = original_shape[-2:]
        if block_downsample(n_tokens, original_h, original_w) > self.max_downsample:
            return None
        sigma = _current_sigma(extra_options)
        if sigma is not None and not (self.sigma_end <= sigma <= self.sigma_start):
            return None
        return token_grid(n_tokens, original_shape, extra_options.get("activations_shape"))


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


class StepCounter:
    """Numbers the sampling steps of a run from the sigmas the patch sees (one step per distinct sigma,
    cond and uncond batches included); a sigma above the previous one starts a new run."""

    def __init__(self):
        self.step = -1
        self.sigma = None

    def advance(self, sigma: float | None) -> bool:
        """Track ``sigma``; True when it starts a new run."""
        if sigma == self.sigma:
            return False
        new_run = self.sigma is None or sigma is None or sigma > self.sigma
        self.step = 0 if new_run else self.step + 1
        self.sigma = sigma
        return new_run


class ToMeAttn1Patch:
    """Builds the plan from ``norm1(x)`` and merges the self-attention inputs.

    With ``reuse_steps`` > 1, a block's plan is kept and served again for the
    next steps (the matching is the costly part); the cache lives for one
    sampling run and is not copied with the model.
    """

    def __init__(self, settings: ToMeSettings):
        self.settings = settings
        self.steps = StepCounter()
        self.cache: dict = {}

    def __deepcopy__(self, memo):
        return type(self)(self.settings)  # the model patcher deep-copies patches on clone: a fresh cache

    def plan(self, n: torch.Tensor, extra_options):
        """The merge plan for this block call, or ``IDENTITY`` where ToMe must not act."""
        s = self.settings
        grid = s.reach.grid(n.shape[1], extra_options)
        if grid is None:
            return IDENTITY
        if s.reuse_steps <= 1:
            return self.fresh_plan(n, grid, extra_options)
        if self.steps.advance(_current_sigma(extra_options)):
            self.cache.clear()
        key = (extra_options.get("block"), extra_options.get("block_index", 0), tuple(n.shape),
               tuple(extra_options.get("cond_or_uncond") or ()))
        step, plan = self.cache.get(key, (None, None))
        if step is None or self.steps.step - step >= s.reuse_steps:
            plan = self.fresh_plan(n, grid, extra_options)
            self.cache[key] = (self.steps.step, plan)
        return plan

    def fresh_plan(self, n: torch.Tensor, grid: tuple[int, int], extra_options):
        """A new plan from this call's tokens ``n`` over their ``(w, h)`` grid."""
        s = self.settings
        w, h = grid
        generator = None
        if s.use_rand:
            block = extra_options.get("block") or ()
            sigma = _current_sigma(extra_options) or 0.0
            seed = derive_seed(s.seed, sigma, block, extra_options.get("block_index", 0))
            generator = torch.Generator().manual_seed(seed)
        return build_plan(n, w, h, s.sx, s.sy, int(n.shape[1] * s.ratio), no_rand=not s.use_rand,
                          generator=generator)

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
            return plan.merge(t) if t is not None and t.shape[1] == n_tokens else t

        merge_q = self.settings.merge in (MERGE_QKV, MERGE_Q)
        merge_kv = self.settings.merge in (MERGE_QKV, MERGE_KV)
        merged_n = plan.merge(n)
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

    def __call__(self, out, extra_options):
        plan = extra_options.pop(self.key, None)
        return out if plan is None else plan.unmerge(out)


class ToMeAttn2Patch:
    """Merges the queries of cross-attention with the block's plan (the text context stays whole)."""

    def __call__(self, n, context, value, extra_options):
        plan = extra_options.get(BLOCK_PLAN_KEY, IDENTITY)
        if plan is IDENTITY or n.shape[1] != plan.n_tokens:
            return n, context, value
        extra_options[ATTN2_PLAN_KEY] = plan
        return plan.merge(n), context, value


class MergedFeedForward:
    """Mixed into a copy of a block's feed-forward: runs it on the tokens merged by the block's plan."""

    def forward(self, x):
        plan = _FEED_FORWARD_PLAN.get()
        _FEED_FORWARD_PLAN.set(IDENTITY)
        if plan is IDENTITY or x.shape[1] != plan.n_tokens:
            return super().forward(x)
        return plan.unmerge(super().forward(plan.merge(x)))


@functools.cache
def _merged_class(cls: type) -> type:
    return type(f"ToMe{cls.__name__}", (MergedFeedForward, cls), {})


def merged_feed_forward(ff: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``ff`` that merges around itself. Shallow: it shares ``ff``'s submodules and weights, so
    weight patches (LoRA) keep their keys and reach the same tensors, and ``ff`` itself is left as it is."""
    merged = copy.copy(ff)
    merged.__class__ = _merged_class(type(ff))
    return merged


TOME_PATCH_TYPES = (ToMeAttn1Patch, ToMeUnmergePatch, ToMeAttn2Patch)


@dataclass(frozen=True)
class ToDoSettings:
    """What one Apply ToDo node asked for."""

    factor: int
    reach: Reach
    method: str = NEAREST


@functools.lru_cache(maxsize=64)
def _warn_grid_too_small(w: int, h: int, factor: int) -> None:
    """Once per grid and factor, not once per block call."""
    log.warning("Apply ToDo: downsample_factor %d is larger than a %dx%d token grid; that block is left as is",
                factor, w, h)


class ToDoAttn1Patch:
    """Pools the keys and values of self-attention over ``factor x factor`` cells; the queries stay full.

    It acts on the grid-shaped inputs only: keys or values another patch already
    changed (ToMe merged them, say) are passed on untouched.
    """

    def __init__(self, settings: ToDoSettings):
        self.settings = settings

    def __call__(self, n, context, value, extra_options):
        s = self.settings
        n_tokens = n.shape[1]
        grid = s.reach.grid(n_tokens, extra_options)
        if grid is None:
            return n, context, value
        w, h = grid
        if s.factor > min(w, h):
            _warn_grid_too_small(w, h, s.factor)
            return n, context, value

        def pooled(t):
            return downsample_tokens(t, w, h, s.factor, s.method) if t is not None and t.shape[1] == n_tokens else t

        pooled_context = pooled(context)
        return n, pooled_context, pooled_context if value is context else pooled(value)
