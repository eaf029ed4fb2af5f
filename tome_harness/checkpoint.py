"""Write a random-weight SD1.5 checkpoint (U-Net, CLIP-L text encoder, VAE) in the real layout, float16.

ComfyUI's ``CheckpointLoaderSimple`` loads it, detects it as SD1.5 and finds
every weight. The images it makes are noise, but every layer has its real
shape, so its speed is the real model's speed. Written once into
``.cache/checkpoints/`` and reused:

    .venv/bin/python -m tome_harness.checkpoint [path]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from . import comfyui as comfyui_host
from . import random_models
from .comfyui import ROOT

DEFAULT_PATH = ROOT / ".cache" / "checkpoints" / "tome-random-sd15.safetensors"


# The SD1.x/SDXL VAE, as comfy/sd.py builds it.
VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def build_state_dict() -> dict[str, torch.Tensor]:
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    model = random_models.build_unet_model("sd15")
    clip = comfy.sd.CLIP(model.model.model_config.clip_target(state_dict={}), embedding_directory=None)
    random_models.randomize(clip.cond_stage_model, seed=1)
    vae = AutoencoderKL(ddconfig=VAE_DDCONFIG, embed_dim=4)
    random_models.randomize(vae, seed=2)
    state_dict = model.model.state_dict_for_saving(clip.get_sd(), vae.state_dict(), None)
    return {key: value.to(torch.float16).contiguous() if value.is_floating_point() else value.contiguous()
            for key, value in state_dict.items()}


def ensure_checkpoint(path: Path = DEFAULT_PATH) -> Path:
    """The checkpoint at ``path``, written first if it is not there yet (needs ComfyUI importable)."""
    if path.exists():
        return path
    import comfy.utils

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        comfy.utils.save_torch_file(build_state_dict(), str(partial), metadata={"tome-random-weights": "sd15"})
        partial.chmod(0o644)
        partial.rename(path)  # never leave a half-written checkpoint under the real name
    finally:
        partial.unlink(missing_ok=True)
    return path


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PATH
    comfyui_host.boot_in_process(Path(tempfile.mkdtemp()) / "custom_nodes")
    print(ensure_checkpoint(path))


if __name__ == "__main__":
    main()
