"""Watching the machine while a calibration or a prediction measures: the CPU that other processes used and the
steal (the figures themselves, :class:`~pipelines.calibration.noise.MachineNoise`, are the profile's schema)."""

from __future__ import annotations

import os
from time import perf_counter

from ..calibration.noise import MachineNoise
from ..triton.cleanup import process_stats

__all__ = ["NoiseWatch"]


class NoiseWatch:
    """Watches the machine from when it is made until :meth:`stop`: the CPU time the machine spent (``/proc/stat``)
    against what this process and its descendants spent (``/proc/PID/stat``, with their reaped children's), and the
    steal. Off Linux it measures nothing (every figure ``None``)."""

    def __init__(self) -> None:
        self._began = perf_counter()
        self._machine = _machine_ticks()
        self._ours = _tree_ticks()

    def stop(self, *, disagreement: float | None = None) -> MachineNoise:
        seconds = perf_counter() - self._began
        machine, ours = _machine_ticks(), _tree_ticks()
        cores = float(os.cpu_count() or 1)
        if machine is None or self._machine is None or ours is None or self._ours is None or seconds <= 0:
            return MachineNoise(disagreement=disagreement, cores=cores, seconds=seconds)
        tick = float(os.sysconf("SC_CLK_TCK"))
        busy = machine[0] - self._machine[0]
        total = machine[2] - self._machine[2]
        # Ticks are coarse (10 ms): a short watch reads a core's worth of rounding, so the load is not below 0.
        other = max(0.0, (busy - (ours - self._ours)) / tick / seconds)
        steal = (machine[1] - self._machine[1]) / total if total > 0 else 0.0
        return MachineNoise(other_load=other, steal=steal, disagreement=disagreement, cores=cores, seconds=seconds)


def _machine_ticks() -> tuple[float, float, float] | None:
    """The machine's (busy, steal, total) clock ticks since boot, from ``/proc/stat``'s first line; None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            values = [float(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0.0] * 8)[:8]
    return user + nice + system + irq + softirq, steal, sum(values)


def _tree_ticks() -> float | None:
    """The CPU clock ticks this process and its descendants have used, with the children each has reaped."""
    if not os.path.isdir("/proc"):
        return None
    parents: dict[int, int] = {}
    ticks: dict[int, float] = {}
    for pid, stat in process_stats():
        try:
            parents[pid] = int(stat[1])
            ticks[pid] = sum(float(v) for v in stat[11:15])  # utime, stime, cutime, cstime
        except (IndexError, ValueError):
            continue
    ours, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in ours:
                ours.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0.0) for pid in ours)
