"""Patch objects shared by clones and called from threads, as the ComfyUI of late 2026 does (emulated on 0.3.75
by ``tome_harness.newest_host``): results equal the sequential run, every scope and ``reuse_steps``."""

import pytest
import torch
from helpers import conditioning, loaded, sample, token_counts

from tome_harness.newest_host import cfg_in_threads, clones_share_patch_objects, device_copy

SCOPES = ["self-attention", "self- and cross-attention", "self-attention, cross-attention and MLP"]


@pytest.fixture
def newest_clone():
    with clones_share_patch_objects():
        yield


def test_the_emulation_shares_patch_objects_between_clones(pack, sd15, newest_clone):
    patched = pack.unet.apply_tome(sd15, ratio=0.5)
    clone = patched.clone()
    patches, clone_patches = (m.model_options["transformer_options"]["patches"]["attn1_patch"]
                              for m in (patched, clone))
    assert patches is not clone_patches and patches[0] is clone_patches[0]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("reuse_steps", [1, 3])
def test_cond_and_uncond_in_two_threads_equal_the_sequential_run(pack, comfy_nodes, sd15, newest_clone, scope,
                                                                 reuse_steps):
    patched = pack.unet.apply_tome(sd15, ratio=0.5, scope=scope, reuse_steps=reuse_steps)
    with cfg_in_threads(threaded=False):
        sequential = sample(comfy_nodes, patched.clone())
    with cfg_in_threads(threaded=True):
        threaded = sample(comfy_nodes, patched.clone())
    assert torch.equal(threaded, sequential)
    assert not torch.equal(sequential, sample(comfy_nodes, sd15))


def test_two_clones_at_different_resolutions_one_after_the_other_equal_each_alone(pack, comfy_nodes, sd15,
                                                                                    newest_clone):
    patched = pack.unet.apply_tome(sd15, ratio=0.5, scope=SCOPES[2], reuse_steps=3)

    def at(size, model):
        positive, negative = conditioning()
        latent = {"samples": torch.zeros(1, 4, size, size)}
        (out,) = comfy_nodes.KSampler().sample(model, 3, 4, 4.0, "euler", "normal", positive, negative, latent)
        return out["samples"]

    small, large = patched.clone(), patched.clone()
    together = at(16, small), at(24, large)
    alone = at(16, pack.unet.apply_tome(sd15, ratio=0.5, scope=SCOPES[2], reuse_steps=3)), \
        at(24, pack.unet.apply_tome(sd15, ratio=0.5, scope=SCOPES[2], reuse_steps=3))
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


def test_a_multigpu_copy_merges_around_its_own_feed_forward(pack, comfy_nodes, sd15, newest_clone):
    """The widest scope swaps the feed-forward's class, not the module: a device copy of the model gets the same
    object patches and runs its own weights, merged; the original model's feed-forwards are never called."""
    patched = pack.unet.apply_tome(sd15, ratio=0.5, scope=SCOPES[2])
    copy_ = device_copy(patched, weight_scale=0.5)
    with token_counts(copy_, ".ff.net") as on_copy, token_counts(patched, ".ff.net") as on_original:
        out = sample(comfy_nodes, copy_)
    assert 128 in {n for _, n in on_copy}, "the copy's feed-forwards must see merged tokens"
    assert not on_original, "the copy must never run the original model's weights"
    assert torch.isfinite(out).all()
    with loaded(copy_):
        ff_classes = {type(m).__name__ for name, m in copy_.model.diffusion_model.named_modules()
                      if name.endswith(".ff")}
    assert ff_classes == {"ToMeFeedForward"}
    assert {type(m).__name__ for name, m in copy_.model.diffusion_model.named_modules()
            if name.endswith(".ff")} == {"FeedForward"}, "unloading restores the copy's own class"
