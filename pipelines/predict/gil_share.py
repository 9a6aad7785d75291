"""How far two threads of one process fail to overlap one step: its GIL share, the part of
its CPU time that the fused form's threads cannot run side by side. Measured for
:mod:`pipelines.predict.step_profiles` by running the step in one thread, then in two.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
from collections.abc import Callable
from time import perf_counter, process_time
from typing import Any

__all__ = ["GIL_PAIRS", "GIL_RUN_S", "GIL_TARGET_S", "gil_share", "usable_cores"]

#: Pairs of runs (one thread, then two at once): about this many seconds of runs alone, and
#: at least :data:`GIL_PAIRS` pairs.
GIL_TARGET_S = 0.05
GIL_PAIRS = 5
#: A run lasts this long at least: a thread takes tens of µs to wake, more on a busy machine.
GIL_RUN_S = 0.005

Span = tuple[float, float]
Run = tuple[Span, float, Span, Span, float]


def gil_share(first: Callable[[], Any], second: Callable[[], Any], wall_s: float) -> float:
    """The share (0..1) of a step's CPU time that holds the GIL, from ``first`` and ``second``,
    two calls of one execution of it on two instances, that take ``wall_s`` seconds alone.

    Any lock the step takes counts as the GIL does (some BLAS builds let one call in at a
    time): what matters to the fused form is what threads of one process cannot overlap. It is
    the median over pairs of runs (see :func:`_lost_share`): the runs of a pair follow each
    other, so other work on the machine weighs on both alike, and the median leaves out the
    pairs it upset. Where other work leaves fewer than two cores free, two threads cannot
    overlap whatever the GIL does and the figure reads high: profile on a quiet machine.
    """
    calls = math.ceil(GIL_RUN_S / max(wall_s, 1e-9))
    pairs = max(math.ceil(GIL_TARGET_S / (calls * max(wall_s, 1e-9))), GIL_PAIRS)
    cores = usable_cores()
    share = statistics.median(_lost_share(*run, cores=cores) for run in _paired(first, second, pairs, calls))
    return min(max(share, 0.0), 1.0)


def _lost_share(alone: Span, cpu_alone: float, a: Span, b: Span, cpu_both: float, *, cores: int) -> float:
    """One pair of runs: ``alone`` in one thread, then ``a`` and ``b`` in two at once (start and
    end, in seconds), and the CPU seconds the process used in each.

    Together the runs take ``t2``, from the first start to the last end (a thread that waits
    for the GIL cannot even note its start, so only the first start is sure). Work that
    releases the GIL (numpy, sleeping, I/O) overlaps and ``t2`` stays near ``t1``, the run
    alone; pure Python runs in one thread at a time and ``t2`` nears ``2 t1``. The time lost,
    ``t2 - t1``, is the time one run held the GIL; over the run's CPU time, the share (times
    the cores the run keeps busy, where more than one: the GIL is held by one of them). Two
    bounds keep other causes out:

    - what the cores alone explain (two runs' CPU on this machine's cores) is not the GIL:
      ``t2`` is compared with ``max(t1, 2 cpu1 / cores)``;
    - one thread waits for the GIL no longer than the other holds it, and holds it no longer
      than it runs: the loss counts up to half the CPU the two used. So a step that mostly
      waits (sleeps, I/O) is not judged on a busy machine's late wake-ups; its CPU counts as
      a tenth of its wall time at least, for the same reason.

    On one core the GIL and the core cannot be told apart: the figure is then an upper bound.
    """
    t1 = alone[1] - alone[0]
    t2 = max(a[1], b[1]) - min(a[0], b[0])
    expected = max(t1, 2 * cpu_alone / cores) if cores > 1 else t1
    lost = min(t2 - expected, cpu_both / 2)
    return lost * max(1.0, cpu_alone / max(t1, 1e-9)) / max(cpu_alone, 0.1 * t1, 1e-9)


def _paired(first: Callable[[], Any], second: Callable[[], Any], pairs: int, calls: int) -> list[Run]:
    """``pairs`` times: ``calls`` calls of ``first`` alone, then ``calls`` of ``first`` and as many
    of ``second`` at once, each on a thread of its own. For each pair, the run alone and the
    process's CPU seconds meanwhile, then the two runs together and the CPU seconds meanwhile.
    What a call raises is raised here."""
    go, done = threading.Barrier(3), threading.Barrier(3)
    spans: list[list[Span | None]] = [[], []]
    errors: list[BaseException] = []
    phases = [False, True] * pairs  # does the second thread run, this phase

    def work(index: int, call: Callable[[], Any]) -> None:
        try:
            for together in phases:
                go.wait()
                if index == 0 or together:
                    t0 = perf_counter()
                    for _ in range(calls):
                        call()
                    spans[index].append((t0, perf_counter()))
                else:
                    spans[index].append(None)
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
    runs: list[Run] = []
    try:
        for i in range(0, len(phases), 2):
            c0 = process_time()
            go.wait()
            done.wait()
            c1 = process_time()
            go.wait()
            done.wait()
            c2 = process_time()
            alone, a, b = spans[0][i], spans[0][i + 1], spans[1][i + 1]
            assert alone is not None and a is not None and b is not None
            runs.append((alone, c1 - c0, a, b, c2 - c1))
    except threading.BrokenBarrierError:
        pass  # a call raised: its error is raised below
    finally:
        go.abort()  # frees a thread still waiting (after an interrupt); harmless once all are through
        done.abort()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return runs


def usable_core_ids() -> list[int]:
    """The cores this process may run on, by number; none where they cannot be listed (not on
    Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return []


def usable_cores() -> int:
    """How many cores this process may run on."""
    return len(usable_core_ids()) or os.cpu_count() or 1
