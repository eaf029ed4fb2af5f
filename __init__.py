"""ComfyUI node pack: Token Merging for Stable Diffusion (ToMe), paper-exact, on SD1.x, SD2.x and SDXL."""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
