"""The quality bench's measures of quality (``tome_harness.quality_measures``), on the photographs of
``tome_harness.photos`` at 64 px and on synthetic images: no ComfyUI, no model."""

import functools
from itertools import pairwise

import pytest
import torch

from tome_harness import photos
from tome_harness import quality_measures as qm

SIDE = 64
BLURS = (0.5, 1.0, 2.0)  # pixels, ever stronger


@functools.cache
def held_out() -> torch.Tensor:
    return photos.held_out_images(SIDE)


@functools.cache
def training() -> torch.Tensor:
    """The centred square of every training photograph, as the held-out ones are shown."""
    return torch.stack([photos.center_crop(photos.load(name), SIDE) for name in photos.training_names()])


def noise(count: int = 4) -> torch.Tensor:
    return torch.rand(count, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))


def test_a_blur_loses_detail_the_more_the_stronger_it_is():
    details = [qm.detail(held_out())] + [qm.detail(qm.gaussian_blur(held_out(), sigma)) for sigma in BLURS]
    assert all(a > b for a, b in pairwise(details))
    assert details[-1] < 0.5 * details[0]


def test_a_flat_image_has_no_detail_even_at_its_borders():
    """The blur mirrors the borders: an image's edge is no step."""
    assert qm.detail(torch.full((2, 3, SIDE, SIDE), 0.7)) == pytest.approx(0.0, abs=1e-6)


def test_a_blur_moves_the_patch_distribution_away_the_more_the_stronger_it_is():
    distances = [qm.patch_distance(qm.gaussian_blur(held_out(), sigma), held_out()) for sigma in BLURS]
    assert distances[0] > 0
    assert all(a < b for a, b in pairwise(distances))


def test_identical_sets_are_at_distance_zero():
    assert qm.patch_distance(held_out(), held_out().clone()) == 0.0


def test_the_distance_is_symmetric_also_between_sets_of_different_sizes():
    assert qm.patch_distance(training(), held_out()) == qm.patch_distance(held_out(), training())
    blurred = qm.gaussian_blur(held_out(), 1.0)
    assert qm.patch_distance(blurred, held_out()) == qm.patch_distance(held_out(), blurred)


def test_noise_lies_farther_from_photographs_than_other_photographs_do():
    """Photographs never trained on against the training ones: the floor a sample can reach. Each noise image
    alone lies farther than each training photograph alone, and so does the set."""
    floor = qm.patch_distance(training(), held_out())
    assert qm.patch_distance(noise(), held_out()) > 3 * floor
    farthest_photograph = max(qm.patch_distance(image, held_out()) for image in training())
    assert min(qm.patch_distance(image, held_out()) for image in noise()) > farthest_photograph


def test_another_draw_of_patches_and_directions_moves_the_floor_by_a_few_percent(monkeypatch):
    floor = qm.patch_distance(training(), held_out())
    for seed in (1, 2):
        monkeypatch.setattr(qm, "SEED", seed)
        assert qm.patch_distance(training(), held_out()) == pytest.approx(floor, rel=0.1)


def test_the_measures_draw_from_their_own_generators():
    """The global RNG is neither read (the same figure whatever its seed) nor advanced."""
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = qm.patch_distance(noise(), held_out())
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    assert qm.patch_distance(noise(), held_out()) == first


def test_a_clips_frames_count_as_images():
    clip = torch.stack(list(held_out()), dim=1)[None]  # [1, 3, T, H, W], a frame per photograph
    assert qm.patch_distance(clip, held_out()) == 0.0
    assert qm.detail(clip) == pytest.approx(qm.detail(held_out()), rel=1e-6)
    with pytest.raises(ValueError, match=r"\[N, 3, T, H, W\]"):
        qm.patch_distance(clip[0], held_out())  # a clip alone, not a set of one


def test_ssim_and_psnr_fall_as_an_image_is_blurred():
    image = held_out()[0]
    blurred = [qm.gaussian_blur(image, sigma) for sigma in BLURS]
    assert qm.ssim(image, image) == pytest.approx(1.0) and qm.psnr(image, image) == 100.0
    ssims, psnrs = [qm.ssim(b, image) for b in blurred], [qm.psnr(b, image) for b in blurred]
    assert all(a > b for a, b in pairwise(ssims)) and all(a > b for a, b in pairwise(psnrs))
