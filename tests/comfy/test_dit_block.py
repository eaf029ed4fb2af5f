"""The block scope on DiTs (``tome/hosts/comfyui_dit_block.py``): whole blocks on the reduced image tokens.

Tiny random-weight Flux models of the real layout (one double and one single
block; Flux 2 and Chroma too), through the real ComfyUI classes and sampler,
cond and uncond of different text lengths (7 and 5 tokens) on a 10x12 latent:
a 5x6 grid of 30 image tokens. ToMe at ratio 0.5 leaves 15 of them, ToDo at
factor 2 a 3x3 grid of 9. Then SD3.5 (two joint blocks, the first with its
image-only attn2), Wan 2.1 (two blocks, 3 frames of that grid: 90 tokens, 45
merged, 27 pooled; i2v, Fun's reference frame, VACE, TI2V-5B's per-frame
modulation, Animate's reference frame) and Qwen-Image (two double blocks).
"""

import logging

import pytest
import torch
from helpers import (
    another_nodes_replacement,
    check_block_scope_is_seeded_and_not_the_attention_scope,
    check_block_scope_off_is_the_model,
    record_lengths,
)

from tome_harness import dit_models, host_reads
from tome_harness.block_reuse import with_reuse_blocks

COND_TEXT, UNCOND_TEXT = 7, 5
LATENTS = {"flux": (1, 16, 10, 12), "flux2": (1, 128, 5, 6), "chroma": (1, 16, 10, 12),
           "chroma_radiance": (1, 3, 80, 96)}
TEXTS = {"flux": (COND_TEXT, UNCOND_TEXT), "flux2": (512,), "chroma": (COND_TEXT, UNCOND_TEXT),  # Flux 2 pads to 512
         "chroma_radiance": (COND_TEXT, UNCOND_TEXT)}
IMAGE, MERGED, POOLED = 30, 15, 9
BLOCKS = dict(dit_scope="block", skip_first_blocks=0, skip_last_blocks=0)


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


def sample(comfy_nodes, model, family="flux", seed=3, steps=2, references=None, conditioned=None):
    """A real KSampler run at cfg 2; ``references``: conds naming reference latents (Kontext); ``conditioned``:
    the ``(positive, negative, latent)`` a conditioning node made, in place of the test's own."""
    if conditioned is not None:
        positive, negative, latent = conditioned
    else:
        positive, negative = conditioning(references)
        latent = {"samples": torch.zeros({**LATENTS, **FAMILY_LATENTS}[family])}
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


def test_skips_that_leave_no_block_put_nothing_on_the_model_and_remove_an_earlier_setting(pack, flux, caplog):
    """An empty selection is no setting: nothing is installed (not even replacements that pass every block
    through), and it replaces an earlier node's setting as ratio 0 / factor 1 do."""
    none_left = dict(dit_scope="block", skip_first_blocks=1, skip_last_blocks=1)
    with caplog.at_level(logging.WARNING):
        assert pack.dit.apply_tome_dit(flux, ratio=0.5, **none_left) is flux
        assert pack.dit.apply_todo_dit(flux, downsample_factor=2, **none_left) is flux
    assert caplog.text.count("nothing is put on the model") == 2
    both = pack.dit.apply_todo_dit(pack.dit.apply_tome_dit(flux, ratio=0.5, **BLOCKS), downsample_factor=2, **BLOCKS)
    removed = pack.dit.apply_todo_dit(pack.dit.apply_tome_dit(both, ratio=0.5, **none_left), downsample_factor=2,
                                      **none_left)
    assert not removed.get_wrappers("apply_model", "tome")
    assert "optimized_attention_override" not in removed.model_options["transformer_options"]


def test_blocks_and_steps_outside_the_choice_run_whole_bit_for_bit(comfy_nodes, pack, flux, caplog):
    """Skipping both blocks (with a warning: nothing is put on the model), or a window no step falls in (the
    replacements pass every block through): the run is the unpatched one (this model's 2 steps are at sigma 1 and
    0.001)."""
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


# One call of our replacement, per family: its latent (batch 2), where the image starts in the layout's sequence,
# and the args ComfyUI's block replacement gets (``img``, ``txt`` and the per-token tables). HunyuanVideo and Mochi
# put the text after the image; Wan's and LTX-Video's text is cross-attention context, in no sequence.
UNIT_FRAMES = {"flux": 1, "sd3": 1, "wan": 3, "qwen_image": 1, "hunyuan_video": 3, "ltxv": 3, "mochi": 3}
TEXT_AFTER = ("hunyuan_video", "mochi")
TEXT_APART = ("wan", "ltxv")


def unit_layout(families, family):
    return {"flux": lambda: families.flux_layout((2, 16, 10, 12), 2, COND_TEXT),
            "sd3": lambda: families.sd3_layout((2, 16, 10, 12), 2, COND_TEXT),
            "wan": lambda: families.wan_layout((2, 16, 3, 10, 12), (1, 2, 2), [COND_TEXT]),
            "qwen_image": lambda: families.qwen_image_layout((2, 16, 10, 12), 2, COND_TEXT),
            "hunyuan_video": lambda: families.hunyuan_video_layout((2, 16, 3, 10, 12), (1, 2, 2), COND_TEXT,
                                                                   COND_TEXT),
            "ltxv": lambda: families.ltxv_layout((2, 128, 3, 5, 6), (1, 1, 1), [COND_TEXT]),
            "mochi": lambda: families.mochi_layout((2, 12, 3, 10, 12), (1, 2, 2), COND_TEXT)}[family]()


# Per family, its per-token table: (args key, token axis, batched).
UNIT_TABLES = {"flux": ("pe", 2, True), "qwen_image": ("pe", 2, True), "wan": ("pe", 1, True),
               "hunyuan_video": ("pe", 2, True), "ltxv": ("pe", 2, True), "mochi": ("rope_cos", 0, False)}


def run_block(block, scope_todo=None, scope_tome=None, key=("double_block", 0), inner=None, img=None, txt=None,
              family="flux", vec=None, layout=None, run=None, **extra_args):
    """One call of our replacement of ``key`` on a model of ``family``, on a 5x6 image (batch 2; the video
    models: 3 frames) beside 7 text tokens (ahead of it; after it: HunyuanVideo, Mochi; apart, as cross-attention
    context: Wan, LTX-Video), with a rotary table over the sequence (Wan, LTX-Video: the video's tokens; Mochi: two,
    unbatched, over the video; SD3: none), around ``inner`` (the block): ``(args given, result)``. ``run``: the
    sampling run the call is part of (a ``SamplingRun``; none: a call of its own). ``extra_args``: more entries of
    the block's args."""
    from tome_harness import comfyui as comfyui_host

    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    families = comfyui_host.pack_module("tome.hosts.dit_families")
    generator = torch.Generator().manual_seed(11)
    layout = unit_layout(families, family) if layout is None else layout
    n = IMAGE * UNIT_FRAMES[family]
    img = torch.randn(2, n, 8, generator=generator) if img is None else img
    txt = torch.randn(2, COND_TEXT, 8, generator=generator) if txt is None else txt
    options = {dit.LAYOUT_KEY: layout}
    if run is not None:
        options[comfyui_host.pack_module("tome.hosts.comfyui").RUN_KEY] = run
    sequence = img.shape[1] + (0 if family in TEXT_APART else COND_TEXT)
    args = {"img": img, "txt": txt, "vec": vec, "transformer_options": options}
    if family == "mochi":  # [L, heads, D/2] each, over the video alone
        args.update(rope_cos=torch.randn(n, 2, 4, generator=generator),
                    rope_sin=torch.randn(n, 2, 4, generator=generator), num_tokens=COND_TEXT)
    elif family == "wan":  # [1, L, 1, D/2, 2, 2]
        args["pe"] = torch.randn(1, sequence, 1, 2, 2, 2, generator=generator)
    elif family != "sd3":  # [1, 1, L, D/2, 2, 2]
        args["pe"] = torch.randn(1, 1, sequence, 2, 2, 2, generator=generator)
    if key[0] == "single_block":
        joined = [img, txt] if family in TEXT_AFTER else [txt, img]
        args = {"img": torch.cat(joined, 1), "vec": vec, "pe": args["pe"], "transformer_options": options}
    args.update(extra_args)
    scope = block.BlockScope(scope_todo, scope_tome, (key,), family)
    replacement = block.BlockReduction(scope, key, inner)
    given = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    out = replacement(args, {"original_block": lambda a: pytest.fail("the inner replacement runs the block")})
    torch.testing.assert_close(args["img"], given["img"], rtol=0, atol=0)  # our caller's tensor is left as it was
    assert options[dit.LAYOUT_KEY] is layout  # the layout is the call's again after the block
    return given, out


def settings(pack, kind, **changes):
    window = pack.comfyui.Window()
    keys = frozenset({("double_block", 0), ("single_block", 0)})
    if kind == "tome":
        return pack.dit.DiTToMe(0.5, 2, 2, window, scope="block", blocks=keys, **changes)
    return pack.dit.DiTToDo(2, changes.pop("time_factor", 1), changes.pop("method", "nearest"), window, scope="block",
                            blocks=keys, **changes)


UNIT_CASES = [("flux", ("double_block", 0)), ("flux", ("single_block", 0)), ("sd3", ("double_block", 0)),
              ("wan", ("double_block", 0)), ("qwen_image", ("double_block", 0)),
              ("hunyuan_video", ("double_block", 0)), ("hunyuan_video", ("single_block", 0)),
              ("ltxv", ("double_block", 0)), ("mochi", ("double_block", 0))]


@pytest.mark.parametrize("family,key", UNIT_CASES)
@pytest.mark.parametrize("kind", ["tome", "todo"])
def test_each_token_keeps_its_residual_and_gets_its_reduced_tokens_change(pack, block, family, key, kind):
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
                           key=key, inner=in_place_block, family=family)
    frames = UNIT_FRAMES[family]
    n, kept = IMAGE * frames, (MERGED if kind == "tome" else POOLED) * frames
    # The image's place in img: after the text in Flux's single blocks, first everywhere else.
    at = COND_TEXT if key[0] == "single_block" and family not in TEXT_AFTER else 0
    text_in, text_out = (0, 0) if key[0] == "double_block" else \
        ((slice(n, None), slice(kept, None)) if family in TEXT_AFTER else (slice(0, at), slice(0, at)))
    assert seen["in"].shape[1] == given["img"].shape[1] - n + kept
    full_in = given["img"][:, at:at + n]
    change = (out["img"][:, at:at + n] - full_in)  # [2, 30 * frames, 8]
    reduced_change = (seen["out"] - seen["in"])[:, at:at + kept]  # [2, kept, 8]
    # Every token's change is one of its batch element's reduced changes; as many distinct ones as kept tokens.
    distance = torch.cdist(change, reduced_change, compute_mode="donot_use_mm_for_euclid_dist")  # [2, 30, kept]
    assert distance.min(dim=-1).values.max() < 1e-5
    assert {len(set(distance[b].argmin(dim=-1).tolist())) for b in range(2)} == {kept}
    if kind == "todo":  # nearest: a cell's token is its top-left one, and every token of a cell gets its change
        cells = torch.cat([frame * 9 + (torch.arange(5)[:, None] // 2 * 3 + torch.arange(6)[None, :] // 2).flatten()
                           for frame in range(frames)])
        torch.testing.assert_close(seen["in"][:, at:at + kept],
                                   full_in.unflatten(1, (frames, 5, 6))[:, :, ::2, ::2].flatten(1, 3), rtol=0, atol=0)
        torch.testing.assert_close(change, reduced_change[:, cells])
    if key[0] == "double_block":
        torch.testing.assert_close(out["txt"], given["txt"] + 2.0, rtol=0, atol=0)
    else:
        torch.testing.assert_close(out["img"][:, text_in], seen["out"][:, text_out], rtol=0, atol=0)


def tokens_first(table, axis, batched):
    """A per-token table as ``[B or 1, L, rest]``."""
    table = table if batched else table.unsqueeze(0)
    return table.movedim(axis if batched else axis + 1, 1).flatten(2)


@pytest.mark.parametrize("family", list(UNIT_TABLES))
def test_merged_tokens_run_at_their_destinations_positions(pack, block, family):
    """The rotary table reaching the block keeps the text's rows (ahead of the image: Flux, Qwen-Image; after it:
    HunyuanVideo), and has each merged token's own row (a destination's, or an unmerged token's): gathered per
    batch element, each a row of the image's. Wan's and LTX-Video's tables cover the video alone, as do Mochi's
    two, which have no batch axis (the block gets them batched)."""
    name, axis, batched = UNIT_TABLES[family]
    seen = {}

    def inner(args, extra):
        seen["table"] = args[name]
        return {"img": args["img"], "txt": args["txt"]}

    given, _ = run_block(block, None, settings(pack, "tome"), inner=inner, family=family)
    n, kept = IMAGE * UNIT_FRAMES[family], MERGED * UNIT_FRAMES[family]
    got_axis = axis if batched else axis + 1  # the block gets it batched
    table, got = tokens_first(given[name], axis, batched), tokens_first(seen["table"], got_axis, True)
    text = 0 if family in TEXT_APART + ("mochi",) else COND_TEXT
    image_at = 0 if family in TEXT_AFTER + TEXT_APART else COND_TEXT
    assert got.shape == (2, text + kept, table.shape[-1])
    text_rows = (slice(n, None), slice(kept, None)) if family in TEXT_AFTER else (slice(0, text), slice(0, text))
    torch.testing.assert_close(got[:, text_rows[1]], table[:, text_rows[0]].expand(2, -1, -1), rtol=0, atol=0)
    image = table[0, image_at:image_at + n]  # [30 * frames, rest]
    for b in range(2):
        merged = got[b, image_at:image_at + kept]
        index = torch.cdist(merged, image, compute_mode="donot_use_mm_for_euclid_dist").argmin(dim=-1)
        torch.testing.assert_close(merged, image[index], rtol=0, atol=0)
        assert len(set(index.tolist())) == kept


@pytest.mark.parametrize("family", ["flux", "wan", "hunyuan_video"])
def test_pooled_cells_run_at_their_first_tokens_positions(pack, block, family):
    seen = {}

    def inner(args, extra):
        seen["pe"] = args["pe"]
        return {"img": args["img"], "txt": args["txt"]}

    given, _ = run_block(block, settings(pack, "todo", method="average"), inner=inner, family=family)
    _, axis, _ = UNIT_TABLES[family]
    frames, image_at = UNIT_FRAMES[family], COND_TEXT if family == "flux" else 0
    pe, got = tokens_first(given["pe"], axis, True), tokens_first(seen["pe"], axis, True)
    image = pe[:, image_at:image_at + 30 * frames].unflatten(1, (frames, 5, 6))[:, :, ::2, ::2].flatten(1, 3)
    torch.testing.assert_close(got[:, image_at:image_at + 9 * frames], image.expand(2, -1, -1), rtol=0, atol=0)


def test_hunyuans_text_mask_follows_the_tokens(pack, block):
    """HunyuanVideo's text-padding mask ``[1, 1, L]`` over ``[video | text]`` (zeros over the video): the block
    gets one row per batch element, zeros over the merged video, the text's rows as they were."""
    mask = torch.zeros(1, 1, 90 + COND_TEXT)
    mask[..., -2:] = -1e4  # the text's last two tokens are padding
    seen = {}

    def inner(args, extra):
        seen["mask"] = args["attention_mask"]
        return {"img": args["img"], "txt": args["txt"]}

    run_block(block, None, settings(pack, "tome"), inner=inner, family="hunyuan_video", attention_mask=mask)
    expected = torch.cat([torch.zeros(1, 1, 45), mask[..., 90:]], dim=-1).expand(2, -1, -1)
    torch.testing.assert_close(seen["mask"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind,first", [("tome", MERGED), ("todo", POOLED)])
def test_hunyuans_first_frame_modulation_moves_to_the_reduced_first_frame(pack, block, kind, first):
    """HunyuanVideo's image to video (``guiding_frame_index``) modulates the first frame's tokens apart
    (``modulation_dims``): the range ends where the reduced first frame does. ToDo pooling 2 frames in time: the
    first pooled frame takes it (its position is its first frame's)."""
    seen = {}

    def inner(args, extra):
        seen["dims"] = args["modulation_dims_img"]
        return {"img": args["img"], "txt": args["txt"]}

    scope = (None, settings(pack, "tome")) if kind == "tome" else (settings(pack, "todo", time_factor=2),)
    run_block(block, *scope, inner=inner, family="hunyuan_video",
              modulation_dims_img=[(0, 30, 0), (30, None, 1)], modulation_dims_txt=[(0, None, 1)])
    assert seen["dims"] == [(0, first, 0), (first, None, 1)]


def test_a_modulation_range_inside_a_frame_runs_the_block_whole(pack, block, caplog):
    seen = {}

    def inner(args, extra):
        seen["img"] = args["img"]
        return {"img": args["img"], "txt": args["txt"]}

    with caplog.at_level(logging.WARNING):
        run_block(block, None, settings(pack, "tome"), inner=inner, family="hunyuan_video",
                  modulation_dims_img=[(0, 20, 0), (20, None, 1)])
    assert seen["img"].shape[1] == 90
    assert "do not match its tokens one for one" in caplog.text


@pytest.mark.parametrize("rows", [1, 90])
def test_ltxvs_per_token_modulation_follows_the_tokens_and_a_shared_one_stays(pack, block, rows):
    """LTX-Video's ``vec``: one row for every token (``[B, 1, 6C]``) passes as it is; one per token (a start image
    at timestep 0) is gathered like the tokens."""
    vec = torch.randn(2, rows, 12, generator=torch.Generator().manual_seed(4))
    seen = {}

    def inner(args, extra):
        seen["vec"], seen["img"] = args["vec"], args["img"]
        return {"img": args["img"]}

    run_block(block, settings(pack, "todo"), inner=inner, family="ltxv", vec=vec)
    if rows == 1:
        assert seen["vec"] is vec
    else:
        torch.testing.assert_close(seen["vec"], vec.unflatten(1, (3, 5, 6))[:, :, ::2, ::2].flatten(1, 3),
                                   rtol=0, atol=0)
    assert seen["img"].shape[1] == 27


def test_sd3_blocks_get_no_rotary_table_and_its_last_blocks_text_stays_none(pack, block):
    """SD3's tokens carry their learned positions: nothing to gather, and no ``pe`` appears in the args. Its last
    joint block (``pre_only``) gives no text back: ``None`` passes through."""
    seen = {}

    def inner(args, extra):
        seen["args"] = dict(args)
        return {"img": args["img"] + 1.0, "txt": None}

    given, out = run_block(block, None, settings(pack, "tome"), inner=inner, family="sd3")
    assert "pe" not in seen["args"] and seen["args"]["img"].shape[1] == MERGED
    assert out["txt"] is None
    torch.testing.assert_close(out["img"], given["img"] + 1.0)


@pytest.mark.parametrize("kind,frames", [("todo", 2), ("tome", 3)])
def test_wans_per_frame_modulation_follows_the_frames(pack, block, kind, frames):
    """Wan 2.2 TI2V-5B's start image gives each latent frame its own modulation ``vec [B, T, 6, C]``, which the
    block repeats over each frame's tokens: pooled over 2 frames (time_factor 2), the block gets the first frame
    of each cell's; merged within frames, every frame's."""
    seen = {}

    def inner(args, extra):
        seen["vec"], seen["img"] = args["vec"], args["img"]
        return {"img": args["img"], "txt": args["txt"]}

    vec = torch.randn(2, 3, 6, 8, generator=torch.Generator().manual_seed(2))
    scope = settings(pack, "todo", time_factor=2) if kind == "todo" else settings(pack, "tome")
    run_block(block, *((scope,) if kind == "todo" else (None, scope)), inner=inner, family="wan", vec=vec)
    torch.testing.assert_close(seen["vec"], vec[:, ::2] if kind == "todo" else vec, rtol=0, atol=0)
    assert seen["vec"].shape[1] == frames and seen["img"].shape[1] % frames == 0


def test_a_per_frame_modulation_beside_a_reference_frame_runs_the_block_whole(pack, block, caplog):
    """A per-frame modulation with a reference frame ahead of the video (a combination no Wan model makes today):
    the reduced frames would not share it out evenly, so the block runs whole, with one warning per run."""
    from tome_harness import comfyui as comfyui_host

    families = comfyui_host.pack_module("tome.hosts.dit_families")
    layout = families.wan_layout((2, 16, 3, 10, 12), (1, 2, 2), [COND_TEXT], reference=(2, 16, 10, 12))
    seen = {}

    def inner(args, extra):
        seen["img"] = args["img"]
        return {"img": args["img"], "txt": args["txt"]}

    img = torch.randn(2, 30 + 90, 8)
    with caplog.at_level(logging.WARNING):
        run_block(block, settings(pack, "todo"), inner=inner, family="wan", img=img, layout=layout,
                  vec=torch.randn(2, 4, 6, 8))
    assert seen["img"].shape[1] == 120
    assert "do not match its tokens one for one" in caplog.text


# Every argument a block takes is declared (dit_families.BLOCK_FAMILIES); one the reduced tokens cannot follow
# leaves the block whole, with one warning per sampling run naming it.

def refused_in_two_runs(pack, block, caplog, family="flux", **extra_args):
    """Our replacement of ToMe's block called twice in one sampling run and once in the next, with ``extra_args``
    among the block's args: the image tokens the block got at each call, and the warnings naming a block
    argument."""
    seen = []

    def inner(args, extra):
        seen.append(args["img"].shape[1])
        return {"img": args["img"], "txt": args["txt"]}

    first, second = pack.comfyui.SamplingRun(), pack.comfyui.SamplingRun()
    with caplog.at_level(logging.WARNING):
        for run in (first, first, second):
            run_block(block, None, settings(pack, "tome"), inner=inner, family=family, run=run, **extra_args)
    return seen, [r.getMessage() for r in caplog.records if "block argument" in r.getMessage()]


@pytest.mark.parametrize("family,rows", [("flux", COND_TEXT + IMAGE), ("flux", IMAGE), ("wan", 3 * IMAGE)])
def test_an_undeclared_per_token_argument_runs_the_block_whole_with_one_warning_per_run(pack, block, caplog, family,
                                                                                       rows):
    """An argument no family declares (a newer ComfyUI's, another pack's) with an axis as long as the sequence or
    ``img``: it would pass at full length beside the reduced tokens, so the block runs whole."""
    per_token = torch.randn(2, rows, 4)
    seen, warnings = refused_in_two_runs(pack, block, caplog, family, tome_regions=per_token)
    assert seen == [IMAGE * UNIT_FRAMES[family]] * 3
    assert len(warnings) == 2 and all("'tome_regions'" in w for w in warnings)


def test_an_undeclared_argument_without_a_token_axis_leaves_the_block_reduced(pack, block, caplog):
    seen, warnings = refused_in_two_runs(pack, block, caplog, tome_scale=torch.randn(2, 5), tome_flag=3)
    assert seen == [MERGED] * 3 and not warnings


def test_a_masked_call_runs_the_block_whole_with_one_warning_per_run(pack, block, caplog):
    """Regional prompting's mask over Flux's sequence (``attn_mask``): the reduced tokens cannot follow it."""
    length = COND_TEXT + IMAGE
    seen, warnings = refused_in_two_runs(pack, block, caplog, attn_mask=torch.zeros(2, 1, length, length))
    assert seen == [IMAGE] * 3
    assert len(warnings) == 2 and all("'attn_mask'" in w and "regional prompting" in w for w in warnings)


@pytest.mark.parametrize("family,table", [
    ("flux", {"pe": [torch.randn(1, 1, COND_TEXT + IMAGE, 2, 2, 2)]}),  # not a tensor
    ("hunyuan_video", {"attention_mask": torch.zeros(1, 1, 50)}),  # neither one row per token nor one row
    ("ltxv", {"vec": torch.randn(2, 7, 12)}),
], ids=["flux pe a list", "hunyuan mask of 50 rows", "ltxv vec of 7 rows"])
def test_a_table_of_the_wrong_kind_runs_the_block_whole_with_one_warning_per_run(pack, block, caplog, family, table):
    seen, warnings = refused_in_two_runs(pack, block, caplog, family, **table)
    (name,) = table
    assert seen == [IMAGE * UNIT_FRAMES[family]] * 3
    assert len(warnings) == 2 and all(f"'{name}'" in w for w in warnings)


def test_every_family_declares_what_its_blocks_take(block):
    """The keys each family's forward in ComfyUI 0.3.75 hands its block replacements (and the swapped blocks'
    own args), all declared; the step caches' forwards hand a subset."""
    families = {"flux": {"double_block": {"img", "txt", "vec", "pe", "attn_mask", "transformer_options"},
                         "single_block": {"img", "vec", "pe", "attn_mask", "transformer_options"}},
                "sd3": {"double_block": {"img", "txt", "vec", "transformer_options"}},
                "wan": {"double_block": {"img", "txt", "vec", "pe", "transformer_options"}},
                "wan_animate": {"double_block": {"img", "txt", "vec", "pe", "transformer_options"}},
                "qwen_image": {"double_block": {"img", "txt", "vec", "pe", "transformer_options"}},
                "hunyuan_video": {"double_block": {"img", "txt", "vec", "pe", "attention_mask", "modulation_dims_img",
                                                   "modulation_dims_txt", "transformer_options"},
                                  "single_block": {"img", "vec", "pe", "attention_mask", "modulation_dims",
                                                   "transformer_options"}},
                "ltxv": {"double_block": {"img", "txt", "attention_mask", "vec", "pe", "transformer_options"}},
                "mochi": {"double_block": {"img", "txt", "vec", "rope_cos", "rope_sin", "num_tokens",
                                           "transformer_options"}},
                "lumina2": {"double_block": {"img", "attn_mask", "pe", "vec", "transformer_options"}},
                "hidream": {"double_block": {"img", "attn_mask", "txt", "vec", "pe", "transformer_options"},
                            "single_block": {"img", "attn_mask", "txt", "vec", "pe", "transformer_options"}}}
    assert set(block.BLOCK_FAMILIES) == set(families)
    for family, kinds in families.items():
        assert {kind: set(form.declared) for kind, form in block.BLOCK_FAMILIES[family].args.items()} == kinds, family


@pytest.mark.parametrize("when", ["before", "after"])
def test_another_nodes_block_replacement_runs_on_the_reduced_tokens(comfy_nodes, pack, flux, when):
    """Another node's ``dit`` replacement on both blocks, put on the model before our node or after it: it still
    runs every call, inside ours (on the merged tokens)."""
    put, replaced = another_nodes_replacement(("double_block", 0), ("single_block", 0))
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


# A matching reused: across the blocks of a model call (the benches' tome_harness.block_reuse: measured, not offered
# by a node) and across a block's steps (reuse_steps, Apply ToMe (Advanced)); docs/DITS.md "A matching reused".

def merged_together(block, tome, key, options, seed, reuse_blocks=1):
    """One call of our replacement of Flux's double block ``key`` (of three) on random image tokens
    (``seed``), with ``options`` (a model call's, shared by the calls of one model call): which image tokens
    the block merged together, as the groups of equal change (the block changes each token by a function of
    it alone), a frozenset per batch element. ``reuse_blocks``: one matching for that many blocks of the call."""
    from tome_harness import comfyui as comfyui_host
    from tome_harness.block_reuse import reusing_scope_class

    dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
    families = comfyui_host.pack_module("tome.hosts.dit_families")
    generator = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(2, IMAGE, 8, generator=generator), torch.randn(2, COND_TEXT, 8, generator=generator)
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    options.setdefault(dit.LAYOUT_KEY, families.flux_layout((2, 16, 10, 12), 2, COND_TEXT))
    keys = tuple(("double_block", i) for i in range(3))
    scope = reusing_scope_class(block.BlockScope)(None, tome, keys, "flux", reuse_blocks)
    replacement = block.BlockReduction(scope, key)
    args = {"img": img, "txt": txt, "vec": None, "transformer_options": options,
            "pe": torch.randn(1, 1, COND_TEXT + IMAGE, 2, 2, 2, generator=generator)}
    reduced = []

    def run(a):
        reduced.append(torch.tanh(a["img"] @ weight))
        return {"img": a["img"] + reduced[-1], "txt": a["txt"]}

    change = replacement(args, {"original_block": run})["img"] - img
    # Each token's change is one reduced token's (up to rounding): the tokens given the same one were merged.
    given = torch.cdist(change, reduced[0], compute_mode="donot_use_mm_for_euclid_dist").argmin(dim=-1)
    return [frozenset(frozenset(torch.nonzero(given[b] == k).flatten().tolist()) for k in given[b].unique().tolist())
            for b in range(2)]


def reusing(pack, **changes):
    keys = frozenset(("double_block", i) for i in range(3))
    return pack.dit.DiTToMe(0.5, 2, 2, pack.comfyui.Window(), scope="block", blocks=keys, **changes)


@pytest.mark.parametrize("reuse_blocks", [1, 2])
def test_reuse_blocks_blocks_of_a_model_call_merge_the_tokens_the_first_of_them_matched(pack, block, reuse_blocks):
    tome = reusing(pack)
    options = {}  # one model call: the plan the first block matched is kept in its options
    first, second, third = (merged_together(block, tome, ("double_block", i), options, seed=i,
                                            reuse_blocks=reuse_blocks) for i in range(3))
    assert all(len(groups) == MERGED for groups in first)  # 15 merged tokens: the groups of the first matching
    assert (second == first) == (reuse_blocks == 2)  # other tokens, the same groups: the first block's matching
    assert third != first  # the third block matches afresh
    assert merged_together(block, tome, ("double_block", 1), {}, seed=1, reuse_blocks=reuse_blocks) != first


def test_reuse_steps_a_blocks_matching_serves_its_next_steps_per_batch_of_conds(pack, block):
    """Steps at sigma 10, 8 and 6 of a run keeping plans (each step a model call of its own): with reuse_steps
    2, the step at 8 merges the tokens the step at 10 matched, the step at 6 matches afresh; another batch of
    conds and another block keep their own."""
    run, schedule = pack.comfyui.SamplingRun(keeps_plans=True), torch.tensor([10.0, 8.0, 6.0, 0.0])
    tome = reusing(pack, reuse_steps=2)

    def step(sigma, key=("double_block", 0), uuids=("cond", "uncond"), seed=0):
        options = {"sigmas": torch.tensor([sigma]), "sample_sigmas": schedule, pack.comfyui.RUN_KEY: run,
                   "uuids": uuids}
        return merged_together(block, tome, key, options, seed=seed)

    first = step(10.0)
    other_block, other_batch = step(10.0, key=("double_block", 1), seed=3), step(10.0, uuids=("cond",), seed=4)
    assert step(8.0, seed=1) == first
    assert step(8.0, key=("double_block", 1), seed=5) == other_block != first
    assert step(8.0, uuids=("cond",), seed=6) == other_batch != first
    assert step(6.0, seed=2) != first


def test_reuse_steps_through_the_sampler_same_seed_same_image_same_token_counts(comfy_nodes, pack, flux, caplog):
    """Apply ToMe (Advanced)'s reuse_steps acts at the block scope (3 steps: the second reuses the first's
    matchings); at the attention scope it is ignored with a warning."""
    def advanced(reuse_steps, dit_scope="block"):
        return pack.nodes.ApplyToMeAdvanced.execute(
            model=flux, ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", seed=7, use_rand=True,
            merge="q, k and v", start_percent=0.0, end_percent=1.0, reuse_steps=reuse_steps, dit_scope=dit_scope,
            skip_first_blocks=0, skip_last_blocks=0).result[0]

    reused = advanced(2)
    samples = [sample(comfy_nodes, reused, steps=3) for _ in range(2)]
    torch.testing.assert_close(samples[0], samples[1], rtol=0, atol=0)
    assert torch.isfinite(samples[0]).all()
    assert (samples[0] - sample(comfy_nodes, advanced(1), steps=3)).abs().max() > 1e-4
    assert traced(comfy_nodes, flux, lambda m: advanced(2))[1] == traced(comfy_nodes, flux, lambda m: advanced(1))[1]
    with caplog.at_level(logging.WARNING):
        attention = advanced(3, dit_scope="attention")
    assert "reuse_steps=3 has no meaning at dit_scope 'attention'" in caplog.text
    assert attention.model_options["transformer_options"]["optimized_attention_override"].tome.reuse_steps == 1


def test_flux_through_the_sampler_same_seed_same_image_and_not_the_attention_scopes(comfy_nodes, pack, flux):
    block_scope = pack.dit.apply_tome_dit(flux, ratio=0.5, seed=7, **BLOCKS)
    first, second = sample(comfy_nodes, block_scope), sample(comfy_nodes, block_scope)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert torch.isfinite(first).all()
    attention_scope = sample(comfy_nodes, pack.dit.apply_tome_dit(flux, ratio=0.5, seed=7))
    assert (first - attention_scope).abs().max() > 1e-3
    assert (first - sample(comfy_nodes, flux)).abs().max() > 1e-3


# SD3.5, Wan 2.1 and Qwen-Image through the sampler. Per model: its latent, the attribute holding its blocks, and
# from a block's forward call its (image stream tokens, text tokens or None).
FAMILY_LATENTS = {"sd3": (1, 16, 10, 12), "wan21": (1, 16, 3, 10, 12), "qwen_image": (1, 16, 1, 10, 12),
                  "wan21_fun": (1, 16, 3, 10, 12), "wan21_vace": (1, 16, 3, 10, 12), "wan21_i2v": (1, 16, 3, 10, 12)}
FAMILY_BLOCKS = {
    "sd3": ("joint_blocks", lambda args, kwargs: (args[1].shape[1], args[0].shape[1])),  # (context, x)
    "wan21": ("blocks", lambda args, kwargs: (args[0].shape[1], None)),  # the text is cross-attention context
    "qwen_image": ("transformer_blocks",
                   lambda args, kwargs: (kwargs["hidden_states"].shape[1], kwargs["encoder_hidden_states"].shape[1])),
}
FRAMES = {"sd3": 1, "wan21": 3, "qwen_image": 1}


def family_trace(model, family, calls):
    """Forward pre-hooks on every block of ``model``: ``(block index, image tokens, text tokens)`` per call."""
    name, entry = FAMILY_BLOCKS.get(family, FAMILY_BLOCKS["wan21"])
    blocks = getattr(model.get_model_object("diffusion_model"), name)
    return [module.register_forward_pre_hook(lambda m, a, k, i=i: calls.append((i, *entry(a, k))), with_kwargs=True)
            for i, module in enumerate(blocks)]


def family_traced(comfy_nodes, model, apply, family, references=None, conditioned=None):
    attention, blocks = [], []
    patched = apply(with_override(model, record_lengths(attention)))
    handles = family_trace(model, family, blocks)
    try:
        out = sample(comfy_nodes, patched, family, references=references, conditioned=conditioned)
    finally:
        for handle in handles:
            handle.remove()
    return out, blocks, attention


@pytest.fixture(scope="module")
def family_models(comfy_nodes):
    return {name: dit_models.build_dit_model(name) for name in FAMILY_BLOCKS}


APPLY = {"tome": lambda pack: lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS),
         "todo": lambda pack: lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, **BLOCKS)}


@pytest.mark.parametrize("family", list(FAMILY_BLOCKS))
@pytest.mark.parametrize("node", ["tome", "todo"])
def test_sd3_wan_and_qwen_image_blocks_and_their_attention_run_on_the_reduced_image(comfy_nodes, pack, family_models,
                                                                                    family, node):
    """Every block call gets the reduced image (per frame: 15 merged or 9 pooled of 30) and the whole text; every
    attention call sees what its block has: SD3's joint attention the text and the image, its attn2 (block 0)
    the image alone; Wan's self-attention the video, its cross-attention the video's queries and the text's keys;
    Qwen-Image's joint attention the text and the image."""
    kept = (MERGED if node == "tome" else POOLED) * FRAMES[family]
    out, blocks, attention = family_traced(comfy_nodes, family_models[family], APPLY[node](pack), family)
    assert torch.isfinite(out).all()
    texts = (COND_TEXT, UNCOND_TEXT)
    if family == "wan21":
        assert set(blocks) == {(i, kept, None) for i in range(2)}
        assert set(attention) == {(kept, kept)} | {(kept, text) for text in texts}
    else:
        assert set(blocks) == {(i, kept, text) for i in range(2) for text in texts}
        expected = {(text + kept, text + kept) for text in texts}
        assert set(attention) == (expected | {(kept, kept)} if family == "sd3" else expected)
    assert len(blocks) == 2 * 2 * 2  # 2 blocks, cond and uncond, 2 steps: every block call reduced


@pytest.mark.parametrize("family", list(FAMILY_BLOCKS))
def test_sd3_wan_and_qwen_image_ratio_0_factor_1_and_steps_outside_the_window_are_the_model_bit_for_bit(
        comfy_nodes, pack, family_models, family):
    check_block_scope_off_is_the_model(pack, family_models[family], lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family", list(FAMILY_BLOCKS))
def test_sd3_wan_and_qwen_image_same_seed_same_image_and_not_the_attention_scopes(comfy_nodes, pack, family_models,
                                                                                  family):
    check_block_scope_is_seeded_and_not_the_attention_scope(pack, family_models[family],
                                                            lambda m: sample(comfy_nodes, m, family), BLOCKS)


@pytest.mark.parametrize("family", list(FAMILY_BLOCKS))
@pytest.mark.parametrize("when", ["before", "after"])
def test_another_nodes_block_replacement_runs_on_the_reduced_tokens_of_sd3_wan_and_qwen_image(
        comfy_nodes, pack, family_models, family, when):
    put, replaced = another_nodes_replacement(("double_block", 1))
    model = family_models[family]
    apply = APPLY["tome"](pack)
    patched = apply(put(model)) if when == "before" else put(apply(model))
    assert torch.isfinite(sample(comfy_nodes, patched, family)).all()
    assert replaced == [MERGED * FRAMES[family]] * (2 * 2)  # block 1, cond and uncond, 2 steps


def test_wan_reference_frames_stay_whole(comfy_nodes, pack):
    """Wan Fun's reference image is one frame of 30 tokens ahead of the video: it enters every block whole, the
    three video frames pooled (27 tokens) behind it; self-attention sees both."""
    model = dit_models.build_dit_model("wan21_fun")
    references = {"reference_latents": [torch.randn(1, 16, 1, 10, 12, generator=torch.Generator().manual_seed(4))]}
    out, blocks, attention = family_traced(comfy_nodes, model, APPLY["todo"](pack), "wan21_fun", references)
    assert torch.isfinite(out).all()
    assert set(blocks) == {(i, 30 + 27, None) for i in range(2)}
    assert (30 + 27, 30 + 27) in attention


def test_wan_vace_main_blocks_are_reduced_and_its_control_blocks_stay_whole(comfy_nodes, pack):
    """VACE: our replacement composes with the main blocks' marks: the main blocks get the merged video, the
    control block attends over the whole control video (90 tokens) on the model's full input, and another node's
    replacement on main block 1 still runs, inside ours."""
    put, replaced = another_nodes_replacement(("double_block", 1))
    model = put(dit_models.build_dit_model("wan21_vace"))
    out, blocks, attention = family_traced(comfy_nodes, model, APPLY["tome"](pack), "wan21_vace")
    assert torch.isfinite(out).all()
    assert {tokens for _, tokens, _ in blocks} == {45}
    assert (90, 90) in attention and (45, 45) in attention
    assert replaced == [45] * (2 * 2)


def test_wan_22_animate_reduces_the_video_behind_its_whole_reference_frame(comfy_nodes, pack):
    """Wan 2.2 Animate (its own node's conditioning: a reference frame ahead of 3 video frames): the reference
    frame's 30 tokens stay whole, the video is pooled; its face adapter and pose latents see the full video."""
    from comfy_extras.nodes_wan import WanAnimateToVideo

    generator = torch.Generator().manual_seed(9)
    positive, negative = conditioning()
    conditioned = WanAnimateToVideo.execute(positive, negative, dit_models.build_wan21_vae(), 96, 80, 9, 1, 5, 0,
                                            reference_image=torch.rand(1, 80, 96, 3, generator=generator),
                                            pose_video=torch.rand(9, 80, 96, 3, generator=generator)).result[:3]
    model = dit_models.build_dit_model("wan22_animate")
    out, blocks, _ = family_traced(comfy_nodes, model, APPLY["todo"](pack), "wan22_animate",
                                   conditioned=conditioned)
    assert torch.isfinite(out).all()
    assert {tokens for _, tokens, _ in blocks} == {30 + 27}


def test_wan_i2v_blocks_attend_the_merged_video_to_the_text_and_the_image_tokens(comfy_nodes, pack):
    """Wan 2.1 i2v: the start image enters as channels, CLIP vision's 4 tokens as a second cross-attention; both
    cross-attentions get the merged video's queries."""
    import comfy.clip_vision

    clip = comfy.clip_vision.Output()
    clip["penultimate_hidden_states"] = torch.randn(1, 4, 1280, generator=torch.Generator().manual_seed(6))
    model = dit_models.build_dit_model("wan21_i2v")
    out, blocks, attention = family_traced(comfy_nodes, model, APPLY["tome"](pack), "wan21_i2v",
                                           references={"clip_vision_output": clip})
    assert torch.isfinite(out).all()
    assert {tokens for _, tokens, _ in blocks} == {45}
    assert set(attention) == {(45, 45), (45, 4), (45, COND_TEXT), (45, UNCOND_TEXT)}


@pytest.mark.parametrize("node,tokens", [("todo", 2 * POOLED), ("tome", 3 * MERGED)])
def test_wan_22_5b_with_a_start_image_gives_each_frame_its_modulation(comfy_nodes, pack, node, tokens):
    """TI2V-5B with a start image (the noise mask ``Wan22ImageToVideoLatent`` makes: frame 0 kept) runs each latent
    frame at its own timestep, one modulation per frame: ToDo pooling 2 frames in time gives the block 2 pooled
    frames (and their first frames' modulation), ToMe 3 merged frames; the sample stays finite."""
    model = dit_models.build_dit_model("wan22_5b")
    mask = torch.ones(1, 1, 3, 10, 12)
    mask[:, :, 0] = 0.0
    positive, negative = conditioning()
    latent = {"samples": torch.randn(1, 48, 3, 10, 12, generator=torch.Generator().manual_seed(3)),
              "noise_mask": mask}
    apply = {"todo": lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, time_factor=2, **BLOCKS),
             "tome": lambda m: pack.dit.apply_tome_dit(m, ratio=0.5, **BLOCKS)}[node]
    seen = []

    def other_nodes_block(args, extra):  # inside ours: what the block gets
        seen.append((args["img"].shape[1], tuple(args["vec"].shape[:2])))
        return extra["original_block"](args)

    patched = apply(model).clone()
    patched.set_model_patch_replace(other_nodes_block, "dit", "double_block", 0)
    out = sample(comfy_nodes, patched, "wan22_5b", conditioned=(positive, negative, latent))
    assert torch.isfinite(out).all()
    frames = 2 if node == "todo" else 3
    assert set(seen) == {(tokens, (1, frames))}


@pytest.mark.parametrize("name", ["wan22_s2v", "wan21_humo", "cosmos_predict2", "cosmos1"])
def test_a_family_without_the_block_scope_falls_back_to_attention_with_a_warning(comfy_nodes, pack, caplog, name):
    model = dit_models.build_dit_model(name)
    with caplog.at_level(logging.WARNING):
        patched = pack.dit.apply_todo_dit(model, downsample_factor=2, **BLOCKS)
    assert "dit_scope 'block' does not reach" in caplog.text
    assert "reducing inside its attention calls instead" in caplog.text
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert override.todo.scope == "attention"
    (wrapper,) = patched.get_wrappers("apply_model", "tome")
    assert wrapper.blocks is None


def dropping_override(func, *args, **kwargs):
    """Another node's attention override that never calls the one it found (an attention backend's kind)."""
    return func(*args, **kwargs)


def test_an_override_dropping_ours_at_run_time_leaves_the_block_scope_reducing_and_says_what_is_lost(
        comfy_nodes, pack, flux, caplog):
    """Put over ours after our node: with the block scope alone nothing is lost (the blocks are reduced through
    their replacements) and nothing is said; with an attention-scope ToMe beside a block-scope ToDo, the warning
    says that only what attention reduced is lost."""
    block_only = with_override(pack.dit.apply_tome_dit(flux, ratio=0.5, **BLOCKS), dropping_override)
    with caplog.at_level(logging.WARNING):
        _, blocks, _ = traced(comfy_nodes, flux, lambda m: block_only)
    assert {call[2] for call in blocks if call[0] == "double"} == {MERGED}
    assert "cannot be stacked" not in caplog.text
    caplog.clear()
    mixed = with_override(pack.dit.apply_tome_dit(pack.dit.apply_todo_dit(flux, downsample_factor=2, **BLOCKS),
                                                  ratio=0.5), dropping_override)
    with caplog.at_level(logging.WARNING):
        _, blocks, _ = traced(comfy_nodes, flux, lambda m: mixed)
    assert {call[2] for call in blocks if call[0] == "double"} == {POOLED}
    assert "nothing is reduced inside attention calls in this run (the blocks that dit_scope 'block' reaches are " \
           "still reduced)" in caplog.text
    assert "nothing is reduced in this run" not in caplog.text


def test_cosmos_falls_back_to_attention_with_a_warning_naming_its_class(comfy_nodes, pack, caplog):
    cosmos = dit_models.build_dit_model("cosmos_predict2")
    with caplog.at_level(logging.WARNING):
        pack.dit.apply_todo_dit(cosmos, downsample_factor=2, **BLOCKS)
    assert "dit_scope 'block' does not reach CosmosPredict2's blocks yet" in caplog.text


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


@pytest.mark.parametrize("name", ["Flux", "Wan 2.1"])
@pytest.mark.parametrize("node", ["tome", "tome reuse", "todo"])
def test_the_block_scope_reads_the_host_at_most_once_per_model_call_and_never_blocks(comfy_nodes, pack, node, name):
    """A window (the sigma read once per model call) and use_rand (seeded from that same read); reuse_steps
    (the run's schedule read in its first call's sigma read)."""
    base = host_reads.build_model(name)
    apply = {"tome": lambda: pack.dit.apply_tome_dit(base, ratio=0.5, end_percent=0.7, **BLOCKS),
             "tome reuse": lambda: with_reuse_blocks(pack.dit.apply_tome_dit(base, ratio=0.5, end_percent=0.7,
                                                                             reuse_steps=2, **BLOCKS), 2),
             "todo": lambda: pack.dit.apply_todo_dit(base, downsample_factor=2, end_percent=0.7, **BLOCKS)}[node]
    host_reads.count_sampling(comfy_nodes, apply(), name)  # first-run work
    plain = host_reads.count_sampling(comfy_nodes, base, name)
    ours = host_reads.count_sampling(comfy_nodes, apply(), name)
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
                lambda m: pack.dit.apply_todo_dit(m, downsample_factor=2, end_percent=0.5, **BLOCKS),
                lambda m: with_reuse_blocks(pack.dit.apply_tome_dit(m, ratio=0.5, reuse_steps=2, **BLOCKS), 2)]
    references = [sample(comfy_nodes, apply(flux)) for apply in settings]
    for a, b in [(0, 1), (0, 2), (1, 2), (0, 3)]:
        assert (references[a] - references[b]).abs().max() > 0.1
    for apply, reference in zip(settings, references, strict=True):
        torch.testing.assert_close(sample(comfy_nodes, apply(compiled)), reference, rtol=1e-4, atol=1e-4)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for apply, reference in zip(settings, references, strict=True):
        torch.testing.assert_close(sample(comfy_nodes, apply(compiled)), reference, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
