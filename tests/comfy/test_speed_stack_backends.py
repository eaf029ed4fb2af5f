"""An attention backend that reinstalls itself at every step (the late host's core "Model Sparse Attention"
pattern, emulated by ``tome_harness.attention_backend``) stacked with Apply ToMe / Apply ToDo, before and after
them in the node chain.

U-Nets: our patches are attn1 patches, not the override, so the two never compete for the slot: ours merges or
pools before self-attention, and the backend's kernel (U-Net attention goes through ``wrap_attn`` too)
computes on the reduced tensors. DiTs: ours is an override too; the backend, on top after every step's
``prepare_state``, calls ours with its kernel as the attention, so ours reduces and the kernel computes on the
reduced tensors. In both, the image equals that of our node alone (the kernel computes with ComfyUI's own
attention), and the kernel computes exactly as many attentions per step as without our node.

A backend that drops the override it finds (``chains=False``) cannot be stacked with Apply ToMe / ToDo on a
DiT, in either order: it reinstalls itself over ours at every step. Set once at its node instead
(``reinstalls=False``), it works only placed before ours. In the first case ours says so at run time: the layout
wrapper sees an override on top that never calls ours and warns once per sampling run, naming it.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest
import torch
from helpers import conditioning, sd15_level
from test_speed_stack_caches import DIT_FULL_KEYS, DIT_KEYS, DIT_LATENTS, dit_sample, todo, tome

from tome_harness import dit_models
from tome_harness.attention_backend import AttentionBackend, BackendOverride, late_prepare_state

OVERRIDE = "optimized_attention_override"
BEFORE, AFTER = "backend before ours", "backend after ours"
NODES = {"ApplyToMe": tome, "ApplyToDo": todo}
SD15_STEPS, DIT_STEPS = 3, 2


@pytest.fixture
def late_host():
    with late_prepare_state():
        yield


def stacked(pack, model, node, order, backend):
    if order == BEFORE:
        return NODES[node](pack, backend.apply(model))
    return backend.apply(NODES[node](pack, model))


def by_sigma(calls):
    out = defaultdict(list)
    for call in calls:
        out[call.sigma].append(call)
    return out


def test_the_emulation_puts_itself_back_on_top_at_a_step_and_chains_what_it_found(comfy_nodes, pack):
    """The emulated node's rules (the pattern it stands for), checked on their own."""
    model = dit_models.build_dit_model("flux")
    backend = AttentionBackend()
    patched = backend.apply(model)
    first = patched.model_options["transformer_options"][OVERRIDE]
    assert isinstance(first, BackendOverride) and first.previous is None
    ours = todo(pack, patched)  # ours goes on top at the node, chaining the backend
    run_options = {"transformer_options": dict(ours.model_options["transformer_options"])}
    ours_override = run_options["transformer_options"][OVERRIDE]
    assert isinstance(ours_override, pack.dit.DiTReduction) and ours_override.inner is first
    for callback in ours.get_all_callbacks("on_prepare_state"):
        callback(ours, None, run_options)
    top = run_options["transformer_options"][OVERRIDE]
    assert isinstance(top, BackendOverride) and top.previous is ours_override  # back on top, ours chained
    for callback in ours.get_all_callbacks("on_prepare_state"):
        callback(ours, None, run_options)
    assert run_options["transformer_options"][OVERRIDE] is top  # once on top, a step changes nothing
    assert ours.model_options["transformer_options"][OVERRIDE] is ours_override  # the model's options untouched


def sample_sd15(comfy_nodes, model):
    positive, negative = conditioning()
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    (out,) = comfy_nodes.KSampler().sample(model, 3, SD15_STEPS, 4.0, "euler", "normal", positive, negative,
                                           latent)
    return out["samples"]


@pytest.fixture(scope="module")
def sd15_alone(comfy_nodes, sd15):
    """The backend alone on SD1.5: what its kernel computes per step, and each node's image without it."""
    backend = AttentionBackend()
    with late_prepare_state():
        sample_sd15(comfy_nodes, backend.apply(sd15))
    return backend.calls


@pytest.fixture(scope="module")
def ours_alone():
    """Each node's image without the backend, sampled once per model and node (both orders compare to it)."""
    return {}


SD15_REDUCED = {"ApplyToMe": (128, 128), "ApplyToDo": (256, 64)}  # (queries, keys) at the 16x16 blocks


@pytest.mark.parametrize("order", [BEFORE, AFTER])
@pytest.mark.parametrize("node", [pytest.param("ApplyToMe"), pytest.param("ApplyToDo", marks=pytest.mark.slow)])
def test_sd15_both_act_on_every_step(comfy_nodes, pack, sd15, sd15_alone, ours_alone, late_host, node, order):
    alone = by_sigma(sd15_alone)
    assert len(alone) == SD15_STEPS
    # U-Net self-attention goes through the override too: the backend alone sees the full 16x16 grid.
    assert all(any((c.queries, c.keys) == (256, 256) for c in calls) for calls in alone.values())
    backend = AttentionBackend()
    out = sample_sd15(comfy_nodes, stacked(pack, sd15, node, order, backend))
    steps = by_sigma(backend.calls)
    assert steps.keys() == alone.keys()
    for sigma, calls in steps.items():
        assert len(calls) == len(alone[sigma])  # every attention computed once by the kernel, none dropped
        pairs = {(c.queries, c.keys) for c in calls}
        assert SD15_REDUCED[node] in pairs and (256, 256) not in pairs, (sigma, pairs)
    if ("sd15", node) not in ours_alone:
        ours_alone["sd15", node] = sample_sd15(comfy_nodes, NODES[node](pack, sd15))
    torch.testing.assert_close(out, ours_alone["sd15", node])


def test_sd15_self_attention_reaches_the_override_at_every_transformer_block(comfy_nodes, sd15, sd15_alone):
    """Why the U-Net composes: every attn1 (and attn2) call of the 16 transformer blocks goes through the
    override, so the kernel sees what our attn1 patch left."""
    per_step = {len(calls) for calls in by_sigma(sd15_alone).values()}
    blocks = [n for n, _ in sd15.model.diffusion_model.named_modules() if n.endswith(".attn1")]
    assert per_step == {2 * len(blocks)} and len(blocks) == 16 and sd15_level(blocks[0]) == 1


@pytest.fixture(scope="module")
def dits(comfy_nodes):
    return {family: dit_models.build_dit_model(family) for family in DIT_LATENTS}


@pytest.mark.parametrize("order", [BEFORE, AFTER])
@pytest.mark.parametrize("node", ["ApplyToMe", "ApplyToDo"])
@pytest.mark.parametrize("family", ["flux", "wan21"])
def test_dits_both_act_on_every_step(comfy_nodes, pack, dits, ours_alone, late_host, family, node, order, caplog):
    model = dits[family]
    alone = AttentionBackend()
    dit_sample(comfy_nodes, alone.apply(model), family, steps=DIT_STEPS)
    backend = AttentionBackend()
    with caplog.at_level(logging.WARNING):
        out = dit_sample(comfy_nodes, stacked(pack, model, node, order, backend), family, steps=DIT_STEPS)
    assert "cannot be stacked" not in caplog.text  # a chaining backend is no case for the dropped-override warning
    steps, alone_steps = by_sigma(backend.calls), by_sigma(alone.calls)
    assert len(steps) == DIT_STEPS and steps.keys() == alone_steps.keys()
    for sigma, calls in steps.items():
        assert len(calls) == len(alone_steps[sigma])  # each attention computed once, none dropped
        keys = {c.keys for c in calls}
        assert keys & DIT_KEYS[family, node] and not keys & DIT_FULL_KEYS[family], (sigma, keys)
    if (family, node) not in ours_alone:
        ours_alone[family, node] = dit_sample(comfy_nodes, NODES[node](pack, model), family, steps=DIT_STEPS)
    torch.testing.assert_close(out, ours_alone[family, node])


@pytest.mark.parametrize("order", [BEFORE, AFTER])
def test_a_backend_that_drops_the_override_it_finds_drops_ours_in_either_order(comfy_nodes, pack, dits,
                                                                               late_host, order):
    """Reinstalled over ours at every step without calling it, no node order keeps ours: the kernel computes
    every image self-attention whole."""
    backend = AttentionBackend(chains=False)
    dit_sample(comfy_nodes, stacked(pack, dits["flux"], "ApplyToDo", order, backend), "flux", steps=DIT_STEPS)
    keys = {c.keys for c in backend.calls}
    assert keys >= DIT_FULL_KEYS["flux"] and not keys & DIT_KEYS["flux", "ApplyToDo"]


def test_a_backend_set_once_that_drops_the_override_it_finds_works_only_before_ours(comfy_nodes, pack, dits,
                                                                                   late_host):
    """Set at its node only (no step callback) and not chaining: before ours, ours keeps it as its inner
    attention and hands it the reduced tensors; after ours, it replaces ours for good."""
    found = {}
    for order in (BEFORE, AFTER):
        backend = AttentionBackend(chains=False, reinstalls=False)
        dit_sample(comfy_nodes, stacked(pack, dits["flux"], "ApplyToDo", order, backend), "flux", steps=DIT_STEPS)
        found[order] = {c.keys for c in backend.calls}
    assert found[BEFORE] & DIT_KEYS["flux", "ApplyToDo"] and not found[BEFORE] & DIT_FULL_KEYS["flux"]
    assert found[AFTER] >= DIT_FULL_KEYS["flux"] and not found[AFTER] & DIT_KEYS["flux", "ApplyToDo"]


def test_a_backend_that_drops_ours_is_named_in_one_warning_per_run(comfy_nodes, pack, dits, late_host, caplog):
    backend = AttentionBackend(chains=False)
    with caplog.at_level(logging.WARNING):
        dit_sample(comfy_nodes, stacked(pack, dits["flux"], "ApplyToDo", AFTER, backend), "flux",
                   steps=DIT_STEPS)
    lines = [r.getMessage() for r in caplog.records if "BackendOverride" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
