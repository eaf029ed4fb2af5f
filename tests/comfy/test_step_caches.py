"""Apply ToMe / ToDo under the step caches people install: TeaCache, MagCache and First Block Cache, from their
pinned copies (``tome_harness.step_caches``), in the real ComfyUI, on the tiny random DiTs, sampled by KSampler.

Their forwards replace the model's and call the blocks without ``transformer_options`` (or put them in the
replacement's ``extra``; First Block Cache on SD3.5, HunyuanVideo and LTX-Video swaps the block lists for one
cached block instead). For every family each pack covers and both scopes, a run of the cache alone and one with
our node on top (same seed) are compared:

- where the reduction acts, exactly the tokens it removes are missing: every linear layer of the model's blocks
  sees the whole run's token counts less the removed image tokens (block scope), or every image self-attention
  call the whole run's lengths less them (attention scope); and the sample differs from the cache alone;
- where it cannot, one warning in the run says why, nothing is reduced, and the sample is the cache alone's bit
  for bit.

What acts where is the table of docs/SPEED_STACK.md ("Third-party step caches"). A pack's forward that fails on
this host by itself is skipped, naming the error, and a test checks it still fails (else the table is stale).
The default run keeps one family of each pack (Flux, Wan VACE under MagCache, SD3.5 under First Block Cache); CI
runs every family.
"""

from __future__ import annotations

import contextlib
import logging
import os

import pytest
import torch
from helpers import LATENT, LATENTS, dit_sample, record_lengths

from tome_harness import dit_models, step_caches
from tome_harness.step_caches import FIRST_BLOCK_CACHE, MAGCACHE, PACKS, TEACACHE

ATTENTION, BLOCK = "attention", "block"
# Where the attention scope acts: the cache's forward hands the blocks their transformer_options (MagCache's
# HunyuanVideo 1.5 forward hands them to its text refiner alone: no image attention reaches the override).
ATTENTION_ACTS = {(MAGCACHE, "qwen_image"), (FIRST_BLOCK_CACHE, "sd3"),
                  (FIRST_BLOCK_CACHE, "hunyuan_video"), (FIRST_BLOCK_CACHE, "ltxv")}
# Where the block scope cannot act: First Block Cache swapped the block lists for its one cached block.
BLOCKS_REPLACED = {(FIRST_BLOCK_CACHE, "sd3"), (FIRST_BLOCK_CACHE, "hunyuan_video"), (FIRST_BLOCK_CACHE, "ltxv")}
WARNINGS = {ATTENTION: "reached its attention override", BLOCK: "reached its block replacements",
            "replaced": "the model's blocks were replaced"}
DEFAULT_RUN = {(TEACACHE, "flux"), (MAGCACHE, "wan21_vace"), (FIRST_BLOCK_CACHE, "sd3")}
CASES = [pytest.param(cache, family, marks=() if (cache, family) in DEFAULT_RUN else pytest.mark.slow,
                      id=f"{cache}-{family}") for cache in PACKS for family in PACKS[cache].families]
IMAGE = 30  # the tiny models' 5x6 patches a frame
BLOCK_LISTS = ("double_blocks", "single_blocks", "joint_blocks", "blocks", "transformer_blocks", "layers",
               "double_stream_blocks", "single_stream_blocks")


@pytest.fixture(scope="module")
def caches(comfy_nodes):
    if not step_caches.THIRDPARTY.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"CI has no pinned step-cache packs at {step_caches.THIRDPARTY}")
        pytest.skip(f"no pinned step-cache packs at {step_caches.THIRDPARTY} (shared/thirdparty beside the repo)")
    return step_caches.load(comfy_nodes)


@pytest.fixture(scope="module")
def models(comfy_nodes):
    """The tiny DiTs by family, each built when a test first asks for it (``model_of``): the default run needs
    three of the twelve."""
    return {}


def model_of(models, family):
    if family not in models:
        models[family] = dit_models.build_dit_model(family)
    return models[family]


def steps_for(cache):
    return max(4, PACKS[cache].min_steps)


def skip_where_the_pack_fails(cache, family):
    if family in PACKS[cache].fails:
        pytest.skip(f"{cache}'s own forward fails on this host for {family}: {PACKS[cache].fails[family]}")


def image_tokens(family):
    latent = LATENTS.get(family, LATENT)
    return IMAGE * (latent[2] if len(latent) == 5 else 1)


@contextlib.contextmanager
def linear_lengths(model):
    """The token counts (dim 1 of 3-D inputs) every linear layer of the model's main blocks sees."""
    lengths = set()
    net = model.get_model_object("diffusion_model")
    hooks = [linear.register_forward_pre_hook(lambda m, a: lengths.add(a[0].shape[1]) if a[0].ndim == 3 else None)
             for name in BLOCK_LISTS for block in getattr(net, name, None) or ()
             for linear in block.modules() if isinstance(linear, torch.nn.Linear)]
    try:
        yield lengths
    finally:
        for hook in hooks:
            hook.remove()


def traced(comfy_nodes, caches, models, cache, family, apply=None, order="cache first"):
    """Sample ``family`` under ``cache`` (a pack's name) and, with ``apply``, our node (applied after the cache, or
    before it): the sample, the block linears' token counts and the (query, key) lengths of the attention calls
    that reached the override chain (a recorder put on the model before ours, which ours calls)."""
    model, attention = model_of(models, family).clone(), []
    model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        record_lengths(attention)

    def cached(m):
        return step_caches.cached(caches, cache, m, family)

    patched = cached(model) if apply is None else apply(cached(model)) if order == "cache first" else \
        cached(apply(model))
    with linear_lengths(model) as lengths:
        out = dit_sample(comfy_nodes, patched, family, steps=steps_for(cache))
    return out, lengths, set(attention)


def tome_advanced(pack_nodes, dit_scope):
    def apply(model):
        (out,) = pack_nodes.ApplyToMeAdvanced.execute(
            model=model, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
            merge="q, k and v", start_percent=0.0, end_percent=1.0, dit_scope=dit_scope, skip_first_blocks=0,
            skip_last_blocks=0).result
        return out
    return apply


def without(lengths, n, removed):
    """``lengths`` of sequences holding ``n`` image tokens less ``removed`` of them."""
    return {length - removed if length >= n else length for length in lengths}


def self_attention_without(pairs, n, removed, keys_only=False):
    """(query, key) lengths with the image self-attention calls' ``removed`` tokens gone from both (ToMe) or
    from the keys alone (ToDo)."""
    return {(q if keys_only else q - removed, k - removed) if q == k >= n else (q, k) for q, k in pairs}


def warnings_of(caplog, scope_or_cause):
    return [r for r in caplog.records if WARNINGS[scope_or_cause] in r.getMessage()]


def expected_warning(cache, family, scope):
    """The warning the run gives, or ``None`` where the reduction acts."""
    if scope == BLOCK:
        return "replaced" if (cache, family) in BLOCKS_REPLACED else None
    return None if (cache, family) in ATTENTION_ACTS else ATTENTION


@pytest.mark.parametrize("scope", (ATTENTION, BLOCK))
@pytest.mark.parametrize(("cache", "family"), CASES)
def test_under_a_step_cache_the_reduction_acts_exactly_or_warns_once(comfy_nodes, pack, caches, models, cache,
                                                                     family, scope, caplog):
    skip_where_the_pack_fails(cache, family)
    alone, alone_lengths, alone_attention = traced(comfy_nodes, caches, models, cache, family)
    n, removed = image_tokens(family), image_tokens(family) // 2
    with caplog.at_level(logging.WARNING):
        ours, lengths, attention = traced(comfy_nodes, caches, models, cache, family, tome_advanced(pack.nodes, scope))
    warning = expected_warning(cache, family, scope)
    if warning is None:
        assert not warnings_of(caplog, scope)
        if scope == BLOCK:
            assert lengths == without(alone_lengths, n, removed)
        else:
            assert attention == self_attention_without(alone_attention, n, removed) != alone_attention
        assert torch.isfinite(ours).all() and (ours - alone).abs().max() > 1e-4
    else:
        assert len(warnings_of(caplog, warning)) == 1, caplog.text
        assert lengths == alone_lengths and attention == alone_attention
        torch.testing.assert_close(ours, alone, rtol=0, atol=0)


def apply_tome(pack_nodes):
    def apply(model):
        (out,) = pack_nodes.ApplyToMe.execute(model=model, ratio=0.5, stride_x=2, stride_y=2,
                                              max_downsample="auto").result
        return out
    return apply


def apply_todo(pack_nodes, dit_scope):
    def apply(model):
        (out,) = pack_nodes.ApplyToDo.execute(model=model, downsample_factor=2, max_downsample="auto",
                                              method="nearest", start_percent=0.0, end_percent=1.0,
                                              dit_scope=dit_scope, skip_first_blocks=0, skip_last_blocks=0).result
        return out
    return apply


@pytest.mark.parametrize("order", ("cache first", "ours first"))
def test_every_node_in_either_order_under_teacache_on_flux(comfy_nodes, pack, caches, models, order, caplog):
    """Apply ToDo at the block scope pools the image to 3x3 cells in every block; Apply ToMe and Apply ToDo at the
    attention scope say, once, that TeaCache's forward leaves their override out of reach."""
    alone, alone_lengths, _ = traced(comfy_nodes, caches, models, TEACACHE, "flux")
    for apply, acts in ((apply_todo(pack.nodes, BLOCK), True), (apply_todo(pack.nodes, ATTENTION), False),
                        (apply_tome(pack.nodes), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            out, lengths, _ = traced(comfy_nodes, caches, models, TEACACHE, "flux", apply, order)
        if acts:
            assert lengths == without(alone_lengths, IMAGE, IMAGE - 9) and not warnings_of(caplog, BLOCK)
            assert (out - alone).abs().max() > 1e-4
        else:
            assert len(warnings_of(caplog, ATTENTION)) == 1, caplog.text
            torch.testing.assert_close(out, alone, rtol=0, atol=0)


def test_each_run_warns_again(comfy_nodes, pack, caches, models, caplog):
    """The warning is once per sampling run, not once per process: a user's second run is told again."""
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            traced(comfy_nodes, caches, models, TEACACHE, "flux", apply_tome(pack.nodes))
    assert len(warnings_of(caplog, ATTENTION)) == 2


@pytest.mark.parametrize(("cache", "family"), [pytest.param(cache, family, id=f"{cache}-{family}")
                                               for cache in PACKS for family in PACKS[cache].fails])
def test_a_packs_own_failure_on_this_host_is_still_its_own(comfy_nodes, caches, models, cache, family):
    """The forwards the table marks as failing on this host fail with no node of ours in the graph: when one
    runs, the table and docs/SPEED_STACK.md ("Third-party step caches") are stale."""
    with pytest.raises(Exception) as failure:
        traced(comfy_nodes, caches, models, cache, family)
    assert type(failure.value).__name__ in PACKS[cache].fails[family]
