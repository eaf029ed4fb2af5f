"""Real photographs for training and measuring the small models of the quality bench.

Nothing is downloaded or committed: the photographs come from Debian's
``mate-backgrounds`` (twelve nature photographs, installed by
``scripts/setup.sh``) and from the files scikit-image ships in its wheel.
``ukui-wallpapers`` was looked at and left out: its images are rendered
illustrations, not photographs. A fixed set of photographs is held out: no
model is ever trained on them, and the bench measures on them alone.

Images are ``[3, H, W]`` float tensors in ``[0, 1]``. Video clips are made by
moving and zooming a crop window smoothly across one photograph: real content,
real (camera) motion.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

MATE_NATURE = Path("/usr/share/backgrounds/mate/nature")
MATE_PHOTOS = ("Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "LadyBird", "RainDrops", "Storm",
               "TwoWings", "Wood", "YellowFlower")
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "motorcycle_left")
# Never trained on: two of each source, of different content (an insect close up, a sky, a cat, a cup).
HELD_OUT = ("LadyBird", "Storm", "chelsea", "coffee")
LONG_SIDE = 512  # every photograph is kept at most this large for crops up to half of it (the wallpapers are 4K)


class MissingPhotographs(RuntimeError):
    """The Debian package is not installed: ``scripts/setup.sh`` installs it."""


def _skimage_file(name: str) -> Path:
    import skimage.data

    root = Path(skimage.data.__file__).parent
    for suffix in (".png", ".jpg"):
        if (root / f"{name}{suffix}").exists():
            return root / f"{name}{suffix}"
    raise MissingPhotographs(f"scikit-image ships no {name} photograph here ({root})")


def photo_path(name: str) -> Path:
    if name in SKIMAGE_PHOTOS:
        return _skimage_file(name)
    path = MATE_NATURE / f"{name}.jpg"
    if not path.exists():
        raise MissingPhotographs(f"{path} is missing: install Debian's mate-backgrounds (scripts/setup.sh does)")
    return path


def long_side_for(out: int) -> int:
    """How large a photograph is kept for crops of ``out`` pixels: ``LONG_SIDE``, or twice ``out`` where that is
    larger, so that a crop of the real models' footprint (512 or 1024 px) is not upsampled from the 4K
    wallpapers (scikit-image's photographs are about 512 px: they are)."""
    return max(LONG_SIDE, 2 * out)


@functools.cache
def load(name: str, long_side: int = LONG_SIDE) -> torch.Tensor:
    """The photograph ``name`` as ``[3, H, W]`` in ``[0, 1]``, its long side at most ``long_side``."""
    from PIL import Image

    with Image.open(photo_path(name)) as image:
        image = image.convert("RGB")
        scale = long_side / max(image.size)
        if scale < 1:
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.LANCZOS)
        array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def training_names() -> tuple[str, ...]:
    return tuple(n for n in MATE_PHOTOS + SKIMAGE_PHOTOS if n not in HELD_OUT)


def resized_crop(image: torch.Tensor, top: float, left: float, size: float, out: int) -> torch.Tensor:
    """The square window ``size`` pixels wide at ``(top, left)`` of ``image [3, H, W]`` (rounded to whole
    pixels, kept inside the image), resampled to ``out x out``: bilinear, antialiased when shrinking."""
    _, h, w = image.shape
    side = min(max(round(size), 1), h, w)
    t, lf = min(max(round(top), 0), h - side), min(max(round(left), 0), w - side)
    window = image[None, :, t:t + side, lf:lf + side]
    resized = F.interpolate(window, size=(out, out), mode="bilinear", antialias=side > out, align_corners=False)
    return resized[0].clamp(0, 1)


def center_crop(image: torch.Tensor, out: int) -> torch.Tensor:
    """The largest centred square of ``image``, resampled to ``out x out``: one held-out test image."""
    _, h, w = image.shape
    size = min(h, w)
    return resized_crop(image, (h - size) / 2, (w - size) / 2, size, out)


@dataclass
class CropSampler:
    """Random square crops of the training photographs: a random photograph, a window between ``out`` pixels
    and the photograph's short side, a random place, a random horizontal flip. Seeded: the same ``seed``
    gives the same crops."""

    out: int
    seed: int = 0
    names: tuple[str, ...] = ()

    def __post_init__(self):
        self.names = self.names or training_names()
        self.images = [load(n, long_side_for(self.out)) for n in self.names]
        self.generator = torch.Generator().manual_seed(self.seed)

    def _uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=self.generator))

    def window(self, image: torch.Tensor) -> tuple[float, float, float]:
        _, h, w = image.shape
        size = self._uniform(self.out, min(h, w))
        return self._uniform(0, h - size), self._uniform(0, w - size), size

    def image(self) -> torch.Tensor:
        photo = self.images[int(torch.randint(len(self.images), (), generator=self.generator))]
        crop = resized_crop(photo, *self.window(photo), self.out)
        return crop.flip(-1) if torch.rand((), generator=self.generator) < 0.5 else crop

    def batch(self, n: int) -> torch.Tensor:
        """``[n, 3, out, out]``."""
        return torch.stack([self.image() for _ in range(n)])

    def clip(self, frames: int) -> torch.Tensor:
        """``[3, frames, out, out]``: a window that moves and zooms in a straight line across one photograph."""
        photo = self.images[int(torch.randint(len(self.images), (), generator=self.generator))]
        return pan_zoom(photo, self.window(photo), self.window(photo), frames, self.out)

    def clips(self, n: int, frames: int) -> torch.Tensor:
        """``[n, 3, frames, out, out]``."""
        return torch.stack([self.clip(frames) for _ in range(n)])


def pan_zoom(photo: torch.Tensor, start: tuple[float, float, float], end: tuple[float, float, float], frames: int,
             out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: the crop window moved linearly from ``start`` to ``end`` (each
    ``(top, left, size)``)."""
    steps = [i / max(frames - 1, 1) for i in range(frames)]
    windows = [tuple(a + (b - a) * s for a, b in zip(start, end, strict=True)) for s in steps]
    return torch.stack([resized_crop(photo, *w, out) for w in windows], dim=1)


def held_out_images(out: int) -> torch.Tensor:
    """``[len(HELD_OUT), 3, out, out]``: the centred square of every held-out photograph."""
    return torch.stack([center_crop(load(n, long_side_for(out)), out) for n in HELD_OUT])


def held_out_clips(out: int, frames: int) -> torch.Tensor:
    """``[len(HELD_OUT), 3, frames, out, out]``: a fixed slow pan and zoom-in over each held-out photograph."""
    clips = []
    for name in HELD_OUT:
        photo = load(name, long_side_for(out))
        _, h, w = photo.shape
        size = min(h, w)
        start = ((h - size) / 2, (w - size) / 2, size)
        end = ((h - size) / 2 + size * 0.1, (w - size) / 2 + size * 0.05, size * 0.8)
        clips.append(pan_zoom(photo, start, end, frames, out))
    return torch.stack(clips)
