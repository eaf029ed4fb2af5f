"""Averaging keys without shortening them.

A DiT's attention gets its queries and keys after the model's qk-norm and, on most families, after RoPE: vectors
of about one length per head, pointing every way. The mean of such vectors is shorter than they are (two at an
angle ``a``: ``cos(a / 2)`` of their length). A key averaged from several tokens (ToMe's merge, ToDo's average
pooling) then draws less attention than any of the tokens it stands for: a bias of one sign at every
reduction, which a sampling run adds up step after step. Measured on the models trained here (docs/QUALITY.md):
with plain averaging, pruning the same tokens came nearer the unpatched output over a run than merging them.
``keeping_norms`` keeps each averaged token's direction and gives it, head by head, the mean length of the
vectors averaged into it. Merged queries keep the plain mean: a shorter query attends more evenly, nearer the
mean of its tokens' outputs, which it hands back to each of them (rescaled queries moved the trained models'
prediction more)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def keeping_norms(average: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """``average(x)``, each head of each averaged token scaled to the mean length of that head's vectors in the
    tokens averaged into it.

    ``average`` maps ``[B, N, ...] -> [B, M, ...]`` by taking means of groups of tokens (any trailing shape: it
    averages ``[B, N, heads, D]`` and the ``[B, N, heads]`` lengths); ``x [B, N, heads * D]`` or
    ``[B, N, heads, D]``, returned in the same form.
    Tokens averaged alone keep their length up to rounding. Lengths are taken in at least float32: squares of
    half-precision vectors overflow.
    """
    per_head = x.unflatten(-1, (heads, -1)) if x.dim() == 3 else x
    precision = torch.float64 if x.dtype == torch.float64 else torch.float32
    lengths = torch.linalg.vector_norm(per_head, dim=-1, dtype=precision)
    averaged = average(per_head)
    shortened = torch.linalg.vector_norm(averaged, dim=-1, dtype=precision)
    scale = average(lengths) / shortened.clamp_min(torch.finfo(precision).tiny)
    kept = averaged * scale.unsqueeze(-1).to(averaged.dtype)
    return kept if x.dim() != 3 else kept.flatten(-2)
