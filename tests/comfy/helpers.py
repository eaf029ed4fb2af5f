"""Small tools for the in-process tests: forwards as the sampler makes them, and what reaches self-attention."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from dataclasses import dataclass

import torch

from tome_harness import dit_models
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


# The DiT tests' texts: cond and uncond of different lengths, so they run as separate model calls, and what the
# families' text encoders add beside them.
COND_TEXT, UNCOND_TEXT = 7, 5
BYT5, VISION, LLAMA = 4, 3, 3  # HunyuanVideo 1.5's glyph and vision tokens, HiDream's LLM tokens (used twice)
# Mochi's T5 mask: the prompt's own tokens of cond's 7 (padding after them) and uncond's 5; its blocks join only these.
MOCHI_PROMPT = {COND_TEXT: 4, UNCOND_TEXT: UNCOND_TEXT}


def clip_vision_output(**states):
    """ComfyUI's CLIP vision output (``comfy.clip_vision.Output``) holding ``states``."""
    import comfy.clip_vision

    out = comfy.clip_vision.Output()
    for name, value in states.items():
        out[name] = value
    return out


def dit_family_conds(family, text, context_dim):
    """What a DiT family's text encoders and nodes add to the conditioning of ``text`` tokens besides them."""
    generator = torch.Generator().manual_seed(6)
    if family == "ltxv":  # its T5 encoder always hands over the text's mask (cross-attention only)
        return {"attention_mask": torch.ones(1, text, dtype=torch.long)}
    if family == "hunyuan_video15":
        return {"conditioning_byt5small": torch.randn(1, BYT5, 1472, generator=generator),
                "clip_vision_output": clip_vision_output(
                    last_hidden_state=torch.randn(1, VISION, context_dim, generator=generator))}
    if family == "wan21_i2v":
        return {"clip_vision_output": clip_vision_output(
            penultimate_hidden_states=torch.randn(1, 4, 1280, generator=generator))}
    if family == "hidream":  # [B, LLM layers, tokens, width]
        return {"conditioning_llama3": torch.randn(1, 2, LLAMA, context_dim, generator=generator)}
    if family == "mochi":  # its T5 encoder hands over the mask, ones over the prompt, zeros over the padding
        mask = torch.zeros(1, text, dtype=torch.long)
        mask[:, :MOCHI_PROMPT[text]] = 1
        return {"attention_mask": mask}
    return {}


# The DiT tests' latent: 5x6 patches (30 tokens), 3x3 cells of 2x2: 10x12 under 2x2 patches; the video models have 3
# frames of them, Qwen-Image one; LTX-Video and Flux 2 patch 1x1, Chroma Radiance 16x16 pixels.
VIDEO = (1, 16, 3, 10, 12)
LATENTS = {"wan21": VIDEO, "wan21_fun": VIDEO, "qwen_image": (1, 16, 1, 10, 12), "hunyuan_video": VIDEO,
           "hunyuan_video15": (1, 32, 3, 10, 12), "hunyuan_image21": (1, 64, 5, 6), "ltxv": (1, 128, 3, 5, 6),
           "wan22_5b": (1, 48, 3, 10, 12), "wan21_i2v": VIDEO, "wan21_vace": VIDEO, "cosmos_predict2": VIDEO,
           "flux2": (1, 128, 5, 6), "chroma_radiance": (1, 3, 80, 96), "wan22_animate": VIDEO, "wan22_s2v": VIDEO,
           "wan21_humo": VIDEO, "mochi": (1, 12, 3, 10, 12), "cosmos1": VIDEO, "wan22_fun_control": VIDEO}
LATENT = (1, 16, 10, 12)


def dit_conditioning(family, references=None):
    """cond and uncond (with different text lengths), both with the family's extra conds and ``references``
    (conds naming edit, reference or guide latents)."""
    generator = torch.Generator().manual_seed(5)
    extra = {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM), **(references or {})}
    return tuple([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator),
                   dict(extra, **dit_family_conds(family, text, dit_models.CONTEXT_DIM))]]
                  for text in (COND_TEXT, UNCOND_TEXT))


def dit_sample(comfy_nodes, model, family, seed=3, steps=2, references=None, latent_shape=None, conditioned=None):
    """A real KSampler run at cfg 2; ``conditioned``: the ``(positive, negative, latent)`` a conditioning node
    made, in place of the test's own."""
    positive, negative = dit_conditioning(family, references)
    latent = {"samples": torch.zeros(latent_shape or LATENTS.get(family, LATENT))}
    if conditioned is not None:
        positive, negative, latent = conditioned
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


def record_lengths(calls):
    """An attention override noting the (query, key) lengths of every call in ``calls``, whatever the tensor
    layout, then running the attention."""

    def record(func, *args, **kwargs):
        axis = 2 if kwargs.get("skip_reshape", False) else 1  # [B, H, L, D] or [B, L, ...]
        calls.append((args[0].shape[axis], args[1].shape[axis]))
        return func(*args, **kwargs)

    return record


def another_nodes_replacement(*keys):
    """Another node's ``dit`` replacement on the blocks ``keys`` (``(kind, index)``), recording the image length
    each call hands it and running the block: the function that puts it on a clone, and the record."""
    seen = []

    def block(args, extra):
        seen.append(args["img"].shape[1])
        return extra["original_block"](args)

    def put(model):
        model = model.clone()
        for kind, index in keys:
            model.set_model_patch_replace(block, "dit", kind, index)
        return model

    return put, seen


# The block scope's checks through the sampler, on any DiT it reaches: ``run(model)`` samples a model.

def check_block_scope_off_is_the_model(pack, model, run, blocks):
    """ToDo and ToMe at the block scope (``blocks``: the node inputs) undone by ratio 0 and factor 1, and a step
    window no step falls in, sample the model bit for bit; both on, it differs."""
    reference = run(model)
    both = pack.dit.apply_tome_dit(pack.dit.apply_todo_dit(model, downsample_factor=2, **blocks), ratio=0.5, **blocks)
    removed = pack.dit.apply_todo_dit(pack.dit.apply_tome_dit(both, ratio=0.0, **blocks), downsample_factor=1,
                                      **blocks)
    windowed = pack.dit.apply_tome_dit(model, ratio=0.5, start_percent=0.5, end_percent=0.6, **blocks)
    for patched in (removed, windowed):
        torch.testing.assert_close(run(patched), reference, rtol=0, atol=0)
    reduced = run(both)
    assert torch.isfinite(reduced).all() and (reduced - reference).abs().max() > 1e-3


def check_block_scope_is_seeded_and_not_the_attention_scope(pack, model, run, blocks):
    """ToMe at the block scope: the same seed samples the same, and not what the attention scope samples."""
    block_scope = pack.dit.apply_tome_dit(model, ratio=0.5, seed=7, **blocks)
    first, second = run(block_scope), run(block_scope)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert torch.isfinite(first).all()
    assert (first - run(pack.dit.apply_tome_dit(model, ratio=0.5, seed=7))).abs().max() > 1e-3


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


def check_block_scope_reached_without_a_warning(pack, models, caplog):
    """Apply ToDo at the block scope on each of ``models`` keeps the block scope and says nothing of a fallback (no
    skips: the test models have too few blocks for the default's to leave one)."""
    with caplog.at_level(logging.WARNING):
        for model in models:
            patched = pack.dit.apply_todo_dit(model, downsample_factor=2, dit_scope="block", skip_first_blocks=0,
                                              skip_last_blocks=0)
            assert patched.model_options["transformer_options"]["optimized_attention_override"].todo.scope == "block"
    assert "does not reach" not in caplog.text
