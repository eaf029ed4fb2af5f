"""A whole diffusers StableDiffusionPipeline, assembled from random-weight parts, runs with ``tome.apply_patch``.

Nothing is downloaded: the CLIP tokenizer files are the ones ComfyUI ships.
"""

import pytest
import torch

import tome
from tome_harness.comfyui import comfyui_path

diffusers = pytest.importorskip("diffusers", reason="diffusers is a test dependency: run scripts/setup.sh")
transformers = pytest.importorskip("transformers")


def random_pipeline():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    vae = diffusers.AutoencoderKL(block_out_channels=(32, 64), norm_num_groups=8, latent_channels=4,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=49408,
        max_position_embeddings=77))
    tokenizer = transformers.CLIPTokenizer.from_pretrained(comfyui_path() / "comfy" / "sd1_tokenizer",
                                                         model_max_length=77)
    return diffusers.StableDiffusionPipeline(
        unet=unet.eval(), vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        scheduler=diffusers.DDIMScheduler(), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)


def test_pipeline_runs_end_to_end_with_the_patch_and_merges():
    pipe = random_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe("a lighthouse", num_inference_steps=2, height=64, width=64, output_type="pt",
                    generator=torch.Generator().manual_seed(3)).images

    before = generate()
    tome.apply_patch(pipe, ratio=0.5)
    lengths = []
    hooks = [m.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
             for name, m in pipe.unet.named_modules() if name.endswith("attn1")]
    patched = generate()
    for hook in hooks:
        hook.remove()
    assert patched.shape == (1, 3, 64, 64) and torch.isfinite(patched).all()
    # This VAE halves the size: a 32x32 latent, whose 1024 full-resolution tokens are half merged away.
    assert 512 in lengths and 1024 not in lengths
    tome.remove_patch(pipe)
    assert torch.equal(generate(), before)
