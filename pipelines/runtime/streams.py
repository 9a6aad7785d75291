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

import inspect
import math
import queue
from collections import ChainMap, defaultdict
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import anyio

from .. import serving
from ..core.graph import Graph
from ..core.step import check_outputs
from ..errors import PipelinesError, StepError, StepTimeoutError
from ..serving import SKIPPED, Rows, Schedule
from .instances import StepModel
from .scheduler import Request, Scheduler

__all__ = ["StreamLayout", "StreamRun"]

_END = object()  # a whole_stream step's iterator: the stream ended

#: a key's remaining reads in a stream's requests: never zero, so no tensor is dropped early
#: (a response reads the request's tensors again and again)
_NEVER = 1 << 40


class StreamLayout:
    """Where each node of a schedule runs in a streaming pipeline: once per request, or once per
    response of a stream; which steps read a stream whole; which stream the answers come from."""

    def __init__(self, pipeline: Graph, schedule: Schedule) -> None:
        order = schedule.order
        self.level = {n: pipeline.stream_of(n) for n in order}
        self.top = [n for n in order if self.level[n] is None]
        self.sources = {n for n in order if pipeline.stream_from(n) == n}
        self.whole = [n for n in order if pipeline.nodes[n].step.whole_stream]
        self.per_response = {s: [n for n in order if self.level[n] == s] for s in self.sources}
        self.readers = {s: [w for w in order if w in self.whole and pipeline.stream_input(w) == s] for s in self.sources}
        answers = {pipeline.stream_from(key[0]) for _, key in schedule.outputs}
        self.answers: str | None = next(iter(answers)) if answers else None
        # The once-per-request nodes each waits for: those before it, except the stream a whole_stream
        # step reads as it comes; a stream also waits for those its per-response steps read, so
        # that one after another ("bls-sync") the stream runs once they are done.
        self.after: dict[str, list[str]] = {}
        ordered: dict[str, list[str]] = {}  # one after another, a whole_stream step follows its stream
        for name in self.top:
            read = pipeline.stream_input(name) if name in self.whole else None
            after = [b for b in schedule.after[name] if self.level[b] is None and b != read]
            for node in self.per_response.get(name, ()):
                after += [b for b in schedule.after[node] if self.level[b] is None and b != name and b not in after]
            self.after[name] = after
            ordered[name] = after + ([read] if read in self.level else [])
        self.in_order = _in_order(self.top, ordered)


def _in_order(names: list[str], after: dict[str, list[str]]) -> list[str]:
    """``names`` in their order, each moved after those it waits for (graphlib would reorder ties)."""
    placed: list[str] = []
    left = list(names)
    while left:
        ready = next(n for n in left if all(b in placed for b in after[n]))
        placed.append(ready)
        left.remove(ready)
    return placed


class StreamRun:
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
        self.readers: dict[str, queue.SimpleQueue[Any]] = {}  # (whole step) -> its stream's items
        self.error: BaseException | None = None
        self.tg: Any = None
        self.req: Request = None  # type: ignore[assignment]  # set by run()

    # ------------------------------------------------------------------ the request

    async def run(self, req: Request) -> None:
        layout = self.layout
        req.remaining = defaultdict(lambda: _NEVER)
        self.req = req
        self.done = {n: anyio.Event() for n in layout.top}
        self.readers = {w: queue.SimpleQueue() for w in layout.whole}
        async with anyio.create_task_group() as tg:
            self.tg = tg
            req.tg = tg
            if self.sequential:
                tg.start_soon(self._one_after_another)
            else:
                for name in layout.top:
                    tg.start_soon(self._guarded, self._top_node, name)
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
            self.tg.start_soon(self._guarded, self._top_node, name)
        for name in self.layout.in_order:
            if name not in self.layout.whole:
                await self._guarded(self._top_node, name)
            if self.error is not None:
                return

    async def _top_node(self, name: str) -> None:
        """Run a once-per-request node when the once-per-request nodes before it are done."""
        req = self.req
        for before in self.layout.after[name]:
            await self.done[before].wait()
        try:
            if name in self.layout.whole:
                await self._whole(name)
            elif name in self.layout.sources:
                await self._stream(name, self._generator(name))
            else:
                await self.scheduler._run_node(req, name, perf_counter())
        except Exception:
            # The responses before the failure go on to the end: the steps that read this stream
            # whole see it end, and answer what they made of it, before the error is raised.
            self._end_readers(name)
            for reader in self.layout.readers.get(name, ()):
                await self.done[reader].wait()
            raise
        finally:
            self._end_readers(name)
        self.done[name].set()

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
        branch.read_conditions(name)
        return branch.count(branches.when[name])

    def _gathered(self, name: str, key: Any) -> Any:
        value = self.req.values[key]
        branch, branches = self.req.branch, self.scheduler.branches
        if branch is not None and branches is not None:
            value = branch.gather(value, branches.terms_of(key), branches.when[name])
        return value

    async def _whole(self, name: str) -> None:
        """A step that reads a stream whole: its stream's inputs as iterators, in a worker thread."""
        req = self.req
        stream = self.pipeline.stream_input(name)
        if self._rows(name) == 0:
            returns = req.schedule.returns[name]
            if self.pipeline.nodes[name].step.streaming:
                await self._stream(name, _ready(Responses.skipped(returns)))
            else:
                req.values.update({(name, out): SKIPPED for out in returns})
            return
        model = self.scheduler.models[name]
        items = self.readers[name]
        streamed = [(i, k) for i, k in self.scheduler.bindings[name] if k[0] is not None and self._streamed(k[0], stream)]
        iterators = _Tee(items, [i for i, _ in streamed])
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
            items.put(_END)  # a step that stopped reading early leaves the rest unread
        for out in req.schedule.returns[name]:
            req.values[(name, out)] = outputs[out]
        req.trace.append((name, 0.0, compute, perf_counter() - start - compute, 1))

    def _streamed(self, node: str, stream: str | None) -> bool:
        return node == stream or self.layout.level.get(node) == stream

    def _end_readers(self, name: str) -> None:
        """Tell the whole_stream readers of ``name``'s stream that it ended (or failed)."""
        for reader in self.layout.readers.get(name, ()):
            self.readers[reader].put(_END)

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
            keys = [(i, k) for i, k in self.scheduler.bindings[reader] if k[0] is not None and self._streamed(k[0], name)]
            self.readers[reader].put({i: child.values[k] for i, k in keys})
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


class Responses:
    """A streaming step's responses, each checked as a return value is; ``close()`` stops it."""

    def __init__(
        self, model: StepModel | None, gen: Any, lease: Any = None, held_by: Any = None, rows: int = 1
    ) -> None:
        self.model = model
        self.gen = gen
        self.lease = lease
        self.rows = rows
        self.index = 0
        self.is_async = inspect.isasyncgen(gen)
        self._held_by = held_by  # a whole_stream generator's items: ended on close, so it stops reading
        # The step's timeout bounds its whole stream in every mode, as each server form's step model does.
        timeout = model.step.options.timeout if model is not None else None
        self.timeout = timeout
        self.deadline = perf_counter() + timeout if timeout else math.inf

    @classmethod
    def skipped(cls, returns: list[str]) -> Responses:
        return cls(None, iter([{out: SKIPPED for out in returns}]))

    @classmethod
    async def start(cls, model: StepModel, inputs: dict[str, Any], rows: int, *, held_by: Any = None) -> Responses:
        assert model.pool is not None
        lease = await model.pool.acquire()
        try:
            gen = lease.instance.function(**inputs)
            if not (inspect.isasyncgen(gen) or isinstance(gen, Iterator)):
                gen = iter(gen)
        except BaseException as exc:
            model.pool.give_back(lease)
            if isinstance(exc, Exception):
                raise model._raised(exc) from exc
            raise
        return cls(model, gen, lease, held_by, rows)

    async def next(self) -> dict[str, Any] | None:
        """The next response's outputs, or ``None`` at the end of the stream."""
        model = self.model
        if perf_counter() > self.deadline:
            assert model is not None
            raise model._told(
                StepTimeoutError,
                f"ran past its timeout of {self.timeout:g} s after {self.index} responses; the stream was ended "
                "with this error. Raise the step's timeout, or find why its generator does not end",
            )
        try:
            if model is None:  # a skipped step's one response
                return next(self.gen, None)
            if self.is_async:
                try:
                    item = await self.gen.__anext__()
                except StopAsyncIteration:
                    return None
            else:
                # Not abandoned when cancelled: the generator is closed only once this call returns.
                item = await anyio.to_thread.run_sync(next, self.gen, _END)
                if item is _END:
                    return None
        except PipelinesError:
            raise
        except Exception as exc:
            assert model is not None
            raise model._raised(exc, f"(after {self.index} responses)") from exc
        self.index += 1  # counted from 1, as `pipelines run` numbers responses and the server forms name them
        return _checked(model, item, self.index, self.rows)

    async def close(self) -> None:
        gen, model, lease = self.gen, self.model, self.lease
        self.lease = None
        if self._held_by is not None:
            self._held_by.put(_END)
        try:
            if self.is_async:
                await gen.aclose()
            elif hasattr(gen, "close"):
                await anyio.to_thread.run_sync(gen.close)
        except Exception:  # the stream's own error, if any, is the one worth reporting
            pass
        finally:
            if lease is not None and model is not None and model.pool is not None:
                model.pool.give_back(lease)


def _checked(model: StepModel, item: Any, index: int, rows: int) -> dict[str, Any]:
    """One yield as a dict of arrays of the step's declared outputs, or an error naming its number (from 1)."""
    step = model.step
    try:
        outputs = serving.normalise_outputs(list(step.outputs), item, _fail(step.name))
        outputs = serving.as_arrays(outputs)
        check_outputs(step, outputs, batched=model.batched, batch_size=rows if model.batched else None)
    except serving.Refused as exc:
        raise model._told(StepError, f"response {index}: output {exc}", exc.tensor) from None
    except PipelinesError as exc:
        reason = exc.message.removeprefix(f"step {step.name!r} ")
        raise model._told(StepError, f"response {index}: {reason}", exc.tensor) from None
    return outputs


def _fail(step: str) -> Callable[[str, str | None], StepError]:
    def fail(message: str, tensor: str | None) -> StepError:
        return StepError(f"step {step!r} {message}", step=step, tensor=tensor)

    return fail


async def _caught(failed: list[BaseException], tg: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``; its error kept in ``failed`` (the first one wins) and ``tg`` cancelled."""
    try:
        await fn(*args)
    except Exception as exc:
        failed.append(exc)
        tg.cancel_scope.cancel()


async def _ready(value: Any) -> Any:
    return value


class _Tee:
    """The iterators a whole_stream step reads: one per streamed input, fed from one queue of items
    (each a dict of those inputs for one response), so that they advance together."""

    def __init__(self, items: queue.SimpleQueue[Any], names: list[str]) -> None:
        self._items = items
        self._held: dict[str, list[Any]] = {n: [] for n in names}
        self._ended = False

    def of(self, name: str) -> Iterator[Any]:
        held = self._held[name]
        while True:
            if not held:
                if self._ended or not self._pull():
                    return
            yield held.pop(0)

    def _pull(self) -> bool:
        item = self._items.get()
        if item is _END:
            self._ended = True
            return False
        for name, value in item.items():
            if name in self._held:
                self._held[name].append(value)
        return True
