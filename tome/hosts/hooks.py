"""``apply_patch`` / ``remove_patch``: ToMe on a diffusers pipeline or U-Net, or an LDM model, as tomesd does.

Same call and same results as tomesd 0.1.3's functions of these names, with
what the ComfyUI node brings:

- its own generator: ``seed`` seeds it; without a seed it starts from a copy of
  the global RNG state (tomesd's choice, so results match), and the global RNG
  is never advanced either way;
- grids a stride does not fit (tiny images, 1-wide levels) merge nothing
  instead of crashing;
- ``max_downsample="auto"``: the highest-resolution level with transformer
  blocks, so SDXL (none at full resolution) gets merged at downsample 2;
- bad arguments raise ``ValueError`` naming the argument before anything is
  patched.

The blocks keep their classes: forward hooks around each
``BasicTransformerBlock`` and its ``attn1``, ``attn2`` and ``ff`` build one
merge plan per block call (from the block's input, as tomesd) and merge the
input of each chosen module, unmerging its output. ``remove_patch`` takes the
hooks off, leaving the model exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..grid import block_grid
from ..levels import is_a, transformer_downsamples
from ..merge import IDENTITY, build_plan

DOWNSAMPLES = (1, 2, 4, 8)


@dataclass
class _ToMeState:
    """Shared by every patched block of one U-Net, as tomesd's ``_tome_info``."""

    ratio: float
    max_downsample: int
    sx: int
    sy: int
    use_rand: bool
    modules: tuple[str, ...]
    seed: int | None
    latent_size: tuple[int, int] | None = None
    generator: torch.Generator | None = None
    hooks: list = field(default_factory=list)

    def generator_for(self, device: torch.device) -> torch.Generator:
        """This U-Net's generator on ``device``, made on first use (and again after a device change)."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            if self.seed is not None:
                self.generator.manual_seed(self.seed)
            elif device.type == "cuda":
                self.generator.set_state(torch.cuda.get_rng_state(device))
            elif device.type == "cpu":
                self.generator.set_state(torch.get_rng_state())
            else:  # no global state to copy on this device: a fixed function of the process's seed
                self.generator.manual_seed(torch.initial_seed())
        return self.generator


def _diffusion_model(model: nn.Module) -> nn.Module:
    """The U-Net of a diffusers pipeline (``.unet``), of an LDM wrapper (``.model.diffusion_model``), or itself."""
    if hasattr(model, "unet"):
        return model.unet
    inner = getattr(model, "model", None)
    return getattr(inner, "diffusion_model", model)


def _transformer_blocks(unet: nn.Module) -> list[nn.Module]:
    return [m for m in unet.modules() if is_a(m, "BasicTransformerBlock")]


def _validate(unet, ratio, max_downsample, sx, sy, blocks) -> int:
    """Check every argument; the ``max_downsample`` to use. Raises ``ValueError`` naming the argument."""
    if not blocks:
        raise ValueError(f"model: no BasicTransformerBlock found in {type(unet).__name__}; "
                         "expected a diffusers pipeline or U-Net, or an LDM/SGM Stable Diffusion model")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), not {ratio}")
    for name, stride in (("sx", sx), ("sy", sy)):
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"{name} must be an integer of at least 1, not {stride!r}")
    if max_downsample == "auto":
        levels = transformer_downsamples(unet)
        if not levels:
            raise ValueError(f"max_downsample='auto' cannot find the U-Net levels of {type(unet).__name__}; "
                             f"pass one of {DOWNSAMPLES}")
        return levels[0]
    if max_downsample not in DOWNSAMPLES:
        raise ValueError(f"max_downsample must be 'auto' or one of {DOWNSAMPLES}, not {max_downsample!r}")
    return max_downsample


def _record_latent_size(state: _ToMeState):
    def hook(module, args, kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("x"))
        state.latent_size = tuple(sample.shape[-2:])
    return hook


def _plan_block(state: _ToMeState):
    """Before a block: its plan, from its input tokens ``x [B, N, C]``, as tomesd's ``compute_merge``."""
    def hook(block, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        block._tome_plan = IDENTITY
        if state.latent_size is None:
            return
        n_tokens = x.shape[1]
        grid = block_grid(n_tokens, state.latent_size, state.max_downsample)
        if grid is None:
            return
        w, h = grid
        # tomesd: an odd batch cannot hold a prompt and its negative together, and a partition drawn
        # for each separately leaves artifacts, so the draw is switched off there.
        use_rand = state.use_rand and x.shape[0] % 2 == 0
        generator = state.generator_for(x.device)  # made here even when unused, at the moment tomesd makes it
        block._tome_plan = build_plan(x, w, h, state.sx, state.sy, int(n_tokens * state.ratio),
                                      no_rand=not use_rand, generator=generator if use_rand else None)
    return hook


def _forget_plan(block, args, kwargs, output):
    block._tome_plan = IDENTITY


def _merge_input(block: nn.Module):
    def hook(module, args, kwargs):
        plan = block._tome_plan
        if plan is IDENTITY or not args or args[0].shape[1] != plan.n_tokens:
            return None  # a chunked feed-forward sees slices: leave them whole
        return (plan.merge(args[0]), *args[1:]), kwargs
    return hook


def _unmerge_output(block: nn.Module):
    def hook(module, args, kwargs, output):
        plan = block._tome_plan
        if plan is IDENTITY or output.shape[1] != plan.n_tokens - plan.removed:
            return None
        return plan.unmerge(output)
    return hook


def apply_patch(model: nn.Module, ratio: float = 0.5, max_downsample: int | str = 1, sx: int = 2, sy: int = 2,
                use_rand: bool = True, merge_attn: bool = True, merge_crossattn: bool = False,
                merge_mlp: bool = False, seed: int | None = None) -> nn.Module:
    """Patch ``model`` in place with ToMe and return it (tomesd's ``apply_patch``, plus ``seed`` and ``auto``).

    ``model``: a diffusers pipeline, a diffusers U-Net, or an LDM/SGM model
    (``.model.diffusion_model``) or U-Net. ``ratio`` in [0, 1): ``int(N * ratio)``
    tokens are merged, at most every source (``1 - 1/(sx*sy)`` of them where
    the stride divides the grid). ``merge_attn``, ``merge_crossattn`` and
    ``merge_mlp`` choose the modules whose tokens are merged: self-attention,
    the queries of cross-attention, the feed-forward. Applying again
    re-configures.
    """
    unet = _diffusion_model(model)
    blocks = _transformer_blocks(unet)
    max_downsample = _validate(unet, ratio, max_downsample, sx, sy, blocks)
    remove_patch(model)

    modules = tuple(name for name, on in (("attn1", merge_attn), ("attn2", merge_crossattn), ("ff", merge_mlp))
                    if on)
    state = _ToMeState(ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy,
                       use_rand=use_rand, modules=modules, seed=seed)
    unet._tome_state = state
    state.hooks.append(unet.register_forward_pre_hook(_record_latent_size(state), with_kwargs=True))
    for block in blocks:
        block._tome_plan = IDENTITY
        state.hooks.append(block.register_forward_pre_hook(_plan_block(state), with_kwargs=True))
        state.hooks.append(block.register_forward_hook(_forget_plan, with_kwargs=True))
        for name in modules:
            module = getattr(block, name, None)
            if module is None:  # diffusers: a block without cross-attention has attn2 = None
                continue
            state.hooks.append(module.register_forward_pre_hook(_merge_input(block), with_kwargs=True))
            state.hooks.append(module.register_forward_hook(_unmerge_output(block), with_kwargs=True))
    return model


def remove_patch(model: nn.Module) -> nn.Module:
    """Undo ``apply_patch`` (and nothing else); a model that is not patched is returned as it is."""
    unet = _diffusion_model(model)
    state = getattr(unet, "_tome_state", None)
    if state is None:
        return model
    for hook in state.hooks:
        hook.remove()
    for block in _transformer_blocks(unet):
        if hasattr(block, "_tome_plan"):
            del block._tome_plan
    del unet._tome_state
    return model
