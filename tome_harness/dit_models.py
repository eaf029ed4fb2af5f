"""Tiny random-weight DiTs of the families the DiT adapter serves, built through ComfyUI's own classes.

Each builder takes ComfyUI's model configuration of the family (as
``comfy/model_detection.py`` reads it from a checkpoint) and narrows the
width and depth, keeping the token order and the attention calls: joint text
and image attention, SD3.5's image-only second attention, Wan's self- and
cross-attention, Lumina 2's refiners. Needs ComfyUI on ``sys.path``.
"""

from __future__ import annotations

import torch

from .random_models import randomize

# ComfyUI's configurations of the real models, with width and depth cut down (heads kept several, head widths
# fitting the RoPE axes). The text width is the ``context_dim`` of the test conditioning.
CONTEXT_DIM = 32

DIT_CONFIGS = {
    "flux": ("Flux", {
        "image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": CONTEXT_DIM,
        "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": True,
    }),
    "sd3": ("SD3", {  # SD3.5 medium's layout: joint blocks, the first with the image-only attn2
        "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 2, "input_size": None,
        "adm_in_channels": CONTEXT_DIM, "pos_embed_max_size": 32, "num_patches": 32 * 32, "qk_norm": "rms",
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": CONTEXT_DIM, "out_features": 128}},
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": [0],
    }),
    "wan21": ("WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "out_dim": 16, "num_heads": 2, "ffn_dim": 128,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": CONTEXT_DIM,
    }),
    # Wan 2.1 Fun: Fun's reference image enters as one frame of tokens ahead of the video (ref_conv).
    "wan21_fun": ("WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "out_dim": 16, "num_heads": 2, "ffn_dim": 128,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": CONTEXT_DIM, "in_dim_ref_conv": 16,
    }),
    "qwen_image": ("QwenImage", {
        "image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": CONTEXT_DIM,
        "axes_dims_rope": (8, 12, 12),
    }),
    # Z-Image's variant: padded text and image (pad_tokens_multiple); its time embedding needs a width of 256.
    "lumina2": ("Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": CONTEXT_DIM,
        "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2,
        "axes_dims": [32, 48, 48], "axes_lens": [300, 64, 64], "rope_theta": 256.0, "ffn_dim_multiplier": 2.0,
        "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 8,
    }),
}
FAMILIES = ("flux", "sd3", "wan21", "qwen_image", "lumina2")  # one model of each family


@torch.no_grad()
def fill_norm_scales(net: torch.nn.Module) -> None:
    """Flux names its RMSNorm gains ``scale``, which ``randomize`` zeroes as it does biases: a zero gain would
    make every query and key 0. Identity gains, as ``randomize`` gives norms named ``weight``."""
    for name, param in net.named_parameters():
        if param.ndim == 1 and name.endswith(".scale"):
            param.fill_(1.0)


@torch.no_grad()
def fill_position_embedding(net: torch.nn.Module, seed: int) -> None:
    """MMDiT keeps its learned position embedding in a buffer made with ``torch.empty`` (it is meant to be
    loaded), which ``randomize`` does not reach: seeded values of a small scale, as trained ones have."""
    pos_embed = getattr(net, "pos_embed", None)
    if isinstance(pos_embed, torch.Tensor):
        generator = torch.Generator().manual_seed(seed + 1)
        pos_embed.copy_(torch.randn(pos_embed.shape, generator=generator) * 0.02)


def build_dit_model(family: str, seed: int = 0):
    """A ComfyUI ``ModelPatcher`` around a random-weight DiT of ``family`` (a key of ``DIT_CONFIGS``), on the CPU.

    Raises ``ImportError`` where this host lacks what the family's ComfyUI code imports.
    """
    import comfy.model_patcher
    import comfy.supported_models

    class_name, config = DIT_CONFIGS[family]
    model_config = getattr(comfy.supported_models, class_name)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device="cpu")
    randomize(model.diffusion_model, seed)
    fill_norm_scales(model.diffusion_model)
    fill_position_embedding(model.diffusion_model, seed)
    model.eval()
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
