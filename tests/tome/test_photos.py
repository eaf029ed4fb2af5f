"""The video judges' clips (``tome_harness.photos``): the ``camera`` recipe's pans, zooms and parallax move the
picture as they say, and a batch holds more than one kind. No ComfyUI, no model."""

import torch

from tome_harness import photos

SIDE = 64


def stripes(height: int = 256, width: int = 256) -> torch.Tensor:
    """A photograph whose columns all differ: a pan's shift can be read off it."""
    columns = torch.linspace(0, 1, width)
    return torch.stack([columns.expand(height, width), columns.flip(0).expand(height, width),
                        torch.full((height, width), 0.5)])


def test_a_pan_moves_the_window_by_its_share_and_keeps_its_size():
    clip = photos.pan(stripes(), (64.0, 32.0, 128.0), (0.0, 0.25), frames=5, out=128)
    # 128 px window at 1 px per output pixel: the last frame is the first shifted by 32 columns.
    torch.testing.assert_close(clip[:, -1, :, :96], clip[:, 0, :, 32:], atol=1e-5, rtol=0)


def test_a_zoom_grows_the_window_about_its_centre():
    photo = stripes()
    clip = photos.zoom(photo, (64.0, 64.0, 128.0), 0.5, frames=3, out=64)
    torch.testing.assert_close(clip[:, -1], photos.resized_crop(photo, 96.0, 96.0, 64.0, 64))
    torch.testing.assert_close(clip[:, 0], photos.resized_crop(photo, 64.0, 64.0, 128.0, 64))


def test_parallax_slides_the_near_layer_three_times_as_far_as_the_background_the_other_way():
    background = torch.zeros(3, 256, 256)
    layer = torch.ones(3, 16, 16)
    clip = photos.parallax(background, (0.0, 0.0, 128.0), (0.0, 0.125), layer, (0.5, 0.5), frames=3, out=64)
    # The layer's centre: at 32 px, then 3 x 0.125 x 64 = 24 px to the left by the last frame.
    columns = clip[0].sum(dim=1)  # [frames, w]: where the layer covers each frame
    centres = (columns * torch.arange(64)).sum(-1) / columns.sum(-1)
    torch.testing.assert_close(centres, torch.tensor([31.5, 19.5, 7.5]), atol=0.6, rtol=0)


def test_a_batch_of_camera_clips_holds_every_motion_in_turn_and_is_seeded():
    one, two = photos.CropSampler(SIDE, seed=3), photos.CropSampler(SIDE, seed=3)
    torch.testing.assert_close(one.camera_clips(3, 4), two.camera_clips(3, 4), rtol=0, atol=0)

    class Noting(photos.CropSampler):
        motions: list

        def camera_clip(self, frames, motion):
            self.motions.append(motion)
            return super().camera_clip(frames, motion)

    sampler = Noting(SIDE, seed=4)
    sampler.motions = []
    batch = sampler.camera_clips(3, 4)
    assert batch.shape == (3, 3, 4, SIDE, SIDE)
    assert sorted(sampler.motions) == sorted(photos.MOTIONS)
    assert all((clip[:, 0] - clip[:, -1]).abs().mean() > 0.005 for clip in batch)  # each one moves


def test_the_held_out_camera_clips_are_the_held_out_photographs_moving():
    clips = photos.held_out_camera_clips(SIDE, 3)
    assert clips.shape == (len(photos.HELD_OUT), 3, 3, SIDE, SIDE)
    torch.testing.assert_close(clips[photos.HELD_OUT.index("LadyBird")],
                               photos.held_out_clips(SIDE, 3)[photos.HELD_OUT.index("LadyBird")])
    assert all((clip[:, 0] - clip[:, -1]).abs().mean() > 0.005 for clip in clips)
