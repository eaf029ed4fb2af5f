"""Measures of image quality for the quality bench (``bench/quality_bench.py``), not only of identity.

PSNR and SSIM say how near an output is to another image (the unpatched output, the photograph). Two more say
what an output is like without a twin to compare it with, and need no downloaded network:

- ``detail``: its high-frequency energy, the figure by which ToDo (arXiv 2402.13573) judges the fine detail a
  token reduction keeps, here with a filter of our choosing: the mean magnitude of the image less its Gaussian
  blur of ``DETAIL_SIGMA`` pixels (a high-pass filter passing half the amplitude at 0.19 cycles per pixel and
  more above: detail finer than about 5 pixels). A reduction that smooths lowers it; ratios to the unpatched
  output's and to the photographs' say how much.
- ``patch_distance``: how far the distribution of an image set's 8x8 pixel patches lies from another set's, by
  a sliced Wasserstein distance: the patches projected on random directions, each projection's sorted values
  compared. A stand-in for FID that needs only pixels: it grows as samples lose the photographs' textures
  (blur, noise, flat colour). Each patch is taken less its mean colour: what is compared is texture, which token
  reduction changes, not the colour of a scene, which varies from one photograph to the next far more (with
  the colour kept, one photograph lies farther from the others than uniform noise does). Its floor is the
  distance of real photographs from other real photographs.

Images are float tensors in ``[0, 1]``: one ``[3, H, W]``, a set ``[N, 3, H, W]``, or clips ``[N, 3, T, H, W]``
(their frames count as images). Every measure returns a float. Randomness comes from generators seeded here,
never the global RNG: a measure of the same images is the same number.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

DETAIL_SIGMA = 1.0  # pixels: the Gaussian blur whose residual is the detail

PATCH = 8  # the side of a patch, in pixels: what a latent pixel of the real VAEs stands for
# Patches a set and directions. Another draw of them (another SEED) moves the distance of 512 px photographs from
# the held-out ones by 5 to 8% (a blurred set's from its original by 1 to 3%), the patches and the directions
# about alike; four times as many of either halves its part, for four times the time (now 0.3 s a distance of
# 512 px sets on one core). Sets of one shape are measured on the same places and directions, so two settings'
# samples of a seed differ by what differs in them, not by the draw.
PATCHES = 8192
PROJECTIONS = 256
SEED = 0  # of both the patches' places and the directions


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Of images in [0, 1]; 100 dB for identical ones."""
    mse = float((a - b).square().mean())
    return 100.0 if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Of ``[3, H, W]`` images (or ``[3, T, H, W]`` clips: the mean over frames): scikit-image's, 7x7 windows."""
    from skimage.metrics import structural_similarity

    if a.ndim == 4:
        return statistics.fmean(ssim(a[:, t], b[:, t]) for t in range(a.shape[1]))
    return float(structural_similarity(a.numpy(), b.numpy(), channel_axis=0, data_range=1.0))


def frames(images: torch.Tensor) -> torch.Tensor:
    """``[M, 3, H, W]``: an image, a set of images, or the frames of a set of clips. A clip alone comes as a set
    of one, ``[1, 3, T, H, W]``: ``[3, T, H, W]`` would read as a set of images."""
    if images.ndim == 3:
        images = images[None]
    elif images.ndim == 5:
        images = images.transpose(1, 2).flatten(0, 1)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images of shape {tuple(images.shape)}: expected [3, H, W], [N, 3, H, W] or "
                         "[N, 3, T, H, W]")
    return images


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """``images`` (any shape ending in ``H, W``) blurred by a Gaussian of ``sigma`` pixels, separably, out to
    3 sigma. The borders are mirrored, so that an image's edge is no step for the detail to count."""
    shape = images.shape
    planes = images.reshape(-1, 1, *shape[-2:])
    radius = min(math.ceil(3 * sigma), shape[-2] - 1, shape[-1] - 1)
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype)
    kernel = torch.exp(-offsets.square() / (2 * sigma ** 2))
    kernel = kernel / kernel.sum()
    padded = F.pad(planes, (radius, radius, radius, radius), mode="reflect")
    rows = F.conv2d(padded, kernel.view(1, 1, 1, -1))
    return F.conv2d(rows, kernel.view(1, 1, -1, 1)).reshape(shape)


def detail(images: torch.Tensor) -> float:
    """The mean magnitude of ``images`` less their blur of ``DETAIL_SIGMA`` pixels, over pixels, channels and
    images: 0 for a flat image."""
    return float((images - gaussian_blur(images, DETAIL_SIGMA)).abs().mean())


def patches(images: torch.Tensor) -> torch.Tensor:
    """``[PATCHES, 3 * PATCH * PATCH]``: patches of ``images`` (see ``frames``) at places drawn uniformly, with
    replacement, over every image and every place a whole patch fits, each channel of a patch less its mean.
    The places depend only on the images' shape: two sets of one shape give patches from the same places."""
    images = frames(images)
    count, channels, height, width = images.shape
    if min(height, width) < PATCH:
        raise ValueError(f"images of {height}x{width} pixels hold no {PATCH}x{PATCH} patch")
    generator = torch.Generator().manual_seed(SEED)
    image = torch.randint(count, (PATCHES,), generator=generator)
    top = torch.randint(height - PATCH + 1, (PATCHES,), generator=generator)
    left = torch.randint(width - PATCH + 1, (PATCHES,), generator=generator)
    span = torch.arange(PATCH)
    rows = (top[:, None] + span)[:, None, :, None]
    cols = (left[:, None] + span)[:, None, None, :]
    drawn = images[image[:, None, None, None], torch.arange(channels)[None, :, None, None], rows, cols].flatten(2)
    return (drawn - drawn.mean(-1, keepdim=True)).flatten(1)


def directions(dim: int) -> torch.Tensor:
    """``[PROJECTIONS, dim]``: unit vectors drawn uniformly on the sphere."""
    drawn = torch.randn(PROJECTIONS, dim, generator=torch.Generator().manual_seed(SEED))
    return drawn / drawn.norm(dim=1, keepdim=True)


def patch_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The sliced Wasserstein-2 distance between the 8x8 patches of image sets ``a`` and ``b``: the root mean
    square, over ``PROJECTIONS`` random directions, of the difference between the sorted projections of
    ``PATCHES`` patches of each. Symmetric, and 0 for identical sets. The sets need not be of one size."""
    drawn_a, drawn_b = patches(a), patches(b)
    on = directions(drawn_a.shape[1])
    # Each direction's projections in a row, sorted along it: sorting contiguous rows is several times faster.
    sorted_a = (on @ drawn_a.T).sort(dim=1).values
    sorted_b = (on @ drawn_b.T).sort(dim=1).values
    return math.sqrt(float((sorted_a - sorted_b).square().mean()))
