"""Which adapter a ComfyUI model goes to: the DiT families to ``comfyui_dit``, everything else to
``comfyui_unet`` (which acts on U-Nets with transformer blocks and warns, naming the model, on anything else).

The nodes call these two functions with all their inputs; inputs that have no meaning for the model at hand
are ignored there, with a warning when they were changed from their defaults, so nothing silently does nothing.
"""

from __future__ import annotations

import logging

from ..downsample import AVERAGE, METHODS, NEAREST
from ..merge import MEAN
from . import comfyui_dit, comfyui_unet
from .comfyui import MERGE_QKV, check_choice
from .comfyui_unet import SCOPE_SELF
from .dit_families import (
    COSMOS,
    COSMOS1,
    FLUX,
    HIDREAM,
    HUNYUAN_VIDEO,
    LTXV,
    LUMINA2,
    MOCHI,
    QWEN_IMAGE,
    SD3,
    WAN,
    WAN_ANIMATE,
    WAN_HUMO,
    WAN_S2V,
    dit_family,
)
from .dit_settings import SCOPE_ATTENTION, SKIP_FIRST_BLOCKS, SKIP_LAST_BLOCKS, TokenCaching

log = logging.getLogger(__name__)

# Apply ToDo's method "auto": per family, the pooling the quality bench measured cheaper on that family's
# trained judge, by the x0 change at half the schedule (docs/QUALITY.md, "What the footprint and depth
# changed"). Nearest and average cost the same time, so the cheaper in quality is the only choice that is never
# the dearest. A family without a judge gets average, the choice whose measured worst case on a DiT is mildest
# (docs/QUALITY.md has the figures). ``None``: the U-Nets.
AUTO = "auto"
METHOD_CHOICES = (AUTO, *METHODS)
AUTO_METHODS = (
    # (who, families, method, why)
    ("SD1.x, SD2.x, SDXL, SD3.5", (None, SD3), NEAREST, "measured"),
    ("Flux, Flux 2, Chroma, Wan 2.x", (FLUX, WAN, WAN_ANIMATE, WAN_S2V, WAN_HUMO), AVERAGE, "measured"),
    ("Qwen-Image, Lumina 2 / Z-Image, HiDream, HunyuanVideo, LTX-Video, Cosmos, Mochi",
     (QWEN_IMAGE, LUMINA2, HIDREAM, HUNYUAN_VIDEO, LTXV, COSMOS, COSMOS1, MOCHI), AVERAGE,
     "no trained model: the choice whose measured worst case is mildest"),
)
AUTO_METHOD = {family: method for _, families, method, _ in AUTO_METHODS for family in families}


def auto_method_summary() -> str:
    """What ``auto`` picks on each family and why, for the tooltip and the help page."""
    return "; ".join(f"{method} on {who}" + ("" if why == "measured" else f" ({why})")
                     for who, _, method, why in AUTO_METHODS)


def todo_method(method: str, family: str | None) -> str:
    """``method``, or the one ``auto`` picks for ``family`` (a ``dit_family``, ``None`` for the U-Nets)."""
    check_choice("method", method, METHOD_CHOICES)
    return AUTO_METHOD[family] if method == AUTO else method


def warn_ignored(node: str, model, inputs: dict[str, tuple[object, object]]) -> None:
    """Warn about the inputs (``name: (value, default)``) that were changed but mean nothing for ``model``."""
    changed = [f"{name}={value!r}" for name, (value, default) in inputs.items() if value != default]
    if changed:
        log.warning("%s: %s has no meaning on %s and is ignored", node, ", ".join(changed),
                    type(model.model).__name__)


def dit_inputs(dit_scope: str, skip_first_blocks: int, skip_last_blocks: int) -> dict:
    """The DiT-only inputs, as ``warn_ignored`` takes them."""
    return {"dit_scope": (dit_scope, SCOPE_ATTENTION), "skip_first_blocks": (skip_first_blocks, SKIP_FIRST_BLOCKS),
            "skip_last_blocks": (skip_last_blocks, SKIP_LAST_BLOCKS)}


def apply_tome(model, *, ratio: float, stride_x: int = 2, stride_y: int = 2, max_downsample: str = "auto",
               seed: int = 0, use_rand: bool = True, merge: str = MERGE_QKV, start_percent: float = 0.0,
               end_percent: float = 1.0, scope: str = SCOPE_SELF, reuse_steps: int = 1, reduce: str = MEAN,
               dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
               skip_last_blocks: int = SKIP_LAST_BLOCKS, token_cache: bool = False, share_matching: bool = False):
    """Apply ToMe's inputs to ``model``, a U-Net or a DiT; returns the patched clone (or ``model``). ``reduce``
    (``MEAN``, or the quality bench's ``PRUNE`` baseline) is no node input. ``token_cache``: the measured
    ``TokenCaching`` at the block scope."""
    if dit_family(model) is None:
        warn_ignored("Apply ToMe", model, {**dit_inputs(dit_scope, skip_first_blocks, skip_last_blocks),
                                           "token_cache": (token_cache, False)})
        return comfyui_unet.apply_tome(model, ratio=ratio, stride_x=stride_x, stride_y=stride_y,
                                       max_downsample=max_downsample, seed=seed, use_rand=use_rand, merge=merge,
                                       start_percent=start_percent, end_percent=end_percent, scope=scope,
                                       reuse_steps=reuse_steps, reduce=reduce, share_matching=share_matching)
    warn_ignored("Apply ToMe", model, {"max_downsample": (max_downsample, "auto"), "scope": (scope, SCOPE_SELF)})
    return comfyui_dit.apply_tome_dit(model, ratio=ratio, stride_x=stride_x, stride_y=stride_y, seed=seed,
                                      use_rand=use_rand, merge=merge, start_percent=start_percent,
                                      end_percent=end_percent, reduce=reduce, dit_scope=dit_scope,
                                      skip_first_blocks=skip_first_blocks, skip_last_blocks=skip_last_blocks,
                                      reuse_steps=reuse_steps, token_cache=TokenCaching() if token_cache else None,
                                      share_matching=share_matching)


def apply_todo(model, *, downsample_factor: int, max_downsample: str = "auto", method: str = AUTO,
               start_percent: float = 0.0, end_percent: float = 1.0, time_factor: int = 1,
               dit_scope: str = SCOPE_ATTENTION, skip_first_blocks: int = SKIP_FIRST_BLOCKS,
               skip_last_blocks: int = SKIP_LAST_BLOCKS):
    """Apply ToDo's inputs to ``model``, a U-Net or a DiT; returns the patched clone (or ``model``). ``method``
    ``auto`` picks the family's (``AUTO_METHOD``)."""
    family = dit_family(model)
    chosen, method = method, todo_method(method, family)
    if chosen == AUTO:
        log.info("Apply ToDo: method auto is %s on %s", method, family or "a U-Net")
    if family is None:
        warn_ignored("Apply ToDo", model, {"time_factor": (time_factor, 1),
                                           **dit_inputs(dit_scope, skip_first_blocks, skip_last_blocks)})
        return comfyui_unet.apply_todo(model, downsample_factor=downsample_factor, max_downsample=max_downsample,
                                       method=method, start_percent=start_percent, end_percent=end_percent)
    warn_ignored("Apply ToDo", model, {"max_downsample": (max_downsample, "auto")})
    return comfyui_dit.apply_todo_dit(model, downsample_factor=downsample_factor, method=method,
                                      time_factor=time_factor, start_percent=start_percent,
                                      end_percent=end_percent, dit_scope=dit_scope,
                                      skip_first_blocks=skip_first_blocks, skip_last_blocks=skip_last_blocks)
