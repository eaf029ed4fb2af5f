"""Apply ToDo and Apply ToMe on tiny random-weight DiTs of every family, sampled by the real KSampler.

Two recording overrides frame ours: one already on the model before the node
(ours calls it instead of the attention, so it sees what reaches attention),
and one put over ours afterwards (it sees what the model hands to attention).
cond and uncond have different text lengths (7 and 5 tokens), so they run as
separate model calls with layouts of their own (Flux 2 pads both to 512).
"""

import contextlib
import functools
import logging

import pytest
import torch
from helpers import (
    BYT5,
    COND_TEXT,
    LATENT,
    LATENTS,
    LLAMA,
    MOCHI_PROMPT,
    UNCOND_TEXT,
    VISION,
)
from helpers import dit_conditioning as conditioning
from helpers import dit_sample as sample

from tome_harness import dit_models

ALL_FAMILIES = dit_models.FAMILIES + dit_models.SECOND_WAVE + dit_models.THIRD_WAVE + dit_models.FOURTH_WAVE
GRID = (5, 6)
# Per family, written out by hand from ComfyUI's model code: for each self-attention length that holds the image,
# where the image starts (cond and uncond), and the frames of 5x6 patches.
IMAGE_STARTS = {
    "flux": ({COND_TEXT + 30: COND_TEXT, UNCOND_TEXT + 30: UNCOND_TEXT}, 1),  # [text | image]
    "sd3": ({COND_TEXT + 30: COND_TEXT, UNCOND_TEXT + 30: UNCOND_TEXT, 30: 0}, 1),  # joint, and attn2's image
    "wan21": ({90: 0}, 3),  # video only; cross-attention has 90 queries and 7 or 5 keys
    "qwen_image": ({COND_TEXT + 30: COND_TEXT, UNCOND_TEXT + 30: UNCOND_TEXT}, 1),
    "lumina2": ({8 + 32: 8, 32: 0}, 1),  # text and image each padded to 8s; refiners: text (8) alone, image alone
    "hunyuan_video": ({90 + COND_TEXT: 0, 90 + UNCOND_TEXT: 0}, 3),  # [video | text]; the refiner: text alone
    "hunyuan_video15": ({90 + VISION + BYT5 + COND_TEXT: 0, 90 + VISION + BYT5 + UNCOND_TEXT: 0}, 3),
    "hunyuan_image21": ({30 + COND_TEXT: 0, 30 + UNCOND_TEXT: 0}, 1),  # HunyuanVideo's [image | text], one frame
    "ltxv": ({90: 0}, 3),  # video only, then cross-attention to the text
    "wan22_5b": ({90: 0}, 3),
    "wan21_i2v": ({90: 0}, 3),  # cross-attention to the text and to the CLIP vision tokens
    "wan21_vace": ({90: 0}, 3),  # the video; the VACE blocks' control video (same length) stays whole
    "cosmos_predict2": ({90: 0}, 3),
    "flux2": ({512 + 30: 512}, 1),  # Flux 2 pads the text to 512 tokens
    "chroma": ({COND_TEXT + 30: COND_TEXT, UNCOND_TEXT + 30: UNCOND_TEXT}, 1),
    "chroma_radiance": ({COND_TEXT + 30: COND_TEXT, UNCOND_TEXT + 30: UNCOND_TEXT}, 1),
    "hidream": ({30 + COND_TEXT + 2 * LLAMA: 0, 30 + UNCOND_TEXT + 2 * LLAMA: 0}, 1),  # [image | T5, LLM, LLM]
    "wan22_animate": ({90: 30}, 2),  # the first latent frame is the reference image, kept whole
    "wan22_s2v": ({90: 0}, 3),  # without the reference and motion its node adds (see below)
    "wan21_humo": ({90: 0}, 3),
    "mochi": ({90 + MOCHI_PROMPT[COND_TEXT]: 0, 90 + MOCHI_PROMPT[UNCOND_TEXT]: 0}, 3),  # [video | unpadded text]
    "cosmos1": ({90: 0}, 3),  # video only; cross-attention to the text
    "wan22_fun_control": ({90: 0}, 3),  # without the reference its node adds (see below)
}


@pytest.fixture(scope="module")
def dit(pack):
    return pack.dit


@pytest.fixture(scope="module")
def models(comfy_nodes):
    built = {}
    for family in ALL_FAMILIES:
        try:
            built[family] = dit_models.build_dit_model(family)
        except ImportError as error:  # a family whose ComfyUI code needs what this host lacks
            built[family] = error
    return built


@pytest.fixture(params=ALL_FAMILIES)
def family(request, models):
    if isinstance(models[request.param], Exception):
        pytest.skip(f"{request.param} cannot be built on this host: {models[request.param]}")
    return request.param


def token_major(t, kwargs):
    return t.transpose(1, 2) if kwargs.get("skip_reshape") else t


class Call(list):
    """One recorded attention call: the token-major q, k, v, then the output. ``control``: made inside a VACE
    control block."""

    control = False


def recorder(calls, where=None):
    """An attention override that notes the token-major q, k, v it is called with, and passes them on;
    ``where`` (``vace_control_marked``) says whether the call comes from a VACE control block."""

    def record(func, *args, **kwargs):
        calls.append(Call(token_major(t, kwargs).detach().clone() for t in args[:3]))
        calls[-1].control = bool(where and where["control"])
        out = func(*args, **kwargs)
        heads_major = kwargs.get("skip_reshape") and kwargs.get("skip_output_reshape")  # Cosmos 1: [B, H, L, D]
        calls[-1].append((out.transpose(1, 2) if heads_major else out).flatten(2).detach().clone())  # [B, L, H*D]
        return out

    return record


def with_override(model, override):
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    return patched


@contextlib.contextmanager
def vace_control_marked(model):
    """Whether a VACE control block of ``model`` is running, kept by the test's own forward hooks on those
    blocks (removed after): ``{"control": bool}``."""
    where = {"control": False}
    handles = []
    for block in getattr(model.get_model_object("diffusion_model"), "vace_blocks", None) or ():
        handles.append(block.register_forward_pre_hook(lambda *_: where.update(control=True)))
        handles.append(block.register_forward_hook(lambda *_: where.update(control=False)))
    try:
        yield where
    finally:
        for handle in handles:
            handle.remove()


def traced_sample(comfy_nodes, dit, model, family, apply, references=None, latent_shape=None, conditioned=None):
    """Sample ``apply(model)``, recording what the model hands to attention (``outer``, each call marked where
    it comes from a VACE control block) and what reaches it (``inner``), call by call."""
    inner, outer = [], []
    patched = apply(with_override(model, recorder(inner)))
    ours = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(ours, dit.DiTReduction)
    with vace_control_marked(model) as where:
        record_outer = recorder(outer, where)
        out = sample(comfy_nodes, with_override(patched, lambda func, *a, **k: record_outer(
            lambda *a2, **k2: ours(func, *a2, **k2), *a, **k)), family, references=references,
            latent_shape=latent_shape, conditioned=conditioned)
    assert len(inner) == len(outer) > 0
    return out, inner, outer


def image_calls(family, inner, outer, image_starts=IMAGE_STARTS):
    """``(start, frames, inner call, outer call)`` of every image self-attention call; asserts that every other
    call (VACE control blocks' included) reached attention exactly as the model made it."""
    starts, frames = image_starts[family]
    found = []
    for got, made in zip(inner, outer, strict=True):
        q, k, _ = made[:3]
        if q.shape[1] == k.shape[1] and k.shape[1] in starts and not made.control:
            found.append((starts[k.shape[1]], frames, got, made))
        else:
            for a, b in zip(got[:3], made[:3], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert found
    return found


def nearest_cells(image, frames):
    """The top-left token of every 2x2 cell of ``frames`` grids of 5x6: ``[B, frames*30, ...] -> [B, frames*9, ...]``
    """
    return image.unflatten(1, (frames, *GRID))[:, :, ::2, ::2].flatten(1, 3)


def test_todo_pools_the_image_keys_and_values_and_leaves_everything_else(comfy_nodes, dit, models, family,
                                                                        caplog):
    with caplog.at_level(logging.WARNING):
        out, inner, outer = traced_sample(comfy_nodes, dit, models[family], family,
                                          lambda m: dit.apply_todo_dit(m, downsample_factor=2))
    assert torch.isfinite(out).all()
    assert "not one this model's token layout knows" not in caplog.text  # every self-attention call recognised
    for start, frames, got, made in image_calls(family, inner, outer):
        n = frames * 30
        torch.testing.assert_close(got[0], made[0], rtol=0, atol=0)  # the queries stay whole
        for pooled, full in zip(got[1:3], made[1:3], strict=True):
            assert pooled.shape[1] == full.shape[1] - n + frames * 9
            torch.testing.assert_close(pooled[:, :start], full[:, :start], rtol=0, atol=0)
            torch.testing.assert_close(pooled[:, start:start + frames * 9], nearest_cells(full[:, start:start + n],
                                                                                          frames), rtol=0, atol=0)
            torch.testing.assert_close(pooled[:, start + frames * 9:], full[:, start + n:], rtol=0, atol=0)


# Edit, reference and guide images: Flux Kontext, Flux 2 and Qwen-Image edit append a 6x8 latent (3x4 = 12
# tokens) after the image; Wan Fun puts one 10x12 frame (30 tokens) ahead of the video, HunyuanVideo I2V its
# reference latent (one 10x12 frame); LTX-Video's guide (LTXVAddGuide) is a fourth latent frame after the video,
# named by the pixel coordinates of its 30 tokens (keyframe_idxs).
REFERENCES = {
    "flux": ({"reference_latents": [torch.randn(1, 16, 6, 8)]}, None),
    "flux2": ({"reference_latents": [torch.randn(1, 128, 3, 4)]}, None),
    "qwen_image": ({"reference_latents": [torch.randn(1, 16, 1, 6, 8)]}, None),
    "wan21_fun": ({"reference_latents": [torch.randn(1, 16, 1, 10, 12)]}, None),
    "hunyuan_video": ({"ref_latent": torch.randn(1, 16, 1, 10, 12)}, None),
    "ltxv": ({"keyframe_idxs": torch.zeros(1, 3, 30)}, (1, 128, 4, 5, 6)),
}
REFERENCE_STARTS = {
    "flux": ({COND_TEXT + 30 + 12: COND_TEXT, UNCOND_TEXT + 30 + 12: UNCOND_TEXT}, 1),
    "flux2": ({512 + 30 + 12: 512}, 1),
    "qwen_image": ({COND_TEXT + 30 + 12: COND_TEXT, UNCOND_TEXT + 30 + 12: UNCOND_TEXT}, 1),
    "wan21_fun": ({30 + 90: 30}, 3),
    "hunyuan_video": ({30 + 90 + COND_TEXT: 30, 30 + 90 + UNCOND_TEXT: 30}, 3),
    "ltxv": ({90 + 30: 0}, 3),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_reference_images_stay_whole(comfy_nodes, dit, name):
    try:
        model = dit_models.build_dit_model(name)
    except ImportError as error:
        pytest.skip(f"{name} cannot be built on this host: {error}")
    references, latent_shape = REFERENCES[name]
    out, inner, outer = traced_sample(comfy_nodes, dit, model, name,
                                      lambda m: dit.apply_todo_dit(m, downsample_factor=2), references, latent_shape)
    assert torch.isfinite(out).all()
    for start, frames, got, made in image_calls(name, inner, outer, REFERENCE_STARTS):
        n = frames * 30
        torch.testing.assert_close(got[1][:, :start], made[1][:, :start], rtol=0, atol=0)
        torch.testing.assert_close(got[1][:, start:start + frames * 9],
                                   nearest_cells(made[1][:, start:start + n], frames), rtol=0, atol=0)
        torch.testing.assert_close(got[1][:, start + frames * 9:], made[1][:, start + n:], rtol=0, atol=0)


@pytest.mark.parametrize("apply", ["todo", "tome"])
def test_vace_control_blocks_stay_whole_and_another_block_replacement_still_runs(comfy_nodes, dit, models, apply):
    """VACE's control blocks attend over the control video, as long as the video: they reach attention whole,
    while the main blocks' video is reduced; a ``dit`` block replacement another node put on a main block
    (skip-layer guidance's kind) still runs in its place."""
    if isinstance(models["wan21_vace"], Exception):
        pytest.skip(f"wan21_vace cannot be built on this host: {models['wan21_vace']}")
    replaced = []

    def other_nodes_block(args, extra):
        replaced.append(args["img"].shape)
        return extra["original_block"](args)

    model = models["wan21_vace"].clone()
    model.set_model_patch_replace(other_nodes_block, "dit", "double_block", 1)
    reduce = {"todo": lambda m: dit.apply_todo_dit(m, downsample_factor=2),
              "tome": lambda m: dit.apply_tome_dit(m, ratio=0.5)}[apply]
    _, inner, outer = traced_sample(comfy_nodes, dit, model, "wan21_vace", reduce)
    control = [(got, made) for got, made in zip(inner, outer, strict=True)
               if made.control and made[0].shape[1] == made[1].shape[1] == 90]
    main = image_calls("wan21_vace", inner, outer)  # asserts every control call reached attention whole
    assert control and len(main) == 2 * len(control)  # per model call: two main blocks, one control block
    assert all(got[1].shape[1] < 90 for _, _, got, _ in main)
    assert len(replaced) == len(control)  # main block 1 ran through the other node's replacement every call


def vace_conds(reference: bool):
    """The conds ComfyUI's own ``WanVaceToVideo`` makes (a random Wan 2.1 VAE encoding a random 96x80 control
    video of 5 frames, its first frame masked out) and its latent: 2 latent frames of 10x12, and with
    ``reference`` a reference image ahead of them as a third."""
    from comfy_extras.nodes_wan import WanVaceToVideo

    generator = torch.Generator().manual_seed(8)
    mask = torch.ones(5, 80, 96)
    mask[0] = 0.0  # a frame to keep as it is: its reactive half and mask are those of a control frame, not zero
    positive, _, latent, trim = WanVaceToVideo.execute(
        [[torch.zeros(1, 1, dit_models.CONTEXT_DIM), {}]], [[torch.zeros(1, 1, dit_models.CONTEXT_DIM), {}]],
        dit_models.build_wan21_vae(), 96, 80, 5, 1, 1.0, control_video=torch.rand(5, 80, 96, 3, generator=generator),
        control_masks=mask, reference_image=torch.rand(1, 80, 96, 3, generator=generator) if reference else None,
    ).result
    assert trim == int(reference)
    conds = {name: positive[0][1][name] for name in ("vace_frames", "vace_mask", "vace_strength")}
    return conds, tuple(latent["samples"].shape)


@pytest.mark.parametrize("reference", [True, False], ids=["reference image", "no reference image"])
def test_a_vace_reference_image_stays_whole_and_the_video_is_pooled(comfy_nodes, dit, models, reference):
    if isinstance(models["wan21_vace"], Exception):
        pytest.skip(f"wan21_vace cannot be built on this host: {models['wan21_vace']}")
    conds, latent_shape = vace_conds(reference)
    assert latent_shape == (1, 16, 2 + reference, 10, 12)
    _, inner, outer = traced_sample(comfy_nodes, dit, models["wan21_vace"], "wan21_vace",
                                    lambda m: dit.apply_todo_dit(m, downsample_factor=2), conds, latent_shape)
    whole = 30 if reference else 0  # the reference frame's 30 tokens come first, then 2 video frames
    calls = image_calls("wan21_vace", inner, outer, {"wan21_vace": ({whole + 60: whole}, 2)})
    for start, frames, got, made in calls:
        torch.testing.assert_close(got[1][:, :start], made[1][:, :start], rtol=0, atol=0)
        torch.testing.assert_close(got[1][:, start:], nearest_cells(made[1][:, start:], frames), rtol=0, atol=0)


def test_an_unknown_self_attention_length_is_left_whole_with_one_warning_per_run(comfy_nodes, dit, models, caplog):
    """Another pack's ``post_input`` patch adds 2 tokens to Flux's image stream: no self-attention call has a
    length the layout knows, so each reaches attention exactly as the model made it (the image is not looked
    for by guess), and each of two sampling runs (each many calls, cond and uncond) warns once."""
    if isinstance(models["flux"], Exception):
        pytest.skip(f"flux cannot be built on this host: {models['flux']}")

    def two_more_tokens(args):
        return dict(args, img=torch.cat([args["img"], args["img"][:, :2]], 1),
                    img_ids=torch.cat([args["img_ids"], args["img_ids"][:, :2]], 1))

    model = models["flux"].clone()
    model.set_model_patch(two_more_tokens, "post_input")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out, inner, outer = traced_sample(comfy_nodes, dit, model, "flux",
                                              lambda m: dit.apply_todo_dit(m, downsample_factor=2))
            assert torch.isfinite(out).all()
            assert {made[1].shape[1] for made in outer} == {COND_TEXT + 32, UNCOND_TEXT + 32}
            for got, made in zip(inner, outer, strict=True):
                for a, b in zip(got[:3], made[:3], strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "not one this model's token layout knows" in r.getMessage()]
    assert len(warnings) == 2
    assert f"a self-attention call of {COND_TEXT + 32} tokens" in warnings[0].getMessage() or \
        f"a self-attention call of {UNCOND_TEXT + 32} tokens" in warnings[0].getMessage()


def test_todo_time_factor_pools_across_frames(comfy_nodes, dit, models):
    if isinstance(models["wan21"], Exception):
        pytest.skip(f"wan21 cannot be built on this host: {models['wan21']}")
    _, inner, outer = traced_sample(comfy_nodes, dit, models["wan21"], "wan21",
                                    lambda m: dit.apply_todo_dit(m, downsample_factor=2, time_factor=2,
                                                                 method="average"))
    for _, _, got, made in image_calls("wan21", inner, outer):
        assert (got[0].shape[1], got[1].shape[1]) == (90, 2 * 9)  # frames 1-2 and 3 alone, 3x3 cells each
        first = [t.unflatten(1, (3, 5, 6))[:, :2, :2, :2].flatten(1, 3) for t in made[1:3]]  # the first cell's 8
        torch.testing.assert_close(got[2][:, 0], first[1].mean(1))  # values: the mean
        keys = first[0].unflatten(-1, (2, -1))  # two heads: the mean's direction at the keys' mean length (tome.norms)
        mean = keys.mean(1)
        torch.testing.assert_close(got[1][:, 0].unflatten(-1, (2, -1)),
                                   mean / mean.norm(dim=-1, keepdim=True) * keys.norm(dim=-1).mean(1)[..., None])


@pytest.mark.parametrize("merge", ["q, k and v", "k and v only"])
def test_tome_merges_the_image_tokens_and_restores_every_query(comfy_nodes, dit, models, family, merge):
    out, inner, outer = traced_sample(comfy_nodes, dit, models[family], family,
                                      lambda m: dit.apply_tome_dit(m, ratio=0.5, merge=merge))
    assert torch.isfinite(out).all()
    for start, frames, got, made in image_calls(family, inner, outer):
        n, kept = frames * 30, frames * 15
        q, k, v = got[:3]
        assert k.shape[1] == v.shape[1] == made[1].shape[1] - n + kept
        assert q.shape[1] == (k.shape[1] if merge == "q, k and v" else made[0].shape[1])
        torch.testing.assert_close(k[:, :start], made[1][:, :start], rtol=0, atol=0)  # text never merged
        assert got[3].shape[1] == q.shape[1]  # attention ran on the merged queries ...
        assert made[3].shape[1] == made[0].shape[1]  # ... and the model got an output for every query
        if merge == "q, k and v":  # every merged query has its destination's output: as many distinct as kept
            assert len({tuple(row.tolist()) for row in made[3][0, start:start + n]}) == kept


@pytest.mark.parametrize("name", ["flux", "sd3", "wan21"])  # two heads each
def test_tome_merges_keys_at_their_members_length(comfy_nodes, dit, models, name):
    """Merged image keys point where their plain mean points, each head no shorter than that mean (at the mean
    of its members' lengths: tome.norms.keeping_norms; a mean is shorter than its members); queries and values
    are the plain mean. Compared on the first image call, where both runs get the same input, so the same
    plan."""
    firsts = []
    for keep_norms in (True, False):
        _, inner, outer = traced_sample(comfy_nodes, dit, models[name], name, functools.partial(
            dit.apply_tome_dit, ratio=0.5, keep_norms=keep_norms))
        firsts.append(image_calls(name, inner, outer)[0])
    (_, _, kept, made), (_, _, plain, plain_made) = firsts
    for ours, theirs in zip(made[:3], plain_made[:3], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for ours, theirs in zip(kept[::2], plain[::2], strict=True):  # queries, values
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours, theirs = (t.unflatten(-1, (2, -1)).double() for t in (kept[1], plain[1]))  # keys
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > 1 - 1e-5
    longer = ours.norm(dim=-1) / theirs.norm(dim=-1)
    assert longer.min() > 1 - 1e-5 and longer.max() > 1.01


def test_factor_1_and_ratio_0_remove_the_patch_bit_for_bit(comfy_nodes, dit, models, family):
    model = models[family]
    assert dit.apply_todo_dit(model, downsample_factor=1) is model
    assert dit.apply_tome_dit(model, ratio=0.0) is model
    removed = dit.apply_tome_dit(dit.apply_todo_dit(dit.apply_tome_dit(model, ratio=0.5), downsample_factor=2),
                                 ratio=0.0)
    removed = dit.apply_todo_dit(removed, downsample_factor=1)
    options = removed.model_options["transformer_options"]
    assert "optimized_attention_override" not in options
    assert not removed.get_wrappers("apply_model", "tome") and not removed.get_wrappers("outer_sample", "tome")
    torch.testing.assert_close(sample(comfy_nodes, removed, family), sample(comfy_nodes, model, family),
                               rtol=0, atol=0)


def test_same_seed_same_image_and_the_global_rng_untouched(comfy_nodes, dit, models, family):
    patched = dit.apply_tome_dit(dit.apply_todo_dit(models[family], downsample_factor=2), ratio=0.5, seed=7)
    first = sample(comfy_nodes, patched, family)
    torch.testing.assert_close(sample(comfy_nodes, patched, family), first, rtol=0, atol=0)
    assert not torch.equal(first, sample(comfy_nodes, models[family], family))
    # KSampler seeds the global RNG itself, so the patch is checked on a model call alone.
    x = torch.randn(LATENTS.get(family, LATENT), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([5.0])
    options = dict(patched.model_options["transformer_options"], wrappers=patched.wrappers, sigmas=sigma)
    (context, extra), = conditioning(family)[0]
    # The model's conds as the sampler makes them from the conditioning (ComfyUI's own extra_conds).
    conds = {name: cond.cond for name, cond in patched.model.extra_conds(
        noise=x, device=x.device, cross_attn=context, **extra).items()}
    state = torch.get_rng_state()
    with torch.inference_mode():
        out = patched.model.apply_model(x, sigma, transformer_options=options, **conds)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.get_rng_state(), state)


def test_the_input_model_is_untouched_and_a_second_node_replaces_the_first(comfy_nodes, dit, models):
    if isinstance(models["flux"], Exception):
        pytest.skip(f"flux cannot be built on this host: {models['flux']}")
    model = models["flux"]
    once = dit.apply_todo_dit(model, downsample_factor=2)
    twice = dit.apply_todo_dit(once, downsample_factor=3, method="max")
    assert "optimized_attention_override" not in model.model_options.get("transformer_options", {})
    assert not model.get_wrappers("apply_model", "tome")
    assert len(twice.get_wrappers("apply_model", "tome")) == 1
    assert twice.model_options["transformer_options"]["optimized_attention_override"].todo.factor == 3
    assert once.model_options["transformer_options"]["optimized_attention_override"].todo.factor == 2


FAMILY_OF_MODEL = {"wan21": "wan", "wan22_5b": "wan", "wan21_i2v": "wan", "wan21_vace": "wan",
                   "hunyuan_video15": "hunyuan_video", "hunyuan_image21": "hunyuan_video", "flux2": "flux",
                   "chroma": "flux", "chroma_radiance": "flux", "wan22_animate": "wan_animate", "wan22_s2v": "wan_s2v",
                   "wan21_humo": "wan_humo", "wan22_fun_control": "wan"}


def test_each_family_is_recognised_and_a_u_net_passes_through_with_a_warning(dit, models, sd15, caplog):
    for name, model in models.items():
        if not isinstance(model, Exception):
            assert dit.dit_family(model) == FAMILY_OF_MODEL.get(name, name)
    with caplog.at_level(logging.WARNING):
        assert dit.apply_todo_dit(sd15, downsample_factor=2) is sd15
    assert "BaseModel is not a DiT" in caplog.text


def test_the_nodes_send_a_dit_to_its_adapter_and_name_the_inputs_it_ignores(pack, comfy_nodes, models, caplog):
    wan = models["wan21"]
    if isinstance(wan, Exception):
        pytest.skip(f"wan21 cannot be built on this host: {wan}")
    (todo,) = pack.nodes.ApplyToDo.execute(model=wan, downsample_factor=2, max_downsample="auto", method="nearest",
                                           start_percent=0.0, end_percent=1.0, time_factor=2).result
    override = todo.model_options["transformer_options"]["optimized_attention_override"]
    assert (override.todo.factor, override.todo.time_factor) == (2, 2)
    with caplog.at_level(logging.WARNING):
        (tome,) = pack.nodes.ApplyToMeAdvanced.execute(
            model=todo, ratio=0.5, stride_x=2, stride_y=2, max_downsample="4", seed=0, use_rand=True,
            merge="k and v only", start_percent=0.0, end_percent=1.0, scope="self- and cross-attention",
            reuse_steps=1).result
    override = tome.model_options["transformer_options"]["optimized_attention_override"]
    assert override.todo.factor == 2 and override.tome.merge == "k and v only"
    assert "max_downsample='4', scope='self- and cross-attention' has no meaning on WAN21 and is ignored" in \
        caplog.text
    assert torch.isfinite(sample(comfy_nodes, tome, "wan21")).all()


# Wan's variants with tokens of their own, conditioned by ComfyUI's own nodes (a random Wan 2.1 VAE encoding
# random 96x80 pictures; 9 frames: 3 latent frames of 10x12, 5x6 patches each, 90 video tokens):
# - WanAnimateToVideo (reference image, pose video): [reference frame | video], 30 + 90 tokens;
# - WanSoundImageToVideo (reference image, reference motion): [video | reference | motion], 90 + 30 + 40 tokens
#   (the motion packed as 5x6 + 2x3 + 4 x 1x1 patches of 1x2x2, 2x4x4 and 4x8x8);
# - WanHuMoImageToVideo (reference image): [video | reference], 90 + 30 tokens;
# - Wan22FunControlToVideo (reference image, control video as channels): [reference frame | video], 30 + 90 tokens.
VARIANT_STARTS = {"wan22_animate": ({30 + 90: 30}, 3), "wan22_s2v": ({90 + 30 + 40: 0}, 3),
                  "wan21_humo": ({90 + 30: 0}, 3), "wan22_fun_control": ({30 + 90: 30}, 3)}


def variant_conditioning(name):
    """``(positive, negative, latent)`` of the variant's own conditioning node, on cond and uncond of 7 and 5 text
    tokens."""
    from comfy_extras.nodes_wan import (
        Wan22FunControlToVideo,
        WanAnimateToVideo,
        WanHuMoImageToVideo,
        WanSoundImageToVideo,
    )

    positive, negative = conditioning(name)
    vae = dit_models.build_wan21_vae()
    generator = torch.Generator().manual_seed(9)
    image = torch.rand(1, 80, 96, 3, generator=generator)
    if name == "wan22_animate":
        return WanAnimateToVideo.execute(positive, negative, vae, 96, 80, 9, 1, 5, 0, reference_image=image,
                                         pose_video=torch.rand(9, 80, 96, 3, generator=generator)).result[:3]
    if name == "wan22_s2v":
        return WanSoundImageToVideo.execute(positive, negative, vae, 96, 80, 9, 1, ref_image=image,
                                            ref_motion=torch.rand(5, 80, 96, 3, generator=generator)).result
    if name == "wan22_fun_control":
        return Wan22FunControlToVideo.execute(positive, negative, vae, 96, 80, 9, 1, ref_image=image,
                                              control_video=torch.rand(9, 80, 96, 3, generator=generator)).result
    return WanHuMoImageToVideo.execute(positive, negative, vae, 96, 80, 9, 1, ref_image=image).result


@pytest.fixture(scope="module")
def variants(comfy_nodes):
    return {name: variant_conditioning(name) for name in VARIANT_STARTS}


@pytest.fixture(params=list(VARIANT_STARTS))
def variant(request, models):
    if isinstance(models[request.param], Exception):
        pytest.skip(f"{request.param} cannot be built on this host: {models[request.param]}")
    return request.param


def test_a_wan_variant_pools_only_the_video_from_its_own_node_and_knows_every_call(comfy_nodes, dit, models, variants,
                                                                                 variant, caplog):
    with caplog.at_level(logging.WARNING):
        out, inner, outer = traced_sample(comfy_nodes, dit, models[variant], variant,
                                          lambda m: dit.apply_todo_dit(m, downsample_factor=2),
                                          conditioned=variants[variant])
    assert torch.isfinite(out).all()
    assert "not one this model's token layout knows" not in caplog.text
    calls = image_calls(variant, inner, outer, VARIANT_STARTS)  # every other call reached attention whole
    assert len(calls) == 2 * 2 * 2  # 2 blocks, cond and uncond, 2 steps: the override reached every block
    (length,) = VARIANT_STARTS[variant][0]
    for start, frames, got, made in calls:
        torch.testing.assert_close(got[0], made[0], rtol=0, atol=0)  # the queries stay whole
        for pooled, full in zip(got[1:3], made[1:3], strict=True):
            assert pooled.shape[1] == length - 90 + 27  # the video's 90 tokens pooled to 27, the rest whole
            torch.testing.assert_close(pooled[:, :start], full[:, :start], rtol=0, atol=0)
            torch.testing.assert_close(pooled[:, start:start + 27], nearest_cells(full[:, start:start + 90], frames),
                                       rtol=0, atol=0)
            torch.testing.assert_close(pooled[:, start + 27:], full[:, start + 90:], rtol=0, atol=0)


def test_a_wan_variant_merges_only_the_video_and_restores_every_query(comfy_nodes, dit, models, variants, variant):
    _, inner, outer = traced_sample(comfy_nodes, dit, models[variant], variant,
                                    lambda m: dit.apply_tome_dit(m, ratio=0.5), conditioned=variants[variant])
    (length,) = VARIANT_STARTS[variant][0]
    for start, _, got, made in image_calls(variant, inner, outer, VARIANT_STARTS):
        assert [t.shape[1] for t in got[:3]] == [length - 90 + 45] * 3  # 45 of the 90 video tokens merged
        torch.testing.assert_close(got[1][:, :start], made[1][:, :start], rtol=0, atol=0)
        torch.testing.assert_close(got[1][:, start + 45:], made[1][:, start + 90:], rtol=0, atol=0)
        assert made[3].shape[1] == length  # the model got an output for every query


def test_a_wan_variant_at_factor_1_and_ratio_0_is_the_model_bit_for_bit(comfy_nodes, dit, models, variants, variant):
    model = models[variant]
    removed = dit.apply_todo_dit(dit.apply_tome_dit(dit.apply_todo_dit(model, downsample_factor=2), ratio=0.0),
                                 downsample_factor=1)
    assert "optimized_attention_override" not in removed.model_options["transformer_options"]
    torch.testing.assert_close(sample(comfy_nodes, removed, variant, conditioned=variants[variant]),
                               sample(comfy_nodes, model, variant, conditioned=variants[variant]), rtol=0, atol=0)


def test_s2v_blocks_get_the_options_and_another_block_replacement_still_runs(comfy_nodes, dit, models, variants):
    """Wan 2.2 S2V calls its blocks without ``transformer_options``: the layout wrapper hands them over, under a
    ``dit`` block replacement another node put on a block, which still runs in its place."""
    if isinstance(models["wan22_s2v"], Exception):
        pytest.skip(f"wan22_s2v cannot be built on this host: {models['wan22_s2v']}")
    replaced = []

    def other_nodes_block(args, extra):
        replaced.append(args["img"].shape[1])
        return extra["original_block"](args)

    model = models["wan22_s2v"].clone()
    model.set_model_patch_replace(other_nodes_block, "dit", "double_block", 1)
    _, inner, outer = traced_sample(comfy_nodes, dit, model, "wan22_s2v",
                                    lambda m: dit.apply_todo_dit(m, downsample_factor=2),
                                    conditioned=variants["wan22_s2v"])
    assert len(image_calls("wan22_s2v", inner, outer, VARIANT_STARTS)) == 8
    assert replaced == [90 + 30 + 40] * 4  # block 1 of each model call ran through the other node's replacement


# HiDream E1: ComfyUI's InstructPixToPixConditioning encodes the edit picture (random 96x80 pixels through a random
# Flux-layout VAE) as concat_latent_image, which HiDream reads as image_cond and joins to the latent (10x12, the
# empty latent the node makes) along the width before patching: each of the 5 rows of patches is the image's 6,
# then the edit's 6, then the text: 60 + 7 + 2 * 3 (cond) and 60 + 5 + 2 * 3 (uncond) tokens.
E1_ROW = 12
E1_STARTS = {"hidream": ({5 * E1_ROW + COND_TEXT + 2 * LLAMA: 0, 5 * E1_ROW + UNCOND_TEXT + 2 * LLAMA: 0}, 1)}
E1_IMAGE = (torch.arange(5)[:, None] * E1_ROW + torch.arange(6)).flatten()  # where the 30 image tokens sit


def e1_conditioning(vae, width=96):
    """``(positive, negative, latent)`` from ComfyUI's ``InstructPixToPixConditioning`` on an 80 x ``width`` edit
    picture, over cond and uncond of 7 and 5 text tokens."""
    from comfy_extras.nodes_ip2p import InstructPixToPixConditioning

    positive, negative = conditioning("hidream")
    picture = torch.rand(1, 80, width, 3, generator=torch.Generator().manual_seed(10))
    return InstructPixToPixConditioning.execute(positive, negative, picture, vae).result


def image_and_rest(tokens):
    """E1's tokens ``[B, L, ...]`` split into the image's 30 (row-major) and every other token, in order."""
    rest = torch.ones(tokens.shape[1], dtype=torch.bool)
    rest[E1_IMAGE] = False
    return tokens[:, E1_IMAGE], tokens[:, rest]


@pytest.fixture(scope="module")
def flux_vae(models, comfy_nodes):
    if isinstance(models["hidream"], Exception):
        pytest.skip(f"hidream cannot be built on this host: {models['hidream']}")
    return dit_models.build_flux_vae()


@pytest.fixture(scope="module")
def e1(flux_vae):
    return e1_conditioning(flux_vae)


def test_hidream_e1_pools_the_image_rows_between_the_edit_rows_and_leaves_the_rest(comfy_nodes, dit, models, e1,
                                                                                   caplog):
    with caplog.at_level(logging.WARNING):
        out, inner, outer = traced_sample(comfy_nodes, dit, models["hidream"], "hidream",
                                          lambda m: dit.apply_todo_dit(m, downsample_factor=2), conditioned=e1)
    assert torch.isfinite(out).all()
    assert "not one this model's token layout knows" not in caplog.text
    calls = image_calls("hidream", inner, outer, E1_STARTS)
    assert len(calls) == 2 * 2 * 2  # a double and a single block, cond and uncond, 2 steps
    for _, _, got, made in calls:
        torch.testing.assert_close(got[0], made[0], rtol=0, atol=0)  # the queries stay whole, in their order
        for pooled, full in zip(got[1:3], made[1:3], strict=True):
            image, rest = image_and_rest(full)
            assert pooled.shape[1] == full.shape[1] - 30 + 9  # the image's 30 keys pooled to 9, the rest whole
            torch.testing.assert_close(pooled[:, :9], nearest_cells(image, 1), rtol=0, atol=0)
            torch.testing.assert_close(pooled[:, 9:], rest, rtol=0, atol=0)


@pytest.mark.parametrize("merge", ["q, k and v", "k and v only"])
def test_hidream_e1_merges_the_image_and_restores_every_query_in_its_place(comfy_nodes, dit, models, e1, merge):
    _, inner, outer = traced_sample(comfy_nodes, dit, models["hidream"], "hidream",
                                    lambda m: dit.apply_tome_dit(m, ratio=0.5, merge=merge), conditioned=e1)
    calls = image_calls("hidream", inner, outer, E1_STARTS)
    assert len(calls) == 8
    for _, _, got, made in calls:
        length = made[1].shape[1]
        q, k, v = got[:3]
        assert k.shape[1] == v.shape[1] == length - 15  # 15 of the 30 image tokens merged
        assert q.shape[1] == (length - 15 if merge == "q, k and v" else length)
        torch.testing.assert_close(k[:, 15:], image_and_rest(made[1])[1], rtol=0, atol=0)  # edit and text whole
        assert got[3].shape[1] == q.shape[1] and made[3].shape[1] == length  # an output for every query
        image_out, rest_out = image_and_rest(made[3])
        if merge == "q, k and v":  # every image query has its destination's output; the others their own
            assert len({tuple(row.tolist()) for row in image_out[0]}) == 15
            torch.testing.assert_close(rest_out, got[3][:, 15:], rtol=0, atol=0)
        else:
            torch.testing.assert_close(made[3], got[3], rtol=0, atol=0)


def test_hidream_e1_at_factor_1_and_ratio_0_is_the_model_bit_for_bit(comfy_nodes, dit, models, e1):
    model = models["hidream"]
    removed = dit.apply_todo_dit(dit.apply_tome_dit(dit.apply_todo_dit(model, downsample_factor=2), ratio=0.0),
                                 downsample_factor=1)
    assert "optimized_attention_override" not in removed.model_options["transformer_options"]
    torch.testing.assert_close(sample(comfy_nodes, removed, "hidream", conditioned=e1),
                               sample(comfy_nodes, model, "hidream", conditioned=e1), rtol=0, atol=0)


def test_hidream_e1_with_an_odd_latent_width_is_left_whole_with_one_warning_per_run(comfy_nodes, dit, models,
                                                                                   flux_vae, caplog):
    """A 104-pixel-wide edit picture: a 10x13 latent, joined 26 wide, so patch 6 of each row holds the image's
    last latent column and the edit's first. Every call reaches attention exactly as the model made it."""
    odd = e1_conditioning(flux_vae, width=104)
    assert odd[2]["samples"].shape[-1] == 13
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _, inner, outer = traced_sample(comfy_nodes, dit, models["hidream"], "hidream",
                                            lambda m: dit.apply_tome_dit(m, ratio=0.5), conditioned=odd)
            assert {made[1].shape[1] for made in outer} >= {5 * 13 + COND_TEXT + 2 * LLAMA}
            for got, made in zip(inner, outer, strict=True):
                for a, b in zip(got[:3], made[:3], strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "not one this model's token layout knows" in r.getMessage()]
    assert len(warnings) == 2
