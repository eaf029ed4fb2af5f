"""Token merging for Stable Diffusion, in pure PyTorch (no ComfyUI import)."""

from .downsample import downsample_tokens
from .hosts.hooks import apply_patch, remove_patch
from .merge import IDENTITY, MergePlan, bipartite_soft_matching_random2d, build_plan
from .partition import Partition, draw_partition

__all__ = [
    "IDENTITY",
    "MergePlan",
    "Partition",
    "apply_patch",
    "bipartite_soft_matching_random2d",
    "build_plan",
    "downsample_tokens",
    "draw_partition",
    "remove_patch",
]
