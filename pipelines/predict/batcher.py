"""Triton's scheduler for one model on a SimPy clock: its instances, each running one execution at a time, and the
dynamic batcher that forms an execution from the requests waiting (every model of the simulation has one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import simpy

from ..errors import PipelinesError

__all__ = ["Execute", "ModelScheduler", "Waiting"]

# A timer set for the delay's end may wake a rounding short of it (it is set as a difference).
_SLACK = 1e-6
#: How long Triton's batcher thread sleeps when its queue is empty, unless woken
#: (``default_wait_microseconds`` in ``DynamicBatchScheduler::BatcherThread``).
IDLE_WAIT_US = 500_000.0


class Waiting(NamedTuple):
    """A request in the queue: its rows, since when it waits, what succeeds when it is done, and
    what the model's execution is to make of it (``what``, given to :meth:`ModelScheduler.submit`)."""

    rows: int
    since: float
    done: simpy.Event
    what: Any


#: One execution's work while it holds an instance: given its requests and the instance's index, a SimPy process body.
Execute = Callable[[Sequence[Waiting], int], Generator[simpy.Event, object, None]]


class _Payload:
    """What Triton's batcher hands an instance: requests, their rows, the arrival of the oldest
    (``start``), and where it is: ``"forming"`` (taking requests, not yet queued), ``"queued"``
    (waiting for an instance, and still taking requests) or ``"executing"`` (taken; stale)."""

    __slots__ = ("requests", "rows", "start", "state")

    def __init__(self) -> None:
        self.requests: list[Waiting] = []
        self.rows, self.start, self.state = 0, 0.0, "forming"

    def add(self, waiting: Waiting) -> None:
        self.start = waiting.since if not self.requests else min(self.start, waiting.since)
        self.requests.append(waiting)
        self.rows += waiting.rows


class ModelScheduler:
    """A model's queue and instances. ``max_batch_size`` 0, or no ``dynamic_batching``: one request an execution, in
    arrival order. Otherwise Triton's dynamic batcher (2.51, ``DynamicBatchScheduler`` and the rate limiter's payload
    queue) step by step, as docs/simulation.md, "The queues", tells it with why a server forms smaller batches than
    "every request waiting when an instance frees": a batcher thread moves requests into a payload (:meth:`_batch`),
    which keeps growing while it waits for an instance, but only when the thread is woken (see :meth:`submit`); at
    most two payloads an instance wait."""

    def __init__(self, env: simpy.Environment, *, instances: int, execute: Execute, max_batch_size: int = 0,
                 dynamic_batching: bool = False, preferred_batch_sizes: Sequence[int] = (),
                 max_queue_delay_us: float = 0.0) -> None:
        self.env = env
        self.instances = instances
        self._execute = execute
        self._batch_rows = max_batch_size if dynamic_batching else 0
        self._preferred = tuple(sorted(set(preferred_batch_sizes) or ({max_batch_size} if max_batch_size else set())))
        self._largest_preferred = max(self._preferred, default=0)
        self._delay = float(max_queue_delay_us)
        self._queue: deque[Waiting] = deque()
        self._free = list(range(instances - 1, -1, -1))  # pop() hands out instance 0 first
        self._running, self._busy, self._at = 0, 0.0, 0.0  # executions running, instance-µs spent until _at
        # the batcher thread's state (Triton's curr_payload_, payload_saturated_, next_preferred_batch_size_,
        # queued_batch_size_) and the payloads waiting for an instance
        self._payload, self._saturated, self._next_preferred, self._queued_rows = _Payload(), False, 0, 0
        self._waiting: deque[_Payload] = deque()
        self._woken = False
        self._sleep = 0  # a timer wakes the thread only if it still sleeps the sleep it was set for
        self._idle_since: float | None = None  # when the thread last went to sleep on an empty queue
        self._ticking = -1  # the sleep whose idle wake is set

    def submit(self, rows: int, what: Any = None) -> simpy.Event:
        """An event that succeeds when the execution that took this request is done."""
        done = self.env.event()
        self._queue.append(Waiting(rows, self.env.now, done, what))
        if not self._batch_rows:
            if self._free:
                self._wake()
            return done
        self._queued_rows += rows
        if len(self._waiting) < 2 * self.instances and (
                self._saturated or self._payload.state == "executing" or self._queued_rows >= self._next_preferred):
            self._wake()
        elif self._idle_since is not None and self._ticking != self._sleep:
            # Not woken, a thread asleep on an empty queue still looks when its wait runs out.
            ticks = max(1.0, -(-(self.env.now - self._idle_since) // IDLE_WAIT_US))
            self._ticking = self._sleep
            self.env.timeout(self._idle_since + ticks * IDLE_WAIT_US - self.env.now, self._sleep).callbacks.append(
                self._on_timer)
        return done

    def busy(self) -> float:
        """Instance-µs spent in executions until now."""
        self._count_busy()
        return self._busy

    def _count_busy(self) -> None:
        """Brings the instance-µs up to date: at each start and end of an execution, and at each reading."""
        now = self.env.now
        self._busy += self._running * (now - self._at)
        self._at = now

    def _wake(self) -> None:
        """Look at the queue once everything else of this instant has happened: Triton's batcher is a thread woken by
        the queue, so the requests that reach it together (a batch's answers, clients starting at once) are there."""
        if not self._woken:
            self._woken = True
            self.env.timeout(0).callbacks.append(self._on_wake)

    def _on_wake(self, _: simpy.Event) -> None:
        self._woken = False
        if self._batch_rows:
            self._sleep += 1
            self._idle_since = None
            self._batch()
        self._dispatch()

    def _on_timer(self, timer: simpy.Event) -> None:
        if timer.value == self._sleep:
            self._wake()

    def _batch(self) -> None:
        """The batcher thread's loop, from a wake until it sleeps again."""
        for _ in range(10_000):  # each turn moves requests, makes a payload or sleeps
            if self._saturated or self._payload.state == "executing":
                self._payload, self._saturated, self._next_preferred = _Payload(), False, 0
            if not self._queue:
                self._idle_since = self.env.now
                return  # until a request or a payload wakes it, or its wait runs out
            if self._saturated:
                continue
            if len(self._waiting) >= 2 * self.instances:
                return  # until a payload is taken
            wait, count = self._dynamic_batch()
            if wait > 0.0:
                self.env.timeout(wait, self._sleep).callbacks.append(self._on_timer)
                return
            payload = self._payload
            for _ in range(count):
                waiting = self._queue.popleft()
                payload.add(waiting)
                self._queued_rows -= waiting.rows
            if count and payload.state == "forming":
                payload.state = "queued"
                self._waiting.append(payload)
        raise PipelinesError("the simulated batcher made no progress (a bug in the simulation)")

    def _dynamic_batch(self) -> tuple[float, int]:
        """Triton's ``GetDynamicBatch``: ``(0, n)`` to move the first ``n`` queued requests into the
        payload now, or ``(µs, 0)`` to wait that long (or until woken)."""
        in_payload = self._payload.rows
        rows = count = best = 0
        send_now = False
        for waiting in self._queue:
            if in_payload + count:
                if in_payload + rows + waiting.rows > self._largest_preferred and not best:
                    best = count
                    self._saturated = True
                if in_payload + rows + waiting.rows > self._batch_rows:
                    send_now = True
                    break
            rows += waiting.rows
            count += 1
            if in_payload + rows in self._preferred:
                best = count
        waited = self.env.now - self._queue[0].since
        expired = self._delay > 0.0 and waited >= self._delay - _SLACK
        if best and not expired:
            if self._delay == 0.0:
                self._saturated = True
            return 0.0, best
        if not count:
            return 0.0, 0
        if send_now or in_payload + rows >= self._largest_preferred:
            self._saturated = True
            return 0.0, count
        if expired or self._delay == 0.0:
            return 0.0, count
        nearest = next((p for p in self._preferred if p > in_payload + rows), self._preferred[0])
        self._next_preferred = nearest - in_payload
        if not self._saturated and in_payload and in_payload not in self._preferred:
            return 0.0, count  # a queued payload that can grow takes them now
        return self._delay - waited, 0

    def _dispatch(self) -> None:
        """Free instances take what waits: a payload (with those queued behind it that fit and
        have waited out the delay), or without batching one request."""
        while self._free:
            if self._batch_rows:
                if not self._waiting:
                    return
                payload = self._waiting.popleft()
                payload.state = "executing"
                while (self._waiting and self._delay > 0.0 and self._batch_rows > 1
                       and self.env.now - self._waiting[0].start > self._delay
                       and payload.rows + self._waiting[0].rows <= self._batch_rows):
                    merged = self._waiting.popleft()
                    merged.state = "executing"
                    for waiting in merged.requests:
                        payload.add(waiting)
                batch = payload.requests
                self._wake()  # the payload's callback: taken
            elif self._queue:
                batch = [self._queue.popleft()]
            else:
                return
            self._count_busy()
            self._running += 1
            self.env.process(self._run(batch, self._free.pop()))

    def _run(self, batch: list[Waiting], instance: int) -> Generator[simpy.Event, object, None]:
        yield from self._execute(batch, instance)
        self._count_busy()
        self._running -= 1
        self._free.append(instance)
        for waiting in batch:
            waiting.done.succeed()
        # The instance's thread goes straight on to the next payload; the batcher thread, woken by this payload's
        # callback, looks at the queue after it (requests still in the queue are not in the payload it takes).
        self._dispatch()
        self._wake()
