"""The server's cores as one processor-sharing resource on a SimPy clock. Every CPU cost the simulator prices is a job
here, so CPU work beyond the cores slows every job down at once, as the server's scheduler does, instead of queueing
whole jobs behind each other. The model (a job's span, cap, memory share and traffic), and what was measured for it:
docs/simulation.md, "The cores, as processor sharing" and "The memory bus".

Beyond the cores, a job of a core or more takes ``f`` times its span, one below a core ``(1 - cap) + cap × f``: ``f``
solves ``Σ_full cap / f + Σ_below cap / ((1 - cap) + cap × f) = cores`` by Newton's method, times the memory bus's
slowdown (:meth:`Cores._slowdown`). The jobs of a core or more keep one virtual clock (``_v``) and a heap of their ends;
a job below a core keeps its own end. One pending timeout wakes the resource at the next end; a later end keeps it (it
wakes early and sets the next), so a burst of new jobs costs no event each.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush

import simpy

__all__ = ["Cores", "Cost"]

# Jobs whose virtual ends lie this close (relative) to the clock end together: the wake-up's time is a float quotient,
# so the clock may land a rounding short of a job's end.
_CLOSE = 1e-12


@dataclass(frozen=True, slots=True)
class Cost:
    """A boundary's price as a job of one core: ``us`` in all, of which ``copied`` µs are paid per byte (a copy
    through memory, so its memory share is ``copied / us``). Sums and multiples are the costs of several crossings."""

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
    """``cores`` cores shared by every job on them; :meth:`run` adds a job. Made with a fresh environment, before
    anything is scheduled on it."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env = env
        self.cores = float(cores)
        # Jobs of a core or more: (virtual end, order, cap, memory share, traffic, done), on one clock.
        self._jobs: list[tuple[float, int, float, float, float, simpy.Event]] = []
        # Jobs below a core, each on its own: [when it ends at the current share, cap, memory share, traffic, done].
        self._partial: list[list] = []
        # Σ over the active jobs: the caps of those of a core or more (_full), all caps, cap × memory share, cap ×
        # traffic (what a job slows the others by), and cap × memory share × traffic
        self._full = self._caps = self._mem = self._traffic = self._mem_traffic = 0.0
        self._share = 1.0  # how much longer CPU work takes than alone: the cores' share × the bus's
        self._used = 0.0  # the cores in use
        self._v = 0.0  # the clock of the jobs of a core or more, in µs of their spans
        self._at = 0.0  # when the clocks and _busy were last brought up to date
        self._busy = 0.0  # core-µs spent
        self._order = 0  # ties end in the order they were added
        self._generation = 0  # the wake-up that is not stale
        self._wake_at: float | None = None  # when it comes
        self._idle_since = 0.0  # when the last job ended
        # A free job's event, already processed: a process that yields it goes on at once (a third of costs are zero).
        self._nothing = env.event().succeed()
        env.run(until=self._nothing)

    def run(self, span: float, cap: float = 1.0, memory: float = 0.0, traffic: float | None = None) -> simpy.Event:
        """An event that succeeds when a job that takes ``span`` µs alone at ``cap`` cores, a ``memory`` share of it
        waiting on memory, is done; ``cap`` 0: a plain delay of ``span`` that uses no core. ``span`` 0: already done.
        ``traffic`` (0..1): how much it slows a copy beside it; ``None``: its memory share, as for a copy."""
        if span <= 0.0:
            return self._nothing
        if cap <= 0.0:
            return self.env.timeout(span)
        done = simpy.Event(self.env)
        self._advance()
        memory = (memory if memory < 1.0 else 1.0) if memory > 0.0 else 0.0
        traffic = memory if traffic is None else (traffic if traffic < 1.0 else 1.0) if traffic > 0.0 else 0.0
        self._caps += cap
        self._mem += cap * memory
        self._traffic += cap * traffic
        self._mem_traffic += cap * memory * traffic
        if cap >= 1.0:
            self._full += cap
            self._order += 1
            heappush(self._jobs, (self._v + span, self._order, cap, memory, traffic, done))
        else:
            self._partial.append([self._at + span * (1.0 - cap + cap * self._share), cap, memory, traffic, done])
        self._reshare()
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
        # Σ_j cap_j m_j Σ_{k≠j} t_k / Σ caps: each job's share of the others' traffic
        beside = max(0.0, self._mem * self._traffic - self._mem_traffic) / caps
        scale = (self.cores - 1.0) / (caps - 1.0)
        return 1.0 + beside * (scale if scale < 1.0 else 1.0)

    def _reshare(self) -> None:
        """The cores' share of the active jobs, and the cores they use (see the module's docstring). Conditionals, not
        ``min``, here and in :meth:`run`: those calls cost 5 % of a prediction."""
        slow = self._slowdown()
        cores, caps, full, was = self.cores, self._caps, self._full, self._share
        if not self._partial or (slow == 1.0 and caps <= cores):
            # No job below a core, or room for every job: one share for all, as in plain processor sharing.
            share = (full / cores if full > cores else 1.0) * slow
            used = caps if caps < cores else cores
        else:
            # Newton's method for the share f at which the jobs use the cores: their cores u(f) fall, convex, so
            # from the left of the root it never overshoots. Σcaps / cores is on its left (each job uses at least
            # cap / f), and the root itself when every job is of a core or more.
            f = max(1.0, caps / cores)
            for _ in range(50):
                used, slope = full / f, full / (f * f)
                for job in self._partial:
                    cap = job[1]
                    mine = cap * slow / (1.0 - cap + cap * slow * f)
                    used += mine
                    slope += mine * mine
                over = used - cores
                if over <= 1e-9 * cores:
                    break
                f += over / slope
            share = f * slow
            used = used if used < cores else cores
        self._used = used
        if share != was:
            self._share = share
            now = self._at
            for job in self._partial:  # a job below a core: only its CPU time stretches
                cap = job[1]
                job[0] = now + (job[0] - now) * (1.0 - cap + cap * share) / (1.0 - cap + cap * was)

    def idle(self) -> bool:
        """Whether a core has nothing to do now."""
        self._advance()
        return self._caps < self.cores - 1e-9

    def idle_for(self) -> float:
        """How long every core has had nothing to do, until now; 0 while a job runs."""
        self._advance()
        return self.env.now - self._idle_since if self._caps <= 0.0 else 0.0

    def busy(self) -> float:
        """Core-µs spent by all jobs until now."""
        self._advance()
        return self._busy

    def _advance(self) -> None:
        now = self.env.now
        if now > self._at:
            elapsed = now - self._at
            if self._caps > 0.0:
                self._v += elapsed / self._share
                self._busy += elapsed * self._used
            self._at = now

    def _wake_at_next_end(self) -> None:
        ahead = (self._jobs[0][0] - self._v) * self._share if self._jobs else None
        for job in self._partial:
            if ahead is None or job[0] - self._at < ahead:
                ahead = job[0] - self._at
        if ahead is not None:
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
        ended: list[tuple[float, float, float, simpy.Event]] = []
        jobs = self._jobs
        limit = self._v + _CLOSE * (1.0 + self._v)
        while jobs and jobs[0][0] <= limit:
            _, _, cap, memory, traffic, done = heappop(jobs)
            self._full -= cap
            ended.append((cap, memory, traffic, done))
        if self._partial:
            # The clock's float steps grow with the clock, and so does what counts as done.
            close = self._at + _CLOSE * (1.0 + self._at)
            ended += [(job[1], job[2], job[3], job[4]) for job in self._partial if job[0] <= close]
            self._partial = [job for job in self._partial if job[0] > close]
        for cap, memory, traffic, done in ended:
            self._caps -= cap
            self._mem -= cap * memory
            self._traffic -= cap * traffic
            self._mem_traffic -= cap * memory * traffic
            done.succeed()
        if not jobs and not self._partial:
            self._full = self._caps = self._mem = self._traffic = self._mem_traffic = 0.0  # no drift left over
            self._idle_since = self.env.now
        if ended:
            self._reshare()
        self._wake_at_next_end()
