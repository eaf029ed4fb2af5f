"""ToDo's token downsampling alone, against a cell-by-cell reference written with plain loops."""

import math

import pytest
import torch

from tome.downsample import AVERAGE, MAX, METHODS, NEAREST, downsample_tokens, downsampled_grid

GRIDS = [(8, 8), (9, 7), (13, 5), (4, 1), (1, 6)]  # (w, h), several the factors do not divide


def reference(x: torch.Tensor, w: int, h: int, factor: int, method: str) -> torch.Tensor:
    """One output token per cell, the cells walked row by row; a partial cell uses the tokens it has."""
    grid = x.reshape(x.shape[0], h, w, x.shape[2])
    tokens = []
    for top in range(0, h, factor):
        for left in range(0, w, factor):
            cell = grid[:, top:top + factor, left:left + factor].flatten(1, 2)
            tokens.append({NEAREST: cell[:, 0], AVERAGE: cell.mean(1), MAX: cell.amax(1)}[method])
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize(("w", "h"), GRIDS)
def test_matches_the_cell_by_cell_reference(w, h, factor, method):
    x = torch.randn(3, w * h, 5, generator=torch.Generator().manual_seed(w * 100 + h))
    out = downsample_tokens(x, w, h, factor, method)
    out_w, out_h = downsampled_grid(w, h, factor)
    assert out.shape == (3, out_w * out_h, 5) == (3, math.ceil(w / factor) * math.ceil(h / factor), 5)
    torch.testing.assert_close(out, reference(x, w, h, factor, method), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_its_dtype(method, dtype):
    x = torch.randn(2, 9 * 7, 4, generator=torch.Generator().manual_seed(0))
    out = downsample_tokens(x.to(dtype), 9, 7, 2, method)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(x.to(dtype).float(), 9, 7, 2, method), rtol=1e-2, atol=1e-2)


def test_factor_one_returns_the_tokens_themselves():
    x = torch.randn(1, 12, 3)
    assert downsample_tokens(x, 4, 3, 1) is x


def test_1920x1080_image_grid():
    """The size reported to crash the A1111 extension: a 240x135 latent-resolution grid."""
    x = torch.randn(1, 240 * 135, 8)
    assert downsample_tokens(x, 240, 135, 2, AVERAGE).shape == (1, 120 * 68, 8)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "bilinear"}, "method must be one of nearest, average, max"),
    ({"factor": 0}, "factor must be at least 1"),
    ({"w": 5}, "12 tokens do not form a 3x5 grid"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = {"x": torch.randn(1, 12, 2), "w": 4, "h": 3, "factor": 2, "method": NEAREST, **kwargs}
    with pytest.raises(ValueError, match=message):
        downsample_tokens(**args)
