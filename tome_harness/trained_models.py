"""Small diffusion models of five real layouts, trained here on photographs, inside ComfyUI's own classes.

No real weights can be had here, so the quality bench measures what each
setting costs on these: SD1.5's and SDXL's U-Nets, SD3.5's MMDiT, Flux (double
and single stream, RoPE) and Wan 2.1 (3D RoPE, video), built from ComfyUI's
model configurations with small widths. Each keeps its family's block
structure, positional encoding, patching and sampling (EPS on the U-Nets,
rectified flow with the family's shift on the DiTs).

Two generations of judges (``GENERATIONS``):

- ``real footprint`` (``sd15-512``, ``sdxl-1024``, ``sd35-512``, ``flux-512``,
  ``wan21-512``): each sees a photograph at a real resolution of its family
  through the real token grid, a latent pixel standing for an 8x8 pixel patch
  as in the real VAEs (``tome_harness.patch_map``: the principal components of
  8x8x3 patches, 4 for the U-Nets, 16 for the DiTs), and the DiTs are deeper
  (8 to 9 blocks, Wan 6). Trained under bf16 autocast (the CPU's bf16 units).
- ``small`` (``sd15``, ``sdxl``, ``sd35``, ``flux``, ``wan21``): the first judges,
  kept so that every finding can be shown on both. A photograph of 32 to 64 px,
  space-to-depth by ``pixel_factor`` (1 for the 4-channel U-Nets, 2 for the
  16-channel DiTs: 12 channels) with zero channels up to the latent's: the
  token grid of an image of ``8 s`` pixels, each token covering 4 to 8 times
  the share of the picture it covers in the real model. 3 to 5 blocks; SDXL's
  deep stacks cut from 10 to 4.

Training goes through ``model.apply_model``, the host's own call, with the
conditioning the sampler builds (``encode_model_conds``). ComfyUI's classes are
written for inference and update tensors in place (``x += ...``), which
autograd refuses where the old value is needed; ``out_of_place_adds`` turns
those augmented assignments into new tensors while training. The prompt is a
fixed "empty prompt" (seeded random text tokens): the models are unconditional
denoisers of photographs. Needs ComfyUI on ``sys.path``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import dit_models, random_models
from .patch_map import PATCH, PatchMap

WEIGHTS = Path(__file__).resolve().parent / "weights"
CONTEXT_DIM = 32
CONTEXT_TOKENS = 4
PROMPT_SEED = 1234


@dataclass(frozen=True)
class Layout:
    """One trained model: its ComfyUI configuration, its latent geometry and its training recipe."""

    name: str
    config_class: str  # the class in comfy.supported_models
    config: dict
    latent_channels: int
    pixel_factor: int  # the side of the pixel patch a latent pixel stands for
    size: int  # the latent's side, trained and measured
    frames: int = 0  # latent frames of a video model (0: images)
    pooled: int = 0  # width of the pooled text vector the model takes (0: none)
    steps: int = 600
    batch: int = 8
    lr: float = 1e-3
    seed: int = 0
    patch_map: bool = False  # the latent is the patch map's components (pixel_factor 8), not space-to-depth
    bf16: bool = False  # trained under bf16 autocast (master weights in fp32); always measured in fp32
    clips: str = "window"  # a video model's clips, trained and held out: ``photos``' ``window`` or ``camera``
    # A U-Net's attention head width, where the layout sets its own: ComfyUI's SD1.5 and SDXL classes fix their
    # heads whatever the config says (SD1.5 8 heads, SDXL heads of 64: one head at a width of 64). 0: the class's.
    head_width: int = 0

    @property
    def pixels(self) -> int:
        """The side of the photographs this model sees."""
        return self.size * self.pixel_factor

    @property
    def footprint(self) -> str:
        """What the model sees, for every figure measured on it: the real resolution whose token grid it has,
        and the photograph's size."""
        grid = f"{self.size}x{self.size} latent ({8 * self.size} px grid"
        clip = f", {self.frames} frames" if self.frames else ""
        return f"{grid}{clip}), photographs of {self.pixels} px"

    @property
    def is_unet(self) -> bool:
        return self.config_class in ("SD15", "SDXL")

    def latent_shape(self, batch: int) -> tuple[int, ...]:
        if self.frames:
            return (batch, self.latent_channels, self.frames, self.size, self.size)
        return (batch, self.latent_channels, self.size, self.size)


def _unet(family: str, **changes) -> dict:
    return dict(random_models.UNET_CONFIGS[family], model_channels=32, context_dim=CONTEXT_DIM, **changes)


SMALL = (
    Layout("sd15", "SD15", _unet("sd15", channel_mult=[1, 2, 2, 2]), latent_channels=4,
           pixel_factor=1, size=32, steps=600, batch=4),
    Layout("sdxl", "SDXL", _unet("sdxl", channel_mult=[1, 2, 2],
                                 transformer_depth=[0, 0, 2, 2, 4, 4], transformer_depth_middle=4,
                                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 4, 4, 4]),
           latent_channels=4, pixel_factor=1, size=64, pooled=1280, steps=600, batch=4),
    Layout("sd35", "SD3", {  # SD3.5 medium's layout: joint blocks, the first two with the image-only attn2
        "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 3, "input_size": None,
        "adm_in_channels": CONTEXT_DIM, "pos_embed_max_size": 16, "num_patches": 16 * 16, "qk_norm": "rms",
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": CONTEXT_DIM, "out_features": 192}},
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": [0, 1],
    }, latent_channels=16, pixel_factor=2, size=32, pooled=CONTEXT_DIM, steps=1200, batch=12),
    Layout("flux", "Flux", {
        "image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": CONTEXT_DIM,
        "context_in_dim": CONTEXT_DIM, "hidden_size": 128, "mlp_ratio": 3.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 3, "axes_dim": [16, 24, 24], "theta": 10000, "qkv_bias": True,
        "guidance_embed": True,
    }, latent_channels=16, pixel_factor=2, size=32, pooled=CONTEXT_DIM, steps=1500, batch=12),
    Layout("wan21", "WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 128, "out_dim": 16, "num_heads": 2, "ffn_dim": 384,
        "num_layers": 4, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": CONTEXT_DIM,
    }, latent_channels=16, pixel_factor=2, size=32, frames=5, steps=400, batch=4),
)


def _real(layout: Layout, size: int, config: dict, **recipe) -> Layout:
    """``layout``'s family at the real footprint: a latent of ``size`` (``8 size`` px), each latent pixel an
    8x8 patch through the patch map."""
    return replace(layout, name=f"{layout.name}-{8 * size}", config=config, pixel_factor=PATCH,
                               size=size, patch_map=True, bf16=True, **recipe)


_small = {layout.name: layout for layout in SMALL}
REAL_FOOTPRINT = (
    # SD1.5 at 512 px: all sixteen transformer blocks of SD1.5 (one per level and res block), 4096 tokens at the
    # top level.
    _real(_small["sd15"], 64, _small["sd15"].config, steps=280, batch=4),
    # SDXL at 1024 px: levels 2 and 3 at 64x64 and 32x32, as SDXL's at 1024 px. Level 2 is 32 wide, so that
    # ComfyUI's 32-group GroupNorm normalises each channel over the tokens before its transformer blocks, as it
    # does at SD1.5's top level: at a width of 64 (two channels a group) a component common to every token took
    # over those blocks' input, and their self-attention gave every query the same output. Heads of 32 (SDXL's
    # class would fix 64, no head at that width).
    _real(_small["sdxl"], 128, dict(_small["sdxl"].config, channel_mult=[1, 1, 2]), steps=1300, batch=2,
          head_width=32),
    # SD3.5 medium's layout, 8 joint blocks (MMDiT's width is 64 per depth: depth 2 and num_blocks 8 keep it
    # at 128), the image-only attn2 in the first half as in SD3.5 medium (13 of 24).
    _real(_small["sd35"], 64, dict(
        _small["sd35"].config, depth=2, num_blocks=8, mlp_ratio=3.0, pos_embed_max_size=32, num_patches=32 * 32,
        x_block_self_attn_layers=[0, 1, 2, 3],
        context_embedder_config={"target": "torch.nn.Linear",
                                 "params": {"in_features": CONTEXT_DIM, "out_features": 128}}),
        steps=1400, batch=4, lr=5e-4),
    # Flux: 3 double-stream and 6 single-stream blocks (Flux: 19 and 38).
    _real(_small["flux"], 64, dict(_small["flux"].config, depth=3, depth_single_blocks=6), steps=1500, batch=4,
          lr=5e-4),
    # Wan 2.1: 6 blocks, 5 latent frames of 32x32 tokens (5120 tokens), on the clips people make (pans, zooms,
    # parallax).
    _real(_small["wan21"], 64, dict(_small["wan21"].config, num_layers=6), steps=1500, batch=2, lr=5e-4,
          clips="camera"),
)
GENERATIONS = {"real footprint": tuple(layout.name for layout in REAL_FOOTPRINT),
               "small": tuple(layout.name for layout in SMALL)}
LAYOUTS = {layout.name: layout for layout in SMALL + REAL_FOOTPRINT}


# The pixel map.

def patch_map_path(channels: int) -> Path:
    return WEIGHTS / f"patch_map_{channels}.safetensors"


@functools.cache
def patch_map(channels: int) -> PatchMap:
    """The committed patch map of ``channels`` components, checked against its recorded hash."""
    return PatchMap.load(checked(patch_map_path(channels)))


def to_latent(pixels: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Photographs ``[B, 3, H, W]`` (or clips ``[B, 3, T, H, W]``) in ``[0, 1]`` as the layout's latent, from
    ``[-1, 1]``: the patch map's components, or space-to-depth by ``pixel_factor`` with zero channels up to
    ``latent_channels``."""
    x = pixels * 2 - 1
    video = x.ndim == 5
    if video:  # frames into the batch
        b, c, t, h, w = x.shape
        x = x.transpose(1, 2).reshape(b * t, c, h, w)
    if layout.patch_map:
        x = patch_map(layout.latent_channels).encode(x)
    else:
        x = F.pixel_unshuffle(x, layout.pixel_factor)
        x = F.pad(x, (0, 0, 0, 0, 0, layout.latent_channels - x.shape[1]))
    if video:
        x = x.reshape(b, t, *x.shape[1:]).transpose(1, 2)
    return x


def to_pixels(latent: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The inverse of ``to_latent`` (the zero channels dropped; what the patch map's components hold), clamped
    to ``[0, 1]``."""
    video = latent.ndim == 5
    x = latent
    if video:
        b, c, t, h, w = x.shape
        x = x.transpose(1, 2).reshape(b * t, c, h, w)
    if layout.patch_map:
        x = patch_map(layout.latent_channels).decode(x)
    else:
        x = F.pixel_shuffle(x[:, :3 * layout.pixel_factor ** 2], layout.pixel_factor)
    if video:
        x = x.reshape(b, t, *x.shape[1:]).transpose(1, 2)
    return ((x + 1) / 2).clamp(0, 1)


# The models.

def empty_prompt(layout: Layout) -> list:
    """The fixed conditioning every model is trained and sampled with, as ComfyUI's ``CONDITIONING``."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    context = torch.randn(1, CONTEXT_TOKENS, CONTEXT_DIM, generator=generator)
    extra = {"pooled_output": torch.randn(1, layout.pooled, generator=generator)} if layout.pooled else {}
    return [[context, extra]]


def model_config(layout: Layout, dtype: torch.dtype = torch.float32):
    import comfy.supported_models

    config = dict(layout.config, dtype=dtype) if layout.is_unet else dict(layout.config)
    model_config = getattr(comfy.supported_models, layout.config_class)(config)
    if layout.head_width:
        model_config.unet_config.update(num_head_channels=layout.head_width, num_heads=-1)
    model_config.set_inference_dtype(dtype, None)
    return model_config


def untrained(layout: Layout):
    """A ComfyUI ``ModelPatcher`` of ``layout`` with the seeded initial weights training starts from."""
    import comfy.model_patcher

    model = model_config(layout).get_model({}, device="cpu")
    net = model.diffusion_model
    random_models.randomize(net, layout.seed)
    dit_models.fill_norm_scales(net)
    dit_models.fill_position_embedding(net, layout.seed)
    model.eval().requires_grad_(False)  # training turns it on
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def weights_path(layout: Layout) -> Path:
    return WEIGHTS / f"{layout.name}.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded_hashes() -> dict[str, str]:
    """``SHA256SUMS`` beside the weights: file name to hash."""
    lines = (WEIGHTS / "SHA256SUMS").read_text().splitlines()
    return {name.strip(): digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def committed(names) -> list[str]:
    """Those of the layouts ``names`` whose weights are committed (recorded in ``SHA256SUMS``): a recipe can
    stand here before ``bench/train_models.py`` has trained it."""
    hashes = recorded_hashes()
    return [name for name in names if weights_path(LAYOUTS[name]).name in hashes]


def checked(path: Path) -> Path:
    """``path``, after checking the file against its hash in ``SHA256SUMS``."""
    if recorded_hashes().get(path.name) != sha256(path):
        raise RuntimeError(f"{path} does not match its hash in SHA256SUMS: rerun bench/train_models.py")
    return path


def trained(layout: Layout):
    """A ComfyUI ``ModelPatcher`` of ``layout`` with its committed weights, loaded the way ``UNETLoader`` loads
    a diffusion model's state dict (``get_model`` then ``load_model_weights``, in float32 on the CPU), after
    checking the file against its recorded hash."""
    import comfy.model_patcher
    import comfy.utils

    path = checked(weights_path(layout))
    state_dict = {k: v.float() for k, v in comfy.utils.load_torch_file(str(path)).items()}
    model = model_config(layout).get_model(state_dict, "", device="cpu")
    model.load_model_weights(state_dict, "")
    model.eval().requires_grad_(False)
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def model_kwargs(model, layout: Layout, noise: torch.Tensor) -> dict:
    """What the sampler passes to ``model.apply_model`` for the empty prompt and a batch like ``noise``."""
    import comfy.sampler_helpers
    import comfy.samplers

    conds = comfy.samplers.encode_model_conds(model.extra_conds, comfy.sampler_helpers.convert_cond(
        empty_prompt(layout)), noise, noise.device, "positive")
    return {name: cond.process_cond(batch_size=noise.shape[0], device=noise.device).cond
            for name, cond in conds[0]["model_conds"].items()}


class OutOfPlaceAdds(TorchFunctionMode):
    """In-place ``add_``, ``sub_`` and ``mul_`` as new tensors: ComfyUI's inference code writes ``x += y`` on
    tensors autograd still needs. Python's ``x += y`` calls ``add_`` and rebinds ``x`` to its result, so the
    math is kept; ``x[a:b] += y`` writes the new value back through ``__setitem__``, which autograd allows.
    An explicit ``x.add_(y)`` whose result is dropped would be lost: the tests check that a forward under this
    mode equals a plain one, bit for bit, for every layout."""

    REPLACEMENTS = {torch.Tensor.add_: torch.Tensor.add, torch.Tensor.sub_: torch.Tensor.sub,
                    torch.Tensor.mul_: torch.Tensor.mul}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


def sigmas_at(model, percents) -> torch.Tensor:
    """The model's own sigmas at these shares of its schedule (0: pure noise, 1: clean)."""
    sampling = model.model_sampling
    return torch.tensor([sampling.percent_to_sigma(float(p)) for p in percents])


def noised(model, x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x0`` noised to ``sigma`` (per element) by the model's own noising."""
    return model.model_sampling.noise_scaling(sigma.view(-1, *[1] * (x0.ndim - 1)), noise, x0)


def denoise(model, layout: Layout, x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x0`` noised to ``sigma`` (per element), then the model's x0 prediction."""
    return model.apply_model(noised(model, x0, sigma, noise), sigma, **model_kwargs(model, layout, noise))


def loss(model, layout: Layout, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The family's own objective: ``|x0_pred - x0|^2 / sigma^2`` is the noise error of an EPS model and the
    velocity error of a rectified-flow one; sigmas drawn uniformly over the model's schedule."""
    percents = torch.rand(x0.shape[0], generator=generator) * 0.998 + 0.001
    sigma = sigmas_at(model, percents)
    noise = torch.randn(x0.shape, generator=generator)
    with OutOfPlaceAdds():
        predicted = denoise(model, layout, x0, sigma, noise)
    error = (predicted - x0).square().flatten(1).mean(1)
    return (error / sigma.square()).mean()


EVAL_PERCENTS = (0.25, 0.5, 0.75)  # three noise levels: high, middle, low


@torch.no_grad()
def held_out_error(model, layout: Layout, x0: torch.Tensor, seed: int = 0) -> dict[float, dict[str, float]]:
    """Per noise level (a share of the schedule): the mean squared x0 error of the model and of the noisy input
    itself, over the held-out latents ``x0``, with fixed noise."""
    out = {}
    for percent in EVAL_PERCENTS:
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(x0.shape, generator=generator)
        sigma = sigmas_at(model, [percent] * x0.shape[0])
        noisy = noised(model, x0, sigma, noise)
        predicted = model.apply_model(noisy, sigma, **model_kwargs(model, layout, noise))
        out[percent] = {"model": float((predicted - x0).square().mean()),
                        "noisy input": float((noisy - x0).square().mean()), "sigma": float(sigma[0])}
    return out


def held_out_pixels(layout: Layout) -> torch.Tensor:
    """The held-out photographs as ``layout`` sees them: ``[N, 3, H, W]``, or clips ``[N, 3, T, H, W]``."""
    from . import photos

    if layout.frames:
        held_out = photos.held_out_camera_clips if layout.clips == "camera" else photos.held_out_clips
        return held_out(layout.pixels, layout.frames)
    return photos.held_out_images(layout.pixels)


def held_out_latents(layout: Layout) -> torch.Tensor:
    return to_latent(held_out_pixels(layout), layout)


def training_batch(sampler, layout: Layout) -> torch.Tensor:
    if layout.frames:
        clips = sampler.camera_clips if layout.clips == "camera" else sampler.clips
        return to_latent(clips(layout.batch, layout.frames), layout)
    return to_latent(sampler.batch(layout.batch), layout)


def lr_at(layout: Layout, step: int) -> float:
    """A short warm-up, then cosine decay to a tenth."""
    warmup = max(layout.steps // 20, 1)
    if step < warmup:
        return layout.lr * (step + 1) / warmup
    progress = (step - warmup) / max(layout.steps - warmup, 1)
    return layout.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
