"""The server's cores, shared by the steps' own compute and the costs the replay sleeps.

On a server, a stub copying tensors, a BLS call being made and the front end reading a
request burn CPU on the cores that run the steps' functions. The replay spends those
costs by sleeping (:mod:`pipelines.runtime.replay`), which leaves this machine's cores to
the steps: where the cores are busy, a step's compute runs faster here than on the
server. Measured on yolov5 at concurrency 4 (docs/server_profiles.md): the server's
detector computes 15-25 % longer than at concurrency 1, this runtime's 2-9 % longer, and
the async BLS form, whose rounds wait for their slowest request, came out 6-16 % fast.

:class:`CpuShare` keeps a clock of how much slower a compute would run on the server than
here at each moment, from what is running: ``k``, the computes (each weighed by the share
of a core its step was seen to use), and ``s``, the replayed costs being slept (each a
core's worth of work on the server). Here a compute gets ``min(1, cores_here / k)`` of a
core, on the server ``min(1, server_cores / (k + s))``. A compute's CPU time, stretched by
the mean ratio over its run, is what it would take there; the rest is held, with its
instance, after the step's function returns. At concurrency 1 nothing shares a core and
nothing is held. A step run on the event loop (``async def``, or one cheaper than a hand-over
to a thread) is not held: the loop cannot wait, and such a step's compute is too short to
matter.
"""

from __future__ import annotations

import os
import threading
from time import perf_counter

__all__ = ["CpuShare", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


class CpuShare:
    """The slowdown clock (see the module docstring); every method is thread-safe."""

    __slots__ = ("server_cores", "cores_here", "_lock", "_computing", "_sleeping", "_since", "_area")

    def __init__(self, server_cores: float, cores_here: int | None = None) -> None:
        self.server_cores = max(1.0, float(server_cores))
        self.cores_here = float(cores_here or usable_cores())
        self._lock = threading.Lock()
        self._computing = 0.0  # the running computes, each weighed by its share of a core
        self._sleeping = 0  # replayed costs being slept
        self._since = perf_counter()
        self._area = 0.0  # the integral of the slowdown over time

    def _advance(self) -> float:
        now = perf_counter()
        k, s = self._computing, self._sleeping
        slowdown = max(1.0, (k + s) / self.server_cores) / max(1.0, k / self.cores_here)
        self._area += slowdown * (now - self._since)
        self._since = now
        return now

    def sleeper(self, change: int) -> None:
        """A replayed cost starts (+1) or ends (-1) being slept."""
        with self._lock:
            self._advance()
            self._sleeping += change

    def begin(self, weight: float) -> tuple[float, float]:
        """A compute using ``weight`` of a core starts; returns its mark for :meth:`slowdown`."""
        with self._lock:
            now = self._advance()
            self._computing += weight
            return now, self._area

    def slowdown(self, mark: tuple[float, float]) -> float:
        """How many times longer the compute begun at ``mark`` would have run on the server."""
        with self._lock:
            now = self._advance()
            began, area = mark
            return (self._area - area) / (now - began) if now > began else 1.0

    def end(self, weight: float) -> None:
        with self._lock:
            self._advance()
            self._computing = max(0.0, self._computing - weight)
