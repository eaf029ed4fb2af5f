"""Apply ToDo inside the real ComfyUI: what reaches self-attention, the window, composition with ToMe."""

import logging
import math

import pytest
import torch
from helpers import (
    expected_tokens,
    forward,
    random_context,
    random_latent,
    sd15_level,
    sdxl_conds,
    self_attention_calls,
)

from tome_harness import dit_models


@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("method", ["nearest", "average", "max"])
def test_sd15_keeps_queries_and_pools_keys_at_full_resolution(pack, sd15, factor, method):
    patched = pack.unet.apply_todo(model=sd15, downsample_factor=factor, method=method)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(2, 30, 26), 5.0, random_context(2))
    assert torch.isfinite(out).all()
    for call in calls:
        level = sd15_level(call.module)
        h, w = math.ceil(30 / level), math.ceil(26 / level)
        pooled = math.ceil(h / factor) * math.ceil(w / factor) if level == 1 else h * w
        assert (call.queries, call.keys) == (h * w, pooled), call


@pytest.mark.parametrize(("max_downsample", "levels"), [("auto", {2}), ("4", {2, 4})])
def test_sdxl_pools_at_its_highest_resolution_transformer_level(pack, sdxl, max_downsample, levels):
    patched = pack.unet.apply_todo(model=sdxl, downsample_factor=2, max_downsample=max_downsample)
    with self_attention_calls(patched) as calls:
        forward(patched, random_latent(1, 32, 32), 5.0, random_context(1), **sdxl_conds(1))
    pooled_levels = set()
    for call in calls:
        level = {256: 2, 64: 4}[call.queries]
        if call.keys < call.queries:
            assert call.keys == call.queries // 4
            pooled_levels.add(level)
    assert pooled_levels == levels


def test_pooling_happens_only_inside_the_window(pack, sd15):
    patched = pack.unet.apply_todo(model=sd15, downsample_factor=2, start_percent=0.5, end_percent=1.0)
    sigma_start = sd15.get_model_object("model_sampling").percent_to_sigma(0.5)
    for sigma, keys in ((sigma_start * 2, 256), (sigma_start / 2, 64)):
        with self_attention_calls(patched) as calls:
            forward(patched, random_latent(1, 16, 16), sigma, random_context(1))
        assert {c.keys for c in calls if sd15_level(c.module) == 1} == {keys}


@pytest.mark.parametrize("tome_first", [True, False])
def test_with_apply_tome_queries_are_merged_and_keys_pooled_in_either_order(pack, sd15, tome_first):
    """Documented result: ToDo pools the grid-shaped keys and values, ToMe merges the queries."""
    if tome_first:
        patched = pack.unet.apply_todo(model=pack.unet.apply_tome(model=sd15, ratio=0.5), downsample_factor=2)
    else:
        patched = pack.unet.apply_tome(model=pack.unet.apply_todo(model=sd15, downsample_factor=2), ratio=0.5)
    with self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(1, 16, 16), 5.0, random_context(1))
    assert out.shape == (1, 4, 16, 16) and torch.isfinite(out).all()
    full_res = {(c.queries, c.keys) for c in calls if sd15_level(c.module) == 1}
    assert full_res == {(expected_tokens(256, 0.5), 64)}


def test_factor_one_turns_an_earlier_todo_off_and_a_second_node_replaces_the_first(pack, sd15):
    assert pack.unet.apply_todo(model=sd15, downsample_factor=1) is sd15
    twice = pack.unet.apply_todo(model=pack.unet.apply_todo(model=sd15, downsample_factor=3), downsample_factor=2)
    assert len(twice.model_options["transformer_options"]["patches"]["attn1_patch"]) == 1
    off = pack.unet.apply_todo(model=twice, downsample_factor=1)
    with self_attention_calls(off) as calls:
        forward(off, random_latent(1, 16, 16), 5.0, random_context(1))
    assert all(c.queries == c.keys for c in calls)
    assert "patches" not in sd15.model_options["transformer_options"]


def test_a_factor_larger_than_the_grid_skips_the_block_with_a_warning(pack, sd15, caplog):
    patched = pack.unet.apply_todo(model=sd15, downsample_factor=8)
    with caplog.at_level(logging.WARNING), self_attention_calls(patched) as calls:
        out = forward(patched, random_latent(1, 6, 6), 5.0, random_context(1))
    assert torch.isfinite(out).all() and all(c.queries == c.keys for c in calls)
    assert "downsample_factor 8 is larger than a 6x6 token grid" in caplog.text


def test_start_after_end_is_rejected(pack, sd15):
    with pytest.raises(ValueError, match=r"start_percent \(0.8\) must not be greater than end_percent \(0.2\)"):
        pack.unet.apply_todo(model=sd15, downsample_factor=2, start_percent=0.8, end_percent=0.2)


@pytest.mark.parametrize(("inputs", "message"), [
    ({"downsample_factor": 9}, "downsample_factor must be between 1 and 8, not 9"),
    ({"method": "median"}, "method must be one of nearest, average, max, not 'median'"),
])
def test_bad_input_is_an_error_naming_it(pack, sd15, inputs, message):
    with pytest.raises(ValueError, match=message):
        pack.unet.apply_todo(sd15, **{"downsample_factor": 2, **inputs})


def todo_node(pack, model, **inputs):
    """The Apply ToDo node with its defaults, as a user drops it, and ``inputs`` changed."""
    defaults = {i.id: i.default for i in pack.nodes.ApplyToDo.define_schema().inputs if i.id != "model"}
    (patched,) = pack.nodes.ApplyToDo.execute(model=model, **{**defaults, **inputs}).result
    return patched


def pooling_method(patched) -> str:
    """The method the ToDo patch on ``patched`` pools with (a U-Net's attn1 patch or a DiT's override)."""
    options = patched.model_options["transformer_options"]
    if "optimized_attention_override" in options:
        return options["optimized_attention_override"].todo.method
    (patch,) = options["patches"]["attn1_patch"]
    return patch.settings.method


@pytest.mark.parametrize(("name", "method"), [
    ("sd15", "nearest"), ("sd3", "nearest"), ("flux", "average"), ("chroma", "average"), ("wan21", "average"),
    ("qwen_image", "average"), ("ltxv", "average")])
def test_method_auto_is_the_default_and_picks_the_familys_cheaper_pooling(pack, sd15, name, method):
    """``auto`` (the default) picks per family what docs/QUALITY.md measured cheaper; a method a saved workflow
    stored is kept."""
    model = sd15 if name == "sd15" else dit_models.build_dit_model(name)
    assert pooling_method(todo_node(pack, model)) == method
    for stored in ("nearest", "average"):
        assert pooling_method(todo_node(pack, model, method=stored)) == stored


def test_method_auto_has_a_choice_for_every_family_and_the_tooltip_names_them(pack):
    from tome.hosts.dit_families import FAMILIES

    comfyui_models = pack.models
    assert set(comfyui_models.AUTO_METHOD) == {None, *FAMILIES}
    (method,) = [i for i in pack.nodes.ApplyToDo.define_schema().inputs if i.id == "method"]
    assert method.default == "auto" and method.options[0] == "auto"
    for who, _, choice, _ in comfyui_models.AUTO_METHODS:
        assert f"{choice} on {who}" in method.tooltip
