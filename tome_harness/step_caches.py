"""The step-cache packs people stack with token reduction, from their pinned copies, for the tests and the bench.

Three third-party packs replace a DiT's forward with one that skips whole model calls (or all but the first
block) when the model's input or first block moved little since the last computed step:
welltop-cn/ComfyUI-TeaCache, Zehong-Ma/ComfyUI-MagCache and chengzeyi/Comfy-WaveSpeed (First Block Cache).
Their sources are pinned, unchanged, in ``shared/thirdparty/`` beside this repository (``THIRDPARTY``; each
folder's ``PINNED.md`` names its commit) and are loaded by ComfyUI's own custom-node loader, as a user's install
would load them. ``PACKS`` lists, per pack, the families it covers (as its README and its ``model_type`` list
name them) with the ``model_type`` each takes, and the families whose forward in the pack fails on ComfyUI 0.3.75
by itself, without this pack in the graph (``CachePack.fails``, with the error).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .comfyui import ROOT

THIRDPARTY = Path(os.environ.get("TOME_THIRDPARTY") or ROOT.parent / "shared" / "thirdparty")
TEACACHE, MAGCACHE, FIRST_BLOCK_CACHE = "TeaCache", "MagCache", "First Block Cache"
FOLDERS = {TEACACHE: "ComfyUI-TeaCache", MAGCACHE: "ComfyUI-MagCache", FIRST_BLOCK_CACHE: "Comfy-WaveSpeed"}
NODE_IDS = {TEACACHE: "TeaCache", MAGCACHE: "MagCache", FIRST_BLOCK_CACHE: "ApplyFBCacheOnModel"}


@dataclass(frozen=True)
class CachePack:
    """One step-cache pack: its node's ``apply(node, model, model_type, threshold)``, the families it covers (the
    test models' names, ``tome_harness.dit_models``) with the ``model_type`` each takes (``None``: the node has
    none), its default threshold, and the fewest sampling steps it runs (MagCache's calibration needs a whole
    run of its own length or near it: below 20 steps it reads a cache it never wrote). ``fails``: the families
    whose forward in the pack fails on this host by itself, and how."""

    name: str
    apply: Callable
    families: dict[str, str | None]
    threshold: float
    min_steps: int = 1
    fails: dict[str, str] = field(default_factory=dict)


def apply_teacache(node, model, model_type: str, threshold: float):
    (out,) = node().apply_teacache(model, model_type, threshold, 0.0, 1.0, "cpu")
    return out


def apply_magcache(node, model, model_type: str, threshold: float):
    # retention_ratio 0.2, magcache_K 2, every step: the node's defaults.
    (out,) = node().apply_magcache(model, model_type, threshold, 0.2, 2, 0, -1)
    return out


def apply_first_block_cache(node, model, model_type: None, threshold: float):
    (out,) = node().patch(model, "diffusion_model", threshold)
    return out


PACKS = {
    TEACACHE: CachePack(TEACACHE, apply_teacache, {
        "flux": "flux", "ltxv": "ltxv", "lumina2": "lumina_2", "hunyuan_video": "hunyuan_video",
        "hidream": "hidream_i1_dev", "wan21": "wan2.1_t2v_1.3B", "wan21_i2v": "wan2.1_i2v_480p_14B"},
        threshold=0.4, fails={"hunyuan_video": "its HunyuanVideo forward takes no 'disable_time_r', which "
                                               "ComfyUI 0.3.75 passes (TypeError)"}),
    MAGCACHE: CachePack(MAGCACHE, apply_magcache, {
        "flux": "flux", "chroma": "chroma", "qwen_image": "qwen_image", "hunyuan_video": "hunyuan_video",
        "hunyuan_video15": "hunyuan_video1.5", "wan21": "wan2.1_t2v_1.3B", "wan21_i2v": "wan2.1_i2v_480p_14B",
        "wan21_vace": "wan2.1_vace_1.3B"}, threshold=0.06, min_steps=20),
    FIRST_BLOCK_CACHE: CachePack(FIRST_BLOCK_CACHE, apply_first_block_cache, {
        "flux": None, "sd3": None, "hunyuan_video": None, "ltxv": None}, threshold=0.12),
}


def load(nodes) -> dict[str, type]:
    """Load the three packs from ``THIRDPARTY`` into the booted ComfyUI (its ``nodes`` module) as ComfyUI loads a
    custom node folder; their node classes by pack. First Block Cache patches ComfyUI's
    ``execution.get_output_data`` for the whole process when its node first runs (its own doing)."""
    if not THIRDPARTY.is_dir():
        raise FileNotFoundError(f"no pinned step-cache packs at {THIRDPARTY} (set TOME_THIRDPARTY)")
    for name, folder in FOLDERS.items():
        if NODE_IDS[name] not in nodes.NODE_CLASS_MAPPINGS and \
                not asyncio.run(nodes.load_custom_node(str(THIRDPARTY / folder))):
            raise RuntimeError(f"ComfyUI could not load the pinned {name} ({THIRDPARTY / folder})")
    return {name: nodes.NODE_CLASS_MAPPINGS[node_id] for name, node_id in NODE_IDS.items()}


def cached(classes: dict[str, type], pack: str, model, family: str, threshold: float | None = None):
    """``model`` (of test family ``family``) through ``pack``'s node, at ``threshold`` (default: the pack's)."""
    spec = PACKS[pack]
    return spec.apply(classes[pack], model, spec.families[family],
                      spec.threshold if threshold is None else threshold)
