"""The destination/source partition of a 2D token grid.

One destination per ``sy x sx`` cell, drawn at random (or the top-left token),
the same draw for every element of the batch. Cells that the right or bottom
edge cuts off hold only sources.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Partition(NamedTuple):
    """Grid positions, each ``[1, n, 1]``: ``order`` holds all of them, destinations first, then sources;
    ``dst_pos`` and ``src_pos`` are its two parts (views)."""

    dst_pos: torch.Tensor
    src_pos: torch.Tensor
    order: torch.Tensor


def draw_destinations(w: int, h: int, sx: int, sy: int, device: torch.device,
                      no_rand: bool = False,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``[(h // sy) * (w // sx), 1]``: which token of each cell (row-major in the cell; cells row-major) is its
    destination. The same draws as tomesd's ``[h // sy, w // sx, 1]``: a generator fills either in the same order."""
    cells = ((h // sy) * (w // sx), 1)
    if no_rand:
        return torch.zeros(cells, device=device, dtype=torch.int64)
    if generator is None:
        raise ValueError("generator is required unless no_rand=True: "
                         "ToMe never draws from the global random generator")
    # Drawn on the generator's device, as tomesd does, so a CPU generator gives
    # the same partition whatever device the model runs on. The copy to the
    # model's device does not block: a blocking one from the host waits until
    # the device has run everything queued before it, once per plan.
    draw = torch.randint(sy * sx, size=cells, device=generator.device, generator=generator)
    return draw.to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def cell_positions(w: int, h: int, sx: int, sy: int, device: torch.device) -> torch.Tensor:
    """``[cells, sy * sx]``: the grid position of each token of each whole ``sy x sx`` cell (cells row-major,
    tokens row-major in the cell). Made once per grid and device and kept: picking the destinations is then one
    gather instead of a scatter and three reshapes per plan."""
    hsy, wsx = h // sy, w // sx
    grid = torch.arange(h * w, device=device).view(h, w)[:hsy * sy, :wsx * sx]
    return grid.reshape(hsy, sy, wsx, sx).transpose(1, 2).reshape(hsy * wsx, sy * sx)


def partition_from_destinations(choice: torch.Tensor, w: int, h: int, sx: int, sy: int) -> Partition:
    """Token positions of the destinations ``choice`` picks (see ``draw_destinations``) and of the sources."""
    dst = cell_positions(w, h, sx, sy, choice.device).gather(1, choice)
    # Destinations are -1 and sources 0 (tokens of the cells the edges cut off too), so an argsort lists
    # destinations first. The same [1, N, 1] int64 tensor and (unstable) argsort as tomesd: the order of the
    # positions inside each half sets the merged token layout, which must match it bit for bit.
    marks = torch.zeros(w * h, 1, device=choice.device, dtype=torch.int64).scatter_(0, dst, -1)
    order = marks.view(1, -1, 1).argsort(dim=1)
    n_dst = dst.shape[0]
    return Partition(dst_pos=order[:, :n_dst], src_pos=order[:, n_dst:], order=order)


def draw_partition(w: int, h: int, sx: int, sy: int, device: torch.device,
                   no_rand: bool = False,
                   generator: torch.Generator | None = None) -> Partition | None:
    """Draw a partition; ``None`` where the grid has no destination or no source to merge."""
    if sx < 1 or sy < 1:
        raise ValueError(f"stride must be at least 1, got sx={sx}, sy={sy}")
    n_dst = (h // sy) * (w // sx)
    if n_dst == 0 or n_dst == w * h:
        return None
    choice = draw_destinations(w, h, sx, sy, device, no_rand=no_rand, generator=generator)
    return partition_from_destinations(choice, w, h, sx, sy)
