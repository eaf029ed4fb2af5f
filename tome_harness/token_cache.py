"""Token-wise caching at the block scope (issue 44): measured by the quality bench, offered by no node yet.

At the block scope (``tome.hosts.comfyui_dit_block``) a reduced block computes fewer image tokens, and every
token it does not compute takes the change its merged partner went through at this step. Here a token not
computed takes **its own** change from the last step it was computed instead: a step cache per token, as ToCa
(arXiv 2410.05317) and RAS (arXiv 2502.10389) do on real checkpoints.

``with_token_cache`` gives a model patched with Apply ToMe at the block scope a scope whose reduced blocks
select which image tokens they compute (``1 - ratio`` of each frame's, ToMe's ratio) instead of merging:

- the tokens whose block input moved most since they were last computed (relative squared distance), each
  frame alike; a token whose change is ``max_age`` steps old is computed whatever its score;
- every token at the run's first ``full_steps`` steps, and at every ``refresh_every``-th step (0: never again);
- text and every other token whole, as at the block scope.

With ``combine`` a token not computed takes its cached change plus how much the change of its most similar
computed token (cosine of their block inputs, as ToMe matches) moved since that token's was cached: the
temporal guess and the spatial one together.

A block computes the selected tokens alone (the rest are absent as keys, as pruned tokens are) and every image
token gets its input plus its cached change, the computed ones their change just made. The cache (each token's
change, its input when computed, and the step) is kept per sampling run, block and batch of conds, in the run's
``SamplingRun`` (``tome.hosts.comfyui``), and goes with it. Seeds and matchings are not used.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from dataclasses import dataclass

import torch

from tome_harness.block_reuse import with_scope_subclass

# The caches of each sampling run, dropped with it: (block, image shape, device, batch of conds) -> TokenCache.
_RUN_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class TokenCache:
    """One block's cache for one batch of conds: each image token's change ``[B, N, C]``, its block input when
    it was computed, and that step ``[B, N]``."""

    change: torch.Tensor
    input: torch.Tensor
    step: torch.Tensor


def most_moved(image: torch.Tensor, cache: TokenCache, step: int, frames: int, keep: int,
               max_age: int) -> torch.Tensor:
    """``[B, frames * keep]``: the indices of the image tokens ``image [B, N, C]`` to compute, ``keep`` in each of
    its ``frames`` (ascending within each): those whose input moved most since ``cache`` has them, a change
    ``max_age`` steps old first."""
    moved = (image - cache.input).square().sum(-1) / cache.input.square().sum(-1).clamp_min(1e-12)
    stale = (step - cache.step) >= max_age
    score = moved + stale * (1 + moved.amax(dim=1, keepdim=True))  # stale tokens rank above every fresh one
    batch, n = score.shape
    per_frame = score.view(batch, frames, n // frames)
    chosen = per_frame.topk(keep, dim=-1).indices.sort(dim=-1).values
    offsets = torch.arange(frames, device=image.device)[None, :, None] * (n // frames)
    return (chosen + offsets).flatten(1)


def not_chosen(index: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n - m]``: the token indices below ``n`` that ``index [B, m]`` does not hold, ascending."""
    chosen = torch.zeros(index.shape[0], n, dtype=torch.int8, device=index.device).scatter(1, index, 1)
    return chosen.argsort(dim=1, stable=True)[:, :n - index.shape[1]]  # the unchosen (0) first, in order


def nearest_chosen(image: torch.Tensor, index: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """``[B, n - m]``: for each token at ``others``, the position in ``index`` of the chosen token whose input is
    most like its own (cosine), as ToMe pairs a source with its destination."""
    def unit(at):
        rows = image.gather(1, at[..., None].expand(-1, -1, image.shape[-1]))
        return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    return (unit(others) @ unit(index).transpose(1, 2)).argmax(dim=-1)


@dataclass(frozen=True)
class Selection:
    """A reduction stage (as the block scope's ``Merging``): the image tokens at ``index [B, m]`` computed, every
    other one given its cached change (``partner``: plus the move of its nearest computed token's change since
    cached, the tokens at ``others``); ``expand`` writes the new changes, inputs and step into ``slot``."""

    index: torch.Tensor
    image: torch.Tensor  # the block's image input, full
    step: int
    slot: dict  # the run's caches
    key: tuple  # this block and batch's entry in ``slot``
    others: torch.Tensor | None = None  # ``[B, n - m]``: the tokens not computed (``combine``)
    partner: torch.Tensor | None = None  # ``[B, n - m]``: each one's nearest computed token, a position in ``index``

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.index[..., None].expand(-1, -1, x.shape[-1])
        return x.gather(1, rows)

    def position(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(x)

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        return x  # every frame keeps the same count

    def frame(self, k: int) -> int:
        return k

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The computed tokens' changes ``x [B, m, C]`` among every token's cached one: ``[B, N, C]``."""
        old = self.slot.get(self.key)
        rows = self.index[..., None].expand(-1, -1, x.shape[-1])
        base = torch.zeros_like(self.image) if old is None else old.change
        change = base.scatter(1, rows, x)
        if self.partner is not None and old is not None:
            moved = x - old.change.gather(1, rows)  # each computed token's change against its cached one
            at = self.others[..., None].expand(-1, -1, x.shape[-1])
            guess = old.change.gather(1, at) + moved.gather(1, self.partner[..., None].expand(-1, -1, x.shape[-1]))
            change = change.scatter(1, at, guess)
        inputs = (self.image if old is None else old.input).scatter(1, rows, self.image.gather(1, rows))
        steps = (torch.zeros(self.index.shape[0], self.image.shape[1], dtype=torch.long, device=x.device)
                 if old is None else old.step).scatter(1, self.index, self.step)
        self.slot[self.key] = TokenCache(change, inputs, steps)
        return change


@functools.cache
def caching_scope_class(base: type) -> type:
    """``base`` (the pack's ``BlockScope``, as ComfyUI loaded it) selecting tokens to compute, with a cache."""
    block = sys.modules[base.__module__]
    host = sys.modules[block.model_call.__module__]

    @dataclasses.dataclass(frozen=True)
    class CachingBlockScope(base):
        full_steps: int = 2
        refresh_every: int = 0
        max_age: int = 4
        combine: bool = False

        def reduction(self, image, layout, key, options):
            tome = self.tome
            if tome is None or key not in tome.blocks or not tome.window.in_window(options):
                return None
            run = options.get(host.RUN_KEY)
            step = None if run is None else run.step(options)
            if step is None:  # outside a sampling run: nothing to cache across
                return None
            t, h, w = layout.grid
            slot = _RUN_CACHES.setdefault(run, {})
            cache_key = (key, tuple(image.shape), str(image.device), host.batch_of_conds(options))
            cache = slot.get(cache_key)
            whole = cache is None or step < self.full_steps or (self.refresh_every and step % self.refresh_every == 0)
            others = partner = None
            if whole:
                index = torch.arange(image.shape[1], device=image.device).expand(image.shape[0], -1)
            else:
                keep = h * w - int(h * w * tome.ratio)
                index = most_moved(image, cache, step, t, keep, self.max_age)
                if self.combine:
                    others = not_chosen(index, image.shape[1])
                    partner = nearest_chosen(image, index, others)
            selection = Selection(index, image, step, slot, cache_key, others, partner)
            return block.Reduction([selection], None), selection.reduce(image)

    return CachingBlockScope


def with_token_cache(model, full_steps: int = 2, refresh_every: int = 0, max_age: int = 4, combine: bool = False):
    """A clone of ``model`` (Apply ToMe at the block scope) whose reduced blocks compute ``1 - ratio`` of the
    image tokens and give the rest their own cached change (``combine``: plus their nearest computed token's
    move since). A model whose Apply ToMe reduces no block is returned as it is."""
    if full_steps < 1 or refresh_every < 0 or max_age < 1:
        raise ValueError(f"full_steps and max_age must be 1 or more and refresh_every 0 or more, not {full_steps}, "
                         f"{max_age} and {refresh_every}")
    return with_scope_subclass(model, caching_scope_class, full_steps=full_steps, refresh_every=refresh_every,
                               max_age=max_age, combine=combine)
