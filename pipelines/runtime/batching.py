"""Dynamic batching in the local runtime, as Triton's ``dynamic_batching`` does it.

When an instance of the step is free, the batcher gathers queued requests up to
``max_batch_size`` rows (waiting at most ``max_queue_delay_us`` for more), runs
them as one batch, and hands each caller its own rows. If the batch fails, each
request is rerun alone, so one bad request does not take the others down. A batch
that ran past the step's timeout has lost its instance: with ``rerun_stuck``, each
of its requests is rerun alone on the fresh one, as the server's fused model reruns
a joined run that failed (a BLS call's wait is bounded, so there the batch fails).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import InferenceError
from .device import array_module, device_of

if TYPE_CHECKING:
    from .instance_pool import InstancePool, Lease

__all__ = ["DynamicBatcher"]

Execute = Callable[["Lease", dict[str, Any], int], Awaitable[tuple[dict[str, Any], float]]]


class _Pending:
    """One request's rows waiting for, or riding in, a batch."""

    __slots__ = ("inputs", "rows", "submitted", "done", "outputs", "error", "queue_wait", "compute", "batch", "gone")

    def __init__(self, inputs: dict[str, Any], rows: int) -> None:
        self.inputs = inputs
        self.rows = rows
        self.submitted = perf_counter()
        self.done = anyio.Event()
        self.outputs: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.queue_wait = 0.0
        self.compute = 0.0
        self.batch = 1
        self.gone = False  # the caller stopped waiting (cancelled or timed out)

    def answer(self, outputs: dict[str, Any] | None, error: BaseException | None, compute: float, batch: int) -> None:
        if self.done.is_set():
            return
        self.outputs, self.error, self.compute, self.batch = outputs, error, compute, batch
        self.inputs = None  # drop the request's tensors as soon as it is answered
        self.done.set()


class DynamicBatcher:
    """Gathers concurrent requests for one step model and runs them as batches."""

    def __init__(
        self,
        *,
        step: str,
        pool: InstancePool,
        execute: Execute,
        max_batch_size: int,
        max_queue_delay_s: float,
        preferred_batch_sizes: Sequence[int] = (),
        rerun_stuck: bool = False,
    ) -> None:
        self.step = step
        self._rerun_stuck = rerun_stuck
        self._pool = pool
        self._execute = execute
        self._max = max_batch_size
        self._delay = max_queue_delay_s
        self._preferred = frozenset(s for s in preferred_batch_sizes if s <= max_batch_size)
        self._queue: deque[_Pending] = deque()
        self._arrived = anyio.Event()
        self._running: set[_Pending] = set()

    async def submit(self, inputs: dict[str, Any], rows: int) -> tuple[dict[str, Any], float, float, int]:
        """Queue one request's rows; ``(outputs, queue_wait_s, compute_s, requests_in_batch)``."""
        pending = _Pending(inputs, rows)
        self._queue.append(pending)
        self._arrived.set()
        try:
            await pending.done.wait()
        except BaseException:
            pending.gone = True
            try:
                self._queue.remove(pending)
            except ValueError:  # already taken into a batch: its answer will be dropped
                pass
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.outputs is not None
        return pending.outputs, pending.queue_wait, pending.compute, pending.batch

    async def serve(self, workers: int) -> None:
        """Form and run batches while the runtime is open: one worker per instance.

        A worker that just finished a batch forms the next one at once, before the
        event loop turns to the callers it answered, so the instance is not left idle.
        """
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(self._worker)
        finally:
            closed = InferenceError(
                f"step {self.step!r}: the local runtime closed before this request was answered", step=self.step
            )
            for pending in list(self._queue) + list(self._running):
                pending.answer(None, closed, 0.0, 1)
            self._queue.clear()

    async def _worker(self) -> None:
        while True:
            lease = await self._pool.acquire()  # waits only while a stuck call holds the instance
            try:
                batch = await self._gather()
                await self._run(lease, batch)
                # Its answers hold the outputs: keep none of them while waiting for the next batch.
                del batch
            finally:
                self._pool.give_back(lease)

    async def _gather(self) -> list[_Pending]:
        """Wait for a first request, then for more until the batch is full or the delay is over."""
        queue = self._queue
        while True:
            while queue and queue[0].gone:
                queue.popleft()
            if queue:
                break
            await self._next_arrival().wait()
        batch = [queue.popleft()]
        rows = batch[0].rows
        shape = _row_shapes(batch[0])
        deadline = perf_counter() + self._delay
        while rows < self._max and rows not in self._preferred:
            while queue and (
                queue[0].gone or (rows + queue[0].rows <= self._max and _row_shapes(queue[0]) == shape)
            ):
                pending = queue.popleft()
                if not pending.gone:
                    batch.append(pending)
                    rows += pending.rows
            if rows >= self._max or rows in self._preferred or queue:
                break  # full, preferred, or the next request does not fit (its rows, or their shape)
            left = deadline - perf_counter()
            if left <= 0:
                break
            arrival = self._next_arrival()
            with anyio.move_on_after(left) as scope:
                await arrival.wait()
            if scope.cancelled_caught:
                break
        return batch

    def _next_arrival(self) -> anyio.Event:
        # Workers share one event: replacing it while unset would strand the others waiting on it.
        if self._arrived.is_set():
            self._arrived = anyio.Event()
        return self._arrived

    async def _run(self, lease: Lease, batch: list[_Pending]) -> None:
        self._running.update(batch)
        try:
            start = perf_counter()
            for pending in batch:
                pending.queue_wait = start - pending.submitted
            if len(batch) == 1:
                await self._alone(lease, batch[0])
                return
            rows = sum(p.rows for p in batch)
            merged = _concatenate([p.inputs for p in batch])
            try:
                outputs, compute = await self._execute(lease, merged, rows)
            except Exception:
                if lease.abandoned:
                    if not self._rerun_stuck:
                        raise
                    await self._rerun_on_fresh_instances(batch)
                    return
                # Find the request that broke the batch: the others still get their answers.
                for pending in batch:
                    await self._alone(lease, pending)
                return
            finally:
                del merged
            offset = 0
            for pending in batch:
                end = offset + pending.rows
                pending.answer({name: value[offset:end] for name, value in outputs.items()}, None, compute, len(batch))
                offset = end
        except Exception as exc:
            for pending in batch:
                pending.answer(None, exc, 0.0, len(batch))
        finally:
            self._running.difference_update(batch)

    async def _rerun_on_fresh_instances(self, batch: list[_Pending]) -> None:
        """Each request of a batch that got stuck, alone, on whichever instance is free next
        (the stuck one's replacement): only the request that sticks again fails."""
        for pending in batch:
            lease = await self._pool.acquire()
            try:
                await self._alone(lease, pending)
            except Exception as exc:  # this one stuck again: its instance is replaced as well
                pending.answer(None, exc, 0.0, 1)
            finally:
                self._pool.give_back(lease)

    async def _alone(self, lease: Lease, pending: _Pending) -> None:
        if pending.gone:
            pending.answer(None, None, 0.0, 1)
            return
        try:
            outputs, compute = await self._execute(lease, pending.inputs, pending.rows)
        except Exception as exc:
            if lease.abandoned:
                raise
            pending.answer(None, exc, 0.0, 1)
        else:
            pending.answer(outputs, None, compute, 1)


def _row_shapes(pending: _Pending) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each input's shape without the batch dimension: as Triton's dynamic batcher, only
    requests whose rows have the same shapes join one batch (ragged batching is not modelled)."""
    return tuple((name, tuple(value.shape[1:])) for name, value in pending.inputs.items())


def _concatenate(requests: list[dict[str, Any]]) -> dict[str, Any]:
    names = requests[0].keys()
    out = {}
    for name in names:
        parts = [r[name] for r in requests]
        xp = array_module(device_of(parts[0]))
        out[name] = xp.concatenate(parts, axis=0)
    return out
