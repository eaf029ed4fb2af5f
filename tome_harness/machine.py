"""Where a bench ran, for its records: the CPU by name (and whether it has bf16 matrix units, which make a
bf16 row incomparable with one from a CPU without them), its threads, torch, and the GPU if any."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``; elsewhere what ``platform`` knows)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def bf16_matrix_units() -> bool:
    """Whether the CPU multiplies bf16 matrices in hardware (Intel AMX): there bf16 matrix products run several
    times faster than fp32 ones, and a bf16 forward's shares (attention, matching) differ from other CPUs'."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "amx_bf16" in cpuinfo.read_text()


def describe() -> dict:
    return {"cpu": cpu_name(), "bf16 matrix units": bf16_matrix_units(), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
