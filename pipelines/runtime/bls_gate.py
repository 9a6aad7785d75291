"""The BLS model itself, as Triton runs it: one ``execute()`` per instance at a time.

Triton's Python backend finishes one ``execute()`` call of an instance before it
starts the next, ``async def execute`` included. Requests that arrive meanwhile
wait, and the BLS model's dynamic batcher hands them to the next call together:

- ``"bls"`` (async): the requests of one call run side by side, and the call
  ends when the last of them is answered;
- ``"bls-sync"``: the requests of one call run one after another.

Either way the call returns every response of its round at once, when the last
request is done: a request that finishes early waits for its round, as it does
on the server.

Without this gate the local runtime would overlap requests that the server
serialises, and execute the BLS forms in a way the server never does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["BlsGate"]


class _Waiter:
    __slots__ = ("rows", "start", "finished", "released", "gone", "counted")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.start = anyio.Event()
        self.finished = anyio.Event()
        self.released = anyio.Event()  # its round is over: the execute call returned its response
        self.gone = False  # cancelled while queued: it never joins a round
        self.counted = False  # in BlsGate.admitted: its round has let it in, and it is not done


class BlsGate:
    """Admits requests into rounds, as ``instances`` BLS instances would.

    ``concurrent=True`` lets the requests of one round run at once (async
    execute); ``max_rows`` caps one round (the pipeline's ``max_batch_size``, or
    one request when it does not batch).
    """

    def __init__(self, *, instances: int, concurrent: bool, max_rows: int) -> None:
        self.instances = max(1, int(instances))
        self.concurrent = concurrent
        self.max_rows = max(1, int(max_rows))
        # Made on first use and closed when serving ends, so that a runtime opened again gets fresh ones.
        self._streams: tuple[MemoryObjectSendStream[_Waiter], MemoryObjectReceiveStream[_Waiter]] | None = None
        self._held: deque[_Waiter] = deque()  # taken off the stream, but did not fit in a round
        # Requests that a round has let in and that are not done: counted when their round lets
        # them in, before any of them runs, so the first of a round already sees the others.
        self.admitted = 0

    def _queue(self) -> tuple[MemoryObjectSendStream[_Waiter], MemoryObjectReceiveStream[_Waiter]]:
        if self._streams is None:
            self._streams = anyio.create_memory_object_stream[_Waiter](math.inf)
        return self._streams

    @asynccontextmanager
    async def slot(self, rows: int) -> AsyncIterator[None]:
        """Hold one request's place in a round of the BLS model.

        Leaving it waits for the round's end, when the execute call returns every response.
        """
        waiter = _Waiter(rows)
        self._queue()[0].send_nowait(waiter)
        try:
            await waiter.start.wait()
            yield
            self._done(waiter)
            waiter.finished.set()
            await waiter.released.wait()
        finally:
            waiter.gone = True
            self._done(waiter)
            waiter.finished.set()

    def _let_in(self, waiter: _Waiter) -> None:
        if not waiter.gone:  # one cancelled while it waited for its turn in the round is never counted
            waiter.counted = True
            self.admitted += 1
        waiter.start.set()

    def _done(self, waiter: _Waiter) -> None:
        if waiter.counted:
            waiter.counted = False
            self.admitted -= 1

    async def serve(self) -> None:
        """Run the instances' rounds until cancelled (in the runtime's service task group)."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.instances):
                    tg.start_soon(self._instance)
        finally:
            streams, self._streams = self._streams, None
            self._held.clear()
            for stream in streams or ():
                stream.close()

    def _next(self) -> _Waiter | None:
        while self._held:
            waiter = self._held.popleft()
            if not waiter.gone:
                return waiter
        while True:
            try:
                waiter = self._queue()[1].receive_nowait()
            except anyio.WouldBlock:
                return None
            if not waiter.gone:
                return waiter

    async def _instance(self) -> None:
        while True:
            first = self._next()
            if first is None:
                first = await self._queue()[1].receive()
                if first.gone:
                    continue
            round_, rows = [first], first.rows
            while rows < self.max_rows:
                waiter = self._next()
                if waiter is None:
                    break
                if rows + waiter.rows > self.max_rows:
                    self._held.appendleft(waiter)
                    break
                round_.append(waiter)
                rows += waiter.rows
            for waiter in round_:
                self._let_in(waiter)
                if not self.concurrent:
                    await waiter.finished.wait()
            for waiter in round_:
                await waiter.finished.wait()
            for waiter in round_:
                waiter.released.set()
