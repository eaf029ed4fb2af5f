"""The demo: ComfyUI headless with this pack, the A/B workflow through the client, a timing table.

    bash scripts/demo.sh [--ckpt FILE.safetensors] [--steps N] [--size PX] [--ratio R] [--out DIR]

Without ``--ckpt`` it uses a random-weight checkpoint in the real SD1.5
layout (made once, cached): the images are noise, the timings are real.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import tome_client  # a sibling command: scripts/ is this script's first path entry

from tome_harness import server as comfyui_server
from tome_harness.checkpoint import DEFAULT_PATH
from tome_harness.comfyui import ROOT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, help="your own SD1.x checkpoint (.safetensors)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=512, help="width and height in pixels")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=ROOT / "demo_output")
    args = parser.parse_args()

    if args.ckpt is None:
        print("Preparing the random-weight SD1.5 checkpoint (once, about a minute) ...", flush=True)
        made = subprocess.run([sys.executable, "-m", "tome_harness.checkpoint"],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(made.stdout + made.stderr, file=sys.stderr)
            return made.returncode
        ckpt = DEFAULT_PATH
    else:
        ckpt = args.ckpt.resolve()
    print(f"Starting ComfyUI (CPU) with this pack and {ckpt.name} ...", flush=True)
    with tempfile.TemporaryDirectory() as workdir, comfyui_server.running_server(Path(workdir), ckpt.parent) as url:
        return tome_client.main([str(ROOT / "workflows" / "api" / "sd15_tome.json"), "--server", url, "--ab",
                                 "--ckpt", ckpt.name, "--steps", str(args.steps), "--width", str(args.size),
                                 "--height", str(args.size), "--ratio", str(args.ratio), "--out", str(args.out)])


if __name__ == "__main__":
    sys.exit(main())
