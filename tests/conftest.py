"""Shared by every test layer: the repository root, importable for ``tome``."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Appended, not prepended: the pack's own nodes.py must never shadow ComfyUI's nodes module.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "scripts"))
