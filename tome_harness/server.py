"""Start a real headless ComfyUI with this pack and the random checkpoint; stop it whatever happens."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import comfyui as comfyui_host


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_paths_config(workdir: Path, checkpoints: Path) -> Path:
    """An extra_model_paths file that adds our checkpoint folder and a custom_nodes folder holding the pack."""
    custom_nodes = workdir / "custom_nodes"
    comfyui_host.link_pack(custom_nodes)
    config = workdir / "extra_model_paths.yaml"
    config.write_text(f"tome:\n    base_path: {workdir}\n    checkpoints: {checkpoints}\n"
                      f"    custom_nodes: {custom_nodes}\n")
    return config


def wait_until_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {process.returncode} while starting:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/object_info/ApplyToMe", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def running_server(workdir: Path, checkpoints: Path, extra_args: tuple[str, ...] = (), timeout: float = 180):
    """Yield the base URL of a ComfyUI server on a free loopback port; always stops it."""
    with server_process(workdir, checkpoints, extra_args, timeout) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(workdir: Path, checkpoints: Path, extra_args: tuple[str, ...] = (), timeout: float = 180):
    """``running_server``, yielding its process beside the URL: for a test that freezes or kills the worker."""
    (workdir / "user").mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--extra-model-paths-config", str(write_paths_config(workdir, checkpoints)),
               "--output-directory", str(workdir / "output"), "--temp-directory", str(workdir),
               "--user-directory", str(workdir / "user"), "--database-url", "sqlite:///:memory:",
               "--disable-api-nodes", *extra_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(comfyui_host.extra_python_paths()), PYTHONUNBUFFERED="1")
    log = workdir / "comfyui.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(command, cwd=comfyui_host.comfyui_path(), env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, log, timeout)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
