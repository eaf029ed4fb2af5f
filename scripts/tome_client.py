"""Queue an API-format workflow on a running ComfyUI, follow it, save its images.

    python scripts/tome_client.py workflows/api/sd15_tome.json --server http://127.0.0.1:8188 \\
        [--ckpt NAME] [--seed N] [--steps N] [--width PX] [--height PX] [--ratio R] [--out DIR] [--ab]

``--ab`` runs the graph twice, with and without its ToMe and ToDo nodes
(bypassed: their consumers take the model the node was given), and prints
both times, the speed-up and how far the images differ.

Exit status: 0 done; 2 server unreachable; 3 graph rejected (ComfyUI's
``node_errors`` are printed); 4 execution failed.
Needs only the standard library and aiohttp (which ComfyUI requires).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

TOME_NODES = {"ApplyToMe", "ApplyToMeAdvanced"}
SPEEDUP_NODES = TOME_NODES | {"ApplyToDo"}
EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_FAILED = 2, 3, 4


class ClientError(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    prompt_id: str
    seconds: float
    images: list[Path] = field(default_factory=list)


def apply_overrides(graph: dict, ckpt=None, seed=None, steps=None, width=None, height=None, ratio=None) -> dict:
    """A copy of ``graph`` with the given inputs set on every node that has them."""
    graph = copy.deepcopy(graph)
    wanted = {
        "CheckpointLoaderSimple": {"ckpt_name": ckpt},
        "KSampler": {"seed": seed, "steps": steps},
        "EmptyLatentImage": {"width": width, "height": height},
        **{name: {"ratio": ratio} for name in TOME_NODES},
    }
    for node in graph.values():
        for key, value in wanted.get(node["class_type"], {}).items():
            if value is not None:
                node["inputs"][key] = value
    return graph


def without_speedups(graph: dict) -> dict:
    """A copy of ``graph`` with every ToMe and ToDo node bypassed."""
    graph = copy.deepcopy(graph)
    sources = {node_id: node["inputs"]["model"] for node_id, node in graph.items()
               if node["class_type"] in SPEEDUP_NODES}
    for node_id in sources:
        del graph[node_id]
    for node in graph.values():
        for key, value in node["inputs"].items():
            while isinstance(value, list) and value[0] in sources:
                value = sources[value[0]]
            node["inputs"][key] = value
    return graph


def progress_bar(value: int, maximum: int, width: int = 30) -> str:
    filled = int(width * value / max(maximum, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {value}/{maximum}"


async def run_prompt(session: aiohttp.ClientSession, server: str, graph: dict, out: Path,
                     label: str = "", quiet: bool = False) -> Result:
    client_id = uuid.uuid4().hex
    ws_url = server.replace("http", "ws", 1) + f"/ws?clientId={client_id}"
    try:
        websocket = await session.ws_connect(ws_url)
    except aiohttp.ClientError as error:
        raise ClientError(f"cannot reach ComfyUI at {server}: {error}", EXIT_UNREACHABLE) from error
    async with websocket:
        start = time.perf_counter()
        async with session.post(f"{server}/prompt", json={"prompt": graph, "client_id": client_id}) as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                details = json.dumps(body.get("node_errors") or body.get("error") or body, indent=2)
                raise ClientError(f"ComfyUI rejected the graph (HTTP {response.status}):\n{details}", EXIT_REJECTED)
        prompt_id = body["prompt_id"]
        async for message in websocket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue  # binary frames are previews
            event = json.loads(message.data)
            data = event.get("data", {})
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if event["type"] == "progress" and not quiet:
                print(f"\r{label}{progress_bar(data['value'], data['max'])}", end="", file=sys.stderr, flush=True)
            elif event["type"] == "execution_error":
                raise ClientError(f"execution failed in node {data.get('node_id')} ({data.get('node_type')}): "
                                  f"{data.get('exception_message', '').strip()}", EXIT_FAILED)
            elif event["type"] == "execution_interrupted":
                raise ClientError(f"execution interrupted in node {data.get('node_id')}", EXIT_FAILED)
            elif event["type"] == "executing" and data.get("node") is None:
                # Not "execution_success": ComfyUI sends that before it writes the prompt's history,
                # and "executing" with no node only after, so the images can be fetched now.
                break
        seconds = time.perf_counter() - start
    if not quiet:
        print(file=sys.stderr)
    return Result(prompt_id, seconds, await save_images(session, server, prompt_id, out))


async def save_images(session: aiohttp.ClientSession, server: str, prompt_id: str, out: Path) -> list[Path]:
    async with session.get(f"{server}/history/{prompt_id}") as response:
        history = (await response.json()).get(prompt_id, {})
    saved = []
    out.mkdir(parents=True, exist_ok=True)
    for node_output in history.get("outputs", {}).values():
        for image in node_output.get("images", []):
            params = {key: image[key] for key in ("filename", "subfolder", "type")}
            async with session.get(f"{server}/view", params=params) as response:
                response.raise_for_status()
                path = out / image["filename"]
                path.write_bytes(await response.read())
                saved.append(path)
    return saved


def image_difference(first: Path, second: Path) -> tuple[float, float]:
    """Mean absolute difference (0-255 scale) and PSNR in dB between two images."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(io.BytesIO(first.read_bytes())).convert("RGB"), dtype=np.float64)
    b = np.asarray(Image.open(io.BytesIO(second.read_bytes())).convert("RGB"), dtype=np.float64)
    mse = float(((a - b) ** 2).mean())
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
    return float(np.abs(a - b).mean()), psnr


async def main_async(args) -> int:
    graph = apply_overrides(json.loads(Path(args.workflow).read_text()), args.ckpt, args.seed, args.steps,
                            args.width, args.height, args.ratio)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            if not args.ab:
                result = await run_prompt(session, args.server, graph, Path(args.out))
                print(f"prompt {result.prompt_id}: {result.seconds:.1f} s, images: "
                      f"{', '.join(map(str, result.images)) or 'none'}")
                return 0
            # Untimed: loads the checkpoint and encodes the prompts, which both timed runs then reuse.
            warm_up = apply_overrides(without_speedups(graph), steps=1, width=64, height=64)
            await run_prompt(session, args.server, warm_up, Path(args.out) / "warm_up", quiet=True)
            baseline = await run_prompt(session, args.server, without_speedups(graph), Path(args.out) / "without_tome",
                                        label="without ToMe ")
            tome = await run_prompt(session, args.server, graph, Path(args.out) / "with_tome", label="with ToMe    ")
        except ClientError as error:
            print(f"error: {error}", file=sys.stderr)
            return error.status
    mad, psnr = image_difference(baseline.images[0], tome.images[0])
    print("| run | time per image (s) | speed-up |\n|---|---|---|")
    print(f"| without ToMe | {baseline.seconds:.1f} | 1.00x |")
    print(f"| with ToMe | {tome.seconds:.1f} | {baseline.seconds / tome.seconds:.2f}x |")
    print(f"image difference: mean |a-b| = {mad:.2f} / 255, PSNR = {psnr:.1f} dB")
    print(f"images: {baseline.images[0]} and {tome.images[0]}")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workflow", help="an API-format workflow JSON (workflows/api/)")
    parser.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI's address")
    parser.add_argument("--ckpt", help="checkpoint name, as ComfyUI lists it")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--width", type=int, help="image width in pixels (a multiple of 8)")
    parser.add_argument("--height", type=int, help="image height in pixels (a multiple of 8)")
    parser.add_argument("--ratio", type=float, help="ToMe ratio on every Apply ToMe node")
    parser.add_argument("--out", default="output", help="folder for the images")
    parser.add_argument("--ab", action="store_true", help="run with and without ToMe and compare")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
