"""In-process ComfyUI: the real ``comfy`` package on the CPU, with this pack loaded as ComfyUI loads it."""

import comfyui_host
import pytest


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
        attn_patch = comfyui_host.pack_module("attn_patch")
        grid = comfyui_host.pack_module("tome.grid")

    return Pack
