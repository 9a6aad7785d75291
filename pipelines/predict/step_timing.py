"""Timing one step's calls: the median wall and CPU time of repeated calls after a warm-up, each
timed call made with its inputs out of the caches where they are large, as on the server.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from time import perf_counter, process_time
from typing import Any

import numpy as np

__all__ = ["COLD_BYTES", "MAX_REPEATS", "MIN_REPEATS", "TARGET_S", "evict", "time_call"]

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


def time_call(call: Callable[[], Any], repeats: int | None,
              before: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median wall and CPU seconds of ``call()`` after one warm-up call; ``before()`` runs, untimed,
    before each timed call."""
    call()
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
        if repeats is not None:
            if done >= repeats:
                break
        elif done >= MAX_REPEATS or (done >= MIN_REPEATS and w1 - start >= TARGET_S):
            break
    return statistics.median(walls), statistics.median(cpus)

