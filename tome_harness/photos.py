"""Real photographs for training and measuring the small models of the quality bench.

Nothing is downloaded or committed: the photographs come from Debian's
``mate-backgrounds`` (twelve nature photographs, installed by
``scripts/setup.sh``) and from the files scikit-image ships in its wheel.
``ukui-wallpapers`` was looked at and left out: its images are rendered
illustrations, not photographs. A fixed set of photographs is held out: no
model is ever trained on them, and the bench measures on them alone.

Images are ``[3, H, W]`` float tensors in ``[0, 1]``. Video clips are made by
moving a crop window smoothly across one photograph: real content, real (camera)
motion. Two recipes: ``window`` (a straight line between two random windows:
the first judges') and ``camera`` (the clips people make from a photograph: a
pan, a zoom in or out, or parallax, a near layer sliding across the frame
faster than the background, each a modest move over the clip).
"""

from __future__ import annotations

import functools
import math
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


def centred_square(photo: torch.Tensor) -> tuple[float, float, float]:
    """The window ``(top, left, size)`` of ``photo``'s largest centred square."""
    _, h, w = photo.shape
    size = min(h, w)
    return (h - size) / 2, (w - size) / 2, size


def center_crop(image: torch.Tensor, out: int) -> torch.Tensor:
    """The largest centred square of ``image``, resampled to ``out x out``: one held-out test image."""
    return resized_crop(image, *centred_square(image), out)


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

    def camera_clip(self, frames: int, motion: str) -> torch.Tensor:
        """``[3, frames, out, out]``: one ``motion`` (``MOTIONS``) over a random window of a random photograph,
        its direction and size drawn: a pan of 5 to 25% of the window, a zoom by 0.75 to 1.33, parallax's
        background a pan of 3 to 12% under a round layer of another photograph moving three times as far."""
        photo = self.images[int(torch.randint(len(self.images), (), generator=self.generator))]
        window = self.window(photo)
        angle = self._uniform(0, 2 * math.pi)
        if motion == "zoom":
            return zoom(photo, window, math.exp(self._uniform(math.log(0.75), math.log(4 / 3))), frames, self.out)
        reach = self._uniform(0.05, 0.25) if motion == "pan" else self._uniform(0.03, 0.12)
        shift = (reach * math.sin(angle), reach * math.cos(angle))
        if motion == "pan":
            return pan(photo, window, shift, frames, self.out)
        other = self.images[int(torch.randint(len(self.images), (), generator=self.generator))]
        layer = resized_crop(other, *self.window(other), self.out // 2)
        centre = (self._uniform(0.3, 0.7), self._uniform(0.3, 0.7))
        return parallax(photo, window, shift, layer, centre, frames, self.out)

    def camera_clips(self, n: int, frames: int) -> torch.Tensor:
        """``[n, 3, frames, out, out]``: the motions in turn from a random one, so that a batch of two or more
        holds more than one kind."""
        first = int(torch.randint(len(MOTIONS), (), generator=self.generator))
        return torch.stack([self.camera_clip(frames, MOTIONS[(first + i) % len(MOTIONS)]) for i in range(n)])


def pan_zoom(photo: torch.Tensor, start: tuple[float, float, float], end: tuple[float, float, float], frames: int,
             out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: the crop window moved linearly from ``start`` to ``end`` (each
    ``(top, left, size)``)."""
    steps = [i / max(frames - 1, 1) for i in range(frames)]
    windows = [tuple(a + (b - a) * s for a, b in zip(start, end, strict=True)) for s in steps]
    return torch.stack([resized_crop(photo, *w, out) for w in windows], dim=1)


MOTIONS = ("pan", "zoom", "parallax")


def pan(photo: torch.Tensor, window: tuple[float, float, float], shift: tuple[float, float], frames: int,
        out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: ``window`` (top, left, size) moved by ``shift`` (down, right; shares of its
    size) over the clip."""
    top, left, size = window
    return pan_zoom(photo, window, (top + shift[0] * size, left + shift[1] * size, size), frames, out)


def zoom(photo: torch.Tensor, window: tuple[float, float, float], factor: float, frames: int,
         out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: ``window`` grown by ``factor`` about its centre over the clip (below 1: a zoom
    in)."""
    top, left, size = window
    grow = size * (1 - factor) / 2
    return pan_zoom(photo, window, (top + grow, left + grow, size * factor), frames, out)


def round_mask(side: int) -> torch.Tensor:
    """``[1, side, side]``: 1 inside a disc of 0.4 ``side``'s radius, falling to 0 over a tenth of ``side``
    (an object's soft edge)."""
    coords = (torch.arange(side) + 0.5) / side - 0.5
    radius = (coords[:, None].square() + coords[None, :].square()).sqrt()
    return ((0.5 - radius) / 0.1).clamp(0, 1)[None]


def parallax(photo: torch.Tensor, window: tuple[float, float, float], shift: tuple[float, float],
             layer: torch.Tensor, centre: tuple[float, float], frames: int, out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: ``window`` panned by ``shift`` as in ``pan``, under a round near ``layer``
    (``[3, s, s]``) whose centre starts at ``centre`` (shares of the frame) and slides three times as far
    across the frame the other way, as a nearer object does when the camera moves."""
    background = pan(photo, window, shift, frames, out)
    side = layer.shape[-1]
    mask = round_mask(side)
    clip = background.clone()
    for i in range(frames):
        s = i / max(frames - 1, 1)
        top = round((centre[0] - 3 * shift[0] * s) * out - side / 2)
        left = round((centre[1] - 3 * shift[1] * s) * out - side / 2)
        # The layer's part inside the frame.
        t0, l0, t1, l1 = max(top, 0), max(left, 0), min(top + side, out), min(left + side, out)
        if t1 <= t0 or l1 <= l0:
            continue
        patch = (slice(t0 - top, t1 - top), slice(l0 - left, l1 - left))
        alpha = mask[:, patch[0], patch[1]]
        frame = clip[:, i, t0:t1, l0:l1]
        clip[:, i, t0:t1, l0:l1] = frame * (1 - alpha) + layer[:, patch[0], patch[1]] * alpha
    return clip


def held_out_images(out: int) -> torch.Tensor:
    """``[len(HELD_OUT), 3, out, out]``: the centred square of every held-out photograph."""
    return torch.stack([center_crop(load(n, long_side_for(out)), out) for n in HELD_OUT])


def held_out_clips(out: int, frames: int) -> torch.Tensor:
    """``[len(HELD_OUT), 3, frames, out, out]``: a fixed slow pan and zoom-in over each held-out photograph."""
    return torch.stack([slow_pan_zoom(load(name, long_side_for(out)), frames, out) for name in HELD_OUT])


def slow_pan_zoom(photo: torch.Tensor, frames: int, out: int) -> torch.Tensor:
    """``[3, frames, out, out]``: from ``photo``'s centred square, 10% down, 5% right and in to 80% of it."""
    top, left, size = centred_square(photo)
    return pan_zoom(photo, (top, left, size), (top + size * 0.1, left + size * 0.05, size * 0.8), frames, out)


def held_out_camera_clips(out: int, frames: int) -> torch.Tensor:
    """``[len(HELD_OUT), 3, frames, out, out]``: the ``camera`` recipe's motions over the held-out photographs'
    centred squares, fixed: ``LadyBird`` the slow pan and zoom-in of ``held_out_clips``, ``Storm`` a pan of 15%
    to the right, ``chelsea`` a zoom out from 80% of the square to all of it, ``coffee`` parallax (a pan of 8%
    down and left under a round layer of ``LadyBird``, never trained on either)."""
    taken = {name: load(name, long_side_for(out)) for name in HELD_OUT}
    storm, chelsea, coffee = taken["Storm"], taken["chelsea"], taken["coffee"]
    square, coffee_square = centred_square(storm), centred_square(coffee)
    top, left, size = centred_square(chelsea)
    layer = center_crop(taken["LadyBird"], out // 2)
    clips = {"LadyBird": slow_pan_zoom(taken["LadyBird"], frames, out),
             "Storm": pan(storm, (square[0], square[1], square[2] * 0.85), (0.0, 0.15), frames, out),
             "chelsea": zoom(chelsea, (top + size * 0.1, left + size * 0.1, size * 0.8), 1.25, frames, out),
             "coffee": parallax(coffee, (coffee_square[0], coffee_square[1] + coffee_square[2] * 0.08,
                                         coffee_square[2] * 0.9), (0.08, -0.08), layer, (0.45, 0.45), frames, out)}
    return torch.stack([clips[name] for name in HELD_OUT])
