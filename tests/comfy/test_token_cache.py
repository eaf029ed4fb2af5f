"""Token-wise caching at the block scope (Apply ToMe (Advanced)'s ``token_cache``, ``tome/hosts/dit_token_cache.py``):
a token a reduced block does not compute takes its own change from the step it was last computed.

One double block of a Flux layout called directly on a 5x6 grid of 30 image tokens (ratio 0.5: 15 computed), the
block changing each token by a function of it alone, so each token's change tells where it came from; then tiny
random-weight models of every family the block scope covers, through the real sampler.
"""

import collections
import logging

import pytest
import torch
from helpers import dit_sample, record_lengths

from tome_harness import dit_models

IMAGE, COMPUTED, TEXT, WIDTH = 30, 15, 7, 8
KEY = ("double_block", 0)
SCHEDULE = torch.tensor([10.0, 8.0, 6.0, 4.0, 0.0])
BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)


class Block:
    """The block: each token changed by ``tanh(x W)``; the image tokens of each call noted."""

    def __init__(self):
        self.weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(0))
        self.seen = []

    def change(self, x):
        return torch.tanh(x @ self.weight)

    def __call__(self, args):
        self.seen.append(args["img"])
        return {"img": args["img"] + self.change(args["img"]), "txt": args["txt"]}


def call(pack, block, fake, scope, run, sigma, img, uuids=("cond",)):
    """One call of ``scope``'s replacement of the double block at step ``sigma`` of ``run``: the image tokens'
    change."""
    from tome_harness import comfyui as comfyui_host

    families = comfyui_host.pack_module("tome.hosts.dit_families")
    options = {"sigmas": torch.tensor([sigma]), "sample_sigmas": SCHEDULE, pack.comfyui.RUN_KEY: run,
               "uuids": uuids, pack.dit.LAYOUT_KEY: families.flux_layout((1, 16, 10, 12), 2, TEXT)}
    generator = torch.Generator().manual_seed(1)
    args = {"img": img, "txt": torch.randn(1, TEXT, WIDTH, generator=generator), "vec": None,
            "transformer_options": options,
            "pe": torch.randn(1, 1, TEXT + IMAGE, 2, 2, 2, generator=generator)}
    replacement = block.BlockReduction(scope, KEY)
    return replacement(args, {"original_block": fake})["img"] - img


@pytest.fixture
def caching(pack, block):
    def scope(**settings):
        tome = pack.dit.DiTToMe(0.5, 2, 2, pack.comfyui.Window(), scope="block", blocks=frozenset({KEY}),
                                token_cache=pack.dit.TokenCaching(**settings))
        return block.BlockScope(None, tome, (KEY,), "flux")
    return scope


def moved_half(first):
    """``first`` with 15 of its 30 tokens moved, and which."""
    moved = torch.zeros(IMAGE, dtype=torch.bool)
    moved[torch.randperm(IMAGE, generator=torch.Generator().manual_seed(3))[:COMPUTED]] = True
    return first + moved[None, :, None] * torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(4)), \
        moved


def test_a_token_not_computed_keeps_its_own_change_from_the_step_it_was_last_computed(pack, block, caching):
    """Step 0 computes every token; at step 1 the 15 tokens whose input moved are computed and the other 15 keep
    their change of step 0; at step 2 (nothing moved) the 15 whose change is 2 steps old (``max_age`` 2) are
    computed, and the others keep step 1's."""
    scope, run, fake = caching(full_steps=1, max_age=2), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    first = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(call(pack, block, fake, scope, run, 10.0, first), fake.change(first))
    assert fake.seen[-1].shape[1] == IMAGE

    second, moved = moved_half(first)
    change = call(pack, block, fake, scope, run, 8.0, second)
    assert fake.seen[-1].shape[1] == COMPUTED
    torch.testing.assert_close(fake.seen[-1], second[:, moved])
    torch.testing.assert_close(change[:, moved], fake.change(second)[:, moved])
    torch.testing.assert_close(change[:, ~moved], fake.change(first)[:, ~moved])

    third = call(pack, block, fake, scope, run, 6.0, second)
    torch.testing.assert_close(fake.seen[-1], second[:, ~moved])  # the stale ones, though nothing moved
    torch.testing.assert_close(third, fake.change(second))


def test_each_batch_of_conds_and_each_run_keeps_its_own_cache(pack, block, caching):
    """A batch of other conds, or a new run, has no cache: its first call computes every token."""
    scope, run, fake = caching(full_steps=1), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    img = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    call(pack, block, fake, scope, run, 10.0, img)
    call(pack, block, fake, scope, run, 8.0, img)
    assert fake.seen[-1].shape[1] == COMPUTED
    call(pack, block, fake, scope, run, 8.0, img, uuids=("uncond",))
    assert fake.seen[-1].shape[1] == IMAGE
    call(pack, block, fake, scope, pack.comfyui.SamplingRun(keeps_plans=True), 8.0, img)
    assert fake.seen[-1].shape[1] == IMAGE
    run.end()  # the run over: its caches gone, its next call computes every token
    call(pack, block, fake, scope, run, 8.0, img)
    assert fake.seen[-1].shape[1] == IMAGE


def test_a_refresh_step_computes_every_token_and_outside_a_run_the_block_runs_whole(pack, block, caching):
    scope, run, fake = caching(full_steps=1, refresh_every=2), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    img = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    counts = []
    for sigma in SCHEDULE[:-1].tolist():
        call(pack, block, fake, scope, run, sigma, img)
        counts.append(fake.seen[-1].shape[1])
    assert counts == [IMAGE, COMPUTED, IMAGE, COMPUTED]
    torch.testing.assert_close(call(pack, block, fake, scope, None, 8.0, img), fake.change(img))
    assert fake.seen[-1] is img  # handed the block's own arguments, as without the pack


# Through the sampler: one model of each family the block scope covers (``BLOCK_FAMILIES``).
FAMILIES = ["flux", "sd3", "wan21", "wan22_animate", "qwen_image", "hunyuan_video", "ltxv", "mochi", "lumina2",
            "hidream"]
STEPS = 3


def attention_lengths(comfy_nodes, model, family, steps):
    """The (query, key) lengths of every attention call of a ``steps``-step run of ``model``, counted."""
    calls = []
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        record_lengths(calls)
    out = dit_sample(comfy_nodes, patched, family, steps=steps)
    return out, collections.Counter(calls)


@pytest.fixture(scope="module")
def family_models(comfy_nodes):
    return {family: dit_models.build_dit_model(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_through_the_sampler_the_cached_steps_compute_toMes_share_and_every_step_whole_is_the_model(
        comfy_nodes, pack, family_models, family):
    """Past its one whole step, each attention call of the token cache sees the lengths ToMe 0.5 at the block
    scope gives (as many image tokens computed as ToMe leaves, each frame alike); every step whole samples the
    model; and the cached steps change the sample."""
    model = family_models[family]

    def cached(full_steps):
        return pack.dit.apply_tome_dit(model, ratio=0.5, token_cache=pack.dit.TokenCaching(full_steps=full_steps),
                                       **BLOCKS)

    _, whole_step = attention_lengths(comfy_nodes, model, family, 1)
    _, merged_steps = attention_lengths(comfy_nodes, pack.dit.apply_tome_dit(model, ratio=0.5, **BLOCKS), family,
                                        STEPS - 1)
    out, lengths = attention_lengths(comfy_nodes, cached(1), family, STEPS)
    assert lengths == whole_step + merged_steps and lengths != whole_step + whole_step + whole_step
    assert torch.isfinite(out).all()
    reference = dit_sample(comfy_nodes, model, family, steps=STEPS)
    torch.testing.assert_close(dit_sample(comfy_nodes, cached(STEPS), family, steps=STEPS), reference,
                               rtol=1e-5, atol=1e-5)
    assert (out - reference).abs().max() > 1e-3


def test_the_node_input_reaches_the_block_scope_and_the_run_drops_its_caches(comfy_nodes, pack, family_models):
    """Apply ToMe (Advanced) with ``token_cache``: the caches fill during the run (cond and uncond apart: one per
    block and batch of conds) and are gone when it ends."""
    model = family_models["flux"]
    patched = pack.nodes.ApplyToMeAdvanced.execute(
        model, 0.5, 2, 2, "auto", 0, True, "q, k and v", 0.0, 1.0, dit_scope="block", skip_first_blocks=0,
        skip_last_blocks=0, token_cache=True).result[0]
    runs, sizes = [], []

    def watch(args, extra):
        run = args["transformer_options"][pack.comfyui.RUN_KEY]
        runs.append(run)
        sizes.append(len(run._caches))
        return extra["original_block"](args)

    patched.set_model_patch_replace(watch, "dit", "single_block", 0)
    dit_sample(comfy_nodes, patched, "flux", steps=STEPS)
    blocks = len(pack.dit.block_keys(model, "flux"))
    assert len(set(runs)) == 1 and max(sizes) == 2 * blocks and not runs[0]._caches


def test_token_cache_where_it_cannot_act_warns_and_bad_settings_name_the_input(pack, family_models, caplog):
    model = family_models["flux"]
    with caplog.at_level(logging.WARNING):
        attention = pack.dit.apply_tome_dit(model, ratio=0.5, token_cache=pack.dit.TokenCaching())
        reused = pack.dit.apply_tome_dit(model, ratio=0.5, reuse_steps=2, token_cache=pack.dit.TokenCaching(),
                                         **BLOCKS)
    assert "token_cache has no meaning at dit_scope 'attention'" in caplog.text
    assert "reuse_steps=2 has no meaning with token_cache" in caplog.text
    tome = attention.model_options["transformer_options"]["optimized_attention_override"].tome
    assert tome.token_cache is None and tome.scope == "attention"
    tome = reused.model_options["transformer_options"]["optimized_attention_override"].tome
    assert tome.token_cache is not None and tome.reuse_steps == 1
    with pytest.raises(ValueError, match="max_age"):
        pack.dit.apply_tome_dit(model, ratio=0.5, token_cache=pack.dit.TokenCaching(max_age=0), **BLOCKS)


def test_cond_and_uncond_in_two_threads_equal_the_sequential_run(comfy_nodes, pack, family_models):
    """The newest host's threaded CFG split, clones sharing the patch objects: each batch of conds keeps its own
    cache whichever thread runs it."""
    from tome_harness.newest_host import cfg_in_threads, clones_share_patch_objects

    with clones_share_patch_objects():
        patched = pack.dit.apply_tome_dit(family_models["wan21"], ratio=0.5, token_cache=pack.dit.TokenCaching(
            full_steps=1), **BLOCKS)
        with cfg_in_threads(threaded=False):
            sequential = dit_sample(comfy_nodes, patched.clone(), "wan21", steps=STEPS)
        with cfg_in_threads(threaded=True):
            threaded = dit_sample(comfy_nodes, patched.clone(), "wan21", steps=STEPS)
    assert torch.equal(threaded, sequential)
