"""The machine a figure comes from: its CPU, the cores this process may use, its memory, and
whether it has a GPU. Benchmarks record it, and a server profile is checked against it.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Iterator
from typing import Any

__all__ = ["machine_info", "process_stats"]


def process_stats() -> Iterator[tuple[int, list[bytes]]]:
    """Every process's ``/proc/PID/stat`` fields after its command name (``state`` first, then ``ppid``,
    ``pgrp`` ...), by pid; nothing off Linux. The name may hold spaces or parentheses, the fields after its
    last ``)`` cannot; a process that goes away while it is read is left out."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(b")") + 2:].split()


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
