"""The quality bench's patch map (``tome_harness.patch_map``): principal components of 8x8 pixel patches."""

import torch
import torch.nn.functional as F

from tome_harness import patch_map as pm


def _images(seed: int, n: int = 6, side: int = 32) -> torch.Tensor:
    """Smooth random images in ``[-1, 1]``: upsampled noise, so that a few components hold most of a patch."""
    coarse = torch.rand(n, 3, side // 8, side // 8, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)


def test_the_components_are_orthonormal_largest_first_and_of_unit_mean_variance():
    """One scale for all components: the latent is the projection of the patches up to that factor, so token
    distances are the pixels' (whitening each component would weigh texture as much as colour)."""
    images = _images(0)
    fitted = pm.fit(images, channels=16)
    torch.testing.assert_close(fitted.basis.T @ fitted.basis, torch.eye(16), rtol=0, atol=1e-5)
    assert (fitted.scale == fitted.scale[0]).all()
    latent = fitted.encode(images)
    assert latent.shape == (6, 16, 4, 4)
    torch.testing.assert_close(latent.mean((0, 2, 3)), torch.zeros(16), rtol=0, atol=1e-4)
    variances = latent.var((0, 2, 3), correction=0)
    torch.testing.assert_close(variances.mean(), torch.tensor(1.0), rtol=1e-3, atol=1e-3)
    assert (variances[:-1] >= variances[1:]).all()  # the largest components first


def test_decoding_is_the_projection_onto_the_components():
    """Encode then decode keeps what the components hold: a second round changes nothing, and an image made of
    the mean and the components comes back exactly."""
    fitted = pm.fit(_images(0), channels=4)
    images = _images(1)
    once = fitted.decode(fitted.encode(images))
    torch.testing.assert_close(fitted.decode(fitted.encode(once)), once, rtol=0, atol=1e-5)
    assert (once - images).abs().max() > 1e-3  # four components do not hold everything


def test_more_components_reconstruct_better_and_the_sign_is_fixed():
    images = (_images(2) + 1) / 2
    four, sixteen = pm.fit(_images(0), 4), pm.fit(_images(0), 16)
    assert all(b > a for a, b in zip(pm.reconstruction_psnr(four, images), pm.reconstruction_psnr(sixteen, images),
                                     strict=True))
    largest = four.basis.gather(0, four.basis.abs().argmax(0, keepdim=True))
    assert (largest > 0).all()
    torch.testing.assert_close(pm.fit(_images(0), 4).basis, four.basis, rtol=0, atol=0)  # seeded: the same map


def test_a_map_survives_saving(tmp_path):
    fitted = pm.fit(_images(0), 4)
    fitted.save(tmp_path / "map.safetensors")
    loaded = pm.PatchMap.load(tmp_path / "map.safetensors")
    for name, value in fitted.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
