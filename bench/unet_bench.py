"""U-Net benchmark: one forward of a random-weight SD1.5/SDXL U-Net, every variant side by side.

Variants, run round-robin in one process (minimum of ``--repeats``):
  none         no patch
  core         ComfyUI's core TomePatchModel (merges the queries only)
  ours-qkv     Apply ToMe, q, k and v merged (the paper; the node's default)
  ours-q       Apply ToMe, q only
  ours-kv      Apply ToMe, k and v only
  ideal        self-attention on N - r tokens with merge and unmerge (almost) free: the limit
  fast         (only when named in ``--variants``) the README's fast setting at 2048 px and in hires passes:
               SD1.5 self+cross at max_downsample 2 (at 1024 px scope all at 4, the ``all-ds4`` row of
               ``--scope-grid``), SDXL scope all at max_downsample 4
  ideal-fast   (only when named) the limit of the fast setting's max_downsample at scope all: every
               transformer block there runs whole (attention, cross-attention, MLP) on the first N - r
               tokens and passes the rest through; for SDXL, the fast setting with merge and unmerge free
  todo-F       Apply ToDo, keys and values pooled by F x F (nearest), for each F of ``--todo``; they do not
               depend on the ratio, so they run with the first ratio only (their rows have no ratio)
  S-dsD        with ``--scope-grid``: Apply ToMe (q, k and v) with scope S (self, self+cross, all; or those
               of ``--scopes``) at max_downsample D, for each D of ``--max-downsample``

``--variants`` picks among the fixed ones (none is always run); at 1024 px a full set takes long. Besides the
time of a whole forward (and per image, with ``--batch``), each row has the seconds spent inside the attention
patch callbacks during the warm-up forward ("in patches"): the merge overhead itself.

Memory (``--memory``), two numbers per row: "peak MiB", the whole forward's peak above what the process held
after loading the model and making the inputs, and "attention MiB", the largest rise of memory inside one call
of ComfyUI's attention function, where ToMe's saving lies (the JSON also has "model MiB", what was held before).
The attention calls are wrapped through ``transformer_options["optimized_attention_override"]``, ComfyUI's own
hook around every attention backend, so nothing is patched. On CUDA both numbers come from the caching
allocator (``torch.cuda.max_memory_allocated``, exact per tensor), in this process. On the CPU they come from
the resident set: glibc gives every block over its mmap threshold its own ``mmap`` and unmaps it on free, so
RSS follows the big tensors, and Linux lets a process reset its RSS high-water mark (write "5" to
``/proc/self/clear_refs``, read ``VmHWM`` in ``/proc/self/status``). Smaller blocks live in glibc's heap, where
freed ones stay resident and are reused unseen, and glibc raises its threshold (up to 32 MiB) as blocks are
freed: so each variant's memory is measured in a fresh child process (this script, hidden flag ``--child``),
with the threshold pinned at 128 KiB; the child loads the model, warms up with one 256 px forward, resets the
mark and runs the measured forward. The attention wrapper resets the mark before each call and reads it after;
the whole-forward peak is the largest of the marks read before each reset and at the end. ComfyUI's
sub-quadratic and split attention size their chunks from the free memory they see, so their numbers depend on
what else runs on the machine. ``--repeats 0`` runs only these memory forwards, each timed (with children: one
forward per variant in a fresh process), and then this process builds no model of its own: the way to measure
a large model, which the timing process and a child would otherwise hold twice.

``--cap-mib N``: instead of timing, the largest image each variant completes when the forward may use N MiB
above the loaded model: a search in 64 px steps between ``--cap-px LO HI``, one child per size tried. On the
CPU the cap is ``RLIMIT_DATA`` (private writable memory: heap and anonymous mmaps, that is every tensor),
set to the child's data size after loading plus N; ``RLIMIT_AS`` would count the address space that shared
libraries, thread stacks and malloc arenas reserve without using (a booted child here: 1.2 GB ``VmSize``
against 0.5 GB ``VmData``), more still with CUDA's libraries. ComfyUI is shown the remaining headroom as its
free memory, as on a machine with that much left, so sub-quadratic and split attention chunk to fit. The cap
counts memory allocated but not yet written, which RSS does not, so it is a little stricter than the "peak MiB"
column. On CUDA the cap is ``torch.cuda.set_per_process_memory_fraction``.

    .venv/bin/python bench/unet_bench.py --family sd15 --px 512 768 --ratio 0.5 [--todo 2 3] [--attention sdpa]
    .venv/bin/python bench/unet_bench.py --family sdxl --px 1024 --variants core --todo --scope-grid \
        --max-downsample 2 4
    .venv/bin/python bench/unet_bench.py --family sd15 --px 768 --batch 1 2 4 --variants ours-qkv --todo
    .venv/bin/python bench/unet_bench.py --family sd15 --cap-mib 2048 --cap-px 512 2048 --variants ours-qkv
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from tome.grid import block_downsample
from tome.hosts.comfyui_unet import MERGE_KV, MERGE_Q, MERGE_QKV, SCOPE_ALL, SCOPE_CROSS, SCOPE_SELF
from tome_harness import comfyui as comfyui_host
from tome_harness import machine
from tome_harness.comfyui import ATTENTION_CHOICES, ROOT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIXED_VARIANTS = ("core", "ours-qkv", "ours-q", "ours-kv", "ideal")
OPTIONAL_VARIANTS = ("fast", "ideal-fast")
SCOPES = {"self": SCOPE_SELF, "self+cross": SCOPE_CROSS, "all": SCOPE_ALL}
FAST_SETTINGS = {"SD15": (SCOPE_CROSS, 2), "SDXL": (SCOPE_ALL, 4)}  # by ComfyUI's model config class
MEMORY_MODES = ("auto", "child", "in-process", "off")
MIB = 2**20
WARMUP_PX = 256  # the child's warm-up size: enough to set up the lazy state, cheap at any measured size
CHILD_MARK = "UNET_BENCH_CHILD "
# A fixed mmap threshold (glibc's initial 128 KiB) turns off glibc's dynamic one, which after the warm-up would
# rise to 32 MiB and put blocks up to that size in the heap, where freed ones stay resident and are reused
# unseen: with it fixed, every block over 128 KiB is mapped on allocation and unmapped on free.
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def ideal_patches(ratio, max_downsample):
    """Self-attention on the first N - r tokens, padded back: attention's saving without the merge's cost."""
    def attn1(n, context, value, extra_options):
        original_h, original_w = extra_options["original_shape"][-2:]
        if block_downsample(n.shape[1], original_h, original_w) > max_downsample:
            return n, context, value
        kept = n[:, : n.shape[1] - int(n.shape[1] * ratio)]
        extra_options["ideal_removed"] = n.shape[1] - kept.shape[1]
        return kept, kept, kept

    def attn1_output(out, extra_options):
        removed = extra_options.pop("ideal_removed", 0)
        return torch.nn.functional.pad(out, (0, 0, 0, removed)) if removed else out

    return attn1, attn1_output


def fast_setting(model) -> tuple[str, int]:
    """The README's fast setting for ``model``'s family at 2048 px and in hires passes: (scope, max_downsample)."""
    return FAST_SETTINGS[type(model.model.model_config).__name__]


def ideal_block_forwards(model, ratio, max_downsample):
    """``{attribute path: forward}`` for every transformer block of ``model``: a forward that, at blocks of
    downsample up to ``max_downsample``, runs the block on the first N - r tokens and passes the other r
    through unchanged; the limit of scope all (attention, cross-attention and MLP on N - r tokens, merge and
    unmerge free). For ``add_object_patch``: the patch sets each block's ``forward`` on the clone only."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    def reduced(block):
        whole = type(block).forward.__get__(block)  # the class's, never an earlier patch's

        def forward(x, context=None, transformer_options={}):  # noqa: B006 - ComfyUI's own signature
            original_h, original_w = transformer_options["original_shape"][-2:]
            n = x.shape[1]
            if block_downsample(n, original_h, original_w) > max_downsample:
                return whole(x, context=context, transformer_options=transformer_options)
            kept = n - int(n * ratio)
            out = whole(x[:, :kept], context=context, transformer_options=transformer_options)
            return torch.cat([out, x[:, kept:]], dim=1)
        return forward

    blocks = model.model.diffusion_model.named_modules()
    return {f"diffusion_model.{name}.forward": reduced(block) for name, block in blocks
            if isinstance(block, BasicTransformerBlock)}


def variant_makers(unet_adapter, core_cls, model, ratio, max_downsample, todo_factors=(), fixed=FIXED_VARIANTS,
                   scope_downsamples=(), scopes=tuple(SCOPES)):
    """Like ``variants``, but each model still to be made: a child process makes only the one it measures."""
    def ours(mode, scope=SCOPE_SELF, downsample=max_downsample):
        return unet_adapter.apply_tome(model, ratio=ratio, max_downsample=str(downsample), merge=mode, scope=scope)

    def ideal():
        patched = model.clone()
        attn1, attn1_output = ideal_patches(ratio, max_downsample)
        patched.set_model_attn1_patch(attn1)
        patched.set_model_attn1_output_patch(attn1_output)
        return patched

    def ideal_fast():
        patched = model.clone()
        _, fast_downsample = fast_setting(model)
        for path, forward in ideal_block_forwards(model, ratio, fast_downsample).items():
            patched.add_object_patch(path, forward)
        return patched

    makers = {
        "core": lambda: core_cls.execute(model, ratio=ratio).result[0],
        "ours-qkv": lambda: ours(MERGE_QKV),
        "ours-q": lambda: ours(MERGE_Q),
        "ours-kv": lambda: ours(MERGE_KV),
        "ideal": ideal,
        "fast": lambda: ours(MERGE_QKV, *fast_setting(model)),
        "ideal-fast": ideal_fast,
    }
    return {
        "none": lambda: model,
        **{name: makers[name] for name in fixed},
        **{f"todo-{f}": lambda f=f: unet_adapter.apply_todo(model, downsample_factor=f,
                                                             max_downsample=str(max_downsample))
           for f in todo_factors},
        **{f"{short}-ds{d}": lambda scope=scope, d=d: ours(MERGE_QKV, scope, d)
           for d in scope_downsamples for short, scope in SCOPES.items() if short in scopes},
    }


def variants(*args, **kwargs):
    """The models to time, by name: ``none`` and the ``fixed`` ones, ToDo for each factor, and Apply ToMe for
    each scope at each of ``scope_downsamples``. Arguments as ``variant_makers``."""
    return {name: make() for name, make in variant_makers(*args, **kwargs).items()}


def load(model):
    """Make ``model`` the loaded one, as the sampler does before its first step: this applies its object
    patches (the MLP swap of scope "all") and takes those of the previously loaded clone off. Untimed."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])


PATCH_KINDS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch")


def with_patch_timer(model, device):
    """A clone of ``model`` whose attention patch callbacks add their seconds to the returned list's one entry:
    the merge overhead itself (plan, merge, unmerge), free of a whole forward's run-to-run noise. The MLP merge
    of scope "all" runs inside the feed-forward, not in a callback, and is not counted."""
    spent = [0.0]

    def timed(patch):
        def call(*args):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = patch(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent[0] += time.perf_counter() - start
            return result
        return call

    timed_model = model.clone()
    patches = timed_model.model_options["transformer_options"].get("patches", {})
    for kind in PATCH_KINDS:
        if kind in patches:
            patches[kind] = [timed(p) for p in patches[kind]]
    return timed_model, spent


class Inputs(NamedTuple):
    """One forward's inputs, all batched: latent ``x [B, 4, px/8, px/8]``, ``sigma [B]``, ``context [B, 77,
    C]``, and for SDXL the pooled vector ``y [B, adm]`` in ``conds``."""
    x: torch.Tensor
    sigma: torch.Tensor
    context: torch.Tensor
    conds: dict


def make_inputs(family: str, context_dim: int, px: int, batch: int, device) -> Inputs:
    """Seeded inputs for ``batch`` images of ``px`` x ``px``; the same for every variant."""
    from tome_harness import random_models

    g = torch.Generator().manual_seed(0)
    latent = px // 8
    x = torch.randn(batch, 4, latent, latent, generator=g).to(device)
    context = torch.randn(batch, 77, context_dim, generator=g).to(device)
    conds = {}
    if family == "sdxl":
        conds["y"] = torch.zeros(batch, random_models.UNET_CONFIGS["sdxl"]["adm_in_channels"], device=device)
    return Inputs(x, torch.full((batch,), 5.0, device=device), context, conds)


def forward(model, inputs: Inputs, device, attention_override=None):
    """One U-Net forward as the sampler calls it; ``attention_override`` goes in as ComfyUI's
    ``optimized_attention_override`` (called as ``override(attention_function, *args, **kwargs)``)."""
    options = dict(model.model_options["transformer_options"], sigmas=inputs.sigma)
    if attention_override is not None:
        options["optimized_attention_override"] = attention_override
    with torch.inference_mode():
        out = model.model.apply_model(inputs.x, inputs.sigma, c_crossattn=inputs.context,
                                      transformer_options=options, **inputs.conds)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmData``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class RssProbe:
    """This process's resident memory in bytes, with a resettable high-water mark (Linux only)."""

    def current(self) -> int:
        return status_kib("VmRSS") * 1024

    def reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS to the current RSS

    def peak(self) -> int:
        return status_kib("VmHWM") * 1024


class CudaProbe:
    """Bytes held by PyTorch's CUDA tensors, with the caching allocator's resettable peak."""

    def current(self) -> int:
        return torch.cuda.memory_allocated()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()


def probe_for(device):
    return CudaProbe() if device.type == "cuda" else RssProbe()


class PeakTracker:
    """The peak of one forward above its start, and the largest rise inside one attention call.

    A probe has one high-water mark, which the attention wrapper resets before each call: so the forward's
    peak is kept as the maximum of the marks read just before each reset and at the end."""

    def __init__(self, probe):
        self.probe = probe
        self.start = probe.current()
        self.forward_peak = self.start
        self.attention_rise = 0
        probe.reset()

    def attention(self, func, *args, **kwargs):
        """ComfyUI's ``optimized_attention_override``: run ``func`` and keep its memory rise."""
        self.forward_peak = max(self.forward_peak, self.probe.peak())
        before = self.probe.current()
        self.probe.reset()
        out = func(*args, **kwargs)
        self.attention_rise = max(self.attention_rise, self.probe.peak() - before)
        return out

    def result(self) -> dict:
        """``peak MiB`` above the start, ``attention MiB``, and ``model MiB``: what was held at the start."""
        self.forward_peak = max(self.forward_peak, self.probe.peak())
        return {"model MiB": self.start / MIB, "peak MiB": (self.forward_peak - self.start) / MIB,
                "attention MiB": self.attention_rise / MIB}


def measure_memory(model, inputs: Inputs, device) -> dict:
    """The memory of one forward of ``model`` (loaded first), in this process (see the module docstring), and
    that forward's seconds."""
    load(model)
    tracker = PeakTracker(probe_for(device))
    start = time.perf_counter()
    forward(model, inputs, device, tracker.attention)
    return {**tracker.result(), "seconds": time.perf_counter() - start}


class Bench(NamedTuple):
    """What every measurement shares: the booted host, the adapter, the core node and the model."""
    device: torch.device
    unet_adapter: object
    core_cls: type
    model: object
    max_downsample: int
    context_dim: int
    attention_name: str


def setup(args, nodes=None) -> Bench:
    """Boot ComfyUI with ``args.attention`` (unless ``nodes`` says it is booted) and build the model."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nodes = nodes or comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes",
                                                  cpu=device.type == "cpu", attention=args.attention)
    import comfy.ldm.modules.attention as attention

    from tome_harness import random_models

    unet_adapter = comfyui_host.pack_module("tome.hosts.comfyui_unet")
    model = random_models.build_unet_model(args.family, dtype=DTYPES[args.dtype], channels=args.channels,
                                           context_dim=args.context_dim)
    model.load_device = device  # built for the CPU; ComfyUI's loader moves the weights to the load device
    model.model.to(device)
    context_dim = random_models.unet_config(args.family, context_dim=args.context_dim)["context_dim"]
    return Bench(device, unet_adapter, nodes.NODE_CLASS_MAPPINGS["TomePatchModel"], model,
                 unet_adapter.transformer_downsamples(model)[0], context_dim,
                 attention.optimized_attention.__name__)


def makers_for(bench: Bench, args, ratio, with_todo=True):
    """The variant makers that ``args`` asks for at ``ratio``."""
    return variant_makers(bench.unet_adapter, bench.core_cls, bench.model, ratio, bench.max_downsample,
                          args.todo if with_todo else (), args.variants,
                          args.max_downsample if args.scope_grid else (), args.scopes)


CHILD_ARGS = ("family", "dtype", "attention", "channels", "context_dim", "todo", "variants", "scope_grid",
              "max_downsample", "scopes")


def run_child(args, variant: str, px: int, batch: int, ratio: float, cap_mib: float | None = None) -> dict:
    """Measure one forward of ``variant`` in a fresh process (this script, ``--child``); its result dict, with
    ``ok`` false and the ``error`` where the forward failed (a cap) or the child died."""
    spec = {"args": {k: getattr(args, k) for k in CHILD_ARGS}, "variant": variant, "px": px, "batch": batch,
            "ratio": ratio, "cap_mib": cap_mib}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT, env=CHILD_ENV)
    results = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if not results:
        return {"ok": False, "error": f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(results[-1][len(CHILD_MARK):])


def impose_cap(cap_mib: float, device) -> None:
    """Let this process allocate at most ``cap_mib`` more than it holds now; see the module docstring."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + cap_mib * MIB) / total))
        return
    import comfy.model_management

    limit = status_kib("VmData") * 1024 + int(cap_mib * MIB)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))

    def headroom(dev=None, torch_free_too=False):
        free = max(limit - status_kib("VmData") * 1024, 0)
        return (free, free) if torch_free_too else free

    comfy.model_management.get_free_memory = headroom


def lift_cap(device, previous: tuple[int, int]) -> None:
    """Put back the ``RLIMIT_DATA`` that ``impose_cap`` found, so that reporting cannot fail for want of memory."""
    if device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_DATA, previous)


def child_main(spec: dict) -> None:
    """The ``--child`` process: load, warm up, (cap,) measure one forward, print the result on a marked line."""
    args = argparse.Namespace(**spec["args"])
    bench = setup(args)
    model = makers_for(bench, args, spec["ratio"])[spec["variant"]]()
    load(model)
    forward(model, make_inputs(args.family, bench.context_dim, WARMUP_PX, 1, bench.device), bench.device)
    inputs = make_inputs(args.family, bench.context_dim, spec["px"], spec["batch"], bench.device)
    previous = resource.getrlimit(resource.RLIMIT_DATA)
    if spec["cap_mib"] is not None:
        impose_cap(spec["cap_mib"], bench.device)
    try:
        result = {"ok": True, **measure_memory(model, inputs, bench.device), "attention": bench.attention_name}
    except (RuntimeError, MemoryError) as error:  # an allocation over the cap: CPU and CUDA alike
        result = {"ok": False, "error": str(error)[:500]}
    lift_cap(bench.device, previous)
    print(CHILD_MARK + json.dumps(result), flush=True)


def memory_mode(args, device) -> str:
    """``--memory``, with ``auto`` resolved: a child per variant on the CPU, this process on CUDA."""
    if args.memory != "auto":
        return args.memory
    return "in-process" if device.type == "cuda" else "child"


MEMORY_KEYS = ("model MiB", "peak MiB", "attention MiB")


def timing_fields(best: dict, batch: int, in_patches: dict, distance: dict) -> dict[str, dict]:
    """The timing fields of each variant's row (seconds, per image, speed-ups, time in the patches, output
    distance) from its best seconds; None where not measured."""
    def ratio(a, b):
        return None if a is None or b is None else a / b

    return {name: {"seconds": best[name], "s/image": ratio(best[name], batch),
                   "speed-up": ratio(best["none"], best[name]), "vs core": ratio(best.get("core"), best[name]),
                   "in patches": in_patches.get(name), "relative distance": distance.get(name)} for name in best}


def time_variants(bench: Bench, args, models: dict, inputs: Inputs) -> dict[str, dict]:
    """A warm-up forward of each variant (output distance, time in the patches), then ``args.repeats``
    round-robin timed forwards; the timing fields of each variant's row (see ``timing_fields``)."""
    device, batch = bench.device, inputs.x.shape[0]
    load(models["none"])
    baseline = forward(models["none"], inputs, device).float()
    distance, in_patches = {}, {}
    for name, m in models.items():
        timed_model, spent = with_patch_timer(m, device)
        load(timed_model)
        out = forward(timed_model, inputs, device).float()
        distance[name] = float((out - baseline).norm() / baseline.norm())
        in_patches[name] = spent[0]
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            load(m)
            start = time.perf_counter()
            forward(m, inputs, device)
            times[name].append(time.perf_counter() - start)
    return timing_fields({name: min(t) for name, t in times.items()}, batch, in_patches, distance)


def memory_of(bench: Bench | None, args, names, models: dict | None, inputs: Inputs | None, mode: str, px: int,
              batch: int, ratio: float) -> dict:
    """The ``MEMORY_KEYS``, the measured forward's ``seconds`` and the ``attention`` function of each variant,
    measured as ``mode`` says (``models`` and ``inputs``: this process's, for "in-process"); None where not
    measured or where the child failed (its error is printed)."""
    results = {}
    for name in names:
        if mode == "child":
            result = run_child(args, name, px, batch, ratio)
            if not result["ok"]:
                print(f"memory of {name} at {px} px: {result['error']}", file=sys.stderr, flush=True)
        elif mode == "in-process":
            result = {**measure_memory(models[name], inputs, bench.device), "attention": bench.attention_name}
        else:
            result = {}
        results[name] = {key: result.get(key) for key in (*MEMORY_KEYS, "seconds", "attention")}
    return results


def variant_names(args, with_todo=True) -> list[str]:
    """The names of the variants ``args`` asks for, in the order of ``variant_makers``."""
    return ["none", *args.variants, *(f"todo-{f}" for f in (args.todo if with_todo else ())),
            *(f"{short}-ds{d}" for d in (args.max_downsample if args.scope_grid else ()) for short in SCOPES
              if short in args.scopes)]


def run(args, nodes=None) -> list[dict]:
    """The rows, one per size, batch, ratio and variant; ``nodes``: ComfyUI's, where already booted.

    With ``--repeats 0`` and children this process builds no model, so that a large one is held once."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = memory_mode(args, device)
    bench = setup(args, nodes) if args.repeats or mode == "in-process" else None
    rows = []
    for px in args.px:
        for batch in args.batch:
            inputs = make_inputs(args.family, bench.context_dim, px, batch, device) if bench else None
            for i, ratio in enumerate(args.ratio):
                names = variant_names(args, i == 0)
                models = ({name: make() for name, make in makers_for(bench, args, ratio, i == 0).items()}
                          if bench else None)
                # timed first: in this process, the memory forwards then come warm
                timing = time_variants(bench, args, models, inputs) if args.repeats else None
                memory = memory_of(bench, args, names, models, inputs, mode, px, batch, ratio)
                one_forward = {name: m.pop("seconds") for name, m in memory.items()}
                # --repeats 0: no round-robin; the memory forward's time (with children, each in a fresh process)
                timing = timing or timing_fields(one_forward, batch, {}, {})
                for name in names:
                    attention = memory[name].pop("attention") or (bench.attention_name if bench else None)
                    rows.append({"family": args.family, "px": px, "batch": batch, "dtype": args.dtype,
                                 "ratio": None if name.startswith("todo") else ratio, "attention": attention,
                                 "device": device.type, "variant": name, "memory": mode, **timing[name],
                                 **memory[name]})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def largest_under_cap(fits, sizes: list[int]):
    """The largest of the ascending ``sizes`` for which ``fits(size)``, by bisection (fitting is taken to be
    monotone in the size); None when even the smallest does not fit. Returns it and what each try gave."""
    tried = {}

    def check(i):
        tried[sizes[i]] = fits(sizes[i])
        return tried[sizes[i]]

    if not check(0):
        return None, tried
    lo, hi = 0, len(sizes) - 1  # sizes[lo] fits; above hi nothing is known to fit
    if check(hi):
        return sizes[hi], tried
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if check(mid):
            lo = mid
        else:
            hi = mid - 1
    return sizes[lo], tried


def run_cap(args) -> list[dict]:
    """For each variant, the largest image (64 px steps in ``args.cap_px``) whose forward fits ``--cap-mib``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lo, hi = args.cap_px
    sizes = list(range(lo, hi + 1, 64))
    rows = []
    for name in variant_names(args):
        def fits(px, name=name):
            result = run_child(args, name, px, args.batch[0], args.ratio[0], args.cap_mib)
            print(json.dumps({"variant": name, "px": px, "fits": result["ok"], "error": result.get("error")}),
                  flush=True)
            return result["ok"]

        largest, tried = largest_under_cap(fits, sizes)
        rows.append({"family": args.family, "dtype": args.dtype, "attention": args.attention or "default",
                     "device": device.type, "batch": args.batch[0], "ratio": args.ratio[0], "variant": name,
                     "cap MiB": args.cap_mib, "px range": [lo, hi], "largest px": largest,
                     "tried": {str(px): ok for px, ok in sorted(tried.items())}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fmt(value, spec: str, missing: str = "n/a", unit: str = "") -> str:
    """``value`` formatted with ``spec`` and ``unit``; ``missing`` where it is None (not measured)."""
    return missing if value is None else format(value, spec) + unit


def markdown(rows: list[dict]) -> str:
    lines = ["| model | px | batch | ratio | variant | time (s) | s/image | vs no patch | vs core node "
             "| in patches (s) | output distance | peak MiB | attention MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} {r['dtype']} | {r['px']} | {r.get('batch', 1)} | {fmt(r['ratio'], '', '-')} "
                     f"| {r['variant']} | {fmt(r['seconds'], '.2f')} | {fmt(r.get('s/image', r['seconds']), '.2f')} "
                     f"| {fmt(r['speed-up'], '.2f', unit='x')} | {fmt(r['vs core'], '.2f', unit='x')} "
                     f"| {fmt(r['in patches'], '.2f')} "
                     f"| {fmt(r['relative distance'], '.3f')} | {fmt(r['peak MiB'], '.0f')} "
                     f"| {fmt(r.get('attention MiB'), '.0f')} |")
    return "\n".join(lines)


def cap_markdown(rows: list[dict]) -> str:
    lines = ["| model | attention | batch | variant | cap MiB | largest px | sizes tried |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["px range"]
        largest = f"< {lo}" if r["largest px"] is None else f"{r['largest px']}{'+' if r['largest px'] == hi else ''}"
        tried = ", ".join(f"{px}{'' if ok else ' (fails)'}" for px, ok in r["tried"].items())
        lines.append(f"| {r['family']} {r['dtype']} | {r['attention']} | {r['batch']} | {r['variant']} "
                     f"| {r['cap MiB']:.0f} | {largest} | {tried} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    batches = sorted({r.get("batch", 1) for r in rows})
    for px in sorted({r["px"] for r in rows}):
        for batch in batches:
            at = [r for r in rows if r["px"] == px and r.get("batch", 1) == batch]
            suffix = f" {px}px" + (f" x{batch}" if len(batches) > 1 else "")
            for variant in dict.fromkeys(r["variant"] for r in at):
                points = sorted((r["ratio"], r["speed-up"]) for r in at if r["variant"] == variant
                                and r["ratio"] is not None)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=variant + suffix)
                else:  # ToDo: no ratio, a level line across the plot
                    (speed_up,) = [r["speed-up"] for r in at if r["variant"] == variant]
                    ax.axhline(speed_up, linestyle="--", linewidth=1, label=variant + suffix,
                               color=f"C{len(ax.lines) % 10}")
    ax.set_xlabel("ratio")
    ax.set_ylabel("speed-up over no patch")
    ax.set_title(f"{rows[0]['family']} U-Net forward, {rows[0]['device']}, {rows[0]['attention']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["sd15", "sdxl"], default="sd15")
    parser.add_argument("--px", type=int, nargs="+", default=[512], help="image sizes (square), in pixels")
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="batch sizes: latent, context and conditioning batched; rows give seconds per image")
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.5], help="ToMe ratios to run")
    parser.add_argument("--todo", type=int, nargs="*", default=[2, 3],
                        help="ToDo downsample factors to run (default 2 3; --todo alone: none)")
    parser.add_argument("--variants", nargs="*", choices=FIXED_VARIANTS + OPTIONAL_VARIANTS,
                        default=list(FIXED_VARIANTS), help="which fixed variants to run beside no patch")
    parser.add_argument("--scope-grid", action="store_true", help="Apply ToMe at every scope and max_downsample")
    parser.add_argument("--max-downsample", type=int, nargs="+", default=[1, 2, 4],
                        help="the max_downsample values of --scope-grid")
    parser.add_argument("--scopes", nargs="+", choices=list(SCOPES), default=list(SCOPES),
                        help="the scopes of --scope-grid (default: all three)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default=None,
                        help="ComfyUI's attention backend: split (--use-split-cross-attention), sub-quadratic "
                             "(--use-quad-cross-attention, the CPU default), sdpa (--use-pytorch-cross-attention, "
                             "the CUDA default); default: ComfyUI's choice for the device")
    parser.add_argument("--sdpa", dest="attention", action="store_const", const="sdpa",
                        help="alias of --attention sdpa")
    parser.add_argument("--channels", type=int, default=None,
                        help="narrow the U-Net to this many base channels (layout kept; smoke runs)")
    parser.add_argument("--context-dim", type=int, default=None, help="narrow the text context (smoke runs)")
    parser.add_argument("--memory", choices=MEMORY_MODES, default="auto",
                        help="peak memory: a fresh child process per variant (CPU default), this process "
                             "(CUDA default; on the CPU biased by earlier variants), or off")
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="instead of timing: the largest px each variant completes using at most this many "
                             "MiB above the loaded model (batch and ratio: the first given)")
    parser.add_argument("--cap-px", type=int, nargs=2, default=[512, 2048], metavar=("LO", "HI"),
                        help="the size range --cap-mib searches, in 64 px steps")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed forwards per variant, the minimum kept; 0: no warm-up and no round-robin, "
                             "only the memory forward, timed (with --memory child: one forward in a fresh process)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for the results")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measured forward, see run_child
    args = parser.parse_args(argv)
    if args.repeats == 0 and args.memory == "off":
        parser.error("--repeats 0 times the memory forwards only: it needs --memory other than off")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"unet_{args.family}_{args.dtype}_{args.attention or 'default'}"
    if args.cap_mib is not None:
        rows = run_cap(args)
        stem = f"{stem}_cap{args.cap_mib:.0f}"
        table = cap_markdown(rows)
    else:
        rows = run(args)
        table = markdown(rows)
        if args.repeats:
            plot(rows, args.out / f"{stem}.png")
    record = {"machine": machine.describe(), "argv": sys.argv[1:], "rows": rows}
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2))
    (args.out / f"{stem}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
