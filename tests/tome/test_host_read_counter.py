"""The host-read counter (``tome_harness.host_reads``) alone, and the reads of the DiT layouts that need one."""

import torch

from tome.hosts.dit_families import vace_reference_frames
from tome_harness.host_reads import count


def test_the_counter_sees_every_kind_of_host_read_and_blocking_copy():
    x = torch.arange(4.0)
    with count() as counts:
        float(x[0])
        x[1].item()
        bool(x[2])
        x.tolist()
        x.nonzero()
        x.cpu()
    assert (counts.host_reads, counts.blocking_copies) == (6, 0)
    with count() as counts:
        torch.tensor([1.0, 2.0])
        x.to("cpu")
        x.to(x.device, non_blocking=True)
        x.to(torch.float16)
    assert (counts.host_reads, counts.blocking_copies) == (0, 2)
    assert counts.ops["_to_copy"] == 1


def test_vace_reference_frames_read_the_host_once_whatever_the_frame_count():
    context = torch.zeros(1, 1, 96, 6, 2, 2)  # 16-channel latents: reactive half from 16, mask from 32
    context[:, :, 40, 3:] = 1.0  # frames 3 on are control frames
    with count() as counts:
        assert vace_reference_frames(context) == 3
    assert counts.host_reads == 1


def test_a_model_calls_read_brings_the_sigma_in_the_same_host_read():
    from tome.hosts.comfyui import ModelCall

    call = ModelCall(torch.tensor([0.625, 0.625]))
    context = torch.zeros(1, 1, 96, 4, 2, 2)
    context[:, :, 40, 1:] = 1.0
    with count() as counts:
        assert vace_reference_frames(context, call.read) == 1
        assert call.sigma() == 0.625  # read already: no second wait
    assert counts.host_reads == 1
    assert ModelCall(None).read(torch.tensor([True, False])) == [True, False]  # no sigma: the values alone
