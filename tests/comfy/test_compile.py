"""Apply ToMe and Apply ToDo inside ``torch.compile``, as ComfyUI's ``TorchCompileModel`` runs it.

The hazard: ``TorchCompileModel`` compiles the diffusion model, and the
ComfyUI of late 2026 drops every dynamo guard on ``transformer_options``
(``newest_host.compile_like_newest``), where our patches live. Whatever dynamo
traced there (the ratio, the step window, ``reuse_steps``, which clone's
settings) would be frozen at the first call and reused. The promise: a
compiled run gives the uncompiled run's image, under 0.3.75's own node
(guards kept) and under the newest host's filter, for the settings that decide
per call, for two clones of one compiled model, and on DiTs.

Most tests compile with ``aot_eager``: dynamo traces, guards and breaks graphs
exactly as it does for inductor (that is where a decision gets frozen), without
inductor's minutes of code generation on a CPU. One test runs inductor itself.
Each test starts from an empty dynamo cache, so its count of compiled graphs is
its own.
"""

import pytest
import torch
from helpers import dit_sample as family_sample
from helpers import sample

from tome_harness import dit_models, newest_host

pytestmark = pytest.mark.slow

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # aot_eager: the same kernels, but fused graphs may reorder float sums
# Inductor generates its own kernels: 6e-4 at most was seen over 4 steps here, on values of tens.
INDUCTOR_TOLERANCE = {"rtol": 1e-4, "atol": 2e-3}
# Two settings that act differently move the tiny models' samples (values of tens) apart by more than this, over
# 10 times what either tolerance allows there: a frozen decision cannot pass for compile noise.
DIFFERENT = 0.1


def core_compile(model, backend):
    """0.3.75's own ``TorchCompileModel`` node (dynamo keeps its guards on ``transformer_options``)."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    return TorchCompileModel.execute(model, backend).result[0]


HOSTS = {"0.3.75": core_compile, "newest": newest_host.compile_like_newest}


@pytest.fixture(params=list(HOSTS))
def compile_model(request):
    """Compile a model as the host of the parameter does, from an empty dynamo cache."""
    torch._dynamo.reset()
    yield lambda model, backend="aot_eager": HOSTS[request.param](model, backend)
    torch._dynamo.reset()


def compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def assert_same_image(compiled, uncompiled):
    torch.testing.assert_close(compiled, uncompiled, **TOLERANCE)


def assert_differs(a, b):
    assert (a - b).abs().max() > DIFFERENT


def test_a_step_window_that_ends_half_way_is_followed_step_by_step(pack, comfy_nodes, sd15, compile_model):
    windowed = pack.unet.apply_tome(sd15, ratio=0.5, end_percent=0.5)
    reference = sample(comfy_nodes, windowed)
    # The window matters: merging on every step, or on none, gives another image.
    assert_differs(reference, sample(comfy_nodes, pack.unet.apply_tome(sd15, ratio=0.5)))
    assert_differs(reference, sample(comfy_nodes, sd15))
    assert_same_image(sample(comfy_nodes, pack.unet.apply_tome(compile_model(sd15), ratio=0.5, end_percent=0.5)),
                      reference)


def test_reuse_steps_plans_are_kept_and_renewed_as_without_compile(pack, comfy_nodes, sd15, compile_model):
    reused = pack.unet.apply_tome(sd15, ratio=0.5, reuse_steps=3)
    reference = sample(comfy_nodes, reused)
    assert_differs(reference, sample(comfy_nodes, pack.unet.apply_tome(sd15, ratio=0.5)))
    assert_same_image(sample(comfy_nodes, pack.unet.apply_tome(compile_model(sd15), ratio=0.5, reuse_steps=3)),
                      reference)


def test_differently_set_clones_of_one_compiled_model_each_get_their_own_settings(pack, comfy_nodes, sd15,
                                                                                    compile_model):
    """One compiled model, then three nodes on it, sampled one after the other: no clone reuses what another's
    run traced, and running them again compiles nothing new (recompiles are bounded by the settings used)."""
    compiled = compile_model(sd15)
    settings = [
        lambda m: pack.unet.apply_tome(m, ratio=0.3),
        lambda m: pack.unet.apply_tome(m, ratio=0.6, scope="self-attention, cross-attention and MLP"),
        lambda m: pack.unet.apply_todo(m, downsample_factor=2),
    ]
    references = [sample(comfy_nodes, apply(sd15)) for apply in settings]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert_differs(references[a], references[b])
    for apply, reference in zip(settings, references, strict=True):
        assert_same_image(sample(comfy_nodes, apply(compiled)), reference)
    graphs = compiled_graphs()
    assert graphs > 0
    for apply, reference in zip(settings, references, strict=True):
        assert_same_image(sample(comfy_nodes, apply(compiled)), reference)
    assert compiled_graphs() == graphs


def test_inductor_gives_the_uncompiled_image(pack, comfy_nodes, sd15, compile_model):
    """The real backend, once: ToMe with a window and ToDo on one compiled model."""
    compiled = compile_model(sd15, "inductor")
    for apply in (lambda m: pack.unet.apply_tome(m, ratio=0.5, end_percent=0.5),
                  lambda m: pack.unet.apply_todo(m, downsample_factor=2)):
        torch.testing.assert_close(sample(comfy_nodes, apply(compiled)), sample(comfy_nodes, apply(sd15)),
                                   **INDUCTOR_TOLERANCE)


# DiTs: the override acts inside the attention call of the compiled model.

# VACE: the mark its main blocks get (a dit block replacement) must reach the override through the compiled graph.
DIT_LATENTS = {"flux": (1, 16, 10, 12), "wan21": (1, 16, 3, 10, 12), "wan21_vace": (1, 16, 3, 10, 12)}


def dit_sample(comfy_nodes, model, family):
    """A real KSampler run, cfg 2, cond and uncond of different text lengths (7 and 5 tokens)."""
    generator = torch.Generator().manual_seed(5)
    extra = {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM)}
    positive = [[torch.randn(1, 7, dit_models.CONTEXT_DIM, generator=generator), dict(extra)]]
    negative = [[torch.randn(1, 5, dit_models.CONTEXT_DIM, generator=generator), dict(extra)]]
    latent = {"samples": torch.zeros(DIT_LATENTS[family])}
    (out,) = comfy_nodes.KSampler().sample(model, 3, 2, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


@pytest.mark.parametrize("family", list(DIT_LATENTS))
def test_dits_with_todo_and_tome_give_the_uncompiled_image(pack, comfy_nodes, family, compile_model):
    model = dit_models.build_dit_model(family)
    compiled = compile_model(model)
    settings = [lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2),
                lambda m: pack.dit.apply_tome_dit(m, ratio=0.5)]
    references = [dit_sample(comfy_nodes, apply(model), family) for apply in settings]
    unpatched = dit_sample(comfy_nodes, model, family)
    for apply, reference in zip(settings, references, strict=True):
        assert not torch.allclose(reference, unpatched, **TOLERANCE)
        assert_same_image(dit_sample(comfy_nodes, apply(compiled), family), reference)


# The hazard itself, shown on a patch written as ours must not be, so that the tests above are known to be able
# to fail: an attention override that dynamo traces into the compiled graph and that reads its setting from
# ``transformer_options``.

def traced_scaling_override(func, *args, **kwargs):
    """Attention with the values scaled by ``transformer_options["toy_scale"]``, traced by dynamo (no
    ``eager``): the scale becomes a constant of the graph, kept valid only by a guard on ``transformer_options``."""
    q, k, v = args[:3]
    return func(q, k, v * kwargs["transformer_options"]["toy_scale"], *args[3:], **kwargs)


def with_toy_scale(model, scale):
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    options.update(optimized_attention_override=traced_scaling_override, toy_scale=scale)
    return patched


def test_a_setting_traced_from_transformer_options_is_frozen_under_the_newest_guard_filter(comfy_nodes, request,
                                                                                            compile_model):
    """Two clones of one compiled Flux, scale 1 then 2: 0.3.75 keeps its guard on ``transformer_options`` and
    recompiles for the second, the late-2026 filter drops it and the second clone silently runs the first's
    graph (its image is the first's). The same comparison passes for our patches (above): they run outside
    the graph (``eager``)."""
    model = dit_models.build_dit_model("flux")
    references = [dit_sample(comfy_nodes, with_toy_scale(model, scale), "flux") for scale in (1.0, 2.0)]
    assert_differs(*references)
    compiled = compile_model(model)
    assert_same_image(dit_sample(comfy_nodes, with_toy_scale(compiled, 1.0), "flux"), references[0])
    second = dit_sample(comfy_nodes, with_toy_scale(compiled, 2.0), "flux")
    frozen = request.node.callspec.params["compile_model"] == "newest"
    assert_same_image(second, references[0] if frozen else references[1])


def every_block_tome(pack, model):
    """Apply ToMe 0.5 at the block scope, every block reduced: a ``dit`` replacement on each block."""
    return pack.dit.apply_tome_dit(model, ratio=0.5, dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)


@pytest.mark.parametrize("family", ["flux", "wan21"])
def test_a_patched_clone_of_a_compiled_model_that_already_ran_unpatched_gets_its_reduction(
        pack, comfy_nodes, family, compile_model):
    """The common A/B workflow: one compiled model sampled as it is, then through Apply ToDo, Apply ToMe and the
    block scope. Each patched clone must give its uncompiled image, not the unpatched graph's."""
    model = dit_models.build_dit_model(family)
    compiled = compile_model(model)
    unpatched = dit_sample(comfy_nodes, compiled, family)
    torch.testing.assert_close(unpatched, dit_sample(comfy_nodes, model, family), **TOLERANCE)
    for apply in (lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2),
                  lambda m: pack.dit.apply_tome_dit(m, ratio=0.5),
                  lambda m: every_block_tome(pack, m)):
        reference = dit_sample(comfy_nodes, apply(model), family)
        assert_differs(reference, unpatched)
        assert_same_image(dit_sample(comfy_nodes, apply(compiled), family), reference)


@pytest.mark.parametrize("family", ["flux", "wan21"])
def test_a_compiled_model_that_ran_at_the_block_scope_runs_unpatched_and_attention_clones_as_they_are(
        pack, comfy_nodes, family, compile_model):
    """The other order: the block scope first (a dit replacement on every block), then the compiled model as it
    is and an attention-scope clone, whose blocks have no replacement: neither may take the block scope's graph."""
    model = dit_models.build_dit_model(family)
    compiled = compile_model(model)
    assert_same_image(dit_sample(comfy_nodes, every_block_tome(pack, compiled), family),
                      dit_sample(comfy_nodes, every_block_tome(pack, model), family))
    assert_same_image(dit_sample(comfy_nodes, compiled, family), dit_sample(comfy_nodes, model, family))
    todo = lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2)  # noqa: E731
    assert_same_image(dit_sample(comfy_nodes, todo(compiled), family), dit_sample(comfy_nodes, todo(model), family))


@pytest.mark.parametrize("family", ["flux"])
def test_two_patched_clones_compiled_apart_and_sampled_in_turn_each_get_their_own_image(
        pack, comfy_nodes, family, compile_model):
    """Two compile nodes, one on a block-scope clone and one on an attention-scope clone of the same model (they
    compile the same module's code, so they share dynamo's cache), sampled in turn twice."""
    model = dit_models.build_dit_model(family)
    settings = [lambda m: every_block_tome(pack, m), lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2)]
    references = [dit_sample(comfy_nodes, apply(model), family) for apply in settings]
    compiled = [compile_model(apply(model)) for apply in settings]
    for _ in range(2):
        for each, reference in zip(compiled, references, strict=True):
            assert_same_image(dit_sample(comfy_nodes, each, family), reference)


# The block scope under compile: only its decision runs outside the graph, so every block (reduced or left whole)
# runs its layers inside compiled graphs as the unpatched model's do.

def counting_backend(counts: dict):
    """A dynamo backend running each graph as traced and adding, at every run, its linear layers to
    ``counts["linear"]``: the linear layers a sampling run ran inside compiled graphs."""
    def backend(graph, inputs):
        linears = sum(node.op == "call_function" and "linear" in str(node.target) for node in graph.graph.nodes)

        def run(*args):
            counts["linear"] += linears
            return graph.forward(*args)
        return run
    return backend


def linears_in_graphs(comfy_nodes, model, family) -> int:
    torch._dynamo.reset()
    counts = {"linear": 0}
    family_sample(comfy_nodes, newest_host.compile_like_newest(model, counting_backend(counts)), family)
    torch._dynamo.reset()
    return counts["linear"]


@pytest.mark.parametrize("family", ["flux", "wan21", "lumina2"])
@pytest.mark.parametrize("skips", [(0, 0), (1, 0)], ids=["every block", "the first block whole"])
def test_every_block_runs_inside_the_compiled_graph_at_the_block_scope(pack, comfy_nodes, family, skips):
    model = dit_models.build_dit_model(family)
    reduced = pack.dit.apply_tome_dit(model, ratio=0.5, dit_scope="block", skip_first_blocks=skips[0],
                                      skip_last_blocks=skips[1])
    unpatched = linears_in_graphs(comfy_nodes, model, family)
    assert unpatched > 0
    assert linears_in_graphs(comfy_nodes, reduced, family) == unpatched


# SD3 with more blocks than dynamo compiles one function for (its recompile limit, 8); its width follows its depth.
DEEP_SD3 = {"depth": 12, "context_embedder_config": {
    "target": "torch.nn.Linear", "params": {"in_features": dit_models.CONTEXT_DIM, "out_features": 64 * 12}}}


def test_every_block_of_a_deep_sd3_runs_inside_the_compiled_graph_at_the_block_scope(pack, comfy_nodes):
    """ComfyUI's SD3 ``original_block`` indexes the blocks by the index it captured, which dynamo specializes
    on: called through it, each block recompiled the same code, and past the recompile limit the remaining blocks
    ran uncompiled (on an H200, 16 of SD3.5 medium's 24). The scope runs SD3's blocks itself."""
    assert torch._dynamo.config.recompile_limit < DEEP_SD3["depth"]
    model = dit_models.build_dit_model("sd3", changes=DEEP_SD3)
    reduced = pack.dit.apply_tome_dit(model, ratio=0.5, dit_scope="block", skip_first_blocks=1)
    unpatched = linears_in_graphs(comfy_nodes, model, "sd3")
    assert unpatched > 0
    assert linears_in_graphs(comfy_nodes, reduced, "sd3") == unpatched


# The token cache (``token_cache``): its choice of tokens in the eager decision, its write into the run outside the
# graph; the blocks inside it.

def every_block_token_cache(pack, model):
    return pack.dit.apply_tome_dit(model, ratio=0.5, dit_scope="block", skip_first_blocks=0, skip_last_blocks=0,
                                   token_cache=pack.dit.TokenCaching(full_steps=1))


@pytest.mark.parametrize("family", ["flux", "wan21"])
def test_a_token_cache_gives_the_uncompiled_image_with_every_block_inside_the_compiled_graph(
        pack, comfy_nodes, family, compile_model):
    """Three steps, the last two cached: the compiled run samples the uncompiled one (not the merging block
    scope's, not the unpatched one), and runs as many linear layers inside compiled graphs as the unpatched
    model."""
    def run(model):
        return family_sample(comfy_nodes, model, family, steps=3)

    model = dit_models.build_dit_model(family)
    reference = run(every_block_token_cache(pack, model))
    assert_differs(reference, run(model))
    assert_differs(reference, run(every_block_tome(pack, model)))
    assert_same_image(run(every_block_token_cache(pack, compile_model(model))), reference)
    assert linears_in_graphs(comfy_nodes, every_block_token_cache(pack, model), family) == \
        linears_in_graphs(comfy_nodes, model, family)
