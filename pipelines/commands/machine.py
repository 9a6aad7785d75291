"""The machine a figure comes from: its CPU, the cores this process may use, its memory, and
whether it has a GPU. Benchmarks record it, and a server profile is checked against it.
"""

from __future__ import annotations

import os
import platform
import shutil
from typing import Any

__all__ = ["machine_info"]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """The machine the figures come from: CPU, cores usable by this process, memory, GPU presence."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gib": _memory_gib(),
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
    }
