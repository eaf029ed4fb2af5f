"""Stand-in for torchvision, put on ComfyUI's path only where torchvision is not installed.

ComfyUI 0.3.75 imports torchvision at module level in its Stable Cascade,
Cosmos and ACE code, which every start of ComfyUI imports, but calls into it
only when one of those models runs. SD1.x, SD2.x and SDXL never do. Installing
the real torchvision here would replace the CPU build of torch with a
multi-GB CUDA build, so the test and demo hosts get this stand-in instead,
which fails loudly the moment anything actually uses it.
"""

MESSAGE = ("torchvision is not installed: this ComfyUI host runs SD1.x/SD2.x/SDXL only; "
           "install torchvision for Stable Cascade, Cosmos or ACE models")


def __getattr__(name):
    raise AttributeError(f"torchvision.{name}: {MESSAGE}")
