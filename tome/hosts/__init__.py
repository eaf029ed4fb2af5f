"""One module per host that ``tome/`` reaches into: ``comfyui`` (ComfyUI's conventions, shared),
``comfyui_unet`` (ComfyUI's U-Nets: SD1.x, SD2.x, SDXL) and ``hooks`` (diffusers and LDM models, outside ComfyUI).
None of them imports its host."""
