"""Where a node's setting was measured slower on a GPU than no patch: the measured losses, and the one warning a
sampling run gives where its settings act at such a size.

On one H200 at one image a forward of under about 60 ms is set by the host (ComfyUI's Python, the kernel
launches), not by the tokens: there the matching, gathers and scatters add launches that fewer tokens do not
pay back (docs/BENCHMARKS.md, "On a GPU (one H200)"; under torch.compile docs/SPEED_STACK.md, "torch.compile on
a GPU"). ``ROWS`` holds, per family and setting, the sizes that GPU table measured with the speed-up of each,
for every setting the table shows losing at some size; ``tests/docs/test_gpu_table.py`` holds it to the tables.
What to do instead, and the rule in words with its commands: docs/SETTINGS.md, "When the node warns on a GPU".

The rule (``gpu_warning``): a run on any device but the CPU (there the tokens set a forward's pace, and the
pack's rows were chosen on it) warns once where a setting that acts on it was measured slower than no patch
at the run's size. Sizes between measurements: a run's size counts as losing where it is at or below the
largest measured losing size and below the smallest measured gaining size (none measured: no bound), and the
warning quotes the smallest losing size at or above it. Above the largest losing size nothing is known to
lose, so nothing is said, even where no gain was measured either. A setting or family the table did not
measure never warns. Nothing of the user's own run is timed.

Sizes are image tokens per image (or clip): a U-Net's latent cells (its highest-resolution level's tokens), a
DiT's patches over every frame, so that one figure holds whatever a family's VAE or patch (Flux 2, Chroma
Radiance). The batch is not counted: every figure is one image a forward. A family's rows stand for the whole
family (Flux's for Flux 2 and Chroma, SD3.5 medium's for SD3.5 large, SD1.5's for SD2.x): the warning names the
model measured. The settings are read as the table's columns: at any ratio or factor (at these sizes the host
sets the pace, and the matching costs the same whatever the ratio), a U-Net's ToMe at scope self-attention as
the default's column whatever its max_downsample, a wider scope as the fast setting's; ToMe's token cache was
not measured on a GPU and is left out.

No ComfyUI import: a U-Net's family is read from the class names of its model config (``unet_family``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .dit_families import FLUX, HIDREAM, LTXV, LUMINA2, QWEN_IMAGE, SD3, patch_grid
from .dit_settings import SCOPE_ATTENTION, SCOPE_BLOCK

TOME, TODO = "Apply ToMe", "Apply ToDo"
# A U-Net's scopes as the table's columns: ToMe at scope self-attention (the default's; ToDo acts there too), and a
# scope with cross-attention or the MLP too (the fast setting's).
SELF_ATTENTION, WIDER = "self-attention", "wider"
SD15, SDXL = "sd15", "sdxl"  # the U-Net families the table measured
UNET_FAMILIES = {"SD15": SD15, "SD20": SD15, "SDXL": SDXL}  # ComfyUI's model config classes (and their subclasses)

RULE_DOC = "docs/SETTINGS.md, 'When the node warns on a GPU'"


class Setting(NamedTuple):
    """What one node does, as the GPU table's columns tell settings apart."""

    method: str  # TOME or TODO
    scope: str  # SELF_ATTENTION or WIDER on a U-Net, a dit_scope on a DiT


@dataclass(frozen=True)
class Measured:
    """One cell of the GPU table: the size as the table names it, its image tokens, the speed-up over no patch."""

    size: str
    tokens: int
    speedup: float


@dataclass(frozen=True)
class Row:
    """One setting on one family, at every size the GPU table measured it (the model named as the table names
    it); ``instead``: what to do at the sizes where it loses. ``compiled``: measured under torch.compile against
    the compiled unpatched model (a compiled run reads it before the row measured uncompiled)."""

    family: str
    model: str
    setting: Setting
    measured: tuple[Measured, ...]
    instead: str
    compiled: bool = False

    def loss_at(self, tokens: int) -> Measured | None:
        """The measured loss a run of ``tokens`` image tokens counts as (see the module docstring), or ``None``."""
        losing = [m for m in self.measured if m.speedup < 1.0]
        gaining = [m.tokens for m in self.measured if m.speedup >= 1.0]
        if not losing or tokens > max(m.tokens for m in losing) or (gaining and tokens >= min(gaining)):
            return None
        return min((m for m in losing if m.tokens >= tokens), key=lambda m: m.tokens)


# Image tokens at the measured sizes: a U-Net's latent is an eighth of the image on each side; the image DiTs
# measured (SD3.5, Flux, Qwen-Image, Z-Image, HiDream) patch 2x2 cells of an eighth, so a token is 16 px square;
# LTX-Video's VAE takes 32 px square and 8 frames (and the first) to one token.
def unet_px(px: int, speedup: float) -> Measured:
    return Measured(f"{px} px", (px // 8) ** 2, speedup)


def dit_px(px: int, speedup: float) -> Measured:
    return Measured(f"{px} px", (px // 16) ** 2, speedup)


LTXV_121 = (768 // 32) * (512 // 32) * ((121 - 1) // 8 + 1)

SD15_INSTEAD = "use Apply ToDo 2 (it gained at every size measured), or leave the model unpatched"
SDXL_INSTEAD = "leave the model unpatched (no setting gained at 1024 px), or from 2048 px use Apply ToDo 2"
SD3_INSTEAD = "use Apply ToDo 2 at dit_scope 'attention', the one setting that gained on SD3.5 medium at 1024 px"
IMAGE_DIT_INSTEAD = "use Apply ToDo 2 (it gained at both scopes), or ToMe at dit_scope 'block'"
COMPILED_INSTEAD = "compile the model without the pack (every patched variant lost to it)"

# The columns: U-Nets' Apply ToMe 0.5 (default), fast setting and Apply ToDo 2; DiTs' ToMe 0.5 (attention), and
# at the block scope the node's default skips (2:2); under compile, the rows of every block.
ROWS = (
    Row(SD15, "SD1.5", Setting(TOME, SELF_ATTENTION), (unet_px(512, 0.87), unet_px(1024, 0.90), unet_px(2048, 1.51)),
        SD15_INSTEAD),
    Row(SD15, "SD1.5", Setting(TOME, WIDER), (unet_px(512, 0.75), unet_px(1024, 0.79), unet_px(2048, 1.50)),
        SD15_INSTEAD),
    Row(SDXL, "SDXL", Setting(TOME, SELF_ATTENTION), (unet_px(1024, 0.82), unet_px(2048, 1.01)), SDXL_INSTEAD),
    Row(SDXL, "SDXL", Setting(TOME, WIDER), (unet_px(1024, 0.37), unet_px(2048, 0.66)),
        "leave the model unpatched, or at 2048 px use Apply ToDo 2 or ToMe at scope self-attention (the wider "
        "scopes lost at every size)"),
    Row(SDXL, "SDXL", Setting(TODO, SELF_ATTENTION), (unet_px(1024, 0.96), unet_px(2048, 1.12)),
        "leave the model unpatched (no setting gained at 1024 px)"),
    Row(SD3, "SD3.5 medium", Setting(TOME, SCOPE_ATTENTION), (dit_px(1024, 0.49),), SD3_INSTEAD),
    Row(SD3, "SD3.5 medium", Setting(TOME, SCOPE_BLOCK), (dit_px(1024, 0.69),), SD3_INSTEAD),
    Row(SD3, "SD3.5 medium", Setting(TODO, SCOPE_BLOCK), (dit_px(1024, 0.85),), SD3_INSTEAD),
    Row(FLUX, "Flux", Setting(TOME, SCOPE_ATTENTION), (dit_px(1024, 0.84),), IMAGE_DIT_INSTEAD),
    Row(QWEN_IMAGE, "Qwen-Image", Setting(TOME, SCOPE_ATTENTION), (dit_px(1024, 0.80),), IMAGE_DIT_INSTEAD),
    Row(LUMINA2, "Z-Image", Setting(TOME, SCOPE_ATTENTION), (dit_px(1024, 0.89),), IMAGE_DIT_INSTEAD),
    Row(HIDREAM, "HiDream I1", Setting(TOME, SCOPE_ATTENTION), (dit_px(1024, 0.84),), IMAGE_DIT_INSTEAD),
    Row(LTXV, "LTX-Video 2B", Setting(TOME, SCOPE_ATTENTION), (Measured("768x512 x 121", LTXV_121, 0.83),),
        IMAGE_DIT_INSTEAD),
    # docs/SPEED_STACK.md, "torch.compile on a GPU": against the compiled unpatched model.
    *(Row(SD3, "SD3.5 medium", setting, (dit_px(1024, speedup),), COMPILED_INSTEAD, compiled=True)
      for setting, speedup in ((Setting(TOME, SCOPE_ATTENTION), 0.36), (Setting(TODO, SCOPE_ATTENTION), 0.96),
                               (Setting(TOME, SCOPE_BLOCK), 0.44), (Setting(TODO, SCOPE_BLOCK), 0.60))),
)
ROW_OF = {(row.family, row.setting, row.compiled): row for row in ROWS}


def row_for(family: str | None, setting: Setting, compiled: bool = False) -> Row | None:
    """The row that judges ``setting`` on ``family``: under compile the compiled one where it was measured so,
    else the uncompiled one."""
    return (compiled and ROW_OF.get((family, setting, True))) or ROW_OF.get((family, setting, False))


def describe(setting: Setting, compiled: bool) -> str:
    """``setting`` in the nodes' words."""
    if setting.scope == WIDER:
        where = " at a scope with cross-attention or the MLP (the fast setting)"
    elif setting.scope == SELF_ATTENTION:
        where = " at scope self-attention" if setting.method == TOME else ""
    else:
        where = f" at dit_scope '{setting.scope}'"
    return setting.method + where + (" under torch.compile" if compiled else "")


def gpu_warning(device_type: str, tokens: int, family: str | None, settings: Iterable[Setting],
                compiled: bool = False) -> str | None:
    """The one warning line of a sampling run on ``device_type`` (a ``torch.device``'s type) whose image has
    ``tokens`` tokens (see the module docstring) and whose model, of ``family`` (a ``dit_family``, ``SD15`` or
    ``SDXL``), acts with ``settings``; ``compiled``: under torch.compile. ``None`` on the CPU, and wherever no
    setting was measured slower at that size."""
    if device_type == "cpu":
        return None
    losses = {}
    for setting in settings:
        row = row_for(family, setting, compiled)
        loss = row.loss_at(tokens) if row is not None else None
        if loss is not None:
            gains = min((m for m in row.measured if m.speedup >= 1.0), key=lambda m: m.tokens, default=None)
            baseline = "the compiled unpatched model" if row.compiled else "no patch"
            losses[setting] = (f"{describe(setting, row.compiled)} ran at {loss.speedup:.2f}x the speed of {baseline} "
                               f"on {row.model} at {loss.size} ({loss.tokens} tokens"
                               f"{f', gaining only from {gains.size}' if gains else ''}): instead, {row.instead}")
    if not losses:
        return None
    nodes = " / ".join(dict.fromkeys(setting.method for setting in losses))
    return (f"{nodes} on a GPU ({device_type}): this run's image has {tokens} tokens, and on one H200 at one image "
            f"a forward, {'; '.join(losses.values())}. The run goes on as set; the rule and its figures: {RULE_DOC}")


def image_tokens(latent_shape: Sequence[int], patch: Sequence[int] = (1, 1, 1)) -> int:
    """The image tokens of one image (or clip) of a latent ``[B, C, H, W]`` or ``[B, C, T, H, W]`` under
    ``patch`` ``(pt, ph, pw)``: a U-Net's latent cells with the default."""
    return math.prod(patch_grid(latent_shape, patch))


@dataclass(frozen=True)
class GpuUse:
    """What a patched model does, as the rule reads it: its ``family``, the ``settings`` that act, and its
    ``patch`` (``(1, 1, 1)``: a U-Net's latent cells). A run's start asks it for the warning."""

    family: str | None
    settings: tuple[Setting, ...]
    patch: tuple[int, int, int] = (1, 1, 1)

    def warning(self, device_type: str, latent_shape: Sequence[int], compiled: bool = False) -> str | None:
        """``gpu_warning`` for a run on ``device_type`` with a latent of ``latent_shape``."""
        return gpu_warning(device_type, image_tokens(latent_shape, self.patch), self.family, self.settings, compiled)


def gpu_use(family: str | None, settings: Iterable[Setting], patch: Sequence[int] = (1, 1, 1)) -> GpuUse | None:
    """A ``GpuUse``, or ``None`` where no row judges any of ``settings`` on ``family`` (no run of it can warn, so
    the run's start need not ask)."""
    settings = tuple(settings)
    if not any((family, setting, compiled) in ROW_OF for setting in settings for compiled in (False, True)):
        return None
    return GpuUse(family, settings, tuple(patch))


def unet_family(model) -> str | None:
    """``SD15`` or ``SDXL`` for a ``ModelPatcher`` whose model config is (or derives from) ComfyUI's SD1.5, SD2.x
    or SDXL config; ``None`` for any other U-Net (no row judges it)."""
    config = getattr(model.model, "model_config", None)
    return next((UNET_FAMILIES[cls.__name__] for cls in type(config).__mro__ if cls.__name__ in UNET_FAMILIES), None)
