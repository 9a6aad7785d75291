"""The server's cores as one processor-sharing resource on a SimPy clock. Every CPU cost the
simulator prices is a job here, so CPU work beyond the cores slows every job down at once, as
the server's scheduler does, instead of queueing whole jobs behind each other.

A job has a cap (the cores it uses alone) and a span (how long it takes alone): its demand is
span × cap CPU µs. While the caps of the active jobs sum to at most the cores, each runs at its
cap; beyond, each runs at cap × cores / Σcaps. Every job's rate is thus its cap times one
common factor, so the resource keeps one virtual clock (``_v``: how far a job of any cap has
got, in µs of its span) and a job ends when ``_v`` reaches its start plus its span. A heap of
those ends gives the next one in O(log n). One pending timeout wakes the resource at the next
end; whenever the active set changes the end is computed again, and a new timeout is set only
if it is sooner (a generation number makes the one it replaces do nothing). A later end keeps
the pending one, which then wakes early, finds nothing done, and sets the next: so a burst of
new jobs that slows the others costs no event each (5-7 % fewer events in all at concurrency 16
than a new timeout at every change, on a 4-step pipeline).

The cores also share one memory bus. One core streaming memory takes nearly all of it: on this
project's 2-core VM a 32 MiB copy took 1.4 ms alone and 3.0 ms while the other core made the
same copy, while a matrix product, pure Python or work on data in the core's own cache took as
long either way. So a job also has a memory share (0..1): the part of its time that waits on
memory, measured for a step (:mod:`pipelines.predict.memory_share`) and, for a boundary, the
part of its cost that is paid per byte (a copy). Jobs that run together slow each other by
their shares: a job of share ``m`` beside others of shares ``m'`` takes ``1 + m × Σm'`` times as
long (two copies: twice; a copy beside work in the cache: as long as alone). Where more jobs
are active than cores, a job runs beside ``cores - 1`` of the others at a time, so the sum is
scaled by ``(cores - 1) / (active - 1)``. Every job is slowed by the mix's mean factor, weighted
by cap (a job's own factor differs by the second order of shares that are mostly below 0.2,
or alike where they are large), so that the one virtual clock holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush

import simpy

__all__ = ["Cores", "Cost"]

# Jobs whose virtual ends lie this close (relative) to the clock end together: the wake-up's time
# is a float quotient, so the clock may land a rounding short of a job's end.
_CLOSE = 1e-12


@dataclass(frozen=True, slots=True)
class Cost:
    """A boundary's price as a job of one core: ``us`` in all, of which ``copied`` µs are paid per
    byte (a copy through memory, so its memory share is ``copied / us``). Sums and multiples are
    the costs of several crossings."""

    us: float = 0.0
    copied: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.us + other.us, self.copied + other.copied)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.us - other.us, self.copied - other.copied)

    def __mul__(self, times: float) -> Cost:
        return Cost(self.us * times, self.copied * times)

    __rmul__ = __mul__

    def __bool__(self) -> bool:
        return self.us > 0.0

    @property
    def memory(self) -> float:
        return self.copied / self.us if self.us > 0.0 else 0.0


class Cores:
    """``cores`` cores shared by every job on them; :meth:`run` adds a job. Made with a fresh
    environment, before anything is scheduled on it."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env = env
        self.cores = float(cores)
        # (virtual end, order, cap, memory share, done)
        self._jobs: list[tuple[float, int, float, float, simpy.Event]] = []
        self._caps = 0.0  # Σ caps of the active jobs
        self._mem = 0.0  # Σ cap × memory share of the active jobs
        self._mem2 = 0.0  # Σ cap × memory share²
        self._v = 0.0  # the virtual clock
        self._at = 0.0  # when _v and _busy were last brought up to date
        self._busy = 0.0  # core-µs spent
        self._order = 0  # ties end in the order they were added
        self._generation = 0  # the wake-up that is not stale
        self._wake_at: float | None = None  # when it comes
        self._idle_since = 0.0  # when the last job ended
        # What a free job returns: an event already processed, so a process that yields it goes on
        # at once, with nothing queued (a third of all costs are zero in a typical profile).
        self._nothing = env.event().succeed()
        env.run(until=self._nothing)

    def run(self, span: float, cap: float = 1.0, memory: float = 0.0) -> simpy.Event:
        """An event that succeeds when a job that takes ``span`` µs alone at ``cap`` cores, a
        ``memory`` share of it waiting on memory, is done; ``cap`` 0: a plain delay of ``span``
        that uses no core. ``span`` 0: already done."""
        if span <= 0.0:
            return self._nothing
        if cap <= 0.0:
            return self.env.timeout(span)
        done = simpy.Event(self.env)
        self._advance()
        memory = min(1.0, memory) if memory > 0.0 else 0.0
        self._caps += cap
        self._mem += cap * memory
        self._mem2 += cap * memory * memory
        self._order += 1
        heappush(self._jobs, (self._v + span, self._order, cap, memory, done))
        self._wake_at_next_end()
        return done

    def pay(self, cost: Cost) -> simpy.Event:
        """:meth:`run` for a boundary's :class:`Cost`: one core, its copy's memory share."""
        return self.run(cost.us, 1.0, cost.memory)

    def _slowdown(self) -> float:
        """The active jobs' mean factor for sharing the memory bus (see the module's docstring)."""
        caps = self._caps
        if self._mem <= 0.0 or caps <= 1.0 or self.cores <= 1.0:
            return 1.0
        beside = max(0.0, self._mem * self._mem - self._mem2) / caps  # Σ_j cap_j m_j Σ_{k≠j} m_k / Σ caps
        return 1.0 + beside * min(1.0, (self.cores - 1.0) / (caps - 1.0))

    def idle(self) -> bool:
        """Whether a core has nothing to do now."""
        self._advance()
        return self._caps < self.cores - 1e-9

    def idle_for(self) -> float:
        """How long every core has had nothing to do, until now; 0 while a job runs."""
        self._advance()
        return self.env.now - self._idle_since if self._caps <= 0.0 and not self._jobs else 0.0

    def busy(self) -> float:
        """Core-µs spent by all jobs until now."""
        self._advance()
        return self._busy

    def _advance(self) -> None:
        now = self.env.now
        if now > self._at:
            caps = self._caps
            if caps > 0.0:
                used = caps if caps < self.cores else self.cores
                self._v += (now - self._at) * used / caps / self._slowdown()
                self._busy += (now - self._at) * used
            self._at = now

    def _wake_at_next_end(self) -> None:
        if self._jobs:
            ahead = (self._jobs[0][0] - self._v) * self._slowdown()
            if self._caps > self.cores:
                ahead *= self._caps / self.cores
            when = self._at + (ahead if ahead > 0.0 else 0.0)
            if self._wake_at is None or when < self._wake_at:
                self._generation += 1
                self._wake_at = when
                self.env.timeout(when - self._at, self._generation).callbacks.append(self._wake)

    def _wake(self, timeout: simpy.Event) -> None:
        if timeout.value != self._generation:
            return
        self._wake_at = None
        self._advance()
        jobs = self._jobs
        limit = self._v + _CLOSE * (1.0 + self._v)
        while jobs and jobs[0][0] <= limit:
            _, _, cap, memory, done = heappop(jobs)
            self._caps -= cap
            self._mem -= cap * memory
            self._mem2 -= cap * memory * memory
            done.succeed()
        if not jobs:
            self._caps = self._mem = self._mem2 = 0.0  # no drift left over from the sums
            self._idle_since = self.env.now
        self._wake_at_next_end()
