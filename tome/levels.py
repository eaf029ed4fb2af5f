"""Which U-Net levels hold transformer blocks, read from the module tree by class name.

Neither ComfyUI nor diffusers is imported: LDM-style U-Nets (ComfyUI's,
Stability's ``sgm`` and CompVis' ``ldm``) and diffusers' ``UNet2DConditionModel``
are recognised by the names of their parts, so ``tome/`` serves both without
depending on either. A name matches anywhere in a module's class hierarchy
(``is_a``), so subclasses that other packs make of those parts still count.
"""

from __future__ import annotations

from torch import nn


def is_a(module: nn.Module, class_name: str) -> bool:
    """Whether ``module``'s class, or any class it derives from, is named ``class_name``."""
    return any(cls.__name__ == class_name for cls in type(module).__mro__)


def ldm_transformer_downsamples(unet: nn.Module) -> list[int]:
    """Downsample factors of an LDM U-Net's levels with ``SpatialTransformer`` blocks, finest first.

    Walks ``input_blocks`` (the encoder half: the decoder mirrors it), counting
    ``Downsample`` layers. Empty for anything without ``input_blocks``.
    """
    levels = set()
    downsample = 1
    for block in getattr(unet, "input_blocks", ()):
        for layer in block:
            if is_a(layer, "Downsample"):
                downsample *= 2
            elif is_a(layer, "SpatialTransformer"):
                levels.add(downsample)
    return sorted(levels)


def diffusers_transformer_downsamples(unet: nn.Module) -> list[int]:
    """The same for a diffusers U-Net: ``down_blocks[i]`` works at downsample ``2 ** i``; a level holds
    transformer blocks when its down block has ``attentions``."""
    return [2 ** i for i, block in enumerate(getattr(unet, "down_blocks", ()))
            if len(getattr(block, "attentions", None) or ()) > 0]


def transformer_downsamples(unet: nn.Module) -> list[int]:
    """Downsample factors of the levels with transformer blocks, for an LDM or a diffusers U-Net."""
    return ldm_transformer_downsamples(unet) or diffusers_transformer_downsamples(unet)
