"""Transformer levels and blocks are found through the class hierarchy: other packs' subclasses still count."""

from torch import nn

from tome.hosts.hooks import _transformer_blocks
from tome.levels import is_a, ldm_transformer_downsamples


class SpatialTransformer(nn.Module):
    pass


class Downsample(nn.Module):
    pass


class BasicTransformerBlock(nn.Module):
    pass


class PacksSpatialTransformer(SpatialTransformer):
    """What another pack's wrapper or subclass looks like: another name, the same part."""


class PacksBlock(BasicTransformerBlock):
    pass


def test_subclasses_of_the_known_parts_are_recognised():
    unet = nn.Module()
    unet.input_blocks = nn.ModuleList([
        nn.ModuleList([nn.Identity()]),
        nn.ModuleList([PacksSpatialTransformer()]),
        nn.ModuleList([Downsample()]),
        nn.ModuleList([SpatialTransformer()]),
    ])
    assert ldm_transformer_downsamples(unet) == [1, 2]
    assert is_a(PacksBlock(), "BasicTransformerBlock") and not is_a(nn.Linear(1, 1), "BasicTransformerBlock")
    assert [type(b).__name__ for b in _transformer_blocks(nn.Sequential(PacksBlock(), nn.Identity()))] == \
        ["PacksBlock"]
