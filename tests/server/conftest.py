"""A real headless ComfyUI server with this pack and the random-weight SD1.5 checkpoint."""

import subprocess
import sys

import pytest

from tome_harness import server as comfyui_server
from tome_harness.comfyui import ROOT

CHECKPOINTS = ROOT / ".cache" / "checkpoints"
CHECKPOINT = "tome-random-sd15.safetensors"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/server/" in str(item.fspath):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def checkpoint():
    """Written once into the git-ignored cache (about 40 s), then reused."""
    subprocess.run([sys.executable, "-m", "tome_harness.checkpoint", str(CHECKPOINTS / CHECKPOINT)],
                   check=True, stdout=subprocess.DEVNULL)
    return CHECKPOINT


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    with comfyui_server.running_server(tmp_path_factory.mktemp("server"), CHECKPOINTS) as url:
        yield url
