"""An attention-backend node of the ComfyUI of late 2026, emulated on the 0.3.75 host for tests.

The pattern is that of core "Model Sparse Attention" (and of the sparse/Sage
attention packs built the same way), which 0.3.75 does not have:

- the node clones the model and puts its own ``optimized_attention_override``
  into ``transformer_options``, chaining the override it found there;
- it registers an ``ON_PREPARE_STATE`` callback, which the late host calls as
  ``callback(patcher, timestep, model_options)`` once per sampler step from
  ``_calc_cond_batch`` (``model.current_patcher.prepare_state(timestep,
  model_options)``), with the sampling run's own ``model_options``; there the
  node puts itself back on top of the override slot when something else is
  on top, chaining what it found, and does nothing when it is on top already;
- its override is an attention kernel: the override it chained is called
  with the kernel as its attention function (so an override below it, ours,
  still transforms q, k and v and the kernel computes on what it hands on),
  and with no override below, the kernel is called directly.

What 0.3.75 has and what was read there: ``ModelPatcher.prepare_state(timestep)`` calls every
``ON_PREPARE_STATE`` callback as ``callback(patcher, timestep)``, once per ``_calc_cond_batch``, after the
``CALC_COND_BATCH`` wrappers and before any model call of the step (``comfy/samplers.py``);
``wrap_attn`` hands every attention call to ``transformer_options["optimized_attention_override"](func, q, k,
v, heads, ...)`` (``comfy/ldm/modules/attention.py``), U-Net attention included. The late host's third
argument (``model_options``) was read from public code that calls and stubs ``prepare_state(timestep,
model_options)``; the core node's own source could not be read here, so the three rules above are the
pattern as described, not a copy: ``late_prepare_state`` gives the callbacks the late host's signature, and
the kernel computes with the attention function ComfyUI handed the outermost override (a stand-in for the
sparse kernel, so outputs stay comparable), recording what it computed on.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

OVERRIDE_KEY = "optimized_attention_override"
ON_PREPARE_STATE = "on_prepare_state"  # comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE
CALLBACK_KEY = "model_sparse_attention"


@dataclass(frozen=True)
class KernelCall:
    """One attention the backend's kernel computed: token counts of q and k (token-major), and the sigma."""

    queries: int
    keys: int
    sigma: float | None


def tokens(t, skip_reshape: bool) -> int:
    """The token count of ``t``: ``[B, H, L, D]`` with ``skip_reshape``, else ``[B, L, ...]``."""
    return t.shape[2] if skip_reshape else t.shape[1]


class AttentionBackend:
    """The emulated node: ``apply`` is its ``execute``; ``calls`` records what its kernel computed on.

    ``chains``: the override found is chained (the pattern above). ``False`` emulates a backend that takes the
    slot and drops what was there (a kernel that never calls the previous override). ``reinstalls``: the step
    callback is registered (the pattern above); ``False`` emulates a backend set once, at the node, as the
    Sage-attention patch nodes of custom packs do.
    """

    name = "Model Sparse Attention"

    def __init__(self, chains: bool = True, reinstalls: bool = True):
        self.chains = chains
        self.reinstalls = reinstalls
        self.calls: list[KernelCall] = []
        self._lock = threading.Lock()  # cond and uncond may run in two threads

    def __deepcopy__(self, memo):
        # 0.3.75's clone() deep-copies model_options; the real node's override is a function, which a deep copy
        # shares: so are these (the late host shares every patch object anyway).
        return self

    def apply(self, model):
        """The node: a clone of ``model`` with the backend's override on top and its step callback."""
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options[OVERRIDE_KEY] = BackendOverride(self, options.get(OVERRIDE_KEY))
        if self.reinstalls:
            patched.add_callback_with_key(ON_PREPARE_STATE, CALLBACK_KEY, self.prepare_state)
        return patched

    def prepare_state(self, patcher, timestep, model_options=None):
        """The late host's ``ON_PREPARE_STATE`` callback: back on top of the run's override slot."""
        if model_options is None:
            raise RuntimeError("the emulated backend needs the late host's prepare_state: use late_prepare_state()")
        options = model_options.setdefault("transformer_options", {})
        current = options.get(OVERRIDE_KEY)
        if isinstance(current, BackendOverride) and current.backend is self:
            return
        options[OVERRIDE_KEY] = BackendOverride(self, current)

    def record(self, q, k, kwargs) -> None:
        skip = bool(kwargs.get("skip_reshape", False))
        sigmas = (kwargs.get("transformer_options") or {}).get("sigmas")
        with self._lock:
            self.calls.append(KernelCall(tokens(q, skip), tokens(k, skip),
                                         None if sigmas is None else float(sigmas.flatten()[0])))


@dataclass(frozen=True)
class Kernel:
    """The backend's attention: records what it computes on, then computes with ``attention``."""

    backend: AttentionBackend
    attention: object

    def __call__(self, q, k, v, *args, **kwargs):
        self.backend.record(q, k, kwargs)
        return self.attention(q, k, v, *args, **kwargs)


@dataclass(frozen=True)
class BackendOverride:
    """The override the backend installs: ``previous`` (the override it found) is called with the kernel as
    its attention function, or the kernel alone where there is none or the backend does not chain."""

    backend: AttentionBackend
    previous: object = None

    def __deepcopy__(self, memo):
        return self  # shared by clones, as a function is (see AttentionBackend.__deepcopy__)

    def __call__(self, func, *args, **kwargs):
        # Installed twice (at the node and again over ours at a step), the inner copy is handed the outer
        # one's kernel as ``func``: it keeps it, so each attention is computed (and recorded) once.
        kernel = func if isinstance(func, Kernel) and func.backend is self.backend else Kernel(self.backend, func)
        if self.previous is None or not self.backend.chains:
            return kernel(*args, **kwargs)
        return self.previous(kernel, *args, **kwargs)


_run = threading.local()


@contextlib.contextmanager
def late_prepare_state():
    """``ModelPatcher.prepare_state`` as the late host has it: ``ON_PREPARE_STATE`` callbacks get the sampling
    run's ``model_options`` (the ones ``_calc_cond_batch`` builds the step's ``transformer_options`` from)."""
    import comfy.model_patcher
    import comfy.samplers

    original_batch = comfy.samplers._calc_cond_batch
    original_prepare = comfy.model_patcher.ModelPatcher.prepare_state

    def calc_cond_batch(model, conds, x_in, timestep, model_options):
        _run.model_options = model_options
        try:
            return original_batch(model, conds, x_in, timestep, model_options)
        finally:
            _run.model_options = None

    def prepare_state(self, timestep, model_options=None):
        model_options = model_options if model_options is not None else getattr(_run, "model_options", None)
        for callback in self.get_all_callbacks(ON_PREPARE_STATE):
            callback(self, timestep, model_options)

    comfy.samplers._calc_cond_batch = calc_cond_batch
    comfy.model_patcher.ModelPatcher.prepare_state = prepare_state
    try:
        yield
    finally:
        comfy.samplers._calc_cond_batch = original_batch
        comfy.model_patcher.ModelPatcher.prepare_state = original_prepare
