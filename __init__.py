"""ComfyUI node pack: token merging (ToMe) and token downsampling (ToDo) for diffusion models.

Registration through ComfyUI's V3 entry point only: exporting ``NODE_CLASS_MAPPINGS`` beside it would make
ComfyUI register V1 nodes instead. The nodes are imported when ComfyUI asks for them, so the package itself
imports without ComfyUI (pytest collects it as the repository's root package).

``WEB_DIRECTORY`` is the other name ComfyUI reads here: it serves that folder at ``/extensions/<this folder's
name>/``, where the frontend's node help panel finds each node's page (``docs/<node id>.md``).
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import ToMeExtension

    return ToMeExtension()
