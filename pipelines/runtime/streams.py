"""One request of a streaming pipeline in the local runtime: the generators that stream, the
steps that run once per response, the steps that read a stream whole, and the responses.

The steps a stream feeds run once per response, on the runtime's step models, as the scheduler
runs any node (``Scheduler._run_node``); each response is a request of its own that reads the
once-per-request tensors through to the request's. The modes differ as their forms do:

- ``"fused"``: the generator runs in the fused model's own process and is pulled one response
  at a time: it waits while the steps after it handle the response it yielded.
- ``"bls"``, ``"bls-sync"``: the generator runs in its own step model, ahead of the BLS model,
  which walks its responses in order (``async_exec``/``exec(decoupled=True)`` buffer them) and
  runs each response's steps, side by side (``"bls"``) or one after another (``"bls-sync"``).
- ``"ensemble"``: the generator runs ahead, and each response's steps start as soon as it
  arrives, so consecutive responses overlap in different steps, as in Triton's scheduler;
  responses are answered in the order the generator yielded them.

A failure anywhere ends the stream with that error after the responses answered before it;
a consumer that stops early cancels the request, and each generator's ``close()`` runs
(its ``finally`` blocks), once the call it is in returns.
"""

from __future__ import annotations

import math
import queue
from collections import ChainMap, defaultdict
from collections.abc import Callable
from time import perf_counter
from typing import Any

import anyio

from ..core.graph import Graph
from ..serving import END, SKIPPED, Rows, Schedule, StreamLayout, Tee, TopNodes, stream_record
from .scheduler import Request, Scheduler
from .stream_responses import Responses

__all__ = ["StreamLayout", "StreamRun", "layout_of"]

#: a key's remaining reads in a stream's requests: never zero, so no tensor is dropped early
#: (a response reads the request's tensors again and again)
_NEVER = 1 << 40


def layout_of(pipeline: Graph, schedule: Schedule) -> StreamLayout:
    """Where each node of ``schedule`` runs: by the record the compiler writes for a server's model."""
    return StreamLayout(schedule, stream_record(pipeline, list(schedule.order)))


class StreamRun(TopNodes):
    """One streaming request: ``await StreamRun(...).run(req)`` calls ``deliver`` with each response."""

    def __init__(
        self,
        *,
        pipeline: Graph,
        scheduler: Scheduler,
        layout: StreamLayout,
        mode: str,
        deliver: Callable[[dict[str, Any]], None],
    ) -> None:
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.layout = layout
        self.mode = mode
        self.deliver = deliver
        self.sequential = mode == "bls-sync"
        self.done: dict[str, anyio.Event] = {}
        self.items: dict[str, queue.SimpleQueue[Any]] = {}  # (whole step) -> its stream's items
        self.error: BaseException | None = None
        self.tg: Any = None
        self.req: Request = None  # type: ignore[assignment]  # set by run()

    # ------------------------------------------------------------------ the request

    async def run(self, req: Request) -> None:
        layout = self.layout
        req.remaining = defaultdict(lambda: _NEVER)
        self.req = req
        self.done = {n: anyio.Event() for n in layout.top}
        self.items = {w: queue.SimpleQueue() for w in layout.whole}
        async with anyio.create_task_group() as tg:
            self.tg = tg
            req.tg = tg
            if self.sequential:
                tg.start_soon(self._one_after_another)
            else:
                for name in layout.top:
                    tg.start_soon(self._guarded, self._top, name)
        if self.error is not None:
            raise self.error
        if layout.answers is None:
            self.deliver(self.scheduler.answer(req))

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.tg.cancel_scope.cancel()

    async def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            await fn(*args)
        except Exception as exc:
            self.fail(exc)

    async def _one_after_another(self) -> None:
        # A whole_stream step reads its stream as it comes, beside the steps one after another.
        for name in self.layout.whole:
            self.tg.start_soon(self._guarded, self._top, name)
        for name in self.layout.in_order:
            if name not in self.layout.whole:
                await self._guarded(self._top, name)
            if self.error is not None:
                return

    # What TopNodes._top runs a once-per-request node with.

    async def _source(self, name: str) -> None:
        await self._stream(name, self._generator(name))

    async def _once(self, name: str) -> None:
        await self.scheduler._run_node(self.req, name, perf_counter())

    # ------------------------------------------------------------------ generators

    async def _generator(self, name: str) -> Responses:
        """A streaming step's responses: its generator on an instance it holds to the end."""
        req = self.req
        rows = self._rows(name)
        if rows == 0:  # a `when` block no row holds: one response, its outputs skipped
            return Responses.skipped(req.schedule.returns[name])
        model = self.scheduler.models[name]
        inputs = {}
        for input_name, key in self.scheduler.bindings[name]:
            inputs[input_name] = model.place(self._gathered(name, key), req.copies, input_name)
        return await Responses.start(model, inputs, rows)

    def _rows(self, name: str) -> int:
        """How many rows ``name`` runs on; 0 where its `when` blocks hold for none."""
        branch, branches = self.req.branch, self.scheduler.branches
        if branch is None or branches is None:
            return self.req.rows
        return branch.rows_of(name)

    def _gathered(self, name: str, key: Any) -> Any:
        value = self.req.values[key]
        branch, branches = self.req.branch, self.scheduler.branches
        if branch is not None and branches is not None:
            value = branch.gather(value, branches.terms_of(key), branches.when[name])
        return value

    async def _whole(self, name: str) -> None:
        """A step that reads a stream whole: its stream's inputs as iterators, in a worker thread."""
        req = self.req
        stream = self.layout.reads[name]
        if self._rows(name) == 0:
            returns = req.schedule.returns[name]
            if self.pipeline.nodes[name].step.streaming:
                await self._stream(name, _ready(Responses.skipped(returns)))
            else:
                req.values.update({(name, out): SKIPPED for out in returns})
            return
        model = self.scheduler.models[name]
        items = self.items[name]
        streamed = [(i, k) for i, k in self.scheduler.bindings[name] if self.layout.streamed(k[0], stream)]
        iterators = Tee(items, [i for i, _ in streamed])
        inputs: dict[str, Any] = {i: iterators.of(i) for i, _ in streamed}
        for input_name, key in self.scheduler.bindings[name]:
            if input_name not in inputs:
                inputs[input_name] = model.place(self._gathered(name, key), req.copies, input_name)
        if self.pipeline.nodes[name].step.streaming:
            await self._stream(name, Responses.start(model, inputs, req.rows, held_by=items))
            return
        lease = await model.pool.acquire()
        start = perf_counter()
        try:
            outputs, compute = await model.execute(lease, inputs, req.rows, inline=False)
        finally:
            model.pool.give_back(lease)
            items.put(END)  # a step that stopped reading early leaves the rest unread
        for out in req.schedule.returns[name]:
            req.values[(name, out)] = outputs[out]
        req.trace.append((name, 0.0, compute, perf_counter() - start - compute, 1))

    # ------------------------------------------------------------------ one stream

    async def _stream(self, name: str, opening: Any) -> None:
        """Walk the responses of stream ``name`` in the mode's order, each through its steps."""
        responses: Responses = await opening
        try:
            if self.mode == "fused":  # pulled one at a time: the generator waits for the steps after it
                index = 0
                while (outputs := await responses.next()) is not None:
                    await self._response(name, index, outputs)
                    index += 1
                return
            send, receive = anyio.create_memory_object_stream[Any](math.inf)
            failed: list[BaseException] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._run_ahead, responses, send)
                await _caught(failed, tg, self._walk, name, receive, tg, failed)
            if failed:
                raise failed[0]
        finally:
            with anyio.CancelScope(shield=True):
                await responses.close()

    async def _walk(self, name: str, receive: Any, tg: Any, failed: list[BaseException]) -> None:
        with receive:
            if self.mode == "ensemble":
                await self._overlapped(name, receive, tg, failed)
                return
            index = 0
            async for outputs in receive:
                if isinstance(outputs, BaseException):
                    raise outputs
                await self._response(name, index, outputs)
                index += 1

    async def _run_ahead(self, responses: Responses, send: Any) -> None:
        with send:
            try:
                try:
                    while (outputs := await responses.next()) is not None:
                        send.send_nowait(outputs)
                except Exception as exc:  # after the responses before it: the walk raises it in turn
                    send.send_nowait(exc)
            except anyio.BrokenResourceError:  # the walk ended first, on an error of its own
                pass

    async def _overlapped(self, name: str, receive: Any, tg: Any, failed: list[BaseException]) -> None:
        """The ensemble: each response's steps start when it arrives; answers keep the stream's order."""
        previous = None
        index = 0
        async for outputs in receive:
            if isinstance(outputs, BaseException):
                if previous is not None:
                    await previous.wait()
                raise outputs
            turn = anyio.Event()
            tg.start_soon(_caught, failed, tg, self._response, name, index, outputs, previous, turn)
            previous, index = turn, index + 1
        if previous is not None:
            await previous.wait()

    async def _response(
        self,
        name: str,
        index: int,
        outputs: dict[str, Any],
        previous: anyio.Event | None = None,
        turn: anyio.Event | None = None,
    ) -> None:
        """One response of stream ``name``: its steps, then the readers and the caller, in order."""
        parent, layout = self.req, self.layout
        here: dict[Any, Any] = {(name, out): value for out, value in outputs.items()}
        child = Request(parent.schedule, parent.rows)
        child.values = ChainMap(here, parent.values)  # type: ignore[assignment]
        child.remaining = defaultdict(lambda: _NEVER)
        child.copies, child.trace, child.tg, child.inflight = parent.copies, parent.trace, self.tg, 2
        if self.scheduler.branches is not None:
            child.branch = Rows(self.scheduler.branches, parent.rows, child.values.__getitem__)
        nodes = layout.per_response[name]
        try:
            if self.sequential or len(nodes) < 2:
                for node in nodes:
                    await self._after_request_nodes(node, name)
                    await self.scheduler._run_node(child, node, perf_counter())
            else:
                await self._side_by_side(child, nodes, name)
        except Exception:
            if previous is not None:  # the responses before this one are answered first
                await previous.wait()
            raise
        if previous is not None:
            await previous.wait()
        for reader in layout.readers[name]:
            keys = [(i, k) for i, k in self.scheduler.bindings[reader] if self.layout.streamed(k[0], name)]
            self.items[reader].put({i: child.values[k] for i, k in keys})
        if layout.answers == name:
            self.deliver(self.scheduler.answer(child))
        if turn is not None:
            turn.set()

    async def _after_request_nodes(self, node: str, stream: str) -> None:
        """Wait for the once-per-request nodes ``node`` reads (they may run beside the stream)."""
        for before in self.req.schedule.after[node]:
            event = self.done.get(before) if before != stream else None
            if event is not None:
                await event.wait()

    async def _side_by_side(self, child: Request, nodes: list[str], stream: str) -> None:
        done = {n: anyio.Event() for n in nodes}
        after = child.schedule.after
        failed: list[BaseException] = []

        async def one(node: str) -> None:
            for before in after[node]:
                if before in done:
                    await done[before].wait()
            await self._after_request_nodes(node, stream)
            try:
                await self.scheduler._run_node(child, node, perf_counter())
            except Exception as exc:
                failed.append(exc)
                tg.cancel_scope.cancel()
                return
            done[node].set()

        async with anyio.create_task_group() as tg:
            for node in nodes:
                tg.start_soon(one, node)
        if failed:
            raise failed[0]


async def _caught(failed: list[BaseException], tg: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``; its error kept in ``failed`` (the first one wins) and ``tg`` cancelled."""
    try:
        await fn(*args)
    except Exception as exc:
        failed.append(exc)
        tg.cancel_scope.cancel()


async def _ready(value: Any) -> Any:
    return value
