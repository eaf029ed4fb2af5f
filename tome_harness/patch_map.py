"""A fixed linear map between 8x8 pixel patches and latent pixels, standing in for a VAE.

The real models see an image through a VAE whose latent pixel stands for an
8x8 pixel patch. No VAE can be had here, so the trained models of the real
footprint (``trained_models``) see photographs through the principal
components of 8x8x3 patches, fitted on the training photographs
(``tome_harness.photos``; never the held-out ones): a latent pixel holds the
first ``channels`` components of its patch (4 for the U-Nets, 16 for the
DiTs), scaled by one factor that gives the latent unit variance on average over
its channels, as a VAE's latent scale factor does. Not each component to unit
variance: whitening weighs a patch's finest texture as much as its mean colour,
and neighbouring tokens become far less alike than in the photograph (how much
less: docs/QUALITY.md, ``bench/quality_bench.py --redundancy``). With one factor
the map is an orthogonal projection up to scale: distances between tokens,
which ToMe's matching reads, are the pixels' (within what the components hold).
Decoding projects back, so encode then decode keeps what the components hold
and loses the rest; ``reconstruction_psnr`` says how much that is on the
held-out photographs.

A map is ``mean [192]``, ``basis [192, C]`` (orthonormal columns) and
``scale [C]`` (one value, repeated); it is fitted once by
``bench/train_models.py --patch-maps`` and committed beside the weights
(``weights/patch_map_<C>.safetensors``).
The order of a patch's 192 values is ``pixel_unshuffle``'s: channel, then row, then column.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PATCH = 8
PATCH_VALUES = 3 * PATCH * PATCH


@dataclass(frozen=True)
class PatchMap:
    mean: torch.Tensor  # [192]
    basis: torch.Tensor  # [192, C], orthonormal columns, the largest components first
    scale: torch.Tensor  # [C]: one value, the components' root mean square over the training patches

    @property
    def channels(self) -> int:
        return self.basis.shape[1]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, 8h, 8w]`` in ``[-1, 1]`` to ``[B, C, h, w]``."""
        patches = F.pixel_unshuffle(images, PATCH).movedim(1, -1) - self.mean
        return (patches @ self.basis / self.scale).movedim(-1, 1)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` to ``[B, 3, 8h, 8w]`` (not clamped)."""
        patches = (latent.movedim(1, -1) * self.scale) @ self.basis.T + self.mean
        return F.pixel_shuffle(patches.movedim(-1, 1), PATCH)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "basis": self.basis, "scale": self.scale}

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path))

    @classmethod
    def load(cls, path: Path) -> PatchMap:
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


@torch.no_grad()
def fit(images: torch.Tensor, channels: int) -> PatchMap:
    """The principal components of every 8x8 patch of ``images [N, 3, H, W]`` (in ``[-1, 1]``), in float64,
    scaled by one factor to unit mean variance. Each component's sign is fixed (its largest entry positive), so
    the map does not depend on the eigen-solver's choice."""
    patches = F.pixel_unshuffle(images.double(), PATCH).movedim(1, -1).reshape(-1, PATCH_VALUES)
    mean = patches.mean(0)
    centred = patches - mean
    covariance = centred.T @ centred / len(centred)
    values, vectors = torch.linalg.eigh(covariance)  # ascending
    values, vectors = values.flip(0)[:channels], vectors.flip(1)[:, :channels]
    signs = vectors.gather(0, vectors.abs().argmax(0, keepdim=True)).sign()
    scale = values.clamp_min(0).mean().sqrt().expand(channels)
    return PatchMap(mean=mean.float(), basis=(vectors * signs).float().contiguous(), scale=scale.float().contiguous())


def reconstruction_psnr(patch_map: PatchMap, images: torch.Tensor) -> list[float]:
    """Per image of ``images [N, 3, H, W]`` in ``[0, 1]``: the PSNR (dB) of encode then decode, clamped."""
    decoded = ((patch_map.decode(patch_map.encode(images * 2 - 1)) + 1) / 2).clamp(0, 1)
    mse = (decoded - images).square().flatten(1).mean(1)
    return (10 * torch.log10(1 / mse)).tolist()
