"""Token-wise caching at the block scope (``tome_harness/token_cache.py``: measured by the quality bench, offered
by no node yet): a token a reduced block does not compute takes its own change from the step it was last
computed.

One double block of a Flux layout called directly on a 5x6 grid of 30 image tokens (ratio 0.5: 15 computed), the
block changing each token by a function of it alone, so each token's change tells where it came from; then a tiny
random-weight Flux through the real sampler.
"""

import pytest
import torch

from tome_harness import dit_models
from tome_harness.token_cache import caching_scope_class, with_token_cache

IMAGE, COMPUTED, TEXT, WIDTH = 30, 15, 7, 8
KEY = ("double_block", 0)
SCHEDULE = torch.tensor([10.0, 8.0, 6.0, 4.0, 0.0])


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
    tome = pack.dit.DiTToMe(0.5, 2, 2, pack.comfyui.Window(), scope="block", blocks=frozenset({KEY}))
    return lambda **settings: caching_scope_class(block.BlockScope)(None, tome, (KEY,), "flux", **settings)


def test_a_token_not_computed_keeps_its_own_change_from_the_step_it_was_last_computed(pack, block, caching):
    """Step 0 computes every token; at step 1 the 15 tokens whose input moved are computed and the other 15 keep
    their change of step 0; at step 2 (nothing moved) the 15 whose change is 2 steps old (``max_age`` 2) are
    computed, and the others keep step 1's."""
    scope, run, fake = caching(full_steps=1, max_age=2), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    first = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(call(pack, block, fake, scope, run, 10.0, first), fake.change(first))
    assert fake.seen[-1].shape[1] == IMAGE

    moved = torch.zeros(IMAGE, dtype=torch.bool)
    moved[torch.randperm(IMAGE, generator=torch.Generator().manual_seed(3))[:COMPUTED]] = True
    second = first + moved[None, :, None] * torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(4))
    change = call(pack, block, fake, scope, run, 8.0, second)
    assert fake.seen[-1].shape[1] == COMPUTED
    torch.testing.assert_close(fake.seen[-1], second[:, moved])
    torch.testing.assert_close(change[:, moved], fake.change(second)[:, moved])
    torch.testing.assert_close(change[:, ~moved], fake.change(first)[:, ~moved])

    third = call(pack, block, fake, scope, run, 6.0, second)
    torch.testing.assert_close(fake.seen[-1], second[:, ~moved])  # the stale ones, though nothing moved
    torch.testing.assert_close(third, fake.change(second))


def test_combined_a_token_not_computed_adds_its_nearest_computed_tokens_move_to_its_own_cached_change(
        pack, block, caching):
    """Step 1 computes the 15 moved tokens; each other token gets its step-0 change plus how much the change of
    the computed token nearest its input (cosine) moved between step 0 and step 1."""
    scope, run, fake = caching(full_steps=1, combine=True), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    first = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    call(pack, block, fake, scope, run, 10.0, first)
    moved = torch.zeros(IMAGE, dtype=torch.bool)
    moved[torch.randperm(IMAGE, generator=torch.Generator().manual_seed(3))[:COMPUTED]] = True
    second = first + moved[None, :, None] * torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(4))
    change = call(pack, block, fake, scope, run, 8.0, second)
    torch.testing.assert_close(change[:, moved], fake.change(second)[:, moved])
    unit = second[0] / second[0].norm(dim=-1, keepdim=True)
    computed, kept = moved.nonzero().flatten(), (~moved).nonzero().flatten()
    nearest = computed[(unit[kept] @ unit[computed].T).argmax(dim=-1)]
    expected = fake.change(first)[0, kept] + fake.change(second)[0, nearest] - fake.change(first)[0, nearest]
    torch.testing.assert_close(change[0, kept], expected)


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


def test_a_refresh_step_computes_every_token(pack, block, caching):
    scope, run, fake = caching(full_steps=1, refresh_every=2), pack.comfyui.SamplingRun(keeps_plans=True), Block()
    img = torch.randn(1, IMAGE, WIDTH, generator=torch.Generator().manual_seed(2))
    counts = []
    for sigma in SCHEDULE[:-1].tolist():
        call(pack, block, fake, scope, run, sigma, img)
        counts.append(fake.seen[-1].shape[1])
    assert counts == [IMAGE, COMPUTED, IMAGE, COMPUTED]


def test_through_the_sampler_every_step_whole_is_the_model_and_caching_changes_the_image(comfy_nodes, pack):
    flux = dit_models.build_dit_model("flux")
    blocks = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)

    def sample(model):
        positive = [[torch.randn(1, TEXT, dit_models.CONTEXT_DIM, generator=torch.Generator().manual_seed(5)),
                     {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM)}]]
        latent = {"samples": torch.zeros(1, 16, 10, 12)}
        (out,) = comfy_nodes.KSampler().sample(model, 3, 4, 1.0, "euler", "normal", positive, positive, latent)
        return out["samples"]

    plain = sample(flux)
    whole = sample(with_token_cache(pack.dit.apply_tome_dit(flux, ratio=0.5, **blocks), full_steps=4))
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-5)
    cached = sample(with_token_cache(pack.dit.apply_tome_dit(flux, ratio=0.5, **blocks), full_steps=1))
    assert torch.isfinite(cached).all() and (cached - plain).abs().max() > 1e-3
    with pytest.raises(ValueError, match="max_age"):
        with_token_cache(flux, max_age=0)
