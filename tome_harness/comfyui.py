"""Find and boot the real ComfyUI, in-process or as a server's environment.

The host is ``COMFYUI_PATH`` when set, else ``.comfyui/`` in the repository
(provisioned by ``scripts/setup.sh``). Where torchvision is not installed, the
stand-in of ``tome_harness/host_shims`` goes on the path (see its docstring).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIMS = Path(__file__).resolve().parent / "host_shims"
PACK_NAME = "comfyui-tome"  # the folder name ComfyUI loads the pack under in tests
# ComfyUI's attention backends by our name, and the command-line flag (``comfy.cli_args.args``) that picks each.
ATTENTION_FLAGS = {"split": "use_split_cross_attention", "sub-quadratic": "use_quad_cross_attention",
                   "sdpa": "use_pytorch_cross_attention"}
ATTENTION_CHOICES = tuple(ATTENTION_FLAGS)


def comfyui_path() -> Path:
    path = Path(os.environ.get("COMFYUI_PATH") or ROOT / ".comfyui").resolve()
    if not (path / "main.py").exists():
        raise RuntimeError(f"no ComfyUI at {path}: run scripts/setup.sh, or set COMFYUI_PATH to a ComfyUI checkout")
    return path


def extra_python_paths() -> list[str]:
    """What ComfyUI needs on sys.path besides its own folder."""
    spec = importlib.util.find_spec("torchvision")
    # Once an in-process boot put the stand-in on sys.path, find_spec finds it: that is no real torchvision.
    real = spec is not None and spec.origin is not None and not Path(spec.origin).is_relative_to(SHIMS)
    return [] if real else [str(SHIMS)]


def link_pack(custom_nodes: Path) -> Path:
    """Put the pack into ``custom_nodes`` under a fixed name, as a user's install would."""
    custom_nodes.mkdir(parents=True, exist_ok=True)
    link = custom_nodes / PACK_NAME
    if not link.exists():
        link.symlink_to(ROOT, target_is_directory=True)
    return link


def boot_in_process(custom_nodes: Path, cpu: bool = True, sdpa: bool = False, attention: str | None = None):
    """Import ComfyUI, load its built-in nodes and this pack; returns ComfyUI's ``nodes`` module.

    ``cpu``: ComfyUI's ``--cpu``; ``attention``: its attention backend, one of ``ATTENTION_CHOICES`` (split,
    sub-quadratic, sdpa: ``--use-split-cross-attention``, ``--use-quad-cross-attention``,
    ``--use-pytorch-cross-attention``); None: ``sdpa`` (True means "sdpa"), else ComfyUI's default for the
    device (sub-quadratic on the CPU, SDPA on CUDA). ComfyUI reads these once, on import: the first boot of a
    process decides.
    """
    attention = attention or ("sdpa" if sdpa else None)
    if attention is not None and attention not in ATTENTION_FLAGS:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    root = str(comfyui_path())
    for path in [root, *extra_python_paths()][::-1]:
        if path not in sys.path:
            sys.path.insert(0, path)
    from comfy.cli_args import args

    args.cpu = cpu
    for name, flag in ATTENTION_FLAGS.items():
        setattr(args, flag, name == attention)
    args.disable_api_nodes = True
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    link = str(link_pack(custom_nodes))
    if not asyncio.run(nodes.load_custom_node(link)):
        raise RuntimeError("ComfyUI could not load the pack")
    global _pack_module_name
    _pack_module_name = link.replace(".", "_x_")  # the name ComfyUI imports a folder under
    return nodes


_pack_module_name = None


def pack_module(name: str):
    """A module of the pack as ComfyUI loaded it (``nodes``, ``tome.hosts.comfyui_unet``, ...)."""
    return importlib.import_module(f"{_pack_module_name}.{name}")
