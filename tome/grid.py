"""Where a transformer block sits in the U-Net, read from tensor shapes alone.

Everything here is plain arithmetic on shapes and numbers, so it is shared by
every host (ComfyUI patches, model patches) and tested without one.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence


def ratio_cap(sx: int, sy: int) -> float:
    """The largest useful ratio for a stride: every token but one per cell is a source."""
    return 1.0 - 1.0 / (sx * sy)


def block_downsample(n_tokens: int, original_h: int, original_w: int) -> int:
    """The downsample factor of a block with ``n_tokens`` tokens over an ``original_h x original_w`` latent.

    tomesd's rule: it rounds up, so odd latent sizes (whose levels are
    ``ceil(h / 2)`` tall) still land on the right power of two.
    """
    return int(math.ceil(math.sqrt(original_h * original_w // n_tokens)))


def token_grid(n_tokens: int, original_shape: Sequence[int],
               activations_shape: Sequence[int] | None = None) -> tuple[int, int]:
    """``(w, h)`` of a block's token grid.

    ``activations_shape [B, C, h, w]`` is the block's own feature map where the
    host provides it; otherwise the grid is derived from the latent
    ``original_shape [B, C, H, W]`` as tomesd does.
    """
    if activations_shape is not None:
        h, w = activations_shape[-2:]
        if h * w == n_tokens:
            return int(w), int(h)
    original_h, original_w = original_shape[-2:]
    downsample = block_downsample(n_tokens, original_h, original_w)
    return math.ceil(original_w / downsample), math.ceil(original_h / downsample)


def block_grid(n_tokens: int, original_shape: Sequence[int], max_downsample: int,
               activations_shape: Sequence[int] | None = None) -> tuple[int, int] | None:
    """The one rule of every host for whether a block call is reduced, and on which grid.

    ``(w, h)`` of the block's token grid when its downsample factor is at most
    ``max_downsample`` and the grid really holds its ``n_tokens`` tokens;
    ``None`` otherwise: deeper blocks, and token counts no level of the latent
    ``original_shape [B, C, H, W]`` tiles (a block fed other tokens), are left
    alone rather than merged on a wrong grid.
    """
    original_h, original_w = original_shape[-2:]
    downsample = block_downsample(n_tokens, original_h, original_w)
    if not 1 <= downsample <= max_downsample:
        return None
    w, h = token_grid(n_tokens, original_shape, activations_shape)
    return (w, h) if w * h == n_tokens else None


def derive_seed(seed: int, sigma: float, block: Sequence, block_index: int) -> int:
    """A 64-bit seed for one block call, from the user's seed and the call's identity.

    The same seed, sigma and block always give the same draw (in any process:
    Python's own ``hash`` is salted per process, so it is not used), every
    step and block gets a fresh one, and cond and uncond run as separate
    batches still share it.
    """
    identity = f"{seed}|{'|'.join(map(str, block))}|{block_index}".encode()
    digest = hashlib.blake2b(identity + struct.pack("<d", float(sigma)), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
