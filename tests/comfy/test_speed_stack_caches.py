"""Step caches stacked with the pack's nodes: core ``EasyCache`` and ``LazyCache`` (ComfyUI 0.3.75,
``comfy_extras/nodes_easycache.py``) with Apply ToMe, Apply ToMe (Advanced) and Apply ToDo, the cache before and
after our node in the chain, on the tiny SD1.5 U-Net and tiny Flux and Wan 2.1, sampled by the real KSampler.

The caches decide from the model's own outputs whether to skip a step. Their default threshold (0.2) skips
little on random-weight models in a few steps, so each case names a threshold that makes the cache skip some
of the 6 steps and run others (found by sampling these models; the tests fail, saying so, where it no longer
does).

What is counted, per run:
- the steps that ran: the distinct sigmas that reached self-attention; fewer than the schedule's, and as many
  as the schedule's less the cache's own count of skipped steps (its log line "skipped N/M steps");
- every step that ran made as many attention calls as the first (no half-run step);
- the reduction: on every step that ran, the reduced attention calls got the reduced key count, and no
  unreduced image self-attention reached attention.
Same seed, same image: each case samples twice and compares.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import pytest
import torch
from helpers import conditioning, sd15_level, self_attention_calls

from tome_harness import dit_models

STEPS = 6
SKIPPED = re.compile(r"(EasyCache|LazyCache) - skipped (\d+)/(\d+) steps")
BEFORE, AFTER = "cache before ours", "cache after ours"


def tome(pack, model):
    (out,) = pack.nodes.ApplyToMe.execute(model=model, ratio=0.5, stride_x=2, stride_y=2,
                                          max_downsample="auto").result
    return out


def tome_reuse(pack, model):
    (out,) = pack.nodes.ApplyToMeAdvanced.execute(
        model=model, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
        merge="q, k and v", start_percent=0.0, end_percent=1.0, scope="self-attention", reuse_steps=3).result
    return out


def todo(pack, model):
    (out,) = pack.nodes.ApplyToDo.execute(model=model, downsample_factor=2, max_downsample="auto",
                                          method="nearest", start_percent=0.0, end_percent=1.0).result
    return out


NODES = {"ApplyToMe": tome, "ApplyToMeAdvanced": tome_reuse, "ApplyToDo": todo}


def cached(comfy_nodes, model, cache: str, threshold: float):
    """``model`` through the real cache node, active over the whole schedule."""
    (out,) = comfy_nodes.NODE_CLASS_MAPPINGS[cache].execute(model=model, reuse_threshold=threshold,
                                                            start_percent=0.0, end_percent=1.0,
                                                            verbose=False).result
    return out


def stack(comfy_nodes, pack, model, node: str, cache: str, threshold: float, order: str):
    if order == BEFORE:
        return NODES[node](pack, cached(comfy_nodes, model, cache, threshold))
    return cached(comfy_nodes, NODES[node](pack, model), cache, threshold)


def cache_skipped(caplog) -> int:
    """The cache's own count of skipped steps in the last run, from its log line."""
    found = [m for m in SKIPPED.finditer(caplog.text)]
    assert found, "the cache logged no count of skipped steps"
    name, skipped, total = found[-1].groups()
    assert int(total) == STEPS
    return int(skipped)


def check_steps(calls_by_step: dict, skipped: int):
    """The steps that ran (distinct sigmas) against the cache's own count, and whole steps only."""
    ran = len(calls_by_step)
    assert 2 <= ran < STEPS, f"the cache skipped no step (ran {ran} of {STEPS}); raise its threshold"
    assert ran + skipped == STEPS
    counts = {len(calls) for calls in calls_by_step.values()}
    assert len(counts) == 1, f"steps ran with different numbers of attention calls: {counts}"


# SD1.5: 16x16 latent, so the attn1 blocks at downsample 1 see 256 tokens; ToMe 0.5 leaves 128 keys, ToDo 2 64.
SD15_KEYS = {"ApplyToMe": 128, "ApplyToMeAdvanced": 128, "ApplyToDo": 64}
SD15_THRESHOLDS = {"EasyCache": 1.5, "LazyCache": 0.2}


def sample_sd15(comfy_nodes, model, seed=3):
    positive, negative = conditioning()
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    (out,) = comfy_nodes.KSampler().sample(model, seed, STEPS, 4.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


def run_sd15(comfy_nodes, model, caplog):
    """One sampling run: the image, the attn1 calls by sigma, the cache's skipped count."""
    caplog.clear()
    with caplog.at_level(logging.INFO), self_attention_calls(model) as calls:
        out = sample_sd15(comfy_nodes, model)
    by_step = defaultdict(list)
    for call in calls:
        by_step[call.sigma].append(call)
    return out, by_step, cache_skipped(caplog)


def check_sd15(comfy_nodes, pack, sd15, node, cache, order, caplog):
    model = stack(comfy_nodes, pack, sd15, node, cache, SD15_THRESHOLDS[cache], order)
    first, by_step, skipped = run_sd15(comfy_nodes, model, caplog)
    second, _, skipped_again = run_sd15(comfy_nodes, model, caplog)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert skipped_again == skipped
    check_steps(by_step, skipped)
    for sigma, calls in by_step.items():
        finest = [c for c in calls if sd15_level(c.module) == 1]
        assert finest and all(c.keys == SD15_KEYS[node] for c in finest), (sigma, finest)
        assert all(c.keys == c.queries for c in calls if sd15_level(c.module) > 1)  # coarser blocks untouched


@pytest.mark.parametrize("order", [AFTER, BEFORE])
def test_easycache_and_tome_reuse_on_sd15(comfy_nodes, pack, sd15, order, caplog):
    check_sd15(comfy_nodes, pack, sd15, "ApplyToMeAdvanced", "EasyCache", order, caplog)


@pytest.mark.slow
@pytest.mark.parametrize("order", [AFTER, BEFORE])
@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
@pytest.mark.parametrize("node", list(NODES))
def test_step_caches_with_each_node_on_sd15(comfy_nodes, pack, sd15, node, cache, order, caplog):
    if (node, cache) == ("ApplyToMeAdvanced", "EasyCache"):
        pytest.skip("run by test_easycache_and_tome_reuse_on_sd15")
    check_sd15(comfy_nodes, pack, sd15, node, cache, order, caplog)


# reuse_steps across skipped steps: a plan made at step s serves steps s, s+1, s+2 of the schedule, counted by
# the step's place in the schedule (SamplingRun.step), not by how many steps ran since.

def plan_groups(steps: list[int], reuse: int, by_schedule: bool) -> list[bool]:
    """For each step that ran (in order), whether it gets a fresh plan: by the schedule's step index, or
    (the wrong way, for contrast) by the number of steps that ran since the plan was made."""
    fresh, made = [], None
    for i, step in enumerate(steps):
        age = None if made is None else (step - steps[made] if by_schedule else i - made)
        new = age is None or age >= reuse
        made = i if new else made
        fresh.append(new)
    return fresh


@pytest.mark.parametrize("cache,threshold", [("EasyCache", 1.5), ("LazyCache", 0.1)])
def test_reuse_steps_plans_count_schedule_steps_across_skipped_steps(comfy_nodes, pack, sd15, cache, threshold):
    plans = []  # (step index, block, plan), in call order

    def spy(n, context, value, extra_options):
        # Appended after ours: sees the plan our attn1 patch left for its unmerge (PLAN_KEY), and the schedule.
        schedule = [float(s) for s in extra_options["sample_sigmas"].flatten()]
        step = schedule.index(float(extra_options["sigmas"].flatten()[0]))
        plans.append((step, (extra_options["block"], extra_options["block_index"]),
                      extra_options.get(pack.unet.PLAN_KEY)))
        return n, context, value

    model = cached(comfy_nodes, tome_reuse(pack, sd15), cache, threshold)
    model.set_model_attn1_patch(spy)
    sample_sd15(comfy_nodes, model)
    steps = sorted({step for step, _, _ in plans})
    assert len(steps) < STEPS, f"{cache} skipped no step at threshold {threshold}"
    expected = plan_groups(steps, 3, by_schedule=True)
    assert expected != plan_groups(steps, 3, by_schedule=False), \
        f"the steps that ran ({steps}) cannot tell schedule steps from steps run: pick another threshold"
    by_block = defaultdict(list)
    for step, block, plan in plans:
        by_block[block].append((step, plan))
    merged_blocks = [calls for calls in by_block.values() if calls[0][1] is not None]
    assert merged_blocks, "no block was merged"
    for calls in merged_blocks:
        assert [step for step, _ in calls] == steps
        got = [i == 0 or plan is not calls[i - 1][1] for i, (_, plan) in enumerate(calls)]
        assert got == expected, (steps, got, expected)


# Flux (5x6 image patches, text 7 and 5 tokens: joint self-attention of 37 and 35) and Wan 2.1 (3 frames of
# 5x6: 90 tokens, no text in self-attention; cross-attention keys 7 and 5).
DIT_LATENTS = {"flux": (1, 16, 10, 12), "wan21": (1, 16, 3, 10, 12)}
DIT_FULL_KEYS = {"flux": {37, 35}, "wan21": {90}}
DIT_KEYS = {("flux", "ApplyToMe"): {22, 20}, ("flux", "ApplyToDo"): {16, 14},
            ("wan21", "ApplyToMe"): {45}, ("wan21", "ApplyToDo"): {27}}
DIT_THRESHOLDS = {("flux", "EasyCache"): 0.5, ("flux", "LazyCache"): 0.3,
                  ("wan21", "EasyCache"): 1.0, ("wan21", "LazyCache"): 1.0}


def with_override(model, override):
    """A clone of ``model`` with ``override`` in the attention override slot (placed before our node, ours
    chains it and calls it instead of the attention: it sees what reaches attention)."""
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    return patched


def token_major(t, kwargs):
    return t.transpose(1, 2) if kwargs.get("skip_reshape") else t


def dit_sample(comfy_nodes, model, family, seed=3, steps=STEPS):
    """A real KSampler run at cfg 2; cond and uncond of 7 and 5 text tokens run as separate model calls."""
    generator = torch.Generator().manual_seed(5)
    positive, negative = ([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator),
                            {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM)}]] for text in (7, 5))
    latent = {"samples": torch.zeros(DIT_LATENTS[family])}
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


@pytest.fixture(scope="module")
def dits(comfy_nodes):
    return {family: dit_models.build_dit_model(family) for family in DIT_LATENTS}


def run_dit(comfy_nodes, model, family, calls, caplog):
    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        out = dit_sample(comfy_nodes, model, family)
    by_step = defaultdict(list)
    for sigma, keys in calls:
        by_step[sigma].append(keys)
    return out, by_step, cache_skipped(caplog)


@pytest.mark.parametrize("order", [AFTER, BEFORE])
@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
@pytest.mark.parametrize("node", ["ApplyToMe", "ApplyToDo"])
@pytest.mark.parametrize("family", ["flux", "wan21"])
def test_step_caches_with_each_node_on_dits(comfy_nodes, pack, dits, family, node, cache, order, caplog):
    """Apply ToMe (Advanced) at the attention scope is Apply ToMe on a DiT (its reuse_steps and scope are ignored
    there), so the two plain nodes cover the DiTs."""
    calls = []

    def record(func, *args, **kwargs):
        # Under ours: what reaches attention.
        sigma = float(kwargs["transformer_options"]["sigmas"].flatten()[0])
        calls.append((sigma, token_major(args[1], kwargs).shape[1]))
        return func(*args, **kwargs)

    model = stack(comfy_nodes, pack, with_override(dits[family], record), node, cache,
                  DIT_THRESHOLDS[family, cache], order)
    first, by_step, skipped = run_dit(comfy_nodes, model, family, calls, caplog)
    second, _, skipped_again = run_dit(comfy_nodes, model, family, calls, caplog)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert skipped_again == skipped
    check_steps(by_step, skipped)
    assert "cannot be stacked" not in caplog.text  # skipped steps call no attention: no dropped-override warning
    for sigma, keys in by_step.items():
        assert set(keys) & DIT_KEYS[family, node], (sigma, keys)  # reduced self-attention on this step
        assert not set(keys) & DIT_FULL_KEYS[family], (sigma, keys)  # and none left whole
