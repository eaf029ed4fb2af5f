"""What a piece of code asks of the device, counted on the CPU: host reads, blocking copies, operators.

On a GPU, PyTorch queues kernels and returns at once, unless the host needs a tensor's value: ``float()``,
``.item()``, ``bool()``, ``.tolist()``, ``nonzero`` (whose output size is data), a copy to the CPU. Then the host
waits until every queued kernel has run, and the GPU idles while the host prepares the next ones. A blocking
copy from the host (``torch.tensor([...], device=...)``, ``.to(device)`` without ``non_blocking``) waits for
the queue too. Neither needs a GPU to be seen: every such request passes through PyTorch's dispatcher (or, for
``.tolist()`` and ``.to()``, through ``__torch_function__``) on the CPU as well, so ``count()`` counts them
there, and the operators with them (each one a kernel launch, or Python and dispatcher work for a view).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators whose result is a value on the host: the host waits for the device. Under ``inference_mode`` the
# dispatcher shows ``item`` and ``is_nonzero`` before they decompose into ``_local_scalar_dense``; each is one
# read whichever of them is seen.
READ_OPS = frozenset({aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.equal})
# Tensors made from Python data (``torch.tensor``): on a GPU, a blocking copy from the host.
HOST_DATA_OPS = frozenset({aten.lift_fresh})
# Tensor methods that hand the host the data (no operator shows them on the CPU).
READ_METHODS = frozenset({"tolist", "numpy", "cpu"})
# Tensor methods that move data between devices when their source is on the other side.
COPY_METHODS = frozenset({"to", "cuda"})


@dataclass
class Counts:
    """What one counted stretch of code did.

    ``host_reads``: values brought to the host; ``blocking_copies``: copies that name a device without
    ``non_blocking=True`` plus tensors made from Python data (each a no-op where source and target share a
    device, and a wait for the queue where they do not); ``ops``: operators seen by the dispatcher, by name."""

    host_reads: int = 0
    blocking_copies: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    def __sub__(self, other: Counts) -> Counts:
        """What this stretch did beyond ``other`` (a patched run minus the unpatched one: what a patch adds)."""
        return Counts(self.host_reads - other.host_reads, self.blocking_copies - other.blocking_copies,
                      collections.Counter({k: self.ops[k] - other.ops[k] for k in self.ops.keys() | other.ops.keys()
                                           if self.ops[k] != other.ops[k]}))


def names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to()`` / ``.cuda()`` call names a target device (rather than only a dtype)."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:])


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops[func.overloadpacket.__name__] += 1
        if func.overloadpacket in READ_OPS:
            self.counts.host_reads += 1
        elif func.overloadpacket in HOST_DATA_OPS:
            self.counts.blocking_copies += 1
        return func(*args, **(kwargs or {}))


class _MethodCounter(TorchFunctionMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READ_METHODS:
            self.counts.host_reads += 1
        elif name in COPY_METHODS and not kwargs.get("non_blocking", False) and (name == "cuda"
                                                                                 or names_a_device(args, kwargs)):
            self.counts.blocking_copies += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count() -> Iterator[Counts]:
    """Count the host reads, blocking copies and operators of everything run inside (this thread only)."""
    counts = Counts()
    with _MethodCounter(counts), _DispatchCounter(counts):
        yield counts


# Counting a sampling run of each node on each model family, as the counts table and its test do.

@dataclass(frozen=True)
class CountedModel:
    """A small random-weight model of a real layout, and what one sampling run of it is given."""

    family: str  # a U-Net of ``random_models`` or a DiT of ``dit_models``
    latent: tuple[int, ...]
    channels: int | None = None  # a U-Net narrowed as the in-process tests narrow it
    pooled: int = 0  # the width of the pooled text the model's conds need (0: none)


MODELS = {
    "SD1.5": CountedModel("sd15", (1, 4, 16, 16), channels=32),
    "SDXL": CountedModel("sdxl", (1, 4, 32, 32), channels=64, pooled=1280),
    "Flux": CountedModel("flux", (1, 16, 16, 16), pooled=32),
    "Wan 2.1": CountedModel("wan21", (1, 16, 3, 16, 16), pooled=32),  # a 3-frame video
}
TEXT_TOKENS, TEXT_WIDTH = 7, 32
# Each node as a user sets it: Apply ToMe's defaults; Apply ToMe (Advanced) with what decides per call (a
# step window, reuse_steps, the widest scope: ignored on a DiT, with a warning), with the widest scope alone (U-Nets),
# with one matching a call (share_matching) and at the block scope (DiTs, every block); Apply ToDo with nearest and
# with average pooling (its default, auto, is one of the two per family), and at the block scope (DiTs).
WIDEST = "self-attention, cross-attention and MLP"
EVERY_BLOCK = {"dit_scope": "block", "skip_first_blocks": 0, "skip_last_blocks": 0}
NODES = {
    "Apply ToMe": ("tome", {"ratio": 0.5}),
    "Apply ToMe (Advanced)": ("tome", {"ratio": 0.5, "start_percent": 0.0, "end_percent": 0.7, "reuse_steps": 2,
                                       "scope": WIDEST}),
    "Apply ToMe (widest scope)": ("tome", {"ratio": 0.5, "scope": WIDEST}),
    "Apply ToMe (share_matching)": ("tome", {"ratio": 0.5, "share_matching": True}),
    "Apply ToMe (block)": ("tome", {"ratio": 0.5, **EVERY_BLOCK}),
    "Apply ToMe (block, share_matching)": ("tome", {"ratio": 0.5, "share_matching": True, **EVERY_BLOCK}),
    "Apply ToMe (token cache)": ("tome", {"ratio": 0.5, "token_cache": True, **EVERY_BLOCK}),
    "Apply ToDo": ("todo", {"downsample_factor": 2, "method": "nearest"}),
    "Apply ToDo (average)": ("todo", {"downsample_factor": 2, "method": "average"}),
    "Apply ToDo (block)": ("todo", {"downsample_factor": 2, "method": "nearest", **EVERY_BLOCK}),
}
UNET_ONLY = frozenset({"Apply ToMe (widest scope)"})  # the widest scope means nothing on a DiT
DIT_ONLY = frozenset({"Apply ToMe (block)", "Apply ToMe (block, share_matching)", "Apply ToMe (token cache)",
                      "Apply ToDo (block)"})


def nodes_for(name: str) -> list[str]:
    """The keys of ``NODES`` that mean something on ``MODELS[name]``."""
    unet = MODELS[name].channels is not None
    return [node for node in NODES if node not in (DIT_ONLY if unet else UNET_ONLY)]


STEPS = 3


def build_model(name: str):
    """The ``ModelPatcher`` of one of ``MODELS``; needs ComfyUI booted."""
    from . import dit_models, random_models

    spec = MODELS[name]
    if spec.channels is not None:
        return random_models.build_unet_model(spec.family, channels=spec.channels, context_dim=TEXT_WIDTH)
    return dit_models.build_dit_model(spec.family)


def patched(pack_models, model, node: str):
    """``model`` through ``node`` (a key of ``NODES``), as the node calls the pack (``pack_models``: the pack's
    ``tome.hosts.comfyui_models`` as ComfyUI imported it)."""
    kind, inputs = NODES[node]
    return (pack_models.apply_tome if kind == "tome" else pack_models.apply_todo)(model, **inputs)


def conditioning(name: str):
    """cond and uncond of one text length, so the sampler batches them into one model call per step."""
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(5)
    extra = {"pooled_output": torch.zeros(1, spec.pooled)} if spec.pooled else {}
    return tuple([[torch.randn(1, TEXT_TOKENS, TEXT_WIDTH, generator=generator), dict(extra)]] for _ in range(2))


@dataclass(frozen=True)
class SamplingCounts:
    """One KSampler run's counts, and the model calls it made."""

    counts: Counts
    model_calls: int


def count_sampling(comfy_nodes, model, name: str, steps: int = STEPS) -> SamplingCounts:
    """Count one KSampler run (euler, cfg 2, ``steps`` steps) of ``model``, a patched clone of ``MODELS[name]``."""
    positive, negative = conditioning(name)
    latent = {"samples": torch.zeros(MODELS[name].latent)}
    calls = []
    hook = model.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with count() as counts:
            comfy_nodes.KSampler().sample(model, 3, steps, 2.0, "euler", "normal", positive, negative, latent)
    finally:
        hook.remove()
    return SamplingCounts(counts, len(calls))


@dataclass(frozen=True)
class Row:
    """What one node adds to each model call of one model: host reads, blocking copies, operators."""

    model: str
    node: str
    host_reads: float
    blocking_copies: float
    ops: float


def added_per_call(comfy_nodes, pack_models, name: str, node: str, base_model=None,
                   steps: int = STEPS) -> Row:
    """What ``node`` adds to each model call of ``MODELS[name]``: the patched run's counts minus the unpatched
    run's, over the model calls."""
    base_model = base_model or build_model(name)
    count_sampling(comfy_nodes, patched(pack_models, base_model, node), name, steps)  # first-run work not counted
    plain = count_sampling(comfy_nodes, base_model, name, steps)
    ours = count_sampling(comfy_nodes, patched(pack_models, base_model, node), name, steps)
    added = ours.counts - plain.counts
    calls = ours.model_calls
    return Row(name, node, added.host_reads / calls, added.blocking_copies / calls, added.n_ops / calls)


def block_merge_counts(patched_model, tokens: torch.Tensor, grid: tuple[int, int], sigma: float = 5.0,
                       model_call=None) -> Counts:
    """The counts of our self-attention merge around one U-Net block call of ``tokens [B, w*h, C]`` (its attn1
    patches as ComfyUI calls them, the attention itself left out): the plan, the merge, the unmerge.
    ``model_call``: what our model-call wrapper put in the call's options, if anything."""
    patches = patched_model.model_options["transformer_options"]["patches"]
    w, h = grid
    options = {"original_shape": [tokens.shape[0], 4, h, w], "activations_shape": [tokens.shape[0], 32, h, w],
               "block": ("input", 1), "block_index": 0, "sigmas": torch.full((tokens.shape[0],), sigma)}
    options.update(model_call or {})
    with count() as counts:
        n = context = value = tokens
        for patch in patches["attn1_patch"]:
            n, context, value = patch(n, context, value, options)
        for patch in patches["attn1_output_patch"]:
            n = patch(n, options)
    return counts


def tomesd_block_merge_counts(tokens: torch.Tensor, grid: tuple[int, int], ratio: float = 0.5) -> Counts:
    """The same for tomesd 0.1.3's merge (``bipartite_soft_matching_random2d``, then ``merge`` and ``unmerge``
    as its patched block calls them), with a generator on the tokens' device as tomesd makes it."""
    from tomesd.merge import bipartite_soft_matching_random2d

    w, h = grid
    generator = torch.Generator(device=tokens.device).manual_seed(0)
    with count() as counts:
        merge, unmerge = bipartite_soft_matching_random2d(tokens, w, h, 2, 2, int(tokens.shape[1] * ratio),
                                                          no_rand=False, generator=generator)
        unmerge(merge(tokens))
    return counts
