"""The server's cores as one processor-sharing resource on a SimPy clock. Every CPU cost the
simulator prices is a job here, so CPU work beyond the cores slows every job down at once, as
the server's scheduler does, instead of queueing whole jobs behind each other.

A job has a cap (the cores it uses alone) and a span (how long it takes alone): its demand is
span × cap CPU µs. While the caps of the active jobs sum to at most the cores, each runs at its
cap; beyond, each runs at cap × cores / Σcaps. Every job's rate is thus its cap times one
common factor, so the resource keeps one virtual clock (``_v``: how far a job of any cap has
got, in µs of its span) and a job ends when ``_v`` reaches its start plus its span. A heap of
those ends gives the next one in O(log n); one pending timeout, set again whenever the active
set changes, wakes the resource then, and a generation number makes the stale ones do nothing.
"""

from __future__ import annotations

from heapq import heappop, heappush

import simpy

__all__ = ["Cores"]

# Jobs whose virtual ends lie this close (relative) to the clock end together: the wake-up's time
# is a float quotient, so the clock may land a rounding short of a job's end.
_CLOSE = 1e-12


class Cores:
    """``cores`` cores shared by every job on them; :meth:`run` adds a job."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env = env
        self.cores = float(cores)
        self._jobs: list[tuple[float, int, float, simpy.Event]] = []  # (virtual end, order, cap, done)
        self._caps = 0.0  # Σ caps of the active jobs
        self._v = 0.0  # the virtual clock
        self._at = 0.0  # when _v and _busy were last brought up to date
        self._busy = 0.0  # core-µs spent
        self._order = 0  # ties end in the order they were added
        self._generation = 0  # the wake-up that is not stale

    def run(self, span: float, cap: float = 1.0) -> simpy.Event:
        """An event that succeeds when a job that takes ``span`` µs alone at ``cap`` cores is
        done (``span`` 0: at once)."""
        done = self.env.event()
        if span <= 0.0:
            return done.succeed()
        self._advance()
        end = self._v + span
        was_free = self._caps <= self.cores
        self._caps += cap
        self._order += 1
        first = self._jobs[0][0] if self._jobs else None
        heappush(self._jobs, (end, self._order, cap, done))
        # The pending wake-up still holds when no job slowed down and the new one ends later.
        if first is None or not (was_free and self._caps <= self.cores and end >= first):
            self._wake_at_next_end()
        return done

    def busy(self) -> float:
        """Core-µs spent by all jobs until now."""
        self._advance()
        return self._busy

    def _advance(self) -> None:
        now = self.env.now
        if now > self._at:
            if self._caps > 0.0:
                used = min(self._caps, self.cores)
                self._v += (now - self._at) * used / self._caps
                self._busy += (now - self._at) * used
            self._at = now

    def _wake_at_next_end(self) -> None:
        self._generation += 1
        if self._jobs:
            rate = min(1.0, self.cores / self._caps)
            delay = max(0.0, (self._jobs[0][0] - self._v) / rate)
            self.env.timeout(delay, self._generation).callbacks.append(self._wake)

    def _wake(self, timeout: simpy.Event) -> None:
        if timeout.value != self._generation:
            return
        self._advance()
        limit = self._v + _CLOSE * (1.0 + self._v)
        while self._jobs and self._jobs[0][0] <= limit:
            _, _, cap, done = heappop(self._jobs)
            self._caps -= cap
            done.succeed()
        if not self._jobs:
            self._caps = 0.0  # no drift left over from the sums
        self._wake_at_next_end()
