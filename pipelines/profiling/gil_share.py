"""How far two threads of one process fail to overlap one step: its GIL share, the part of its CPU time that the fused
form's threads cannot run side by side. Measured for :mod:`pipelines.profiling.step_profiles` by running the step in one
thread, then in two.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from time import perf_counter, process_time
from typing import Any

__all__ = ["GIL_PAIRS", "GIL_RUN_S", "GIL_TARGET_S", "gil_losses", "usable_cores"]

#: Pairs of runs (one thread, then two at once): about this many seconds of runs alone, and at least :data:`GIL_PAIRS`.
GIL_TARGET_S = 0.05
GIL_PAIRS = 5
#: A run lasts this long at least: a thread takes tens of µs to wake, more on a busy machine.
GIL_RUN_S = 0.005

Span = tuple[float, float]
Run = tuple[Span, float, Span, Span, float]


def gil_losses(first: Callable[[], Any], second: Callable[[], Any], wall_s: float, *, target_s: float = GIL_TARGET_S,
               least: int = GIL_PAIRS) -> list[float]:
    """The share of a step's CPU time that holds the GIL (or any lock it takes: some BLAS builds let one call in at a
    time) as each pair of runs reads it, from ``first`` and ``second``, two calls of one execution of it on two
    instances, that take ``wall_s`` seconds alone (about ``target_s`` of runs alone, and ``least`` pairs at least;
    :func:`_lost_share`, an upper bound on one core). A pair's runs follow each other, so other work weighs on both
    alike, and a median over pairs leaves out those it upset."""
    calls = math.ceil(GIL_RUN_S / max(wall_s, 1e-9))
    pairs = max(math.ceil(target_s / (calls * max(wall_s, 1e-9))), least)
    cores = usable_cores()
    return [_lost_share(*run, cores=cores) for run in _paired(first, second, pairs, calls)]


def _lost_share(alone: Span, cpu_alone: float, a: Span, b: Span, cpu_both: float, *, cores: int) -> float:
    """One pair of runs: ``alone`` in one thread, then ``a`` and ``b`` in two at once (start and end, in seconds), and
    the CPU seconds the process used in each; how it reads them: docs/step_profiles.md."""
    t1 = alone[1] - alone[0]
    t2 = max(a[1], b[1]) - min(a[0], b[0])
    expected = max(t1, 2 * cpu_alone / cores) if cores > 1 else t1
    lost = min(t2 - expected, cpu_both / 2)
    return lost * max(1.0, cpu_alone / max(t1, 1e-9)) / max(cpu_alone, 0.1 * t1, 1e-9)


def _paired(first: Callable[[], Any], second: Callable[[], Any], pairs: int, calls: int) -> list[Run]:
    """``pairs`` times: ``calls`` calls of ``first`` alone, then as many of ``first`` and ``second`` at once, each on a
    thread of its own; for each pair, each run's span and the process's CPU seconds meanwhile. What a call raises is
    raised here."""
    go, done = threading.Barrier(3), threading.Barrier(3)
    spans: dict[tuple[int, int], Span] = {}  # by thread and phase
    errors: list[BaseException] = []
    phases = [False, True] * pairs  # does the second thread run, this phase

    def work(index: int, call: Callable[[], Any]) -> None:
        try:
            for phase, together in enumerate(phases):
                go.wait()
                if index == 0 or together:
                    t0 = perf_counter()
                    for _ in range(calls):
                        call()
                    spans[index, phase] = (t0, perf_counter())
                done.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # the step's own error, raised by the caller
            errors.append(exc)
            go.abort()
            done.abort()

    threads = [threading.Thread(target=work, args=(i, c), name="gil_share", daemon=True)
               for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    cpu = [process_time()]  # at each phase's start, and at the last one's end
    try:
        for _ in phases:
            go.wait()
            done.wait()
            cpu.append(process_time())
    except threading.BrokenBarrierError:
        pass  # a call raised: its error is raised below
    finally:
        go.abort()  # frees a thread still waiting (after an interrupt); harmless once all are through
        done.abort()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [(spans[0, i], cpu[i + 1] - cpu[i], spans[0, i + 1], spans[1, i + 1], cpu[i + 2] - cpu[i + 1])
            for i in range(0, len(phases), 2)]


def usable_core_ids() -> list[int]:
    """The cores this process may run on, by number; none where they cannot be listed (not Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return []


def usable_cores() -> int:
    """How many cores this process may run on."""
    return len(usable_core_ids()) or os.cpu_count() or 1
