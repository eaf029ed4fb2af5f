"""Small tools for the in-process tests: forwards as the sampler makes them, and what reaches self-attention."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass

import torch

from tome_harness.comfyui import ROOT


def forward(model, x, sigma, context, **conds):
    """One U-Net call with the patcher's transformer options, as ComfyUI's sampler makes it."""
    sigma = torch.full((x.shape[0],), float(sigma))
    options = dict(model.model_options["transformer_options"], sigmas=sigma)
    with torch.inference_mode():
        return model.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **conds)


@dataclass
class AttnCall:
    module: str
    queries: int
    keys: int
    sigma: float | None


@contextlib.contextmanager
def self_attention_calls(model):
    """Record the query and key lengths of every self-attention (attn1) call inside ``model``."""
    calls: list[AttnCall] = []

    def record(name, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        context = kwargs.get("context")
        sigmas = kwargs.get("transformer_options", {}).get("sigmas")
        calls.append(AttnCall(name, x.shape[1], (x if context is None else context).shape[1],
                              None if sigmas is None else float(sigmas.flatten()[0])))

    hooks = [module.register_forward_pre_hook(lambda m, a, k, name=name: record(name, m, a, k), with_kwargs=True)
             for name, module in model.model.diffusion_model.named_modules() if name.endswith(".attn1")]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def token_counts(model, suffix: str):
    """Record the token count of the first input of every module whose name ends with ``suffix``
    (``.attn2`` for cross-attention queries, ``.ff.net`` for what the feed-forward computes on), by module."""
    counts: list[tuple[str, int]] = []
    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: counts.append((name, a[0].shape[1])))
             for name, module in model.model.diffusion_model.named_modules() if name.endswith(suffix)]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def loaded(model):
    """``model`` as ComfyUI's sampler holds it: its object patches applied to the shared U-Net, undone after."""
    model.patch_model()
    try:
        yield model
    finally:
        model.unpatch_model()


SAMPLER_STEPS = 4


def conditioning():
    """Positive and negative conditioning for the 32-wide test models."""
    context = torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(5))
    return [[context, {}]], [[torch.zeros_like(context), {}]]


def sample(comfy_nodes, model, seed=3, positive_negative=None):
    """A real KSampler run: 4 euler steps, cfg 4, on a 16x16 latent."""
    positive, negative = positive_negative or conditioning()
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    (out,) = comfy_nodes.KSampler().sample(model, seed, SAMPLER_STEPS, 4.0, "euler", "normal", positive, negative,
                                           latent)
    return out["samples"]


def random_latent(batch, h, w, seed=0):
    return torch.randn(batch, 4, h, w, generator=torch.Generator().manual_seed(seed))


def random_context(batch, dim=32, seed=1):
    return torch.randn(batch, 77, dim, generator=torch.Generator().manual_seed(seed))


def sdxl_conds(batch):
    """SDXL's ADM vector (pooled text and size embeddings), zeros: shapes are what the tests need."""
    return {"y": torch.zeros(batch, 2816)}


def expected_tokens(n_tokens: int, ratio: float) -> int:
    return n_tokens - int(n_tokens * ratio)


def sd15_level(name: str) -> int:
    """The downsample of an SD1.5 attn1 module from its block name (input_blocks.4 -> 2, ...)."""
    part, index = name.split(".")[:2]
    if part == "middle_block":
        return 8
    index = int(index)
    if part == "input_blocks":
        return 2 ** (index // 3)
    return 2 ** (3 - index // 3)


def load_bench(name: str):
    """``bench/<name>.py`` as a module, registered under ``name`` (its dataclasses look their module up there);
    loaded once per session."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]
