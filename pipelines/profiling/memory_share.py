"""How much of a step's time waits on memory, its *memory share*: how it is read, what it measured, and why CPU time,
the streamer's duty and the pinning to cores, in docs/simulation.md, "The memory bus". The streamer is a plain
interpreter, not :mod:`multiprocessing`'s, whose spawned children import the caller's ``__main__`` again and whose
forked ones copy its threads.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter, sleep
from typing import Any

from ..errors import PipelinesError
from .gil_share import usable_core_ids, usable_cores
from .step_timing import timed_calls

__all__ = ["MIN_CPU_US", "MIN_DUTY", "MemoryShare", "Streamer", "measure_memory_share", "streamer"]

#: Below this much CPU time a call (µs), a step's memory traffic is too small to matter beside its boundaries' fixed
#: costs, and its share is not measured (0).
MIN_CPU_US = 50.0
#: Below this duty (the part of the loaded turns the streamer ran), the machine is too busy to tell.
MIN_DUTY = 1 / 3

_STREAM_FLOATS = 16 << 20  # 64 MiB arrays: beyond any last-level cache, so every copy goes to memory
_CHUNK_FLOATS = 1 << 20  # 4 MiB a chunk, about a millisecond: the streamer stops within one
_SETTLE_S = 0.02  # after a change of load: the streamer wakes up, or finishes its chunk
_TURN_S = 0.05  # seconds of calls in each turn, alone or loaded, where no count is given
_MAX_CALLS = 200
_START_S = 60.0
_LONGEST_S = 60.0  # the longest the streamer streams without being told to stop (a turn: ~0.1 s)

# SIGUSR1 sets the streamer copying, SIGUSR2 stops it (checked between chunks); it then prints the CPU seconds it
# streamed and the chunks it copied. It never streams longer than a minute unbidden, nor once its parent has gone (it
# checks once a second): a measurement cut short must not leave a core streaming. Each start is answered at its own
# stop, even one that comes after it stopped by itself or before it began (a loaded machine may run it late), so no stop
# is left over for the next start. The signals are blocked before numpy starts its threads, which inherit the mask: a
# thread that did not block them would take one, whose default action ends the process.
_STREAMER = """
import os, signal, time
go, stop = signal.SIGUSR1, signal.SIGUSR2
signal.pthread_sigmask(signal.SIG_BLOCK, {{go, stop}})
import numpy as np
n, chunk, parent = {floats}, {chunk}, {parent}
a = np.ones(n, np.float32)
b = np.empty_like(a)
np.copyto(b, a)
print("ready", flush=True)
while os.getppid() == parent:
    if signal.sigtimedwait({{go}}, 1.0) is None:
        continue
    began, until, copied = time.process_time(), time.monotonic() + {longest}, 0
    while stop not in signal.sigpending() and os.getppid() == parent and time.monotonic() < until:
        for at in range(0, n, chunk):
            np.copyto(b[at:at + chunk], a[at:at + chunk])
            copied += 1
            if stop in signal.sigpending():
                break
        a, b = b, a
    streamed = time.process_time() - began
    while os.getppid() == parent and signal.sigtimedwait({{stop}}, 1.0) is None:
        pass  # a turn ends at its own stop, one that streamed its longest too
    print(streamed, copied, flush=True)
"""


class Streamer:
    """A process that streams memory while :meth:`streaming` is entered, asleep otherwise; :meth:`close` ends it."""

    def __init__(self) -> None:
        code = _STREAMER.format(floats=_STREAM_FLOATS, chunk=_CHUNK_FLOATS, parent=os.getpid(), longest=_LONGEST_S)
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            _pin(self._proc.pid, -1)
            # one still starting up is no load yet: measuring then would see none
            if self._line().strip() != b"ready":
                raise PipelinesError(f"the process that streams memory beside a step did not start in "
                                     f"{_START_S:g} s (exit status {self._proc.poll()})")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdout.close()

    def _signal(self, signum: int) -> None:
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            raise PipelinesError(f"the process that streams memory beside a step has ended (exit status {code})")
        self._proc.send_signal(signum)

    @contextmanager
    def streaming(self) -> Iterator[list[float]]:
        """Another core streams memory inside this block; the list it gives holds, after it, the seconds the block took,
        the CPU seconds the streamer ran meanwhile and the chunks it copied."""
        took: list[float] = []
        self._signal(signal.SIGUSR1)
        sleep(_SETTLE_S)
        began = perf_counter()
        try:
            yield took
        finally:
            took.append(perf_counter() - began + _SETTLE_S)
            self._signal(signal.SIGUSR2)
            took.extend(self._streamed())
            sleep(_SETTLE_S)

    def _line(self) -> bytes:
        """The streamer's next line; empty where it says nothing in :data:`_START_S`."""
        assert self._proc is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], _START_S)
        return self._proc.stdout.readline() if ready else b""

    def _streamed(self) -> tuple[float, float]:
        try:
            cpu, chunks = self._line().split()
            return float(cpu), float(chunks)
        except ValueError:
            raise PipelinesError(f"the process that streams memory beside a step did not say what it streamed "
                                 f"(exit status {self._proc.poll()})") from None


def _pin(pid: int, index: int) -> set[int] | None:
    """Keep ``pid`` (0: this thread) to the usable core at ``index``; returns what it was allowed before (``None``
    where it is not pinned: one core, or not Linux)."""
    cores = usable_core_ids()
    if len(cores) < 2:
        return None
    before = os.sched_getaffinity(pid)
    os.sched_setaffinity(pid, {cores[index]})
    return before


_shared: list[Streamer] = []
_lock = threading.Lock()


def streamer() -> Streamer | None:
    """This process's streamer, started on first use and ended at exit; ``None`` on one core, where nothing runs
    beside a step."""
    if usable_cores() < 2:
        return None
    with _lock:
        if not _shared:
            _shared.append(Streamer())
            atexit.register(_shared[0].close)
        return _shared[0]


@dataclass(frozen=True)
class MemoryShare:
    """One measurement: ``share`` (0..1, 0 where it could not tell), the ``slowdown`` it was read from (CPU time
    loaded over alone), the streamer's ``duty`` (0 where none ran), and the step's ``traffic`` (0..1; ``None`` where
    it could not tell): how much the streamer's copies slowed beside its calls, its inputs in the caches."""

    share: float
    slowdown: float = 1.0
    duty: float = 0.0
    traffic: float | None = None


def measure_memory_share(call: Callable[[], Any], beside: Streamer | None, *,
                         before: Callable[[], None] | None = None, repeats: int | None = None) -> MemoryShare:
    """``call()``'s memory share and traffic (docs/simulation.md, "The memory bus"); 0 and ``None`` where nothing can
    run beside it (one core) or the machine is too busy to tell (a duty below :data:`MIN_DUTY`). A turn alone and one
    loaded follow each other, so that a drift of the machine's speed moves both alike, each ``repeats`` calls (default:
    by time) with ``before()`` untimed before each; the traffic's turns run no ``before()`` (it streams itself), so the
    step's inputs are in the caches (a stub's copies of them are boundaries of their own)."""
    if beside is None:
        return MemoryShare(0.0)
    allowed = _pin(0, 0)  # this thread on the first core, the streamer on the last
    try:
        call()
        alone = timed_calls(call, repeats, before, target_s=_TURN_S, most=_MAX_CALLS)[1]
        with beside.streaming() as took:
            loaded = timed_calls(call, repeats, before, target_s=_TURN_S, most=_MAX_CALLS)[1]
        wall, streamed = took[0], took[1]
        # the streamer's copies per CPU second, alone and beside the step's warm calls
        with beside.streaming() as took:
            sleep(_TURN_S)
        rate_alone = _rate(took)
        with beside.streaming() as took:
            timed_calls(call, repeats, None, target_s=_TURN_S, most=_MAX_CALLS)
        rate_beside = _rate(took)
    finally:
        if allowed is not None:
            os.sched_setaffinity(0, allowed)
    base = statistics.median(alone)
    duty = min(1.0, streamed / wall) if wall > 0.0 else 0.0
    if base <= 0.0:
        return MemoryShare(0.0, 1.0, duty)
    slowdown = statistics.median(loaded) / base
    share = min(1.0, max(0.0, (slowdown - 1.0) / duty)) if duty >= MIN_DUTY else 0.0
    traffic = min(1.0, max(0.0, rate_alone / rate_beside - 1.0)) if duty >= MIN_DUTY and rate_beside > 0.0 else None
    return MemoryShare(share, slowdown, duty, traffic)


def _rate(took: list[float]) -> float:
    """The streamer's copies per CPU second in a turn :meth:`Streamer.streaming` timed."""
    return took[2] / took[1] if took[1] > 0.0 else 0.0
