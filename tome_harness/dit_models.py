"""Tiny random-weight DiTs of the families the DiT adapter serves, built through ComfyUI's own classes.

Each builder takes ComfyUI's model configuration of the family (as
``comfy/model_detection.py`` reads it from a checkpoint) and narrows the
width and depth, keeping the token order and the attention calls: joint text
and image attention, SD3.5's image-only second attention, Wan's self- and
cross-attention, Lumina 2's refiners, HunyuanVideo's token refiner, VACE's
control blocks, Chroma Radiance's pixel patches. Needs ComfyUI on ``sys.path``.
"""

from __future__ import annotations

import torch

from .random_models import randomize

# ComfyUI's configurations of the real models, with width and depth cut down (heads kept several, head widths
# fitting the RoPE axes). The text width is the ``context_dim`` of the test conditioning.
CONTEXT_DIM = 32


def wan_config(model_type: str, **changes) -> dict:
    """ComfyUI's Wan 2.x configuration of ``model_type`` (``t2v``, ``i2v``, ``vace``, ...), narrowed to width 64,
    two heads and two layers, with the variant's ``changes`` (its input channels, its extra layers)."""
    return {"image_model": "wan2.1", "model_type": model_type, "dim": 64, "out_dim": 16, "num_heads": 2,
            "ffn_dim": 128, "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
            "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": CONTEXT_DIM, **changes}


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
    "wan21": ("WAN21_T2V", wan_config("t2v")),
    # Wan 2.1 Fun: Fun's reference image enters as one frame of tokens ahead of the video (ref_conv).
    "wan21_fun": ("WAN21_T2V", wan_config("t2v", in_dim_ref_conv=16)),
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
    "hunyuan_video": ("HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
        "vec_in_dim": CONTEXT_DIM, "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2,
        "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
        "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
        "vision_in_dim": None,
    }),
    # 1.5: ByT5 glyph tokens (their mapper's input width is fixed at 1472) and CLIP vision tokens join the text;
    # its latent has 32 channels, and the I2V image and its mask enter as channels (32 + 32 + 1).
    "hunyuan_video15": ("HunyuanVideo15", {
        "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 2, 2],
        "vec_in_dim": None, "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2,
        "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
        "guidance_embed": False, "byt5": True, "meanflow": False, "use_cond_type_embedding": True,
        "vision_in_dim": CONTEXT_DIM,
    }),
    # HunyuanImage 2.1: HunyuanVideo's network on images, 2D 1x1 patches of a 64-channel latent, two RoPE axes.
    "hunyuan_image21": ("HunyuanImage21", {
        "image_model": "hunyuan_video", "in_channels": 64, "out_channels": 64, "patch_size": [1, 1],
        "vec_in_dim": None, "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2,
        "depth": 1, "depth_single_blocks": 1, "axes_dim": [16, 16], "theta": 256, "qkv_bias": True,
        "guidance_embed": False, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
        "vision_in_dim": None,
    }),
    "ltxv": ("LTXV", {  # one latent pixel per token (patch 1x1x1), 128 latent channels
        "image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 64, "attention_head_dim": 32,
        "num_attention_heads": 2, "caption_channels": CONTEXT_DIM, "num_layers": 2,
    }),
    # Wan 2.2 TI2V-5B: 48 latent channels (its VAE compresses 16x16 spatially), the same 1x2x2 patches.
    "wan22_5b": ("WAN22_T2V", wan_config("t2v", out_dim=48, in_dim=48)),
    # Wan 2.1 image-to-video: the image enters as channels; CLIP vision tokens are a second cross-attention.
    "wan21_i2v": ("WAN21_I2V", wan_config("i2v", in_dim=36)),
    # VACE: control blocks run self-attention on the control video's tokens, as many as the video's.
    "wan21_vace": ("WAN21_Vace", wan_config("vace", vace_layers=1, vace_in_dim=96)),
    "cosmos_predict2": ("CosmosT2IPredict2", {
        "image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64,
        "concat_padding_mask": True, "crossattn_emb_channels": CONTEXT_DIM, "pos_emb_cls": "rope3d",
        "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
        "use_adaln_lora": True, "adaln_lora_dim": 16, "num_blocks": 2, "num_heads": 2,
        "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 1.0, "rope_w_extrapolation_ratio": 1.0,
        "rope_t_extrapolation_ratio": 1.0,
    }),
    # Flux 2: 128 latent channels, 1x1 patches, four RoPE axes, modulation shared by all blocks.
    "flux2": ("Flux2", {
        "image_model": "flux2", "in_channels": 128, "patch_size": 1, "out_channels": 128, "vec_in_dim": None,
        "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 8, 8, 8], "theta": 2000, "qkv_bias": False, "guidance_embed": True,
        "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
        "ref_index_scale": 10.0,
    }),
    # Chroma: Flux without the pooled vector (its modulation comes from a small approximator network); its
    # channel counts are those of 2x2 patches of the 16-channel latent.
    "chroma": ("Chroma", {
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2, "context_in_dim": CONTEXT_DIM,
        "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
        "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 64,
        "n_layers": 1,
    }),
    # Chroma Radiance: pixels in, 16x16 patches, a small per-patch NeRF head out.
    "chroma_radiance": ("ChromaRadiance", {
        "image_model": "chroma_radiance", "in_channels": 3, "out_channels": 3, "patch_size": 16,
        "context_in_dim": CONTEXT_DIM, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "in_dim": 64,
        "out_dim": 64, "hidden_dim": 64, "n_layers": 1, "nerf_hidden_size": 16, "nerf_mlp_ratio": 2, "nerf_depth": 1,
        "nerf_max_freqs": 8, "nerf_tile_size": 512, "nerf_final_head_type": "linear",
        "nerf_embedder_dtype": torch.float32,
    }),
    # HiDream: T5 and LLM text (one LLM layer per block, picked by llama_layers), mixture-of-experts MLPs.
    "hidream": ("HiDream", {
        "image_model": "hidream", "attention_head_dim": 32, "axes_dims_rope": [16, 8, 8],
        "caption_channels": [CONTEXT_DIM, CONTEXT_DIM], "max_resolution": [128, 128], "in_channels": 16,
        "llama_layers": [0, 1], "num_attention_heads": 2, "num_routed_experts": 2, "num_activated_experts": 1,
        "num_layers": 1, "num_single_layers": 1, "out_channels": 16, "patch_size": 2, "text_emb_dim": CONTEXT_DIM,
    }),
    # Wan 2.2 Animate: i2v's channels (latent, mask, concat image), pose latents added to the video's patches,
    # a face adapter every 5 blocks (none at this depth: the face video is not used in the tests).
    "wan22_animate": ("WAN22_Animate", wan_config("animate", in_dim=36)),
    # Wan 2.2 S2V: reference and motion tokens after the video, audio injected after the blocks.
    "wan22_s2v": ("WAN22_S2V", wan_config("s2v")),
    # HuMo 17B: the reference latent's tokens after the video, an audio cross-attention in every block.
    "wan21_humo": ("WAN21_HuMo", wan_config("humo", in_dim=36)),
    # Mochi: 12-channel latent, joint attention of the video with its T5 text. Its code asserts the video MLP's
    # width of the real model (hidden_size_x * mlp_ratio_x == 1536 * 8), kept at this width by the ratio.
    "mochi": ("GenmoMochi", {
        "image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 2, "hidden_size_x": 64,
        "hidden_size_y": 32, "mlp_ratio_x": 1536 * 8 / 64, "mlp_ratio_y": 4.0, "learn_sigma": False,
        "in_channels": 12, "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0,
        "patch_embed_bias": True, "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
        "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": CONTEXT_DIM, "t5_token_length": 256,
        "rope_theta": 10000.0,
    }),
    # Cosmos 1.0 (7B's layout): self-attention, cross-attention and MLP blocks over [T, H, W, B, D] tokens.
    "cosmos1": ("CosmosT2V", {
        "image_model": "cosmos", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64,
        "block_config": "FA-CA-MLP", "concat_padding_mask": True, "crossattn_emb_channels": CONTEXT_DIM,
        "pos_emb_cls": "rope3d", "pos_emb_learnable": False, "pos_emb_interpolation": "crop",
        "block_x_format": "THWBD", "affline_emb_norm": True, "use_adaln_lora": True, "adaln_lora_dim": 16,
        "num_blocks": 2, "num_heads": 2, "extra_per_block_abs_pos_emb": True, "rope_h_extrapolation_ratio": 1.0,
        "rope_w_extrapolation_ratio": 1.0, "rope_t_extrapolation_ratio": 2.0,
        "extra_per_block_abs_pos_emb_type": "learnable",
    }),
    # Wan 2.2 Fun Control A14B: the control video, a mask and the start image as channels after the latent's
    # (16 + 16 + 4 + 16); Fun's reference image as one frame of tokens ahead of the video (ref_conv).
    "wan22_fun_control": ("WAN21_T2V", wan_config("t2v", in_dim=52, in_dim_ref_conv=16)),
}
FAMILIES = ("flux", "sd3", "wan21", "qwen_image", "lumina2")  # one model of each first-wave family
# The second wave: video models, Wan's variants and Flux's descendants, HiDream and Cosmos.
SECOND_WAVE = ("hunyuan_video", "hunyuan_video15", "hunyuan_image21", "ltxv", "wan22_5b", "wan21_i2v", "wan21_vace",
               "cosmos_predict2", "flux2", "chroma", "chroma_radiance", "hidream")
# The third wave: Wan's variants that add tokens (or a reference frame) of their own to the video.
THIRD_WAVE = ("wan22_animate", "wan22_s2v", "wan21_humo")
# The fourth wave: Mochi, Cosmos 1 and Wan 2.2 Fun Control (a Wan model with Fun's reference convolution).
FOURTH_WAVE = ("mochi", "cosmos1", "wan22_fun_control")


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


def build_dit_model(family: str, seed: int = 0, changes: dict | None = None):
    """A ComfyUI ``ModelPatcher`` around a random-weight DiT of ``family`` (a key of ``DIT_CONFIGS``), on the CPU;
    ``changes``: entries of its config replaced (a deeper model, say).

    Raises ``ImportError`` where this host lacks what the family's ComfyUI code imports.
    """
    import comfy.model_patcher
    import comfy.supported_models

    class_name, config = DIT_CONFIGS[family]
    model_config = getattr(comfy.supported_models, class_name)({**config, **(changes or {})})
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device="cpu")
    randomize(model.diffusion_model, seed)
    fill_norm_scales(model.diffusion_model)
    fill_position_embedding(model.diffusion_model, seed)
    model.eval()
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def build_wan21_vae(seed: int = 0):
    """A ComfyUI ``VAE`` around a random-weight Wan 2.1 video VAE (8x8 spatial, 4x temporal compression, 16
    latent channels) of width 8, recognised by ComfyUI from its state dict as a checkpoint's would be. For
    the nodes that encode images into a Wan conditioning (``WanVaceToVideo``)."""
    import comfy.ldm.wan.vae
    import comfy.sd

    net = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], dropout=0.0)
    randomize(net, seed)
    return comfy.sd.VAE(sd=net.state_dict())


def build_flux_vae(seed: int = 0):
    """A ComfyUI ``VAE`` around a random-weight image VAE of Flux's layout (which HiDream uses: 16 latent channels,
    8x8 compression), recognised by ComfyUI from its state dict as a checkpoint's would be. ComfyUI reads only
    the latent channels from such a state dict and builds the real width (128 base channels), so the VAE is
    full width: it encodes the few small pictures of a test in a fraction of a second. For the nodes that encode
    images into a HiDream conditioning (``InstructPixToPixConditioning``, HiDream E1's edit image)."""
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    config = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
              "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    state = {}
    for prefix, net in (("encoder.", Encoder(**config)), ("decoder.", Decoder(**config))):
        randomize(net, seed)
        state.update({prefix + name: value for name, value in net.state_dict().items()})
    return comfy.sd.VAE(sd=state)
