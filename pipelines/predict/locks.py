"""The locks of a simulated model instance's process (its GIL, its threads, a fused instance's
step locks), on a SimPy clock: one FIFO lock that costs no event when it is free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Mapping
from typing import NamedTuple

import simpy

__all__ = ["FusedInstance", "Lock"]


class Lock:
    """``capacity`` holders at a time, the others waiting in turn: a ``simpy.Resource`` that
    costs no event when it is free (a third of a BLS prediction's events were its GIL's)."""

    __slots__ = ("env", "free", "waiting")

    def __init__(self, env: simpy.Environment, capacity: int = 1) -> None:
        self.env, self.free, self.waiting = env, capacity, deque()

    def take(self) -> Generator[simpy.Event, object, None]:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        turn = self.env.event()
        self.waiting.append(turn)
        yield turn

    def give(self) -> None:
        if self.waiting:
            self.waiting.popleft().succeed()  # the place passes to the next in turn
        else:
            self.free += 1


class FusedInstance(NamedTuple):
    """One fused instance's own: its process's GIL, its step instances' locks (by model), the
    threads its external steps' async_exec() calls run in, its event loop's thread, and the pool
    of threads its Python steps run in otherwise (None: no limit)."""

    gil: Lock
    locks: Mapping[str, Lock]
    threads: Lock | None
    loop: Lock
    pool: Lock | None
