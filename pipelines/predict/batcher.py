"""Triton's scheduler for one model on a SimPy clock: its instances, each running one execution
at a time, and the dynamic batcher that forms an execution from the requests waiting. The
simulator gives every step model, the BLS or fused model and the gate one of these, so they
queue and batch alike, by the rules of Triton's ``DynamicBatchScheduler::GetDynamicBatch``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import simpy

__all__ = ["Execute", "ModelScheduler", "Waiting"]

# A timer set for the delay's end may wake a rounding short of it (it is set as a difference).
_SLACK = 1e-6


class Waiting(NamedTuple):
    """A request in the queue: its rows, since when it waits, what succeeds when it is done, and
    what the model's execution is to make of it (``what``, given to :meth:`ModelScheduler.submit`)."""

    rows: int
    since: float
    done: simpy.Event
    what: Any


#: One execution's work, run while it holds an instance: given its requests and the instance's
#: index, a SimPy process body.
Execute = Callable[[Sequence[Waiting], int], Generator[simpy.Event, object, None]]


class ModelScheduler:
    """A model's queue and instances. ``max_batch_size`` 0, or no ``dynamic_batching``: one
    request an execution. Otherwise an execution takes up to ``max_batch_size`` rows, whole
    requests in arrival order; :meth:`_take` says when it waits for more.

    ``busy()`` is the instance-µs spent so far, for the model's utilisation.
    """

    def __init__(
        self,
        env: simpy.Environment,
        *,
        instances: int,
        execute: Execute,
        max_batch_size: int = 0,
        dynamic_batching: bool = False,
        preferred_batch_sizes: Sequence[int] = (),
        max_queue_delay_us: float = 0.0,
    ) -> None:
        self.env = env
        self.instances = instances
        self._execute = execute
        self._batch_rows = max_batch_size if dynamic_batching else 0
        self._preferred = frozenset(preferred_batch_sizes)
        # Before the delay is up a batch grows to the largest preferred size at most (Triton's
        # max_preferred_batch_size_; the max batch size when none is preferred).
        self._grow_to = max(self._preferred, default=max_batch_size)
        self._delay = float(max_queue_delay_us)
        self._queue: deque[Waiting] = deque()
        self._free = list(range(instances - 1, -1, -1))  # pop() hands out instance 0 first
        self._timer_at: float | None = None
        self._poked = False
        self._running = 0
        self._busy = 0.0
        self._at = 0.0

    def submit(self, rows: int, what: Any = None) -> simpy.Event:
        """An event that succeeds when the execution that took this request is done."""
        done = self.env.event()
        self._queue.append(Waiting(rows, self.env.now, done, what))
        if self._free:
            self._poke()
        return done

    def busy(self) -> float:
        """Instance-µs spent in executions until now."""
        self._count_busy()
        return self._busy

    def _count_busy(self) -> None:
        now = self.env.now
        self._busy += self._running * (now - self._at)
        self._at = now

    def _poke(self) -> None:
        """Look at the queue once everything else of this instant has happened. Triton's batcher
        is a thread woken by the queue: the requests that reach it together (a batch's answers
        going on to the next step, clients starting at once) are there when it looks."""
        if not self._poked:
            self._poked = True
            self.env.timeout(0).callbacks.append(self._on_poke)

    def _on_poke(self, _: simpy.Event) -> None:
        self._poked = False
        self._dispatch()

    def _dispatch(self) -> None:
        while self._free and self._queue:
            batch = self._take()
            if batch is None:
                return
            self._count_busy()
            self._running += 1
            self.env.process(self._run(batch, self._free.pop()))

    def _take(self) -> list[Waiting] | None:
        """The requests of the next execution, taken off the queue, or ``None`` to wait for more.

        As Triton: a prefix of the queue up to the max batch size. If a prefix makes a preferred
        size, or the next request would take it past the largest preferred size, that prefix
        goes at once unless the oldest request has waited out the delay; then, or when the
        prefix cannot grow, or with no delay, the whole prefix goes. Otherwise it waits until
        the oldest request has waited the delay, or until a request arrives.
        """
        queue = self._queue
        if not self._batch_rows:
            return [queue.popleft()]
        rows = count = best = 0
        cannot_grow = False
        for waiting in queue:
            if count and rows + waiting.rows > self._grow_to and not best:
                best = count
            if count and rows + waiting.rows > self._batch_rows:
                cannot_grow = True
                break
            rows += waiting.rows
            count += 1
            if rows in self._preferred:
                best = count
        now = self.env.now
        expired = self._delay > 0.0 and queue[0].since + self._delay <= now + _SLACK
        if best and not expired:
            count = best
        elif not (cannot_grow or rows >= self._grow_to or expired or self._delay == 0.0):
            self._wake_at(queue[0].since + self._delay)
            return None
        return [queue.popleft() for _ in range(count)]

    def _wake_at(self, when: float) -> None:
        if self._timer_at == when:
            return
        self._timer_at = when
        self.env.timeout(when - self.env.now, when).callbacks.append(self._on_timer)

    def _on_timer(self, timer: simpy.Event) -> None:
        if timer.value == self._timer_at:
            self._timer_at = None
        self._dispatch()

    def _run(self, batch: list[Waiting], instance: int) -> Generator[simpy.Event, object, None]:
        yield from self._execute(batch, instance)
        self._count_busy()
        self._running -= 1
        self._free.append(instance)
        for waiting in batch:
            waiting.done.succeed()
        if self._queue:
            self._poke()
