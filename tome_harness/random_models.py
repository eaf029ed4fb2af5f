"""Random-weight diffusion models in the real SD1.5 and SDXL layouts, built through ComfyUI's own classes.

No weights can be downloaded here, so tests and benchmarks use these: the
U-Net configurations are ComfyUI's own (``comfy/model_detection.py``), and
``channels`` shrinks the width while keeping every level, block and head
layout, so fast tests stay fast. Needs ComfyUI on ``sys.path``.
"""

from __future__ import annotations

import math

import torch

UNET_CONFIGS = {
    "sd15": {
        "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
        "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
        "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
        "context_dim": 768, "num_heads": 8, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        "use_temporal_attention": False, "use_temporal_resblock": False,
    },
    "sdxl": {
        "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
        "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "use_temporal_attention": False, "use_temporal_resblock": False,
    },
}


def unet_config(family: str, channels: int | None = None, context_dim: int | None = None,
                dtype: torch.dtype = torch.float32) -> dict:
    """ComfyUI's U-Net config of ``family``, optionally narrower (``channels``, ``context_dim``)."""
    config = dict(UNET_CONFIGS[family], dtype=dtype)
    if channels is not None:
        config["model_channels"] = channels
        if "num_head_channels" in config:  # SDXL: narrower heads too, so the small model keeps several
            config["num_head_channels"] = max(channels // 4, 8)
    if context_dim is not None:
        config["context_dim"] = context_dim
    return config


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Seeded weights of sane scale: fan-in normal for matrices and kernels, identity norms, zero biases.

    ComfyUI builds its layers without initializing them (they are meant to be
    loaded), so every parameter is set here. The values are drawn where each parameter lives: a GPU draws a
    12B-parameter model in a second where a CPU generator takes minutes (the same seed gives other values there).
    """
    generators = {}
    for name, param in module.named_parameters():
        if param.ndim >= 2:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            std = 1.0 / math.sqrt(param[0].numel())
            param.copy_(torch.randn(param.shape, generator=generators[param.device], device=param.device) * std)
        elif name.endswith("weight"):
            param.fill_(1.0)
        else:
            param.zero_()


def model_config(family: str, **kwargs):
    import comfy.supported_models

    config = unet_config(family, **kwargs)
    cls = {"sd15": comfy.supported_models.SD15, "sdxl": comfy.supported_models.SDXL}[family]
    model_config = cls(config)
    model_config.set_inference_dtype(config["dtype"], None)
    return model_config


def build_unet_model(family: str, seed: int = 0, **kwargs):
    """A ComfyUI ``ModelPatcher`` around a random-weight U-Net of ``family`` (``sd15`` or ``sdxl``), on the CPU."""
    import comfy.model_patcher

    model = model_config(family, **kwargs).get_model({}, device="cpu")
    randomize(model.diffusion_model, seed)
    model.eval()
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def build_controlnet(family: str, seed: int = 1, **kwargs):
    """A ComfyUI ``ControlNet`` (as ``ControlNetLoader`` returns it) with random weights, matching the U-Net of
    ``build_unet_model(family, **kwargs)``, taking a 3-channel hint image. Its zero convolutions are random too,
    so its control really changes the U-Net's output."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops

    config = unet_config(family, **kwargs)
    config.pop("out_channels")
    control_model = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init,
                                               device="cpu", **config)
    randomize(control_model, seed)
    return comfy.controlnet.ControlNet(control_model.eval(), load_device=torch.device("cpu"))


def build_fp8_unet_model(family: str, seed: int = 0, weight_dtype: torch.dtype = torch.float8_e4m3fn, **kwargs):
    """``build_unet_model(family, seed, **kwargs)`` loaded as ``UNETLoader`` loads a diffusion model with its fp8
    ``weight_dtype`` (``comfy.sd.load_diffusion_model_state_dict`` in ComfyUI 0.3.75): weights stored in
    ``weight_dtype``, cast per layer to the manual-cast dtype ComfyUI picks for the device (float32 on the CPU).
    The model config is built directly: ComfyUI's detection would not take a narrowed U-Net for SD1.5."""
    import comfy.model_management
    import comfy.model_patcher

    state_dict = build_unet_model(family, seed, **kwargs).model.diffusion_model.state_dict()
    config = model_config(family, **kwargs)
    device = torch.device("cpu")
    manual_cast = comfy.model_management.unet_manual_cast(weight_dtype, device, config.supported_inference_dtypes)
    config.set_inference_dtype(weight_dtype, manual_cast)
    model = config.get_model(state_dict, "", device="cpu")
    model.load_model_weights(state_dict, "")
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def random_lora(model, rank: int = 4, seed: int = 0, scale: float = 0.5) -> dict:
    """A LoRA state dict (kohya names: ``lora_unet_<module>.lora_up/lora_down.weight``, ``.alpha``) for every
    linear layer of ``model``'s U-Net transformer blocks, as ``LoraLoaderModelOnly`` loads from a file; ``scale``
    sizes the update against the layer's weights (random weights here are of unit fan-in scale)."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for name, param in model.model.diffusion_model.named_parameters():
        if ".transformer_blocks." not in name or not name.endswith(".weight") or param.ndim != 2:
            continue
        out_features, in_features = param.shape
        key = "lora_unet_" + name[: -len(".weight")].replace(".", "_")
        lora[f"{key}.lora_up.weight"] = torch.randn(out_features, rank, generator=generator) * scale / math.sqrt(rank)
        lora[f"{key}.lora_down.weight"] = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
        lora[f"{key}.alpha"] = torch.tensor(float(rank))
    return lora
