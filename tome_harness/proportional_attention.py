"""The merged tokens' share of attention at the block scope (issue 44): ToMe's proportional attention, measured
by the quality bench, offered by no node.

When a reduced block's image tokens are merged, half as many image keys compete with the text keys in each
joint softmax, so the text takes more of every query's attention than in the full model. ToMe (Bolya et al.,
ICLR 2023, its equation 1) weighs a merged key by the tokens it stands for: ``log(size)`` added to its logits,
so that a key of ``s`` identical tokens draws what the ``s`` of them would together.

``with_proportional_attention`` gives a model patched with Apply ToMe at the block scope a scope that notes, at
each reduced block call, the size of every merged image token (how many of the block's image tokens it
averages) and an ``optimized_attention_override`` that adds their logarithms to the image keys' logits of each
self-attention inside that block: Flux's and SD3's joint ones (text keys get 0), SD3.5's image-only one and
Wan's. Cross-attention (as many keys as context tokens) and calls with a mask of their own are left as they are.

The sizes live in the model call's options while the block runs: the block scope sets the call's layout to
``None`` for merged tokens and puts it back after, so a block run whole never takes them. ToMe alone: a block
also pooled by ToDo is left unweighted.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tome_harness.block_reuse import with_scope_subclass
from tome_harness.comfyui import pack_module

SIZES_KEY = "tome_harness_merged_sizes"  # in a model call's options, while a merged block runs: MergedSizes


@dataclass(frozen=True)
class MergedSizes:
    """The merged image tokens of one block call: ``log_sizes [B, m]`` (the log of how many image tokens each
    stands for) and, for each length of a self-attention sequence holding them, where they start."""

    log_sizes: torch.Tensor
    starts: dict[int, int]

    def bias(self, length: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The logits' bias of a self-attention over ``length`` keys, ``[B, 1, 1, length]``: each merged image
        key's log size, 0 elsewhere; ``None`` for a sequence without the merged image."""
        start = self.starts.get(length)
        if start is None:
            return None
        batch, m = self.log_sizes.shape
        bias = self.log_sizes.new_zeros(batch, length)
        bias[:, start:start + m] = self.log_sizes
        return bias[:, None, None, :].to(dtype)


@dataclass(frozen=True)
class ProportionalAttention:
    """The override adding ``MergedSizes.bias`` to the self-attentions of a merged block; ``inner``: the override
    that was on the model (called instead of ``func``); ``layout_key``: where the block scope keeps the call's
    layout (``None`` while a merged block runs)."""

    layout_key: str
    inner: Callable | None = None

    def __call__(self, func, *args, **kwargs):
        attention = func if self.inner is None else functools.partial(self.inner, func)
        options = kwargs.get("transformer_options") or {}
        sizes = options.get(SIZES_KEY)
        has_mask = len(args) > 4 or kwargs.get("mask") is not None  # func(q, k, v, heads, mask, ...)
        if sizes is None or options.get(self.layout_key) is not None \
                or has_mask or len(args) < 3:  # heads by keyword: SD3's and Wan's calls
            return attention(*args, **kwargs)
        q, k = args[:2]
        heads_major = bool(kwargs.get("skip_reshape", False))  # [B, H, L, D], else [B, L, ...]
        queries, keys = (t.shape[2] if heads_major else t.shape[1] for t in (q, k))
        bias = sizes.bias(keys, q.dtype) if queries == keys else None
        if bias is None:
            return attention(*args, **kwargs)
        return attention(*args, **(kwargs | {"mask": bias}))


@functools.cache
def proportional_scope_class(base: type) -> type:
    """``base`` (the pack's ``BlockScope``, as ComfyUI loaded it) noting each merged block call's sizes."""
    block = sys.modules[base.__module__]

    @dataclasses.dataclass(frozen=True)
    class ProportionalBlockScope(base):
        def reduction(self, image, layout, key, options):
            reduced = super().reduction(image, layout, key, options)
            options.pop(SIZES_KEY, None)
            if reduced is None or [type(s) for s in reduced[0].stages] != [block.Merging]:
                return reduced
            (merging,), tokens = reduced[0].stages, reduced[1]
            sizes = merging.plan.merge(image.new_ones(image.shape[:2] + (1,), dtype=torch.float32), "sum")
            n, m = layout.n_tokens, tokens.shape[1]
            options[SIZES_KEY] = MergedSizes(sizes[..., 0].log(),
                                             {length - n + m: at for length, at in layout.starts.items()})
            return reduced

    return ProportionalBlockScope


def with_proportional_attention(model):
    """A clone of ``model`` (Apply ToMe at the block scope) whose merged blocks weigh each merged image key by the
    tokens it stands for. A model whose Apply ToMe reduces no block is returned as it is."""
    patched = with_scope_subclass(model, proportional_scope_class)
    if patched is model:
        return model
    options = patched.model_options.setdefault("transformer_options", {})
    settings = pack_module("tome.hosts.dit_settings")
    options[settings.OVERRIDE_KEY] = ProportionalAttention(settings.LAYOUT_KEY, options.get(settings.OVERRIDE_KEY))
    return patched
