"""ComfyUI's calling conventions, shared by the U-Net and the DiT adapters, and what both adapters do alike.

Nothing here imports ComfyUI: a ``ModelPatcher`` is used through the methods
every ComfyUI since 0.3.40 has (``clone``, ``model_options``,
``get_model_object``, ``get_wrappers``, ``add_wrapper_with_key``), and ComfyUI's names for patch
lists and wrappers are written out as the strings they are.

Patch objects are shared. ``ModelPatcher.clone()`` copies the dicts and lists
of ``model_options`` but, on newer ComfyUI, not the objects in them, so a
model, its clones and the MultiGPU copies made from them all call the same
patch objects, cond and uncond possibly at the same time from worker threads.
The pack's patch objects therefore hold only their frozen settings. The state
of a call lives in that call's own ``transformer_options``, at two scopes. A
sampling run's (``reuse_steps``'s plans, the warnings given once per run) is a
``SamplingRun`` put there by a keyed ``OUTER_SAMPLE`` wrapper, which ComfyUI
calls once per run on a copy of the model options made for that run. A model
call's (its sigma, read from the device once; the DiT's count of attention
calls; the plans its blocks share) is a ``ModelCall`` put into a copy of the call's options by a keyed
``APPLY_MODEL`` wrapper; ComfyUI hands every block of the call those options
(a U-Net block copies them into its ``extra_options``), so all of them share
it. Both end with their run or call, on every host, so no ``cleanup()`` has
anything to clear, and no other clone or thread can see them.

Patches run outside compiled graphs (``eager``). ComfyUI's ``TorchCompileModel``
compiles the diffusion model, and newer ComfyUI drops every dynamo guard whose
name holds ``transformer_options``. Our patch objects are reached only through
``transformer_options``, so anything dynamo traced in them (the ratio, the step
window, ``reuse_steps``, which plan a call gets) would be frozen into the graph
at the first call and silently reused by every later call and by every other
clone of the compiled model.

What both adapters do alike has its one home here: the inputs the nodes offer
and both check (``MERGE_MODES``, the ``MAX_*`` limits), the sampling window
(``Window``; a U-Net's ``Reach`` adds the depth), the seeded matching
(``seeded_plan``), a plan kept across steps (``kept_plan``) or shared by a model call's blocks
(``block_plan``), warnings given
once per run (``first_in_run``; a setting measured slower on a GPU at the run's size: ``warn_gpu_loss``,
the rule in ``gpu_rule``), swapped classes and their undo
(``mixed_class``, ``without_swapped_classes``) and replacements put into a
copy of ``patches_replace`` (``with_dit_replacements``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..grid import block_grid, derive_seed, ratio_cap
from ..merge import build_plan

log = logging.getLogger(__name__)

PATCH_LISTS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch")
OUTER_SAMPLE = "outer_sample"  # comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL
WRAPPER_KEY = "tome"  # our key for wrappers, so a second node replaces the first instead of stacking
COMPILE_KEY = "torch.compile"  # TorchCompileModel's apply_model wrapper (comfy_api.torch_helpers.torch_compile)
RUN_KEY = "tome_run"  # in a sampling run's transformer_options: that run's SamplingRun
CALL_KEY = "tome_call"  # in a model call's transformer_options (and its blocks' extra_options): its ModelCall

# The inputs the nodes offer and both adapters check. Which of the self-attention inputs ToMe merges:
MERGE_QKV = "q, k and v"
MERGE_Q = "q only"
MERGE_KV = "k and v only"
MERGE_MODES = (MERGE_QKV, MERGE_Q, MERGE_KV)
MAX_RATIO = 0.99  # ratio: 0 to this
MAX_STRIDE = 8  # stride_x, stride_y: 1 to this
MAX_FACTOR = 8  # downsample_factor (and a DiT's time_factor): 1 to this
MAX_REUSE_STEPS = 20  # reuse_steps: 1 to this


def eager(func: Callable) -> Callable:
    """``func`` never traced by ``torch.compile``: a compiled diffusion model calls it as plain Python, so the
    decisions in it are made afresh at every call (see the module docstring). The tensors it returns flow back
    into the compiled graph."""
    return torch.compiler.disable(func, recursive=True)


class ModelCall:
    """What one model call decides once for all its blocks and attention calls.

    ``sigma()``: the sampler's sigma, read from the ``sigmas`` tensor by the
    first block that needs it and kept: on a GPU a read waits until all queued
    work has run, so a read per block (16 in an SD1.5 call) would stall the
    queue 16 times. Where the call's sampling ``run`` keeps plans across steps
    and has not read its ``schedule`` yet, the same read brings the schedule
    (its first call would otherwise wait twice). ``next_attention()``: the index
    of the call's next image attention call (the DiT's seeds). ``plan()``: the
    plans the call's blocks share (``block_plan``). A model call runs
    in one thread (cond and uncond in two threads are two calls), so nothing here
    needs a lock.
    """

    def __init__(self, sigmas: torch.Tensor | None, run: SamplingRun | None = None,
                 schedule: torch.Tensor | None = None):
        self.reached: set[str] = set()  # the scopes whose hooks this call reached (``SamplingRun.note_call``)
        self._sigmas = sigmas
        self._sigma: float | None = None
        self._run = run
        self._schedule = schedule
        self._attention_calls = 0
        self._plans: dict[Hashable, object] = {}

    def sigma(self) -> float | None:
        if self._sigma is None and self._sigmas is not None:
            self._read_sigma(None)
        return self._sigma

    def read(self, values: torch.Tensor) -> list[float]:
        """``values.tolist()`` (1-D) for a host read the model call must make anyway (Wan VACE's layout), with
        the sigma read in the same one where it is not read yet: one wait for a GPU's queue instead of two."""
        if self._sigma is not None or self._sigmas is None:
            return values.tolist()
        return self._read_sigma(values)

    def _wants_schedule(self) -> bool:
        return self._run is not None and self._schedule is not None and self._run.needs_schedule()

    def _read_sigma(self, values: torch.Tensor | None) -> list[float]:
        """One host read of the sigma, the run's schedule where it wants it, and ``values`` (1-D) where given:
        the sigma and the schedule are kept, ``values``' list returned."""
        wants_schedule = self._wants_schedule()  # asked once: another thread's call may read the schedule meanwhile
        if values is None and not wants_schedule:
            self._sigma = float(self._sigmas.flatten()[0])
            return []
        sigma = self._sigmas.flatten()[:1].to(torch.float64)
        schedule = self._schedule.flatten() if wants_schedule else sigma[:0]
        tail = sigma[:0] if values is None else values
        # All on the sigma's device (non_blocking: a copy between devices must not wait before the one read).
        read = torch.cat([sigma, *(t.to(sigma.device, torch.float64, non_blocking=True) for t in (schedule, tail))])
        read = read.tolist()
        self._sigma = read[0]
        if schedule.numel():
            self._run.know_schedule(read[1:1 + schedule.numel()])
        return read[1 + schedule.numel():]

    def next_attention(self) -> int:
        index = self._attention_calls
        self._attention_calls += 1
        return index

    def plan(self, key: Hashable, make: Callable[[], object]):
        """The plan this call made under ``key``, else ``make()``'s, kept for the rest of the call."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan


def model_call(options) -> ModelCall:
    """The ``ModelCall`` in ``options`` (a model call's ``transformer_options`` or a block's ``extra_options``):
    the one ``start_model_call`` made for the whole model call, or, for a call that did not pass through it
    (a patch called on its own), one for these options alone."""
    call = options.get(CALL_KEY)
    if call is None:
        call = options[CALL_KEY] = new_model_call(options)
    return call


def new_model_call(options) -> ModelCall:
    """A ``ModelCall`` for a call with ``options``: its sigmas, and its sampling run with the run's schedule."""
    return ModelCall(options.get("sigmas"), options.get(RUN_KEY), options.get("sample_sigmas"))


def current_sigma(options) -> float | None:
    """The sampler's sigma for this call (``None`` outside a sampler), read at most once per model call."""
    return model_call(options).sigma()


def in_sigma_window(sigma_start: float, sigma_end: float, options) -> bool:
    """Whether this call's sigma lies in ``[sigma_end, sigma_start]`` (read only where the window is not the whole
    run; a call outside a sampler is in it)."""
    if sigma_start == math.inf and sigma_end <= 0.0:  # the whole run: no need to read the sigma
        return True
    sigma = current_sigma(options)
    return sigma is None or sigma_end <= sigma <= sigma_start


@dataclass(frozen=True)
class Window:
    """When a patch acts: while the sampler's sigma lies in ``[sigma_end, sigma_start]`` (the DiTs' settings,
    whose blocks all work at one resolution)."""

    sigma_start: float = math.inf
    sigma_end: float = 0.0

    def in_window(self, options) -> bool:
        return in_sigma_window(self.sigma_start, self.sigma_end, options)


@dataclass(frozen=True)
class Reach:
    """Where and when a U-Net patch acts: blocks at ``max_downsample`` or finer, while the sampler's sigma lies in
    ``[sigma_end, sigma_start]``."""

    max_downsample: int
    sigma_start: float = math.inf
    sigma_end: float = 0.0

    def in_window(self, extra_options) -> bool:
        return in_sigma_window(self.sigma_start, self.sigma_end, extra_options)

    def grid(self, n_tokens: int, extra_options) -> tuple[int, int] | None:
        """``(w, h)`` of this U-Net block call's token grid when the patch acts on it, else ``None``."""
        original_shape = extra_options.get("original_shape")
        if original_shape is None or not self.in_window(extra_options):
            return None
        return block_grid(n_tokens, original_shape, self.max_downsample, extra_options.get("activations_shape"))


def check_choice(name: str, value, choices) -> None:
    """A clear error naming the input when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, not {value!r}")


def check_range(name: str, value, low, high) -> None:
    """A clear error naming the input and its range when ``value`` lies outside ``[low, high]``."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {value!r}")


def check_tome_inputs(ratio: float, stride_x: int, stride_y: int, reuse_steps: int, merge: str, reduce: str,
                      reductions: Iterable[str]) -> None:
    """The checks of the ToMe inputs both adapters take, each a clear error naming the input."""
    check_range("ratio", ratio, 0.0, MAX_RATIO)
    check_range("stride_x", stride_x, 1, MAX_STRIDE)
    check_range("stride_y", stride_y, 1, MAX_STRIDE)
    check_range("reuse_steps", reuse_steps, 1, MAX_REUSE_STEPS)
    check_choice("merge", merge, MERGE_MODES)
    check_choice("reduce", reduce, reductions)


def capped_ratio(ratio: float, stride_x: int, stride_y: int) -> float:
    """``ratio``, or the stride's cap (every token but one per cell merged) with a warning where it is above."""
    cap = ratio_cap(stride_x, stride_y)
    if ratio > cap:
        log.warning("Apply ToMe: ratio %.3f is above the %dx%d stride's cap of %.3f; using %.3f",
                    ratio, stride_x, stride_y, cap, cap)
        return cap
    return ratio


def sigma_window(model, start_percent: float, end_percent: float) -> tuple[float, float]:
    """The sigmas bounding the sampling window ``[start_percent, end_percent]``, from the model's own schedule."""
    if start_percent > end_percent:
        raise ValueError(f"start_percent ({start_percent}) must not be greater than end_percent ({end_percent})")
    if start_percent <= 0.0 and end_percent >= 1.0:
        return math.inf, 0.0
    sampling = model.get_model_object("model_sampling")
    return sampling.percent_to_sigma(start_percent), sampling.percent_to_sigma(end_percent)


def sampling_window(model, start_percent: float, end_percent: float) -> Window:
    """The ``Window`` of the sampling window ``[start_percent, end_percent]`` on ``model``'s schedule."""
    return Window(*sigma_window(model, start_percent, end_percent))


@functools.lru_cache(maxsize=64)
def warn_grid_too_small(w: int, h: int, factor: int) -> None:
    """ToDo's cells larger than a ``w x h`` token grid: once per grid and factor, not once per call."""
    log.warning("Apply ToDo: downsample_factor %d is larger than a %dx%d token grid; such a grid is left as is",
                factor, w, h)


def seeded_plan(settings, metric: torch.Tensor, w: int, h: int, removed: int, block, index: int, options):
    """ToMe's matching of ``metric [B, w*h, C]`` over its ``w x h`` grid, ``removed`` tokens merged away.
    ``settings`` (a U-Net's or a DiT's ToMe settings) give the strides and, where ``use_rand``, the seed of a
    private generator, mixed with this call's sigma and its place (``block``, ``index``); the global RNG is never
    used."""
    generator = None
    if settings.use_rand:
        seed = derive_seed(settings.seed, current_sigma(options) or 0.0, block, index)
        generator = torch.Generator().manual_seed(seed)
    return build_plan(metric, w, h, settings.sx, settings.sy, removed, no_rand=not settings.use_rand,
                      generator=generator)


class SamplingRun:
    """What one sampling run remembers: the merge plans, each kept for ``reuse_steps`` steps, the token caches
    (``cache``, dropped when the run ends), and the warnings it has given, so each is given once per run.

    Plans are keyed by what identifies one batch of one block call (the
    caller's key); a step is the position of the call's sigma in the run's
    schedule (``sample_sigmas``), read once per run: where the run
    ``keeps_plans``, by the first call's sigma read (``ModelCall``), so no call
    waits on the host twice. cond and uncond may run in two threads at once, so
    every access holds the lock; a plan is made outside it (two threads with
    the same key would make the same plan).
    """

    def __init__(self, keeps_plans: bool = False):
        self.keeps_plans = keeps_plans
        self._lock = threading.Lock()
        self._plans: dict[Hashable, tuple[int, object]] = {}
        self._schedule: list[float] | None = None
        self._warned: set[str] = set()
        self._calls = 0
        self._reached: set[str] = set()
        self._caches: dict[Hashable, object] = {}

    def needs_schedule(self) -> bool:
        """Whether a sigma read should bring the run's schedule: plans are kept across steps, and it is unread."""
        with self._lock:
            return self.keeps_plans and self._schedule is None

    def know_schedule(self, schedule: list[float]) -> None:
        with self._lock:
            if self._schedule is None:
                self._schedule = schedule

    def step(self, extra_options) -> int | None:
        """This call's step: how many of the run's schedule sigmas lie above its sigma."""
        schedule = extra_options.get("sample_sigmas")
        sigma = current_sigma(extra_options)
        if sigma is None or schedule is None:
            return None
        with self._lock:
            known = self._schedule
        if known is None:  # a run that keeps no plans, or a sigma read before this run: a read of its own
            known = schedule.flatten().tolist()
            self.know_schedule(known)
        return sum(s > sigma for s in known)

    def plan(self, key: Hashable, extra_options, reuse_steps: int, make: Callable[[], object]):
        """The plan kept under ``key`` if it was made fewer than ``reuse_steps`` steps ago, else a new one."""
        step = self.step(extra_options)
        if step is None:
            return make()
        with self._lock:
            made, plan = self._plans.get(key, (None, None))
        if made is not None and 0 <= step - made < reuse_steps:
            return plan
        plan = make()
        with self._lock:
            self._plans[key] = (step, plan)
        return plan

    def cache(self, key: Hashable):
        """What the run keeps under ``key`` across its steps (a block's token cache), or ``None``."""
        with self._lock:
            return self._caches.get(key)

    def keep_cache(self, key: Hashable, value) -> None:
        with self._lock:
            self._caches[key] = value

    def end(self) -> None:
        """The run has ended: its caches go now, not when the guider's options copy does."""
        with self._lock:
            self._caches.clear()

    def note_call(self, reached: set[str]) -> None:
        """One model call of the run has ended, having reached the hooks of ``reached`` (scope names)."""
        with self._lock:
            self._calls += 1
            self._reached |= reached

    def unreached(self, scopes) -> list[str]:
        """Those of ``scopes`` whose hooks no model call of the run reached (none where the run made no call)."""
        with self._lock:
            return [scope for scope in scopes if self._calls and scope not in self._reached]

    def first_warning(self, key: str) -> bool:
        """Whether this is the run's first warning of ``key`` (and from now on it is not)."""
        with self._lock:
            if key in self._warned:
                return False
            self._warned.add(key)
            return True


def first_in_run(options, key: str) -> bool:
    """Whether a warning of ``key`` is the first of the sampling run whose ``options`` these are (and from now
    on it is not); always, for a call outside a run."""
    run = options.get(RUN_KEY)
    return run is None or run.first_warning(key)


def batch_of_conds(options) -> tuple:
    """What tells one batch of a block call from another in the same step (cond and uncond, run together or
    apart, in one thread or two): the conds in it (``uuids``), else ``cond_or_uncond``. Part of a kept plan's
    key."""
    return tuple(options.get("uuids") or options.get("cond_or_uncond") or ())


def block_plan(options, share: bool, scope: str, block: Hashable, grid: tuple, tokens: torch.Tensor,
               reuse_steps: int, make: Callable[[], object]):
    """ToMe's plan for a call of ``block`` (its identity) on ``grid``: ``make()``'s, kept across ``reuse_steps``
    steps (``kept_plan``). With ``share`` (``share_matching``, ToMA's reuse), the plan of the model call's first
    block that reached ``scope`` with tokens of this grid, shape and device, served to every later one (kept across
    steps as that first block's would be). A model call runs in one thread (cond and uncond in two are two
    calls): no lock."""
    if not share:
        return kept_plan(options, block, tokens, reuse_steps, make)
    grid = tuple(grid)
    return model_call(options).plan((scope, grid, tuple(tokens.shape), str(tokens.device)), lambda: kept_plan(
        options, (scope, "shared", grid), tokens, reuse_steps, make))


def kept_plan(options, block: Hashable, tokens: torch.Tensor, reuse_steps: int, make: Callable[[], object]):
    """``make()``; with ``reuse_steps`` above 1 inside a sampling run, the plan the run keeps for ``block`` (a
    block's identity) and this batch (the shape and device of its ``tokens``, its conds), made fewer than
    ``reuse_steps`` steps ago, else a new one, kept."""
    run = options.get(RUN_KEY)
    if reuse_steps <= 1 or run is None:
        return make()
    key = (block, tuple(tokens.shape), str(tokens.device), batch_of_conds(options))
    return run.plan(key, options, reuse_steps, make)


@dataclass(frozen=True)
class StartRun:
    """A keyed ``OUTER_SAMPLE`` wrapper: give the sampling run a fresh ``SamplingRun`` (``keeps_plans``: one that
    keeps merge plans across steps, ``reuse_steps``), and warn once at its start where its settings
    (``gpu_use``) were measured slower on a GPU than no patch at its size (``warn_gpu_loss``).

    ``executor.class_obj`` is the guider, whose ``model_options`` are, for the
    length of the run, a copy made for this run alone: the run state goes
    there, reaches every model call and block call through
    ``transformer_options``, and is dropped with the copy when the run ends.
    """

    keeps_plans: bool = False
    # What the settings do, as the GPU rule reads them (a ``gpu_rule.GpuUse``), or None: nothing to warn of.
    gpu_use: object = None

    def __call__(self, executor, *args, **kwargs):
        options = executor.class_obj.model_options.setdefault("transformer_options", {})
        run = options[RUN_KEY] = SamplingRun(self.keeps_plans)
        if self.gpu_use is not None:
            warn_gpu_loss(self.gpu_use, executor.class_obj, run, (kwargs.get("latent_shapes") or [args[0].shape])[0])
        try:
            out = executor(*args, **kwargs)
        finally:
            run.end()
        self.ended(run)
        return out

    def ended(self, run: SamplingRun) -> None:
        """What a host checks when a run has ended (a subclass's: nothing here)."""


GPU_LOSS_KEY = "gpu loss"  # the run's warning key for a setting measured slower on a GPU at its size


def warn_gpu_loss(gpu_use, guider, run: SamplingRun, latent_shape) -> None:
    """Warn once in ``run`` where ``gpu_use`` (``gpu_rule.GpuUse``) was measured slower than no patch on the
    device the ``guider`` samples on (its model's load device: the latent is still on the CPU when the run
    starts), at the size of the run's first latent (``latent_shape``; ComfyUI packs several, as an audio and a
    video latent, into one tensor and hands their shapes beside it), under torch.compile where ComfyUI's
    ``TorchCompileModel`` put its wrapper."""
    options = guider.model_options.get("transformer_options", {})
    compiled = bool(options.get("wrappers", {}).get(APPLY_MODEL, {}).get(COMPILE_KEY))
    line = gpu_use.warning(guider.model_patcher.load_device.type, latent_shape, compiled)
    if line is not None and run.first_warning(GPU_LOSS_KEY):
        log.warning(line)


def wants_run_state(model, keeps_plans: bool, gpu_use=None) -> None:
    """Register on ``model`` (once, under our key) a ``StartRun`` that keeps plans across steps where
    ``keeps_plans``, and warns where ``gpu_use`` (``gpu_rule.GpuUse``) loses on a GPU; none where neither."""
    model.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    if keeps_plans or gpu_use is not None:
        model.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, StartRun(keeps_plans, gpu_use))


def call_options(transformer_options) -> dict:
    """A copy of a model call's ``transformer_options`` holding a fresh ``ModelCall`` (a copy, so a caller's
    dict, or a default shared between calls, is never written)."""
    options = dict(transformer_options or {})
    options[CALL_KEY] = new_model_call(options)
    return options


# The transformer_options of the model call running in this thread (and context), for hooks a step cache's forward
# calls without them (``options_of_call``). A context variable: cond and uncond in two threads are two calls, each
# seeing its own; a model call inside another sees its own and gives the outer one back when it ends.
_RUNNING_CALL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tome_running_call", default=None)


@contextlib.contextmanager
def running_call(options: dict) -> Iterator[None]:
    """``options`` (a model call's own copy, from ``call_options``) are this thread's running call meanwhile."""
    token = _RUNNING_CALL.set(options)
    try:
        yield
    finally:
        _RUNNING_CALL.reset(token)


def options_of_call(*places: Mapping | None) -> dict:
    """The transformer_options of the model call a hook runs in: the first of ``places`` (a block replacement's
    ``args``, then its ``extra``; a block's own keyword, as ``{"transformer_options": ...}``) that has them, else
    the running call's (``running_call``), else ``{}``.

    ComfyUI hands them to every block in ``args``; the step caches people install replace the model's forward
    and do not: TeaCache's and MagCache's forwards leave them out of ``args`` (Wan's put them in ``extra``) or
    call blocks positionally without them (Lumina 2, HiDream); First Block Cache's Flux forward puts them in
    ``extra``. Never indexed: a hook never fails for their absence.
    """
    for place in places:
        options = place.get("transformer_options") if place else None
        if options:
            return options
    return _RUNNING_CALL.get() or {}


def start_model_call(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                     **conds):
    """A keyed ``APPLY_MODEL`` wrapper: the model call gets its own ``ModelCall``, shared by all its blocks."""
    return executor(x, t, c_concat, c_crossattn, control, call_options(transformer_options), **conds)


def wants_model_calls(model) -> None:
    """Register ``start_model_call`` on ``model`` (once, under our key)."""
    if start_model_call not in model.get_wrappers(APPLY_MODEL, WRAPPER_KEY):
        model.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, start_model_call)


def with_replacements(table: Mapping | None, keys: Iterable, make: Callable) -> dict:
    """A copy of ``table`` (replacements by key; ``None``: none) with ``make(key, inner)`` for each of ``keys``,
    ``inner`` being the one there before (``None``)."""
    table = dict(table or {})
    return table | {key: make(key, table.get(key)) for key in keys}


def with_dit_replacements(replaces: Mapping, keys: Iterable, make: Callable) -> dict:
    """A copy of ``patches_replace`` (the model's, shared with its clones: never written) whose ``dit`` block
    replacements are ``with_replacements``'s."""
    return dict(replaces, dit=with_replacements(replaces.get("dit"), keys, make))


@functools.cache
def _swapped(base: type, mixin: type, attributes: tuple) -> type:
    return type(f"ToMe{base.__name__}", (mixin, base), {"tome_base": base, **dict(attributes)})


def mixed_class(base: type, mixin: type, **attributes) -> type:
    """``base`` with ``mixin`` in front and ``attributes`` set, ``tome_base`` naming ``base``: one class per base,
    mixin and attributes, so every clone swapping a module's class gets the same class. A ``base`` that is such a
    class already (the shared model is loaded with another clone's swap right now) is swapped from its own base."""
    return _swapped(getattr(base, "tome_base", base), mixin, tuple(sorted(attributes.items())))


def without_swapped_classes(model, mixin: type) -> None:
    """Drop from ``model``'s object patches an earlier node's class swaps to ``mixin``'s subclasses."""
    for name in [k for k, v in model.object_patches.items() if isinstance(v, type) and issubclass(v, mixin)]:
        del model.object_patches[name]


def without_patches(patches: dict, types: tuple) -> None:
    """Drop an earlier node's patches of ``types``, so a second node of the same kind replaces the first."""
    for name in PATCH_LISTS:
        if name in patches:
            patches[name] = [p for p in patches[name] if not isinstance(p, types)]


def has_patches(model, types: tuple) -> bool:
    patches = model.model_options["transformer_options"].get("patches", {})
    return any(isinstance(p, types) for name in PATCH_LISTS for p in patches.get(name, ()))
