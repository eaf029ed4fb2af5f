"""``torchvision.transforms`` of the stand-in package: see ``__init__``."""

from . import MESSAGE


def __getattr__(name):
    raise AttributeError(f"torchvision.transforms.{name}: {MESSAGE}")
