"""Token downsampling (ToDo; Smith, Saxena, Saha 2024, arXiv 2402.13573): shrink a token grid by pooling.

ToDo keeps the queries of self-attention at full resolution and pools only its
keys and values over ``factor x factor`` cells of the token grid: no
similarity matrix, no sort, nothing to undo afterwards.

Grids the factor does not divide keep their last, partial cells (as pooling
with ``ceil_mode`` does), so every token is covered and a 1920x1080 image works:
the output grid is ``ceil(h / factor) x ceil(w / factor)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NEAREST, AVERAGE, MAX = "nearest", "average", "max"
METHODS = (NEAREST, AVERAGE, MAX)


def downsampled_grid(w: int, h: int, factor: int) -> tuple[int, int]:
    """``(w, h)`` of the grid after downsampling by ``factor``: partial cells count as whole ones."""
    return math.ceil(w / factor), math.ceil(h / factor)


def downsample_tokens(x: torch.Tensor, w: int, h: int, factor: int, method: str = NEAREST) -> torch.Tensor:
    """Tokens ``x [B, h*w, C]`` (row-major over an ``h x w`` grid) pooled over ``factor x factor`` cells.

    ``nearest`` keeps the top-left token of each cell; ``average`` and ``max``
    pool the cell (a partial cell over the tokens it has). Returns
    ``[B, ceil(h/factor) * ceil(w/factor), C]``; ``factor`` 1 returns ``x``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if factor < 1:
        raise ValueError(f"factor must be at least 1, not {factor}")
    batch, n_tokens, channels = x.shape
    if n_tokens != w * h:
        raise ValueError(f"{n_tokens} tokens do not form a {h}x{w} grid")
    if factor == 1:
        return x
    if method == NEAREST:  # the cells' first tokens, taken in the tokens' own layout: one copy
        return x.unflatten(1, (h, w))[:, ::factor, ::factor].flatten(1, 2)
    grid = x.transpose(1, 2).reshape(batch, channels, h, w)
    if method == AVERAGE:
        pooled = F.avg_pool2d(grid, factor, factor, ceil_mode=True)
    else:
        pooled = F.max_pool2d(grid, factor, factor, ceil_mode=True)
    return pooled.flatten(2).transpose(1, 2)
