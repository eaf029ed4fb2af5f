"""In-process ComfyUI: the real ``comfy`` package on the CPU, with this pack loaded as ComfyUI loads it."""

import pytest

from tome_harness import comfyui as comfyui_host
from tome_harness import random_models


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/comfy/" in str(item.fspath):
            item.add_marker(pytest.mark.comfy)


@pytest.fixture(scope="session")
def comfy_nodes(tmp_path_factory):
    return comfyui_host.boot_in_process(tmp_path_factory.mktemp("comfyui") / "custom_nodes")


@pytest.fixture(scope="session")
def pack(comfy_nodes):
    """The pack's modules, as ComfyUI imported them."""

    class Pack:
        nodes = comfyui_host.pack_module("nodes")
        comfyui = comfyui_host.pack_module("tome.hosts.comfyui")
        unet = comfyui_host.pack_module("tome.hosts.comfyui_unet")
        dit = comfyui_host.pack_module("tome.hosts.comfyui_dit")
        models = comfyui_host.pack_module("tome.hosts.comfyui_models")
        grid = comfyui_host.pack_module("tome.grid")

    return Pack


@pytest.fixture(scope="session")
def block(comfy_nodes):
    """The block scope's module (``tome.hosts.comfyui_dit_block``), as ComfyUI imported it."""
    return comfyui_host.pack_module("tome.hosts.comfyui_dit_block")


@pytest.fixture(scope="session")
def sd15(comfy_nodes):
    """The SD1.5 layout, narrowed to 32 channels (and a 32-wide text context) so tests stay fast."""
    return random_models.build_unet_model("sd15", channels=32, context_dim=32)


@pytest.fixture(scope="session")
def sdxl(comfy_nodes):
    """The SDXL layout, narrowed to 64 channels (and a 32-wide text context)."""
    return random_models.build_unet_model("sdxl", channels=64, context_dim=32)
