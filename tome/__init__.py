"""Token merging for Stable Diffusion, in pure PyTorch (no ComfyUI import)."""

from .merge import IDENTITY, MergePlan, bipartite_soft_matching_random2d, build_plan
from .partition import Partition, draw_partition

__all__ = [
    "IDENTITY",
    "MergePlan",
    "Partition",
    "bipartite_soft_matching_random2d",
    "build_plan",
    "draw_partition",
]
