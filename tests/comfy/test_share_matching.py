"""share_matching: one ToMe matching per model call and token grid, shared by every block on the grid (ToMA's reuse).

Through ComfyUI's KSampler on the U-Net and on Flux at both DiT scopes: a model call with the option matches once
per grid where it matched once per block, and at the block scope it is the benches' "one matching a call"
(``tome_harness.block_reuse``) bit for bit, the setting whose cost docs/DITS.md measured on the judges.
"""

import logging

import pytest
import torch
from helpers import sample

from tome_harness import dit_models, host_reads
from tome_harness.block_reuse import EVERY_BLOCK, with_reuse_blocks

BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)


@pytest.fixture(scope="module")
def flux(comfy_nodes):
    return dit_models.build_dit_model("flux")


def sample_dit(comfy_nodes, model, name="Flux"):
    """A KSampler run (euler, 3 steps, cfg 2) of a host-reads model: cond and uncond in one call per step."""
    positive, negative = host_reads.conditioning(name)
    latent = {"samples": torch.zeros(host_reads.MODELS[name].latent)}
    (out,) = comfy_nodes.KSampler().sample(model, 3, host_reads.STEPS, 2.0, "euler", "normal", positive, negative,
                                           latent)
    return out["samples"]


def matchings_per_call(monkeypatch, pack, model, run) -> float:
    """How many ToMe matchings each model call of ``run()`` (a sampling run of ``model``) makes."""
    matchings, calls = [], []
    build_plan = pack.comfyui.build_plan
    monkeypatch.setattr(pack.comfyui, "build_plan", lambda *a, **k: matchings.append(1) or build_plan(*a, **k))
    hook = model.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        hook.remove()
        monkeypatch.undo()
    return len(matchings) / len(calls)


def test_a_unet_model_call_matches_once_per_grid_with_share_matching(comfy_nodes, pack, sd15, monkeypatch):
    """SD1.5's top level holds 5 transformer blocks of one 16x16 grid here: 5 matchings a call, or 1."""
    apply = {share: pack.models.apply_tome(sd15, ratio=0.5, share_matching=share) for share in (False, True)}
    counts = {share: matchings_per_call(monkeypatch, pack, model, lambda m=model: sample(comfy_nodes, m))
              for share, model in apply.items()}
    assert counts == {False: 5, True: 1}
    plain, own, shared = (sample(comfy_nodes, m) for m in (sd15, apply[False], apply[True]))
    assert torch.isfinite(shared).all()
    assert (shared - own).abs().max() > 1e-3  # the later blocks merge other tokens than their own matching picks
    assert (shared - plain).abs().max() > 1e-3


@pytest.mark.parametrize("dit_scope", ["attention", "block"])
def test_a_dit_model_call_matches_once_with_share_matching(comfy_nodes, pack, flux, monkeypatch, dit_scope):
    """The small Flux has two blocks (one double, one single): two image attention calls, two reduced blocks."""
    inputs = dict(BLOCKS, dit_scope=dit_scope)
    apply = {share: pack.models.apply_tome(flux, ratio=0.5, share_matching=share, **inputs) for share in (False, True)}
    counts = {share: matchings_per_call(monkeypatch, pack, model, lambda m=model: sample_dit(comfy_nodes, m))
              for share, model in apply.items()}
    assert counts == {False: 2, True: 1}
    own, shared = (sample_dit(comfy_nodes, apply[share]) for share in (False, True))
    assert torch.isfinite(shared).all()
    assert (shared - own).abs().max() > 1e-3


def test_share_matching_at_the_block_scope_is_the_benches_one_matching_a_call(comfy_nodes, pack, flux):
    """So docs/DITS.md "A matching reused" measured what the option costs on the judges."""
    shared = pack.models.apply_tome(flux, ratio=0.5, share_matching=True, **BLOCKS)
    benches = with_reuse_blocks(pack.models.apply_tome(flux, ratio=0.5, **BLOCKS), EVERY_BLOCK)
    assert torch.equal(sample_dit(comfy_nodes, shared), sample_dit(comfy_nodes, benches))


def test_the_advanced_node_offers_share_matching_and_says_where_it_means_nothing(pack, flux, caplog):
    (model,) = pack.nodes.ApplyToMeAdvanced.execute(
        model=flux, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
        merge="q, k and v", start_percent=0.0, end_percent=1.0, share_matching=True).result
    assert model.model_options["transformer_options"]["optimized_attention_override"].tome.share_matching
    with caplog.at_level(logging.WARNING):
        (cached,) = pack.nodes.ApplyToMeAdvanced.execute(
            model=flux, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
            merge="q, k and v", start_percent=0.0, end_percent=1.0, token_cache=True, share_matching=True,
            **BLOCKS).result
    assert "share_matching has no meaning with token_cache" in caplog.text
    assert not cached.model_options["transformer_options"]["optimized_attention_override"].tome.share_matching
