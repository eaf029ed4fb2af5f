"""The block scope on Lumina 2 / Z-Image and HiDream, whose blocks ComfyUI calls without a ``dit`` block
replacement: their classes are swapped on the patched clone (``tome/hosts/comfyui_dit_swap.py``).

Tiny random-weight models of the real layouts (``tome_harness.dit_models``) through the real sampler, cond and
uncond of 7 and 5 text tokens on a 10x12 latent: a 5x6 grid of 30 image tokens, 15 after ToMe at 0.5, 9 after
ToDo at 2. The Z-Image variant pads the text and the image to 8s: its main layers take [text 8 | image | 2 of
padding]. HiDream's double-stream blocks take the image and [T5 | LLM | LLM] apart, its single-stream blocks
them joined. The blocks' own modules are traced inside the swapped block: its attention (HiDream: the inner
block) and its MLP.
"""

import logging

import pytest
import torch
from helpers import (
    COND_TEXT,
    LLAMA,
    UNCOND_TEXT,
    check_block_scope_is_seeded_and_not_the_attention_scope,
    check_block_scope_off_is_the_model,
    check_block_scope_reached_without_a_warning,
    dit_family_conds,
)

from tome_harness import dit_models

IMAGE, MERGED, POOLED = 30, 15, 9
BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)
LATENT = (1, 16, 10, 12)
FAMILIES = ("lumina2", "hidream")
APPLY = {"tome": lambda pack: lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
         "todo": lambda pack: lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS)}


@pytest.fixture(scope="module")
def models(comfy_nodes):
    return {family: dit_models.build_dit_model(family) for family in FAMILIES}


def conditioning(family):
    generator = torch.Generator().manual_seed(5)
    return tuple([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator),
                   {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM),
                    **dit_family_conds(family, text, dit_models.CONTEXT_DIM)}]] for text in (COND_TEXT, UNCOND_TEXT))


def sample(comfy_nodes, model, family, seed=3, conditioned=None):
    """A real KSampler run at cfg 2, 2 steps; ``conditioned``: a conditioning node's ``(positive, negative,
    latent)``."""
    positive, negative, latent = conditioned or (*conditioning(family), {"samples": torch.zeros(LATENT)})
    (out,) = comfy_nodes.KSampler().sample(model, seed, 2, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


def traced_modules(net, family):
    """``(kind, module, what its call's tokens are)`` for the modules traced inside each block."""
    if family == "lumina2":
        return [(part, getattr(layer, part), lambda a: (a[0].shape[1],))
                for layer in net.layers for part in ("attention", "feed_forward")]
    def tokens(a):
        return (a[0].shape[1],)

    double = [(kind, module, count) for block in net.double_stream_blocks for kind, module, count in (
        ("double", block.block, lambda a: (a[0].shape[1], a[2].shape[1])), ("double mlp", block.block.ff_i, tokens))]
    single = [(kind, module, count) for block in net.single_stream_blocks for kind, module, count in (
        ("single", block.block, tokens), ("single mlp", block.block.ff_i, tokens))]
    return double + single


def traced(comfy_nodes, model, apply, family, **run):
    """Sample ``apply(model)``: the sample and ``(kind, tokens...)`` of every traced module call."""
    calls = []
    net = model.get_model_object("diffusion_model")
    handles = [module.register_forward_pre_hook(lambda m, a, kind=kind, count=count: calls.append((kind, *count(a))))
               for kind, module, count in traced_modules(net, family)]
    try:
        out = sample(comfy_nodes, apply(model), family, **run)
    finally:
        for handle in handles:
            handle.remove()
    return out, calls


def hidream_text(text):
    return text + 2 * LLAMA  # T5's tokens, the LLM's last layer's and the block's own


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_every_lumina_layer_runs_its_attention_and_mlp_on_the_reduced_image(comfy_nodes, pack, models, node):
    kept = MERGED if node == "tome" else POOLED
    out, calls = traced(comfy_nodes, models["lumina2"], APPLY[node](pack), "lumina2")
    assert torch.isfinite(out).all()
    # the text padded to 8, the image's tokens, its 2 of padding (to 32): both the text lengths pad to 8
    assert set(calls) == {("attention", 8 + kept + 2), ("feed_forward", 8 + kept + 2)}
    layers = len(models["lumina2"].get_model_object("diffusion_model").layers)
    assert len(calls) == 2 * layers * 2 * 2  # attention and MLP, every layer, cond and uncond, 2 steps


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_every_hidream_block_runs_on_the_reduced_image_and_the_whole_text(comfy_nodes, pack, models, node):
    kept = MERGED if node == "tome" else POOLED
    out, calls = traced(comfy_nodes, models["hidream"], APPLY[node](pack), "hidream")
    assert torch.isfinite(out).all()
    texts = {hidream_text(text) for text in (COND_TEXT, UNCOND_TEXT)}
    assert {call for call in calls if call[0] == "double"} == {("double", kept, text) for text in texts}
    assert {call for call in calls if call[0] == "single"} == {("single", kept + text) for text in texts}
    # the image's MLP (a mixture of experts): the reduced image alone; the single block's over [image | text]
    assert {call for call in calls if call[0] == "double mlp"} == {("double mlp", kept)}
    assert {call for call in calls if call[0] == "single mlp"} == {("single mlp", kept + text) for text in texts}


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_0_factor_1_and_steps_outside_the_window_are_the_model_bit_for_bit(comfy_nodes, pack, models, family):
    check_block_scope_off_is_the_model(pack, models[family], lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_image_and_not_the_attention_scopes(comfy_nodes, pack, models, family):
    check_block_scope_is_seeded_and_not_the_attention_scope(pack, models[family],
                                                            lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_swap_is_the_patched_clones_alone_and_keeps_the_modules_and_their_weights(comfy_nodes, pack, block,
                                                                                    models, family):
    """The block classes are swapped by object patches of the clone (one per block, each naming its block); once
    the model itself is loaded again its modules have their own classes and it samples as before; the swap goes
    with the block scope (a later ratio 0, or the attention scope, drops it)."""
    model = models[family]
    net = model.get_model_object("diffusion_model")
    classes = {name: type(module) for name, module in net.named_modules()}
    weights = {name: tensor.data_ptr() for name, tensor in net.state_dict().items()}
    reference = sample(comfy_nodes, model, family)
    patched = APPLY["tome"](pack)(model)
    swaps = {name: cls for name, cls in patched.object_patches.items() if name.endswith(".__class__")}
    keys = {cls.tome_block_key for cls in swaps.values()}
    assert len(swaps) == len(keys) == len(block.block_keys(model, pack.dit.dit_family(model)))
    assert all(issubclass(cls, cls.tome_base) for cls in swaps.values())
    assert not model.object_patches
    sample(comfy_nodes, patched, family)
    torch.testing.assert_close(sample(comfy_nodes, model, family), reference, rtol=0, atol=0)
    assert {name: type(module) for name, module in net.named_modules()} == classes
    assert {name: tensor.data_ptr() for name, tensor in net.state_dict().items()} == weights
    for undone in (pack.dit.apply_tome_dit(patched, ratio=0.0, **BLOCKS), pack.dit.apply_tome_dit(patched, ratio=0.5)):
        assert not [name for name in undone.object_patches if name.endswith(".__class__")]


def test_todo_gives_these_families_the_block_scope_without_a_warning(pack, models, caplog):
    check_block_scope_reached_without_a_warning(pack, [models[family] for family in FAMILIES], caplog)


def test_hidream_e1s_image_in_rows_runs_its_blocks_whole_with_one_warning(comfy_nodes, pack, models, caplog):
    """E1's edit image shares each row of patches with the image: no span to hand a block reduced. At the block
    scope alone the run is the unpatched one, and the warning says so once."""
    from comfy_extras.nodes_ip2p import InstructPixToPixConditioning

    picture = torch.rand(1, 80, 96, 3, generator=torch.Generator().manual_seed(10))
    e1 = InstructPixToPixConditioning.execute(*conditioning("hidream"), picture, dit_models.build_flux_vae()).result
    model = models["hidream"]
    with caplog.at_level(logging.WARNING):
        reduced = sample(comfy_nodes, APPLY["tome"](pack)(model), "hidream", conditioned=e1)
    torch.testing.assert_close(reduced, sample(comfy_nodes, model, "hidream", conditioned=e1), rtol=0, atol=0)
    assert caplog.text.count("dit_scope 'block' leaves its blocks whole") == 1


@pytest.mark.slow
@pytest.mark.parametrize("host", ["0.3.75", "newest"])
def test_compiled_lumina_equals_uncompiled_and_a_rerun_compiles_nothing(comfy_nodes, pack, models, host):
    """TorchCompileModel on Z-Image's layout, as ComfyUI 0.3.75 runs it and with the late-2026 guard filter: the
    swapped blocks run outside the graph."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    from tome_harness import newest_host

    compile_model = {"0.3.75": lambda model: TorchCompileModel.execute(model, "aot_eager").result[0],
                     "newest": lambda model: newest_host.compile_like_newest(model, "aot_eager")}[host]
    torch._dynamo.reset()
    try:
        model = models["lumina2"]
        reference = sample(comfy_nodes, APPLY["tome"](pack)(model), "lumina2")
        compiled = compile_model(model)
        torch.testing.assert_close(sample(comfy_nodes, APPLY["tome"](pack)(compiled), "lumina2"), reference,
                                   rtol=1e-4, atol=1e-4)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.testing.assert_close(sample(comfy_nodes, APPLY["tome"](pack)(compiled), "lumina2"), reference,
                                   rtol=1e-4, atol=1e-4)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    finally:
        torch._dynamo.reset()
