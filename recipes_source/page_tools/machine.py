"""What a page ran on: the CPU's name, cores and memory, the GPUs, the torch version."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import psutil
import torch


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe() -> dict:
    """The machine, as a page's results file records it (asks NVML, never starts CUDA)."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
    }
