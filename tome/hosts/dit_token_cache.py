"""Token-wise caching at the block scope (Apply ToMe (Advanced)'s ``token_cache``): a token a reduced block does
not compute takes its own change from the last step it was computed, instead of its merged partner's change now.

At the block scope (``comfyui_dit_block``) ToMe merges each reduced block's image tokens and gives every token its
merged partner's change. With a ``TokenCaching`` on the node's settings, each reduced block computes ``1 - ratio``
of each frame's image tokens instead (as many as ToMe at ``ratio`` keeps), each alone (the rest absent as keys, as
pruned tokens are), and gives every other image token its own input plus its cached change, as ToCa
(arXiv 2410.05317) and RAS (arXiv 2502.10389) do on real checkpoints. Which tokens:

- those whose block input moved most since they were last computed (squared distance over the squared length
  of the cached input), each frame alike; a token whose change is ``max_age`` steps old ranks above every other;
- every token at the run's first ``full_steps`` steps and at every ``refresh_every``-th step (0: never again), and
  at a step with nothing cached for that block and batch.

The cache (each token's change and input in the tokens' dtype, and its step: per block and batch of conds,
``2 * tokens * width`` values and ``tokens`` step counts) lives in the sampling run's ``SamplingRun``, keyed by the
block, the tokens' shape and device and the batch of conds (cond and uncond apart, in one thread or two), and is
dropped when the run ends. Outside a sampling run there is nothing to cache across and the blocks run whole.

Under ``torch.compile`` the choice of tokens runs in the eager decision (``token_selection``); the block and the
spreading of its changes are traced, and only the write of the new changes into the run (``Selection.keep``) runs
outside the graph. No host read: the step comes from the one sigma read of the model call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comfyui import RUN_KEY, batch_of_conds, eager
from .dit_settings import DiTToMe

TOKEN_CACHE_KEY = "token cache"  # first part of a token cache's key in its run


@dataclass(frozen=True)
class TokenCache:
    """One block's cache for one batch of conds: each image token's change ``[B, N, C]``, its block input when it
    was last computed ``[B, N, C]``, and that step ``[B, N]``."""

    change: torch.Tensor
    input: torch.Tensor
    step: torch.Tensor


def most_moved(image: torch.Tensor, cache: TokenCache, step: int, frames: int, keep: int,
               max_age: int) -> torch.Tensor:
    """``[B, frames * keep]``: the indices of the image tokens ``image [B, N, C]`` to compute, ``keep`` in each of
    its ``frames`` (ascending within each): those whose input moved most since ``cache`` has them, a change
    ``max_age`` steps old first."""
    moved = (image - cache.input).float().square().sum(-1) / cache.input.float().square().sum(-1).clamp_min(1e-12)
    stale = (step - cache.step) >= max_age
    score = moved + stale * (1 + moved.amax(dim=1, keepdim=True))  # stale tokens rank above every fresh one
    batch, n = score.shape
    chosen = score.view(batch, frames, n // frames).topk(keep, dim=-1).indices.sort(dim=-1).values
    offsets = torch.arange(frames, device=image.device)[None, :, None] * (n // frames)
    return (chosen + offsets).flatten(1)


def rows_of(index: torch.Tensor, width: int) -> torch.Tensor:
    """``index [B, m]`` as the ``[B, m, width]`` index of ``gather`` and ``scatter`` along the tokens."""
    return index[..., None].expand(-1, -1, width)


@dataclass(frozen=True)
class Selection:
    """A reduction stage (as the block scope's ``Merging``): the image tokens at ``index [B, m]`` computed, every
    other one given its cached change (``cached``; ``None`` where every token is computed). ``expand`` spreads the
    computed tokens' new changes among the cached ones and keeps the result, with ``inputs`` and ``steps`` (the
    cache's inputs and steps with the computed tokens' now), under ``key`` in ``run``."""

    index: torch.Tensor
    cached: torch.Tensor | None
    inputs: torch.Tensor
    steps: torch.Tensor
    run: object  # the sampling run's ``SamplingRun``
    key: tuple

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, rows_of(self.index, x.shape[-1]))

    def position(self, x: torch.Tensor) -> torch.Tensor:
        """A computed token's position: its own."""
        return self.reduce(x)

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        """A per-frame ``x [B, t, ...]``: every frame keeps the same count of tokens."""
        return x

    def frame(self, k: int) -> int:
        return k

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The computed tokens' changes ``x [B, m, C]`` among every token's cached one: ``[B, N, C]``, kept."""
        change = x if self.cached is None else self.cached.scatter(1, rows_of(self.index, x.shape[-1]), x)
        self.keep(change)
        return change

    @eager  # the run's cache is Python state: written outside compiled graphs
    def keep(self, change: torch.Tensor) -> None:
        self.run.keep_cache(self.key, TokenCache(change, self.inputs, self.steps))


def token_selection(tome: DiTToMe, image: torch.Tensor, grid: tuple[int, int, int], block,
                    options) -> Selection | None:
    """How block ``block`` of this call computes its image tokens ``image [B, t*h*w, C]`` (on ``grid``) under
    ``tome.token_cache``; ``None`` outside a sampling run (nothing to cache across: the block runs whole)."""
    run = options.get(RUN_KEY)
    step = None if run is None else run.step(options)
    if step is None:
        return None
    caching = tome.token_cache
    key = (TOKEN_CACHE_KEY, block, tuple(image.shape), str(image.device), batch_of_conds(options))
    old = run.cache(key)
    batch, n, width = image.shape
    if old is None or caching.whole_at(step):
        index = torch.arange(n, device=image.device).expand(batch, -1)
        steps = torch.full((batch, n), step, dtype=torch.int32, device=image.device)
        return Selection(index, None, image, steps, run, key)
    t, h, w = grid
    index = most_moved(image, old, step, t, h * w - int(h * w * tome.ratio), caching.max_age)
    rows = rows_of(index, width)
    inputs = old.input.scatter(1, rows, image.gather(1, rows))
    return Selection(index, old.change, inputs, old.step.scatter(1, index, step), run, key)
