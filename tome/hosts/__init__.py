"""One module per host that ``tome/`` reaches into, none of them importing its host: ``comfyui`` (ComfyUI's
conventions, and what its two adapters do alike), ``comfyui_unet`` (ComfyUI's U-Nets: SD1.x, SD2.x, SDXL),
``comfyui_dit`` (ComfyUI's DiTs: registration and the model call, with ``dit_settings``, ``dit_families``,
``dit_tokens``, ``comfyui_dit_attention``, ``comfyui_dit_block`` and ``comfyui_dit_swap``), ``comfyui_models``
(which of the two a model goes to) and ``hooks`` (diffusers and LDM models, outside ComfyUI)."""
