"""Queue a workflow on one or several running ComfyUI workers, follow it, save its images.

    python scripts/tome_client.py WORKFLOW.json --server http://127.0.0.1:8188 [--server URL ...] \\
        [--ckpt NAME] [--seed N | --seeds A-B] [--prompt TEXT | --prompts FILE] [--steps N] \\
        [--width PX] [--height PX] [--ratio R] [--out DIR] [--ab]

WORKFLOW is API format (``workflows/api/``) or UI format (what ComfyUI's "Save" writes, ``workflows/``);
a UI-format file is converted with the first worker's ``/object_info``.

One graph is one job. ``--seeds A-B`` makes one job per seed, ``--prompts FILE`` one per line (with
``--seeds``, one per pair): a batch. Each job goes to a worker whose ``/queue`` is empty; a job whose
worker stops answering goes back to the queue for another. Each finished job appends one JSON line to
``OUT/manifest.jsonl`` (seed, prompt, server, seconds, images...); a batch skips the jobs already there,
so rerunning the same command finishes an interrupted batch.

``--ab`` runs each job twice, with and without its ToMe and ToDo nodes (bypassed: their consumers take the
model the node was given), after an untimed warm-up on each worker, and prints both times, the speed-up
and how far the images differ.

Exit status: 0 done; 2 no worker reachable (or all stopped answering: rerun to resume); 3 graph rejected
(ComfyUI's ``node_errors`` are printed); 4 execution failed; 5 bad input (file, option or graph).
Needs only the standard library and aiohttp (which ComfyUI requires).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import datetime
import hashlib
import io
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from ui_to_api import ConversionError, is_api_workflow, is_ui_workflow, ui_to_api

TOME_NODES = {"ApplyToMe", "ApplyToMeAdvanced"}
SPEEDUP_NODES = TOME_NODES | {"ApplyToDo"}
EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_FAILED, EXIT_BAD_INPUT = 2, 3, 4, 5
DEFAULT_SERVER = "http://127.0.0.1:8188"
MANIFEST = "manifest.jsonl"
LATENT_SCALE = 8  # SD's VAE maps 8x8 pixels to one latent: other sizes are silently cropped by the server
# The websocket pings every HEARTBEAT_S and drops a worker that does not answer within half of it; ComfyUI
# answers from its event loop, which stays free while the sampler runs in its own thread.
HEARTBEAT_S = 30
# The longest a worker may stay silent inside an answer to a request (queueing a graph, the websocket's
# handshake, an image's bytes): past it the worker counts as lost. A frozen worker still accepts connections
# (the kernel does), so only this notices one that freezes between requests. No total timeout: a prompt's run
# has no bound, and its websocket is watched by the heartbeat instead (aiohttp lifts this read timeout there).
ANSWER_S = 60
QUEUE_POLL_S = 0.5
MAX_ATTEMPTS = 3  # a job that loses its worker this often may be what stops the workers: stop retrying it
# What a worker that went away (or answers garbage, ValueError from the JSON) makes aiohttp raise.
NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError)

# Which node inputs each option sets.
OPTION_TARGETS = {
    "ckpt": ("ckpt_name", {"CheckpointLoaderSimple"}),
    "seed": ("seed", {"KSampler"}),
    "steps": ("steps", {"KSampler"}),
    "width": ("width", {"EmptyLatentImage"}),
    "height": ("height", {"EmptyLatentImage"}),
    "ratio": ("ratio", TOME_NODES),
}


class ClientError(Exception):
    """Ends the run with ``status``; the message says what went wrong and what to do."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class BadInput(ClientError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_BAD_INPUT)


class WorkerLost(Exception):
    """The worker stopped answering in the middle of a job; the job can go to another."""


@dataclass
class PromptRun:
    prompt_id: str
    seconds: float
    outputs: list[dict]  # the image references of /history: filename, subfolder, type


@dataclass
class Job:
    graph: dict
    key: str  # identifies the job in the manifest: a hash of the graph sent and the mode
    prompt_number: int | None = None  # the line of --prompts, for file names
    attempts: int = 0

    @property
    def name(self) -> str:
        parts = [f"seed{graph_seed(self.graph)}"]
        if self.prompt_number is not None:
            parts.append(f"prompt{self.prompt_number}")
        return "_".join(parts)


@dataclass
class Worker:
    url: str
    warmed: bool = False  # --ab: the untimed warm-up has run since the worker (re)started


# ---------------------------------------------------------------- input: files and options

def load_workflow(path: str) -> dict:
    """The workflow file's JSON; BadInput naming the file when it is missing, unreadable or not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"workflow file {path} not found: give the path of a workflow JSON, e.g. "
                       "workflows/api/sd15_tome.json") from None
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read workflow file {path} ({error}): give a readable UTF-8 JSON file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BadInput(f"workflow file {path} is not valid JSON ({error.msg}, line {error.lineno} column "
                       f"{error.colno}): save it again from ComfyUI (Save or Save (API))") from None


def read_prompts(path: str) -> list[tuple[int, str]]:
    """The non-blank lines of a --prompts file with their line numbers."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise BadInput(f"--prompts file {path} not found: give a text file with one prompt per line") from None
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read --prompts file {path} ({error}): give a UTF-8 text file") from None
    prompts = [(number, line.strip()) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise BadInput(f"--prompts file {path} has no prompt: write one prompt per line")
    return prompts


def seed_range(text: str) -> range:
    """``A-B`` (inclusive) or ``A``, for --seeds."""
    first, _, last = text.partition("-")
    try:
        seeds = range(int(first), int(last or first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed range: write A-B, e.g. 1-8") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: the first seed must not exceed the last")
    return seeds


def latent_size(text: str) -> int:
    """A width or height in pixels: a positive multiple of 8."""
    try:
        pixels = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of pixels") from None
    if pixels <= 0 or pixels % LATENT_SCALE:
        low = max(LATENT_SCALE, pixels // LATENT_SCALE * LATENT_SCALE)
        raise argparse.ArgumentTypeError(f"{pixels} is not a positive multiple of {LATENT_SCALE}: use {low} or "
                                         f"{low + LATENT_SCALE}")
    return pixels


def server_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} needs a scheme: use http://{text}")
    return text.rstrip("/")


# ---------------------------------------------------------------- the graph

def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def positive_encoders(graph: dict) -> list[str]:
    """The CLIPTextEncode nodes that feed a KSampler's ``positive`` input: where --prompt goes."""
    found = []
    for node in graph.values():
        link = node["inputs"].get("positive") if node["class_type"] == "KSampler" else None
        if is_link(link) and graph.get(link[0], {}).get("class_type") == "CLIPTextEncode" and link[0] not in found:
            found.append(link[0])
    return found


def graph_seed(graph: dict):
    """The first KSampler's seed (None without one): what the manifest records."""
    return next((node["inputs"].get("seed") for node in graph.values() if node["class_type"] == "KSampler"), None)


def graph_prompt(graph: dict):
    """The positive prompt text (None without one): what the manifest records."""
    return next((graph[node_id]["inputs"].get("text") for node_id in positive_encoders(graph)), None)


def apply_overrides(graph: dict, ckpt=None, seed=None, steps=None, width=None, height=None, ratio=None,
                    prompt=None) -> dict:
    """A copy of ``graph`` with the given inputs set on every node that has them."""
    graph = copy.deepcopy(graph)
    values = {"ckpt": ckpt, "seed": seed, "steps": steps, "width": width, "height": height, "ratio": ratio}
    for option, value in values.items():
        key, classes = OPTION_TARGETS[option]
        for node in graph.values():
            if value is not None and node["class_type"] in classes:
                node["inputs"][key] = value
    if prompt is not None:
        for node_id in positive_encoders(graph):
            graph[node_id]["inputs"]["text"] = prompt
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


def api_graph(data, path: str, node_defs: dict) -> dict:
    """The API-format graph of a workflow file's JSON, converting a UI-format one."""
    if is_ui_workflow(data):
        try:
            return ui_to_api(data, node_defs)
        except ConversionError as error:
            raise BadInput(f"{path}: {error}") from None
    if is_api_workflow(data):
        return data
    raise BadInput(f"{path} is neither an API-format workflow (node ids mapping to class_type and inputs) nor a "
                   "UI-format one (nodes and links): save it from ComfyUI with Save or Save (API)")


def check_options(graph: dict, path: str, args) -> None:
    """Each given option must find the nodes it sets, and its values the range those inputs accept."""
    present = {node["class_type"] for node in graph.values()}
    given = {option: getattr(args, option) for option in OPTION_TARGETS if getattr(args, option) is not None}
    if args.seeds:
        given["seed"] = args.seeds
    for option in given:
        key, classes = OPTION_TARGETS[option]
        if not present & classes:
            flag = "--seeds" if option == "seed" and args.seeds else f"--{option}"
            raise BadInput(f"{flag} sets {key} on {' or '.join(sorted(classes))} nodes, and {path} has none: "
                           f"leave {flag} out or add such a node")
    if (args.prompt is not None or args.prompts) and not positive_encoders(graph):
        flag = "--prompt" if args.prompt is not None else "--prompts"
        raise BadInput(f"{flag} sets the text of the CLIPTextEncode feeding a KSampler's positive input, and {path} "
                       f"has none: leave {flag} out or use such a graph")
    if args.ab and not present & SPEEDUP_NODES:
        raise BadInput(f"--ab compares the graph with and without its {', '.join(sorted(SPEEDUP_NODES))} nodes, "
                       f"and {path} has none: leave --ab out or add one")


def check_ranges(graph: dict, node_defs: dict, args) -> None:
    """Each numeric option within the min and max the server declares for the inputs it sets."""
    values = {"seed": [args.seed] if args.seeds is None else [args.seeds[0], args.seeds[-1]],
              "steps": [args.steps], "width": [args.width], "height": [args.height], "ratio": [args.ratio]}
    for option, given in values.items():
        key, classes = OPTION_TARGETS[option]
        for class_type in sorted(classes & {node["class_type"] for node in graph.values()}):
            spec = input_options(node_defs.get(class_type, {}), key)
            low, high = spec.get("min"), spec.get("max")
            for value in given:
                if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
                    flag = "--seeds" if option == "seed" and args.seeds else f"--{option}"
                    raise BadInput(f"{flag} {value} is out of range for {class_type}.{key}: use a value from {low} "
                                   f"to {high}")


def input_options(node_def: dict, name: str) -> dict:
    """The options (min, max, ...) a node definition declares for one input; {} when it has none."""
    for section in ("required", "optional"):
        spec = node_def.get("input", {}).get(section, {}).get(name)
        if spec is not None:
            return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return {}


def make_jobs(graph: dict, args, prompts: list[tuple[int, str]] | None) -> list[Job]:
    """One job per seed and prompt (every pair), with the command's overrides applied."""
    base = apply_overrides(graph, args.ckpt, None, args.steps, args.width, args.height, args.ratio)
    seeds = list(args.seeds) if args.seeds else [args.seed]
    jobs = []
    for number, prompt in prompts or [(None, args.prompt)]:
        for seed in seeds:
            job_graph = apply_overrides(base, seed=seed, prompt=prompt)
            key = hashlib.sha256(json.dumps({"graph": job_graph, "ab": args.ab}, sort_keys=True).encode())
            jobs.append(Job(job_graph, key.hexdigest()[:16], number))
    return jobs


# ---------------------------------------------------------------- the manifest

class Manifest:
    """``OUT/manifest.jsonl``: one JSON object per finished job, appended as each finishes."""

    def __init__(self, out: Path):
        self.path = out / MANIFEST

    def done_keys(self) -> set[str]:
        """The keys of the jobs recorded; a line cut short by a crash is ignored (its job runs again)."""
        if not self.path.exists():
            return set()
        keys = set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                keys.add(json.loads(line)["key"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        return keys

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as manifest:
            # After a crash mid-line the file may not end in a newline: start ours on a fresh line.
            cut_short = manifest.seek(0, 2) > 0 and manifest.seek(-1, 2) >= 0 and manifest.read(1) != b"\n"
            manifest.write((b"\n" if cut_short else b"") + json.dumps(record).encode() + b"\n")


# ---------------------------------------------------------------- progress

def progress_bar(value: int, maximum: int, width: int = 30) -> str:
    filled = int(width * value / max(maximum, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {value}/{maximum}"


class Progress:
    """Jobs done and each worker's sampler steps, on one line of a terminal; finished jobs and notes as lines."""

    def __init__(self, total: int):
        self.total, self.done, self.images = total, 0, 0
        self.steps: dict[str, str] = {}
        self.live = sys.stderr.isatty()  # a log file gets the per-job lines only, not a redrawn bar

    def step(self, server: str, job: Job, value: int, maximum: int) -> None:
        self.steps[server] = f"{server.split('//')[-1]} {job.name} {value}/{maximum}"
        self.draw()

    def finished(self, server: str, images: int, lines: list[str]) -> None:
        self.done += 1
        self.images += images
        self.steps.pop(server, None)
        self.clear()
        print("\n".join(lines), flush=True)
        self.draw()

    def note(self, message: str) -> None:
        self.clear()
        print(message, file=sys.stderr, flush=True)
        self.draw()

    def draw(self) -> None:
        if self.live:
            line = " | ".join([progress_bar(self.done, self.total) + " jobs", *self.steps.values()])
            print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.live:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one prompt on one worker

async def get_json(session: aiohttp.ClientSession, url: str, seconds: float = 30):
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


async def run_prompt(session: aiohttp.ClientSession, server: str, graph: dict, on_progress=None) -> PromptRun:
    """Queue ``graph``, follow it on the websocket to the end, return its time and image references.

    WorkerLost when the worker stops answering; ClientError when it rejects the graph or the run fails.
    """
    client_id = uuid.uuid4().hex
    ws_url = server.replace("http", "ws", 1) + f"/ws?clientId={client_id}"
    async with session.ws_connect(ws_url, heartbeat=HEARTBEAT_S) as websocket:
        start = time.perf_counter()
        async with session.post(f"{server}/prompt", json={"prompt": graph, "client_id": client_id}) as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                details = json.dumps(body.get("node_errors") or body.get("error") or body, indent=2)
                raise ClientError(f"ComfyUI at {server} rejected the graph (HTTP {response.status}):\n{details}",
                                  EXIT_REJECTED)
        prompt_id = body["prompt_id"]
        async for message in websocket:
            if message.type == aiohttp.WSMsgType.ERROR:
                raise WorkerLost(f"websocket error: {websocket.exception()}")
            if message.type != aiohttp.WSMsgType.TEXT:
                continue  # binary frames are previews
            event = json.loads(message.data)
            data = event.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if event["type"] == "progress" and on_progress:
                on_progress(data["value"], data["max"])
            elif event["type"] == "execution_error":
                raise ClientError(f"execution failed in node {data.get('node_id')} ({data.get('node_type')}): "
                                  f"{data.get('exception_message', '').strip()}", EXIT_FAILED)
            elif event["type"] == "execution_interrupted":
                raise ClientError(f"execution interrupted in node {data.get('node_id')}", EXIT_FAILED)
            elif event["type"] == "executing" and data.get("node") is None:
                # Not "execution_success": ComfyUI sends that before it writes the prompt's history,
                # and "executing" with no node only after, so the images can be fetched now.
                break
        else:
            raise WorkerLost("the websocket closed before the prompt finished")
        seconds = time.perf_counter() - start
    history = (await get_json(session, f"{server}/history/{prompt_id}")).get(prompt_id, {})
    outputs = [image for node_output in history.get("outputs", {}).values()
               for image in node_output.get("images", [])]
    return PromptRun(prompt_id, seconds, outputs)


async def save_images(session: aiohttp.ClientSession, server: str, run: PromptRun, folder: Path,
                      stem: str) -> list[Path]:
    """Download the run's images as ``folder/STEM_N.ext``: unique per job, whichever worker made them."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = []
    for number, image in enumerate(run.outputs):
        params = {key: image[key] for key in ("filename", "subfolder", "type")}
        async with session.get(f"{server}/view", params=params) as response:
            response.raise_for_status()
            path = folder / f"{stem}_{number}{Path(image['filename']).suffix}"
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


# ---------------------------------------------------------------- one job

async def run_job(session: aiohttp.ClientSession, worker: Worker, job: Job, args, progress: Progress) -> dict:
    """Run one job on one worker, save its images, return its manifest record."""
    out = Path(args.out)
    stem = f"{job.name}_{job.key[:8]}"

    def on_progress(value, maximum):
        progress.step(worker.url, job, value, maximum)

    try:
        if not args.ab:
            run = await run_prompt(session, worker.url, job.graph, on_progress)
            images = await save_images(session, worker.url, run, out, stem)
            return job_record(job, worker, args, run, images)
        if not worker.warmed:
            # Untimed: loads the checkpoint and encodes the prompts, which both timed runs then reuse.
            warm_up = apply_overrides(without_speedups(job.graph), steps=1, width=64, height=64)
            await run_prompt(session, worker.url, warm_up)
            worker.warmed = True
        baseline = await run_prompt(session, worker.url, without_speedups(job.graph), on_progress)
        tome = await run_prompt(session, worker.url, job.graph, on_progress)
        baseline_images = await save_images(session, worker.url, baseline, out / "without_tome", stem)
        images = await save_images(session, worker.url, tome, out / "with_tome", stem)
    except NETWORK_ERRORS as error:
        raise WorkerLost(f"{type(error).__name__}: {error}") from error
    if not (baseline_images and images):
        raise BadInput("--ab compares the images of the two runs, and the graph returned none: add a SaveImage "
                       "or PreviewImage node")
    mad, psnr = image_difference(baseline_images[0], images[0])
    return {**job_record(job, worker, args, tome, images),
            "baseline_seconds": round(baseline.seconds, 3), "speedup": round(baseline.seconds / tome.seconds, 3),
            "baseline_images": relative(baseline_images, out), "mean_abs_diff": round(mad, 3),
            "psnr_db": None if psnr == float("inf") else round(psnr, 2)}


def relative(paths: list[Path], out: Path) -> list[str]:
    return [path.relative_to(out).as_posix() for path in paths]


def job_record(job: Job, worker: Worker, args, run: PromptRun, images: list[Path]) -> dict:
    return {"key": job.key, "workflow": str(args.workflow), "seed": graph_seed(job.graph),
            "prompt": graph_prompt(job.graph), "server": worker.url, "prompt_id": run.prompt_id,
            "seconds": round(run.seconds, 3), "images": relative(images, Path(args.out)),
            "attempts": job.attempts + 1,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def job_lines(record: dict, number: int, total: int, out: Path) -> list[str]:
    """What the terminal shows for a finished job (the A/B table with --ab)."""
    prompt = record["prompt"] if record["prompt"] is None or len(record["prompt"]) <= 40 \
        else record["prompt"][:37] + "..."
    images = ", ".join(str(out / image) for image in record["images"]) or "none"
    lines = [f"[{number}/{total}] seed {record['seed']}, prompt {prompt!r} on {record['server']}: "
             f"{record['seconds']:.1f} s, images: {images}"]
    if "baseline_seconds" in record:
        psnr = "inf" if record["psnr_db"] is None else f"{record['psnr_db']:.1f}"
        lines += ["| run | time per image (s) | speed-up |", "|---|---|---|",
                  f"| without ToMe | {record['baseline_seconds']:.1f} | 1.00x |",
                  f"| with ToMe | {record['seconds']:.1f} | {record['speedup']:.2f}x |",
                  f"image difference: mean |a-b| = {record['mean_abs_diff']:.2f} / 255, PSNR = {psnr} dB",
                  f"images: {out / record['baseline_images'][0]} and {out / record['images'][0]}"]
    return lines


# ---------------------------------------------------------------- the batch over workers

class Dispatcher:
    """The jobs not yet done: handed to free workers, taken back from lost ones."""

    def __init__(self, jobs: list[Job]):
        self.pending = collections.deque(jobs)
        self.in_flight = 0
        self.error: ClientError | None = None  # the first rejection or failure: it stops the batch
        self.changed = asyncio.Condition()
        self.over = asyncio.Event()

    async def take(self) -> Job | None:
        """The next job; waits while others run (one may come back); None once the batch is over."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.pending or not self.in_flight or self.error)
            if self.error or not self.pending:
                return None
            self.in_flight += 1
            return self.pending.popleft()

    async def settle(self, job: Job, requeue: bool = False, error: ClientError | None = None) -> None:
        """A taken job ended: done, back to the front of the queue, or failed (which stops the batch)."""
        async with self.changed:
            self.in_flight -= 1
            if requeue:
                self.pending.appendleft(job)
            if error and not self.error:
                self.error = error
            if not self.in_flight and (self.error or not self.pending):
                self.over.set()
            self.changed.notify_all()

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake when the batch is over."""
        try:
            await asyncio.wait_for(self.over.wait(), seconds)
        except asyncio.TimeoutError:
            pass


async def wait_until_free(session: aiohttp.ClientSession, worker: Worker, dispatcher: Dispatcher,
                          patience: float, progress: Progress) -> bool:
    """Wait until the worker's /queue is empty (it may serve others too); False once the batch is over or
    the worker has not answered for ``patience`` seconds."""
    down_since, delay = None, 1.0
    while not dispatcher.over.is_set():
        try:
            queue = await get_json(session, f"{worker.url}/queue", seconds=10)
        except NETWORK_ERRORS:
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > patience:
                progress.note(f"giving up on {worker.url}: no answer for {patience:.0f} s (--worker-patience)")
                return False
            await dispatcher.pause(delay)
            delay = min(2 * delay, 10.0)
            continue
        if down_since is not None:
            progress.note(f"{worker.url} answers again: it gets jobs again")
            down_since, delay = None, 1.0
        if not queue.get("queue_running") and not queue.get("queue_pending"):
            return True
        await dispatcher.pause(QUEUE_POLL_S)
    return False


async def serve(session: aiohttp.ClientSession, worker: Worker, dispatcher: Dispatcher, manifest: Manifest,
                args, progress: Progress) -> None:
    """One worker's loop: whenever it is free, run the next job; a lost job goes back to the queue."""
    while await wait_until_free(session, worker, dispatcher, args.worker_patience, progress):
        job = await dispatcher.take()
        if job is None:
            return
        try:
            record = await run_job(session, worker, job, args, progress)
        except WorkerLost as lost:
            job.attempts += 1
            worker.warmed = False  # a restarted worker has to load the model again
            if job.attempts >= MAX_ATTEMPTS:
                await dispatcher.settle(job, error=ClientError(
                    f"job {job.name} lost its worker {job.attempts} times (last {worker.url}: {lost}): it may be "
                    "what stops them; see the ComfyUI logs", EXIT_FAILED))
                return
            progress.note(f"{worker.url} stopped answering ({lost}): job {job.name} goes back to the queue")
            await dispatcher.settle(job, requeue=True)
            continue
        except ClientError as error:
            await dispatcher.settle(job, error=error)
            return
        manifest.append(record)
        progress.finished(worker.url, len(record["images"]),
                          job_lines(record, progress.done + 1, progress.total, Path(args.out)))
        await dispatcher.settle(job)


async def reachable(session: aiohttp.ClientSession, servers: list[str]) -> list[str]:
    """The servers whose /queue answers now."""
    async def answers(url):
        try:
            await get_json(session, f"{url}/queue", seconds=10)
            return True
        except NETWORK_ERRORS:
            return False

    return [url for url, ok in zip(servers, await asyncio.gather(*map(answers, servers)), strict=True) if ok]


async def main_async(args) -> int:
    data = load_workflow(args.workflow)
    prompts = read_prompts(args.prompts) if args.prompts else None
    servers = list(dict.fromkeys(args.server or [DEFAULT_SERVER]))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=ANSWER_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        live = await reachable(session, servers)
        if not live:
            raise ClientError(f"cannot reach ComfyUI at {', '.join(servers)}: start it, or give its address "
                              "with --server", EXIT_UNREACHABLE)
        try:
            node_defs = await get_json(session, f"{live[0]}/object_info", seconds=120)
        except NETWORK_ERRORS as error:
            raise ClientError(f"cannot read the node list at {live[0]}/object_info ({error}): check that worker",
                              EXIT_UNREACHABLE) from None
        graph = api_graph(data, args.workflow, node_defs)
        check_options(graph, args.workflow, args)
        check_ranges(graph, node_defs, args)
        jobs = make_jobs(graph, args, prompts)
        manifest = Manifest(Path(args.out))
        if args.seeds or prompts:  # a batch resumes; a single graph always runs
            done = manifest.done_keys()
            todo = [job for job in jobs if job.key not in done]
            if len(todo) < len(jobs):
                print(f"skipping {len(jobs) - len(todo)} of {len(jobs)} jobs already in {manifest.path}")
            jobs = todo
        for url in servers:
            if url not in live:
                print(f"warning: {url} does not answer yet; it gets jobs once it does", file=sys.stderr)
        return await run_batch(session, servers, jobs, manifest, args)


async def run_batch(session: aiohttp.ClientSession, servers: list[str], jobs: list[Job], manifest: Manifest,
                    args) -> int:
    """Run the jobs on the workers; the exit status."""
    if not jobs:
        return 0
    progress = Progress(len(jobs))
    progress.draw()
    dispatcher = Dispatcher(jobs)
    start = time.perf_counter()
    await asyncio.gather(*(serve(session, Worker(url), dispatcher, manifest, args, progress) for url in servers))
    progress.clear()
    seconds = time.perf_counter() - start
    if progress.done:
        print(f"{progress.done} jobs done, {progress.images} images in {seconds:.1f} s on {len(servers)} "
              f"worker(s): {60 * progress.images / seconds:.1f} images/min")
    if dispatcher.error:
        raise dispatcher.error
    if dispatcher.pending:
        raise ClientError(f"{len(dispatcher.pending)} jobs not done: no worker answers. Restart the workers and "
                          "rerun the same command to finish them", EXIT_UNREACHABLE)
    return 0


# ---------------------------------------------------------------- command line

class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is bad input (exit 5), not argparse's status 2, which means unreachable."""

    def error(self, message):
        raise BadInput(f"{message} (see --help)")


def build_parser() -> Parser:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("workflow", help="a workflow JSON: API format (workflows/api/) or UI format (workflows/)")
    parser.add_argument("--server", action="append", type=server_url,
                        help=f"a ComfyUI worker's address; repeat for several (default {DEFAULT_SERVER})")
    parser.add_argument("--ckpt", help="checkpoint name, as ComfyUI lists it")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, help="the KSampler seed of the one job")
    seeds.add_argument("--seeds", type=seed_range, metavar="A-B",
                       help="one job per seed from A to B (inclusive): a batch")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", metavar="TEXT",
                         help="the positive prompt (the CLIPTextEncode feeding KSampler's positive) of every job")
    prompts.add_argument("--prompts", metavar="FILE",
                         help="one job per non-blank line, each the positive prompt (with --seeds: every pair)")
    parser.add_argument("--steps", type=int, help="KSampler steps")
    parser.add_argument("--width", type=latent_size, help="image width in pixels (a multiple of 8)")
    parser.add_argument("--height", type=latent_size, help="image height in pixels (a multiple of 8)")
    parser.add_argument("--ratio", type=float, help="ToMe ratio on every Apply ToMe node (the node's range)")
    parser.add_argument("--out", default="output", help="folder for the images and manifest.jsonl")
    parser.add_argument("--ab", action="store_true", help="run each job with and without ToMe and compare")
    parser.add_argument("--worker-patience", type=float, default=120, metavar="SECONDS",
                        help="how long a worker that stopped answering may take to come back before the client "
                             "gives up on it (default 120)")
    return parser


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    try:
        return asyncio.run(main_async(parse_args(argv)))
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status


if __name__ == "__main__":
    sys.exit(main())
