"""Timing one step's calls: the median wall and CPU time of repeated calls after a warm-up, each
timed call made with its inputs out of the caches where they are large, as on the server.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from time import perf_counter, process_time
from typing import Any

import numpy as np

__all__ = ["COLD_BYTES", "MAX_REPEATS", "MIN_REPEATS", "TARGET_S", "evict", "time_call", "timed_calls"]

#: Seconds of repeats to aim for at each batch size, when ``repeats`` is not given.
TARGET_S = 0.2
MIN_REPEATS = 3
MAX_REPEATS = 1000

#: Inputs from this size up are timed out of the caches (below it, a cold read costs nothing
#: that shows, and evicting before each of hundreds of calls would cost seconds).
COLD_BYTES = 256 << 10
_EVICTION = 32 << 20  # bytes written between two timed calls: more than the last-level cache
_evicting: list[Any] = []


def evict() -> None:
    """Write more memory than the caches hold, so the next call reads its inputs from memory."""
    if not _evicting:
        _evicting.append(np.zeros(_EVICTION, np.uint8))
    _evicting[0] += 1


def time_call(call: Callable[[], Any], repeats: int | None, before: Callable[[], None] | None = None, *,
              target_s: float = TARGET_S) -> tuple[float, float]:
    """Median wall and CPU seconds of ``call()`` after one warm-up call (:func:`timed_calls`)."""
    call()
    walls, cpus = timed_calls(call, repeats, before, target_s=target_s)
    return statistics.median(walls), statistics.median(cpus)


def timed_calls(call: Callable[[], Any], repeats: int | None, before: Callable[[], None] | None = None, *,
                target_s: float = TARGET_S, most: int = MAX_REPEATS) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each of ``repeats`` calls (``None``: about ``target_s`` of calls, at
    least :data:`MIN_REPEATS`, at most ``most``); ``before()`` runs, untimed, before each. CPU time
    is the process's, not the thread's: numpy's own threads (BLAS, OpenMP) keep the cores busy too."""
    walls: list[float] = []
    cpus: list[float] = []
    start = perf_counter()
    while True:
        if before is not None:
            before()
        c0, w0 = process_time(), perf_counter()
        call()
        w1, c1 = perf_counter(), process_time()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        done = len(walls)
        if done >= (repeats or most) or (repeats is None and done >= MIN_REPEATS and w1 - start >= target_s):
            return walls, cpus
