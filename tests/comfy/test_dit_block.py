"""The block scope on DiTs (``tome/hosts/comfyui_dit_block.py``): whole blocks on the reduced image tokens.

Tiny random-weight Flux models of the real layout (one double and one single
block; Flux 2 and Chroma too), through the real ComfyUI classes and sampler,
cond and uncond of different text lengths (7 and 5 tokens) on a 10x12 latent:
a 5x6 grid of 30 image tokens. ToMe at ratio 0.5 leaves 15 of them, ToDo at
factor 2 a 3x3 grid of 9.
"""

import logging

import pytest
import torch

from tome_harness import dit_models, host_reads

COND_TEXT, UNCOND_TEXT = 7, 5
LATENTS = {"flux": (1, 16, 10, 12), "flux2": (1, 128, 5, 6), "chroma": (1, 16, 10, 12),
           "chroma_radiance": (1, 3, 80, 96)}
TEXTS = {"flux": (COND_TEXT, UNCOND_TEXT), "flux2": (512,), "chroma": (COND_TEXT, UNCOND_TEXT),  # Flux 2 pads to 512
         "chroma_radiance": (COND_TEXT, UNCOND_TEXT)}
IMAGE, MERGED, POOLED = 30, 15, 9
BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)


@pytest.fixture(scope="module")
def block(pack):
    from tome_harness import comfyui as comfyui_host

    return comfyui_host.pack_module("tome.hosts.comfyui_dit_block")


@pytest.fixture(scope="module")
def models(comfy_nodes):
    return {name: dit_models.build_dit_model(name) for name in LATENTS}


@pytest.fixture(scope="module")
def flux(models):
    return models["flux"]


def conditioning(references=None):
    generator = torch.Generator().manual_seed(5)
    extra = {"pooled_output": torch.zeros(1, dit_models.CONTEXT_DIM), **(references or {})}
    return tuple([[torch.randn(1, text, dit_models.CONTEXT_DIM, generator=generator), dict(extra)]]
                 for text in (COND_TEXT, UNCOND_TEXT))


def sample(comfy_nodes, model, family="flux", seed=3, steps=2, references=None):
    """A real KSampler run at cfg 2; ``references``: conds naming reference latents (Kontext)."""
    positive, negative = conditioning(references)
    latent = {"samples": torch.zeros(LATENTS[family])}
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 2.0, "euler", "normal", positive, negative, latent)
    return out["samples"]


def record_attention(calls):
    """An attention override noting the (query, key) lengths of every call, put on the model before ours."""

    def record(func, *args, **kwargs):
        calls.append((args[0].shape[2], args[1].shape[2]))  # Flux: [B, H, L, D]
        return func(*args, **kwargs)

    return record


def with_override(model, override):
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    return patched


class BlockTrace:
    """Forward hooks on every block of a Flux model: the token counts each block call gets, ``(kind, i,
    img tokens[, txt tokens])``, and its inputs and outputs (cloned before the block adds into them)."""

    def __init__(self, model):
        self.calls, self.inputs, self.outputs = [], [], []
        net = model.get_model_object("diffusion_model")
        self.handles = []
        for kind, blocks in (("double", net.double_blocks), ("single", net.single_blocks)):
            for i, module in enumerate(blocks):
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, a, k, kind=kind, i=i: self.enter(kind, i, a, k), with_kwargs=True))
                self.handles.append(module.register_forward_hook(
                    lambda m, a, k, out, kind=kind: self.outputs.append(
                        tuple(t.clone() for t in out) if kind == "double" else out.clone()), with_kwargs=True))

    def enter(self, kind, i, args, kwargs):
        if kind == "double":
            self.calls.append((kind, i, kwargs["img"].shape[1], kwargs["txt"].shape[1]))
            self.inputs.append((kwargs["img"].clone(), kwargs["txt"].clone()))
        else:
            self.calls.append((kind, i, args[0].shape[1]))
            self.inputs.append(args[0].clone())

    def close(self):
        for handle in self.handles:
            handle.remove()


def traced(comfy_nodes, model, apply, family="flux", references=None):
    """Sample ``apply(model)`` (an attention recorder already on the model): the sample, the blocks' token
    counts and the attention calls' (query, key) lengths."""
    attention = []
    patched = apply(with_override(model, record_attention(attention)))
    trace = BlockTrace(model)
    try:
        out = sample(comfy_nodes, patched, family, references=references)
    finally:
        trace.close()
    return out, trace.calls, attention


@pytest.mark.parametrize("family", list(LATENTS))
@pytest.mark.parametrize("node", ["tome", "todo"])
def test_every_block_and_its_attention_run_on_the_reduced_image_and_the_whole_text(comfy_nodes, pack, models, family,
                                                                                node):
    apply = {"tome": lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
             "todo": lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS)}[node]
    kept = MERGED if node == "tome" else POOLED
    out, blocks, attention = traced(comfy_nodes, models[family], apply, family)
    assert torch.isfinite(out).all()
    texts = TEXTS[family]
    expected_blocks = {("double", 0, kept, text) for text in texts} | {("single", 0, text + kept) for text in texts}
    assert set(blocks) == expected_blocks
    assert len(blocks) == 2 * len(texts) * 2  # 2 blocks, cond and uncond, 2 steps: every block call reduced
    assert set(attention) == {(text + kept, text + kept) for text in texts}  # attention sees what the block has


def test_a_kontext_reference_runs_whole_beside_the_merged_image(comfy_nodes, pack, flux):
    """Kontext's reference latent (6x8: 3x4 = 12 tokens) follows the image in the image stream: it is never
    merged, in the blocks or in their attention."""
    references = {"reference_latents": [torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(4))]}
    out, blocks, attention = traced(comfy_nodes, flux, lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
                                    references=references)
    assert torch.isfinite(out).all()
    texts = (COND_TEXT, UNCOND_TEXT)
    assert set(blocks) == {("double", 0, MERGED + 12, text) for text in texts} | \
        {("single", 0, text + MERGED + 12) for text in texts}
    assert set(attention) == {(text + MERGED + 12,) * 2 for text in texts}


def test_both_at_the_block_scope_pool_then_merge_the_pooled_grid(comfy_nodes, pack, flux):
    def apply(m):
        return pack.dit.apply_tome_dit(pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS), ratio=0.5, **BLOCKS)

    _, blocks, attention = traced(comfy_nodes, flux, apply)
    left = POOLED - int(POOLED * 0.5)  # 9 cells, 4 merged away
    assert {call[2] for call in blocks if call[0] == "double"} == {left}
    assert set(attention) == {(text + left,) * 2 for text in (COND_TEXT, UNCOND_TEXT)}


def test_todo_at_the_block_scope_lets_tome_at_the_attention_scope_merge_the_pooled_grid(comfy_nodes, pack, flux):
    """Inside a pooled block the override is told the pooled 3x3 grid: the attention-scope ToMe merges it."""
    def apply(m):
        return pack.dit.apply_tome_dit(pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS), ratio=0.5)

    _, blocks, attention = traced(comfy_nodes, flux, apply)
    assert {call[2] for call in blocks if call[0] == "double"} == {POOLED}
    assert set(attention) == {(text + POOLED - 4,) * 2 for text in (COND_TEXT, UNCOND_TEXT)}


def test_ratio_0_and_factor_1_are_the_model_bit_for_bit(comfy_nodes, pack, flux):
    assert pack.dit.apply_tome_dit(flux, ratio=0.0, **BLOCKS) is flux
    assert pack.dit.apply_todo_dit(flux, downsample_factor=1, **BLOCKS) is flux
    removed = pack.dit.apply_tome_dit(pack.dit.apply_todo_dit(pack.dit.apply_tome_dit(flux, ratio=0.5, **BLOCKS),
                                                              downsample_factor=2, **BLOCKS), ratio=0.0, **BLOCKS)
    removed = pack.dit.apply_todo_dit(removed, downsample_factor=1, **BLOCKS)
    assert not removed.get_wrappers("apply_model", "tome")
    assert "optimized_attention_override" not in removed.model_options["transformer_options"]
    torch.testing.assert_close(sample(comfy_nodes, removed), sample(comfy_nodes, flux), rtol=0, atol=0)


def test_blocks_and_steps_outside_the_choice_run_whole_bit_for_bit(comfy_nodes, pack, flux, caplog):
    """Skipping both blocks (with a warning), or a window no step falls in: the replacements pass every block
    through, and the run is the unpatched one (this model's 2 steps are at sigma 1 and 0.001)."""
    reference = sample(comfy_nodes, flux)
    with caplog.at_level(logging.WARNING):
        skipped = pack.dit.apply_tome_dit(flux, ratio=0.5, dit_scope="block", skip_first_blocks=1,
                                          skip_last_blocks=1)
    assert "leave none of this model's 2 blocks" in caplog.text
    windowed = pack.dit.apply_todo_dit(flux, downsample_factor=2, start_percent=0.5, end_percent=0.6, **BLOCKS)
    for model in (skipped, windowed):
        _, blocks, _ = traced(comfy_nodes, flux, lambda m, model=model: model)
        assert {call[2] for call in blocks if call[0] == "double"} == {IMAGE}
        torch.testing.assert_close(sample(comfy_nodes, model), reference, rtol=0, atol=0)


def test_skip_first_and_last_blocks_choose_the_blocks_in_the_order_they_run(comfy_nodes, pack, flux):
    first = pack.dit.apply_tome_dit(flux, ratio=0.5, dit_scope="block", skip_first_blocks=1, skip_last_blocks=0)
    last = pack.dit.apply_tome_dit(flux, ratio=0.5, dit_scope="block", skip_first_blocks=0, skip_last_blocks=1)
    for model, double, single in ((first, IMAGE, MERGED), (last, MERGED, IMAGE)):
        _, blocks, _ = traced(comfy_nodes, flux, lambda m, model=model: model)
        assert {call[2] for call in blocks if call[0] == "double"} == {double}
        assert {call[2] for call in blocks if call[0] == "single"} == {COND_TEXT + single, UNCOND_TEXT + single}


def run_block(block, scope_todo=None, scope_tome=None, key=("double_block", 0), inner=None, img=None, txt=None):
    """One call of our replacement of ``key``, on a 5x6 image (batch 2) after 7 text tokens, around ``inner``
    (the block): ``(args given, result)``."""
    from tome_harness import comfyui as comfyui_host

    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    families = comfyui_host.pack_module("tome.hosts.dit_families")
    generator = torch.Generator().manual_seed(11)
    layout = families.flux_layout((2, 16, 10, 12), 2, COND_TEXT)
    img = torch.randn(2, IMAGE, 8, generator=generator) if img is None else img
    txt = torch.randn(2, COND_TEXT, 8, generator=generator) if txt is None else txt
    pe = torch.randn(1, 1, COND_TEXT + IMAGE, 2, 2, 2, generator=generator)
    options = {dit.LAYOUT_KEY: layout}
    args = {"img": img, "txt": txt, "vec": None, "pe": pe, "transformer_options": options}
    if key[0] == "single_block":
        args = {"img": torch.cat([txt, img], 1), "vec": None, "pe": pe, "transformer_options": options}
    scope = block.BlockScope(scope_todo, scope_tome, (key,))
    replacement = block.BlockReduction(scope, key, inner)
    given = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    out = replacement(args, {"original_block": lambda a: pytest.fail("the inner replacement runs the block")})
    torch.testing.assert_close(args["img"], given["img"], rtol=0, atol=0)  # our caller's tensor is left as it was
    assert options[dit.LAYOUT_KEY] is layout  # the layout is the call's again after the block
    return given, out


def settings(pack, kind, **changes):
    reach = pack.comfyui.Reach(1)
    keys = frozenset({("double_block", 0), ("single_block", 0)})
    if kind == "tome":
        return pack.dit.DiTToMe(0.5, 2, 2, reach, scope="block", blocks=keys, **changes)
    return pack.dit.DiTToDo(2, 1, changes.pop("method", "nearest"), reach, scope="block", blocks=keys, **changes)


@pytest.mark.parametrize("key", [("double_block", 0), ("single_block", 0)])
@pytest.mark.parametrize("kind", ["tome", "todo"])
def test_each_token_keeps_its_residual_and_gets_its_reduced_tokens_change(pack, block, key, kind):
    """A block that adds into its input in place, a change of its own for every token it gets (a function of
    the token): each image token's output minus its input is the change of the token it was reduced into, the
    text's output is the block's, and the tensor the block was given is the caller's untouched."""
    seen = {}

    def in_place_block(args, extra):
        x = args["img"]
        seen["in"] = x.clone()
        x += torch.sin(3 * x) + 1.0  # in place, as ComfyUI's blocks do
        seen["out"] = x
        if key[0] == "double_block":
            args["txt"] += 2.0
            return {"img": x, "txt": args["txt"]}
        return {"img": x}

    given, out = run_block(block, *((None, settings(pack, "tome")) if kind == "tome" else (settings(pack, "todo"),)),
                           key=key, inner=in_place_block)
    text = 0 if key[0] == "double_block" else COND_TEXT
    kept = MERGED if kind == "tome" else POOLED
    assert seen["in"].shape[1] == text + kept
    full_in = given["img"][:, text:]
    change = (out["img"][:, text:] - full_in)  # [2, 30, 8]
    reduced_change = (seen["out"] - seen["in"])[:, text:]  # [2, kept, 8]
    # Every token's change is one of its batch element's reduced changes; as many distinct ones as kept tokens.
    distance = torch.cdist(change, reduced_change, compute_mode="donot_use_mm_for_euclid_dist")  # [2, 30, kept]
    assert distance.min(dim=-1).values.max() < 1e-5
    assert {len(set(distance[b].argmin(dim=-1).tolist())) for b in range(2)} == {kept}
    if kind == "todo":  # nearest: a cell's token is its top-left one, and every token of a cell gets its change
        cells = (torch.arange(5)[:, None] // 2 * 3 + torch.arange(6)[None, :] // 2).flatten()
        torch.testing.assert_close(seen["in"][:, text:], full_in.unflatten(1, (5, 6))[:, ::2, ::2].flatten(1, 2),
                                   rtol=0, atol=0)
        torch.testing.assert_close(change, reduced_change[:, cells])
    if key[0] == "double_block":
        torch.testing.assert_close(out["txt"], given["txt"] + 2.0, rtol=0, atol=0)
    else:
        torch.testing.assert_close(out["img"][:, :text], seen["out"][:, :text], rtol=0, atol=0)


def test_merged_tokens_run_at_their_destinations_positions(pack, block):
    """The rotary table reaching the block has the text's entries, then each merged token's own entry (a
    destination's, or an unmerged token's): gathered per batch element, each an entry of the image's."""
    seen = {}

    def inner(args, extra):
        seen["pe"] = args["pe"]
        return {"img": args["img"], "txt": args["txt"]}

    given, _ = run_block(block, None, settings(pack, "tome"), inner=inner)
    pe = given["pe"]
    assert seen["pe"].shape == (2, 1, COND_TEXT + MERGED, 2, 2, 2)
    torch.testing.assert_close(seen["pe"][:, :, :COND_TEXT], pe[:, :, :COND_TEXT].expand(2, -1, -1, -1, -1, -1),
                               rtol=0, atol=0)
    image = pe[0, 0, COND_TEXT:].flatten(1)  # [30, 8]
    for b in range(2):
        merged = seen["pe"][b, 0, COND_TEXT:].flatten(1)
        index = torch.cdist(merged, image, compute_mode="donot_use_mm_for_euclid_dist").argmin(dim=-1)
        torch.testing.assert_close(merged, image[index], rtol=0, atol=0)
        assert len(set(index.tolist())) == MERGED


def test_pooled_cells_run_at_their_first_tokens_positions(pack, block):
    seen = {}

    def inner(args, extra):
        seen["pe"] = args["pe"]
        return {"img": args["img"], "txt": args["txt"]}

    given, _ = run_block(block, settings(pack, "todo", method="average"), inner=inner)
    image = given["pe"][:, :, COND_TEXT:].unflatten(2, (5, 6))[:, :, ::2, ::2].flatten(2, 3)
    torch.testing.assert_close(seen["pe"][:, :, COND_TEXT:], image.expand(2, -1, -1, -1, -1, -1), rtol=0, atol=0)


@pytest.mark.parametrize("when", ["before", "after"])
def test_another_nodes_block_replacement_runs_on_the_reduced_tokens(comfy_nodes, pack, flux, when):
    """Another node's ``dit`` replacement on both blocks, put on the model before our node or after it: it still
    runs every call, inside ours (on the merged tokens)."""
    replaced = []

    def other_nodes_block(args, extra):
        replaced.append(args["img"].shape[1])
        return extra["original_block"](args)

    def put(model):
        model = model.clone()
        model.set_model_patch_replace(other_nodes_block, "dit", "double_block", 0)
        model.set_model_patch_replace(other_nodes_block, "dit", "single_block", 0)
        return model

    if when == "before":
        patched = pack.dit.apply_tome_dit(put(flux), ratio=0.5, **BLOCKS)
    else:
        patched = put(pack.dit.apply_tome_dit(flux, ratio=0.5, **BLOCKS))
    assert torch.isfinite(sample(comfy_nodes, patched)).all()
    assert sorted(set(replaced)) == sorted({MERGED, COND_TEXT + MERGED, UNCOND_TEXT + MERGED})
    assert len(replaced) == 2 * 2 * 2


def test_a_block_replacement_that_skips_the_block_leaves_every_image_token_as_it_was(pack, block):
    """Skip-layer guidance's kind of replacement (the block's input back as its output): no change to unmerge,
    so every image token comes out exactly as it went in (up to the float sum x + 0)."""
    given, out = run_block(block, None, settings(pack, "tome"), inner=lambda args, extra: dict(args))
    torch.testing.assert_close(out["img"], given["img"], rtol=0, atol=0)


def test_flux_through_the_sampler_same_seed_same_image_and_not_the_attention_scopes(comfy_nodes, pack, flux):
    block_scope = pack.dit.apply_tome_dit(flux, ratio=0.5, seed=7, **BLOCKS)
    first, second = sample(comfy_nodes, block_scope), sample(comfy_nodes, block_scope)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert torch.isfinite(first).all()
    attention_scope = sample(comfy_nodes, pack.dit.apply_tome_dit(flux, ratio=0.5, seed=7))
    assert (first - attention_scope).abs().max() > 1e-3
    assert (first - sample(comfy_nodes, flux)).abs().max() > 1e-3


def test_a_family_without_the_block_scope_falls_back_to_attention_with_a_warning(comfy_nodes, pack, caplog):
    lumina = dit_models.build_dit_model("lumina2")
    with caplog.at_level(logging.WARNING):
        patched = pack.dit.apply_todo_dit(lumina, downsample_factor=2, **BLOCKS)
    assert "dit_scope 'block' does not reach NextDiT's blocks yet" in caplog.text or \
        "dit_scope 'block' does not reach Lumina2's blocks yet" in caplog.text
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert override.todo.scope == "attention"
    (wrapper,) = patched.get_wrappers("apply_model", "tome")
    assert wrapper.blocks is None


@pytest.mark.parametrize("name,value,allowed", [("dit_scope", "whole", "attention, block"),
                                                ("skip_first_blocks", -1, "between 0 and 100"),
                                                ("skip_last_blocks", 101, "between 0 and 100")])
def test_a_bad_block_input_is_an_error_naming_it_and_the_model_is_untouched(pack, flux, name, value, allowed):
    before = (dict(flux.model_options["transformer_options"]), flux.get_wrappers("apply_model", "tome"))
    inputs = dict(BLOCKS, **{name: value})
    for apply in (lambda: pack.dit.apply_tome_dit(flux, ratio=0.5, **inputs),
                  lambda: pack.dit.apply_todo_dit(flux, downsample_factor=2, **inputs)):
        with pytest.raises(ValueError, match=name) as error:
            apply()
        assert allowed in str(error.value)
    assert (dict(flux.model_options["transformer_options"]), flux.get_wrappers("apply_model", "tome")) == before


def test_the_nodes_pass_the_block_inputs_and_a_u_net_warns_that_they_mean_nothing(pack, comfy_nodes, flux, sd15,
                                                                                caplog):
    (todo,) = pack.nodes.ApplyToDo.execute(model=flux, downsample_factor=2, max_downsample="auto", method="nearest",
                                           start_percent=0.0, end_percent=1.0, time_factor=1, dit_scope="block",
                                           skip_first_blocks=1, skip_last_blocks=0).result
    (tome,) = pack.nodes.ApplyToMeAdvanced.execute(
        model=todo, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
        merge="q, k and v", start_percent=0.0, end_percent=1.0, dit_scope="block", skip_first_blocks=0,
        skip_last_blocks=1).result
    override = tome.model_options["transformer_options"]["optimized_attention_override"]
    assert (override.todo.scope, override.todo.blocks) == ("block", frozenset({("single_block", 0)}))
    assert (override.tome.scope, override.tome.blocks) == ("block", frozenset({("double_block", 0)}))
    assert torch.isfinite(sample(comfy_nodes, tome)).all()
    (old,) = pack.nodes.ApplyToMeAdvanced.execute(  # a graph saved before the block inputs: the attention scope
        model=flux, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=0, use_rand=True,
        merge="q, k and v", start_percent=0.0, end_percent=1.0).result
    assert old.model_options["transformer_options"]["optimized_attention_override"].tome.scope == "attention"
    with caplog.at_level(logging.WARNING):
        pack.nodes.ApplyToDo.execute(model=sd15, downsample_factor=2, max_downsample="auto", method="nearest",
                                     start_percent=0.0, end_percent=1.0, dit_scope="block")
    assert "dit_scope='block' has no meaning on BaseModel" in caplog.text


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_the_block_scope_reads_the_host_at_most_once_per_model_call_and_never_blocks(comfy_nodes, pack, node):
    """A window (the sigma read once per model call) and use_rand (seeded from that same read)."""
    base = host_reads.build_model("Flux")
    apply = {"tome": lambda: pack.dit.apply_tome_dit(base, ratio=0.5, end_percent=0.7, **BLOCKS),
             "todo": lambda: pack.dit.apply_todo_dit(base, downsample_factor=2, end_percent=0.7, **BLOCKS)}[node]
    host_reads.count_sampling(comfy_nodes, apply(), "Flux")  # first-run work
    plain = host_reads.count_sampling(comfy_nodes, base, "Flux")
    ours = host_reads.count_sampling(comfy_nodes, apply(), "Flux")
    added = ours.counts - plain.counts
    assert ours.model_calls == host_reads.STEPS
    assert added.host_reads <= ours.model_calls, added.ops
    assert added.blocking_copies == 0, added.ops


# torch.compile, as test_compile.py runs it: ComfyUI 0.3.75's own TorchCompileModel and the late-2026 guard filter.

@pytest.fixture(params=["0.3.75", "newest"])
def compile_model(request):
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    from tome_harness import newest_host

    hosts = {"0.3.75": lambda model: TorchCompileModel.execute(model, "aot_eager").result[0],
             "newest": lambda model: newest_host.compile_like_newest(model, "aot_eager")}
    torch._dynamo.reset()
    yield hosts[request.param]
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_equals_uncompiled_for_differently_set_clones_and_a_rerun_compiles_nothing(comfy_nodes, pack,
                                                                                            compile_model):
    flux = dit_models.build_dit_model("flux")
    compiled = compile_model(flux)
    settings = [lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
                lambda m: pack.dit.apply_tome_dit(m, ratio=0.3, dit_scope="block", skip_first_blocks=1,
                                                  skip_last_blocks=0),
                lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, end_percent=0.5, **BLOCKS)]
    references = [sample(comfy_nodes, apply(flux)) for apply in settings]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert (references[a] - references[b]).abs().max() > 0.1
    for apply, reference in zip(settings, references, strict=True):
        torch.testing.assert_close(sample(comfy_nodes, apply(compiled)), reference, rtol=1e-4, atol=1e-4)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for apply, reference in zip(settings, references, strict=True):
        torch.testing.assert_close(sample(comfy_nodes, apply(compiled)), reference, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
