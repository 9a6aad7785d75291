"""One request of a streaming pipeline inside a server model: the fused and BLS models run it
with this module, copied beside their ``model.py``; it imports only the standard library and
``serving``, as they do.

A streaming pipeline's top-level model is decoupled: it sends one response per response of
the pipeline's output stream, in the stream's order, through the request's response sender,
then the final flag alone (``TRITONSERVER_RESPONSE_COMPLETE_FINAL``). A failure is one error
response after the responses before it, then the final flag. It runs as the local runtime's
streams do (``pipelines/runtime/streams.py``): the once-per-request nodes as soon as the ones
before them are done, each stream's responses in order (the model pulls the next response once
the one before is answered), each response's own steps side by side (or one after another, in
``bls-sync``), and a ``whole_stream`` step on the stream as it comes, through an iterator.

What differs between the forms is the host (the model): how a node is called, how a stream is
opened (a generator in this process, or a decoupled model called with BLS), and how tensors are
held (arrays, or pb tensors). Where each node runs is ``serving.StreamLayout``, the local
runtime's too. The host gives :class:`StreamRun` these methods:

- ``start_node(name, values, rows, schedule, branch, alone)``: an awaitable of the node's outputs,
  or of ``None`` once the node is settled without a call (its outputs written into ``values``);
- ``open_stream(name, values, rows, schedule, branch)``: an awaitable of a stream (``next()``, ``close()``);
- ``whole_step(name)``: the in-process :class:`InProcessStep`-like step of a ``whole_stream`` node;
- ``gathered(name, key, values, branch)``: a tensor read by ``name`` as an array on its rows;
- ``held(name, array, dtype)``: an array a whole_stream step made, as the host holds tensors;
- ``nodes`` (name -> the plan's node) and ``dtypes`` ((node, output) -> dtype);
- ``respond(schedule, values, branch)``: the pb response of one answer;
- ``fail(reason, node=None, tensor=None, kind="StepError")``: the exception that carries a
  ``serving.WireError`` for the client.
"""

from __future__ import annotations

import asyncio
import queue
from collections import ChainMap

try:  # in a repository: the copies beside this file (the stub imports them as "<version>.<module>")
    from . import serving, stream_calls
except ImportError:  # in the package, for tests and linters
    from pipelines import serving
    from pipelines.compile.models import stream_calls

pb_utils = serving.pb_utils


class Cancelled(Exception):
    """The client cancelled the request: the stream stops, and nothing more is sent but the final flag."""


class StreamRun(serving.TopNodes):
    """One request of a streaming pipeline: ``await StreamRun(...).run()`` sends its responses,
    its error if it fails, and the final flag."""

    def __init__(self, host, sender, schedule, layout, values, rows, branch, *, sequential=False, alone=False):
        self.host = host
        self.sender = sender
        self.schedule = schedule
        self.layout = layout
        self.values = values  # the request's tensors: (node or None, name) -> tensor
        self.rows = rows  # the request's rows (None: the pipeline does not batch)
        self.branch = branch  # serving.Rows of a conditional plan, or None
        self.sequential = sequential
        self.one_at_a_time = alone  # the host streams no other request beside this one
        self.done = {n: asyncio.Event() for n in layout.top}
        self.items = {w: queue.SimpleQueue() for w in layout.whole}  # a whole_stream step's responses
        self.sent = 0

    async def run(self):
        try:
            if _one_lane(self.layout):
                # Each node waits for the one before it: tasks would buy no overlap, only loop turns
                # before the first response (a task and an event's wake-up per node).
                for name in self.layout.in_order:
                    await self._top(name)
            elif self.sequential:
                await self._one_after_another()
            else:
                await _together([self._top(name) for name in self.layout.top])
            if self.layout.answers is None:  # outputs made once per request: one answer
                self._send(self.host.respond(self.schedule, self.values, self.branch))
        except Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - every failure is the client's error response
            self._send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(_text(exc, self.host.pipeline))))
        finally:
            try:
                self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # noqa: BLE001 - a cancelled request's sender may be closed: nobody reads it
                pass

    def _send(self, response):
        # Not asked whether the request was cancelled: each ask is a round trip to the server
        # process, and a stream asks once between two responses (_stream).
        self.sender.send(response)
        self.sent += 1

    async def _one_after_another(self):
        # A whole_stream step reads its stream as it comes, beside the steps one after another.
        async def in_turn():
            for name in self.layout.in_order:
                if name not in self.layout.whole:
                    await self._top(name)

        await _together([in_turn(), *(self._top(name) for name in self.layout.whole)])

    # What serving.TopNodes._top runs a once-per-request node with.

    async def _source(self, name):
        await self._stream(name, await self._open(name))

    async def _once(self, name):
        await self._nodes([name], {name: []}, self.values)

    def _count(self, name):
        """The rows ``name`` runs on; 0 where its `when` blocks hold for none."""
        if self.branch is None:
            return self.rows
        return self.branch.rows_of(name)

    async def _nodes(self, names, after, values):
        """Run ``names`` (each after those of ``after`` it waits for), reading and writing ``values``."""
        host, schedule = self.host, self.schedule

        def start(name, alone):
            return host.start_node(name, values, self.rows, schedule, self.branch, alone)

        def keep(name, outputs):
            if outputs is not None:
                for out in schedule.returns[name]:
                    values[(name, out)] = outputs[out]

        if self.sequential or len(names) == 1:
            for name in names:  # awaited in turn: no task to make, nor a loop turn to wait for it
                keep(name, await start(name, True))
            return
        await serving.run_concurrently({n: after[n] for n in names}, start, lambda n, future: keep(n, future.result()))

    # ------------------------------------------------------------------ streams

    async def _open(self, name):
        if self.branch is not None and self._count(name) == 0:  # one response of skipped outputs
            return _Skipped(self.schedule.returns[name])
        return await self.host.open_stream(name, self.values, self._count(name), self.schedule, self.branch)

    async def _stream(self, name, stream):
        """Walk the responses of stream ``name`` in order, each through its steps, its readers and out."""
        index = 0
        try:
            while True:
                # Asked once between two responses, not before the first: each ask is a round trip
                # to the server process, which the first response would wait for.
                if index and self.sender.is_cancelled():  # the client gave up: stop pulling the generator
                    raise Cancelled
                outputs = await stream.next(self._alone(name))
                if outputs is None:
                    break
                await self._response(name, index, outputs)
                index += 1
        finally:
            self._end_readers(name)
            await stream.close()

    def _alone(self, name):
        """Whether stream ``name`` is all that can run in this process now: its next response may then
        be pulled on the event loop itself, without a hop to a thread and back (stream_calls). A node
        that could run beside it (begun or not) needs the event loop free between two pulls."""
        if not self.one_at_a_time:
            return False
        # One after another, only the whole_stream steps run beside the node in turn.
        beside = self.layout.whole if self.sequential else self.layout.top
        waiting = self.layout.held_up_by[name]
        return all(self.done[n].is_set() or n in waiting for n in beside if n != name)

    async def _response(self, name, index, outputs):
        layout = self.layout
        values = ChainMap({(name, out): value for out, value in outputs.items()}, self.values)
        nodes = layout.per_response[name]
        if nodes:
            await self._nodes(nodes, layout.inner_after[name], values)
        for reader in layout.readers[name]:
            self.items[reader].put({i: self.host.gathered(reader, key, values, self.branch)
                                    for i, key in self._streamed(reader, name)})
        if layout.answers == name:
            self._send(self.host.respond(self.schedule, values, self.branch))

    def _streamed(self, reader, stream):
        """``(input, key)`` of each input of ``reader`` that comes from ``stream``."""
        return [(s["input"], (s["node"], s["tensor"])) for s in self.host.nodes[reader]["inputs"]
                if self.layout.streamed(s["node"], stream)]

    async def _whole(self, name):
        """A step that reads its stream whole: its stream's inputs as iterators, in a thread of its own."""
        returns = self.schedule.returns[name]
        if self.branch is not None and self._count(name) == 0:
            if name in self.layout.sources:
                await self._stream(name, _Skipped(returns))
            else:
                self.values.update({(name, out): serving.SKIPPED for out in returns})
            return
        rows = self._count(name)
        streamed = self._streamed(name, self.layout.reads[name])
        items = self.items[name]
        tee = serving.Tee(items, [i for i, _ in streamed])
        inputs = {i: tee.of(i) for i, _ in streamed}
        for source in self.host.nodes[name]["inputs"]:
            if source["input"] not in inputs:
                inputs[source["input"]] = self.host.gathered(name, (source["node"], source["tensor"]), self.values, self.branch)
        step = self.host.whole_step(name)
        if name in self.layout.sources:
            await self._stream(name, await stream_calls.InProcessStream.open(self.host, name, step, inputs, rows, held_by=items))
            return
        outputs = await step.call_whole(self.host, name, inputs, rows, items)
        for out in returns:
            self.values[(name, out)] = self.host.held(out, outputs[out], self.host.dtypes.get((name, out)))


class _Skipped:
    """The one response of a stream no row of its `when` blocks holds: its outputs skipped."""

    def __init__(self, returns):
        self.left = [dict.fromkeys(returns, serving.SKIPPED)]

    async def next(self, alone=False):
        return self.left.pop() if self.left else None

    async def close(self):
        pass


def _one_lane(layout):
    """Whether the once-per-request nodes can only run one after another: each waits for the one
    before it, and no step reads a stream whole (which runs beside its stream)."""
    order = layout.in_order
    return not layout.whole and all(order[i] in layout.held_up_by[order[i - 1]] for i in range(1, len(order)))


async def _together(coroutines):
    """Run ``coroutines`` side by side; the first failure cancels the others, which are awaited."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await _settled(tasks)
    finally:
        await _stopped(tasks)


async def _settled(tasks):
    """Wait for ``tasks``; raise the first failure as soon as it happens."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()


async def _stopped(tasks):
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _text(exc, pipeline):
    """The wire text an exception carries to the client (``serving.WireError``)."""
    wire = getattr(exc, "wire", None)
    if wire is not None:
        return wire.text()
    if serving.parse_error(str(exc)) is not None:  # a host's failure, told already
        return str(exc)
    return serving.WireError("InferenceError", pipeline, f"the model failed: {type(exc).__name__}: {exc}").text()
