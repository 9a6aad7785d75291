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
held (arrays, or pb tensors). The host gives :class:`StreamRun` these methods:

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
import inspect
import json
import os
import queue
import threading
import time
from collections import ChainMap
from collections.abc import Iterator

try:  # in a repository: the copy beside this file (the stub imports it as "<version>.stream_run")
    from . import serving
except ImportError:  # in the package, for tests and linters
    from pipelines import serving

pb_utils = serving.pb_utils

_END = object()  # the end of a generator, or of a whole_stream step's items


class Cancelled(Exception):
    """The client cancelled the request: the stream stops, and nothing more is sent but the final flag."""


def response_label(index):
    """How an error names a stream's response (``index`` counts from 0): numbered from 1, as
    ``pipelines run`` shows responses and a streaming step's own model names them."""
    return f"response {index + 1}"


class Layout:
    """Where each node of one schedule runs: once per request, or once per response of a stream;
    which nodes stream, which read a stream whole; which stream the answers come from.

    ``streams`` is the compiler's record of each node (``pipelines.compile.fused.stream_nodes``):
    ``of`` (the stream it runs once per response of), ``from`` (the stream its outputs belong to),
    ``streams`` (it is a streaming step), ``whole`` and ``reads`` (the stream it reads whole).
    """

    def __init__(self, schedule, streams):
        order = schedule.order
        self.level = {n: streams[n]["of"] for n in order}
        self.top = [n for n in order if self.level[n] is None]
        self.sources = [n for n in order if streams[n]["streams"]]
        self.whole = [n for n in order if streams[n]["whole"]]
        self.reads = {n: streams[n]["reads"] for n in self.whole}
        self.per_response = {s: [n for n in order if self.level[n] == s] for s in self.sources}
        self.inner_after = {
            s: {n: [b for b in schedule.after[n] if self.level[b] == s] for n in nodes}
            for s, nodes in self.per_response.items()
        }
        self.readers = {s: [w for w in self.whole if self.reads[w] == s] for s in self.sources}
        answers = {None if node is None else streams[node]["from"] for _, (node, _) in schedule.outputs}
        self.answers = next(iter(answers)) if answers else None  # one stream, or none: the declaration says so
        # The once-per-request nodes each waits for: those before it, except the stream a whole_stream
        # step reads as it comes; a stream also waits for those its per-response steps read.
        self.after = {}
        ordered = {}  # one after another, a whole_stream step follows its stream
        for name in self.top:
            read = self.reads.get(name)
            after = [b for b in schedule.after[name] if self.level[b] is None and b != read]
            for node in self.per_response.get(name, ()):
                after += [b for b in schedule.after[node] if self.level[b] is None and b != name and b not in after]
            self.after[name] = after
            ordered[name] = after + ([read] if read in self.level else [])
        self.in_order = _in_order(self.top, ordered)


def _in_order(names, after):
    """``names`` in their order, each moved after those it waits for."""
    placed, left = [], list(names)
    while left:
        ready = next(n for n in left if all(b in placed for b in after[n]))
        placed.append(ready)
        left.remove(ready)
    return placed


class StreamRun:
    """One request of a streaming pipeline: ``await StreamRun(...).run()`` sends its responses,
    its error if it fails, and the final flag."""

    def __init__(self, host, sender, schedule, layout, values, rows, branch, *, sequential=False):
        self.host = host
        self.sender = sender
        self.schedule = schedule
        self.layout = layout
        self.values = values  # the request's tensors: (node or None, name) -> tensor
        self.rows = rows  # the request's rows (None: the pipeline does not batch)
        self.branch = branch  # serving.Rows of a conditional plan, or None
        self.sequential = sequential
        self.done = {n: asyncio.Event() for n in layout.top}
        self.items = {w: queue.SimpleQueue() for w in layout.whole}  # a whole_stream step's responses
        self.sent = 0

    async def run(self):
        try:
            if self.sequential:
                await self._one_after_another()
            else:
                await _together([self._top(name) for name in self.layout.top])
            if self.layout.answers is None:  # outputs made once per request: one answer
                self._send(self.host.respond(self.schedule, self.values, self.branch))
        except Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - every failure is the client's error response
            self._send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(_text(exc))))
        finally:
            try:
                self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # noqa: BLE001 - a cancelled request's sender may be closed: nobody reads it
                pass

    def _send(self, response):
        if self.sender.is_cancelled():
            raise Cancelled
        self.sender.send(response)
        self.sent += 1

    async def _one_after_another(self):
        # A whole_stream step reads its stream as it comes, beside the steps one after another.
        async def in_turn():
            for name in self.layout.in_order:
                if name not in self.layout.whole:
                    await self._top(name)

        await _together([in_turn(), *(self._top(name) for name in self.layout.whole)])

    async def _top(self, name):
        """A once-per-request node, once the once-per-request nodes before it are done."""
        for before in self.layout.after[name]:
            await self.done[before].wait()
        try:
            if name in self.layout.whole:
                await self._whole(name)
            elif name in self.layout.sources:
                await self._stream(name, await self._open(name))
            else:
                await self._nodes([name], {name: []}, self.values)
        except Exception:
            # The responses before the failure go on to the end: the steps that read this stream
            # whole see it end, and answer what they made of it, before the error is sent.
            self._end_readers(name)
            for reader in self.layout.readers.get(name, ()):
                await self.done[reader].wait()
            raise
        self.done[name].set()

    def _count(self, name):
        """The rows ``name`` runs on; 0 where its `when` blocks hold for none."""
        if self.branch is None:
            return self.rows
        self.branch.read_conditions(name)
        return self.branch.count(self.branch.branches.when[name])

    async def _nodes(self, names, after, values):
        """Run ``names`` (each after those of ``after`` it waits for), reading and writing ``values``."""
        host, schedule = self.host, self.schedule

        def start(name, alone):
            return host.start_node(name, values, self.rows, schedule, self.branch, alone)

        def collect(name, future):
            outputs = future.result()
            if outputs is not None:
                for out in schedule.returns[name]:
                    values[(name, out)] = outputs[out]

        if self.sequential or len(names) == 1:
            for name in names:
                future = asyncio.ensure_future(start(name, True))
                await asyncio.gather(future, return_exceptions=True)
                collect(name, future)
            return
        await serving.run_concurrently({n: after[n] for n in names}, start, collect)

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
                if self.sender.is_cancelled():  # the client gave up: stop pulling the generator
                    raise Cancelled
                outputs = await stream.next()
                if outputs is None:
                    break
                if self.sender.is_cancelled():
                    raise Cancelled
                await self._response(name, index, outputs)
                index += 1
        finally:
            self._end_readers(name)
            await stream.close()

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
        level = self.layout.level
        return [(s["input"], (s["node"], s["tensor"])) for s in self.host.nodes[reader]["inputs"]
                if s["node"] is not None and (s["node"] == stream or level.get(s["node"]) == stream)]

    def _end_readers(self, name):
        for reader in self.layout.readers.get(name, ()):
            self.items[reader].put(_END)

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
        tee = _Tee(items, [i for i, _ in streamed])
        inputs = {i: tee.of(i) for i, _ in streamed}
        for source in self.host.nodes[name]["inputs"]:
            if source["input"] not in inputs:
                inputs[source["input"]] = self.host.gathered(name, (source["node"], source["tensor"]), self.values, self.branch)
        step = self.host.whole_step(name)
        if name in self.layout.sources:
            await self._stream(name, await InProcessStream.open(self.host, name, step, inputs, rows, held_by=items))
            return
        outputs = await step.call_whole(self.host, name, inputs, rows, items)
        for out in returns:
            self.values[(name, out)] = self.host.held(out, outputs[out], self.host.dtypes.get((name, out)))


class _Skipped:
    """The one response of a stream no row of its `when` blocks holds: its outputs skipped."""

    def __init__(self, returns):
        self.left = [dict.fromkeys(returns, serving.SKIPPED)]

    async def next(self):
        return self.left.pop() if self.left else None

    async def close(self):
        pass


class InProcessStep:
    """A step that runs in this model's process (the fused model's steps; a BLS model's
    ``whole_stream`` steps): its instance, its output contract, and what bounds its calls."""

    def __init__(self, instance, gives, device, timeout_s, renew, file=None):
        self.instance = instance
        self.file = file  # the step's source file, which by-value code no longer names
        self.gives = gives  # serving.Contract of its outputs
        self.device = device
        self.is_async = instance.is_async
        self.lock = asyncio.Lock()  # a step shared by two nodes, or two runs, is called one at a time
        self.timeout_s = timeout_s  # 0: none
        self.renew = renew  # a fresh instance (initialize() again), for one abandoned past its timeout
        self.broken = None  # why no fresh instance could be made: every later call fails with it

    def reason(self, exc):
        return serving.exception_reason(exc, self.instance.home, self.file)

    async def replace_stuck(self, instance):
        """A call of ``instance`` ran past its timeout and cannot be stopped: a fresh instance takes its place."""
        try:
            self.instance = await in_daemon_thread(self.renew)
        except Exception as exc:  # noqa: BLE001 - build() wraps the step's own error in a wire error: say the step's
            self.broken = (f"its instance was abandoned by a call that ran past its timeout of {self.timeout_s:g} s, "
                           f"and a fresh one could not be made: {serving.exception_reason(exc.__cause__ or exc)}")

    async def call_whole(self, host, name, inputs, rows, items):
        """One call of a whole_stream step that returns once: in a thread of its own, as it blocks on
        the stream's responses; bounded by the step's timeout."""
        node = host.nodes[name]
        async with self.lock:
            if self.broken is not None:
                raise host.fail(self.broken, node=name)
            call = in_daemon_thread(self.instance.execute, inputs)
            try:
                if self.timeout_s:
                    outputs = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
                else:
                    outputs = await asyncio.shield(call)
            except asyncio.TimeoutError:
                items.put(_END)  # it may be waiting for the stream: end its iterator
                await self.replace_stuck(self.instance)
                raise host.fail(_past(self.timeout_s, node, "a fresh instance of the step takes its place"),
                                node=name, kind="StepTimeoutError") from None
            except asyncio.CancelledError:
                items.put(_END)  # the request ends: let the call finish on the iterator's end
                raise
            except serving.Refused as exc:
                raise host.fail(str(exc), node=name, tensor=exc.tensor) from None
            except Exception as exc:  # noqa: BLE001 - the step's own error, told with its line
                raise host.fail(self.reason(_unwrapped(exc)), node=name) from None
        try:
            self.gives.check_outputs(serving.as_arrays(outputs), rows if self.gives.max_batch_size > 0 else None)
        except serving.Refused as exc:
            raise host.fail(str(exc), node=name, tensor=exc.tensor) from None
        return outputs


def _unwrapped(exc):
    if isinstance(exc, SystemExit):
        return serving.StepExited(exc.code)
    if isinstance(exc, KeyboardInterrupt):
        return serving.StepInterrupted(exc)
    return exc


def _past(limit, node, then):
    return (f"ran past its timeout of {limit:g} s (model {node['model']!r}); the request was answered "
            f"with this error, and {then}")


def load_step(version_dir, pipeline, node_name, node, index):
    """The :class:`InProcessStep` of ``node`` (its ``folder`` of step files under ``version_dir``,
    its ``timeout_us``): the step's own ``step.json``, code and checks, as its step model loads them."""
    folder = os.path.join(version_dir, node["folder"])
    with open(os.path.join(folder, "step.json"), encoding="utf-8") as f:
        step = json.load(f)
    inputs = {n: serving.Spec.from_dict(s) for n, s in step["inputs"].items()}
    outputs = {n: serving.Spec.from_dict(s) for n, s in step["outputs"].items()}
    nodes = step.get("nodes") or [node_name]
    config = serving.instance_config(
        step=step["step"],
        inputs=inputs,
        outputs=outputs,
        parameters=step.get("parameters") or {},
        max_batch_size=int(step["max_batch_size"]),
        pipeline=pipeline,
        node=nodes[0] if len(nodes) == 1 else None,
        instance_index=index,
        device=step.get("device") or "cpu",
    )
    impl = None

    def build():
        nonlocal impl
        try:
            if impl is None:
                impl = serving.load_impl(step["impl"], folder)
            return serving.StepInstance(step["step"], impl, list(outputs), config, array=step.get("array"))
        except Exception as exc:
            reason = f"could not be loaded: {serving.exception_reason(exc)}"
            raise RuntimeError(serving.WireError("StepError", pipeline, reason, node_name, step["step"]).text()) from exc

    contract = serving.Contract(outputs, int(step["max_batch_size"]))
    return InProcessStep(build(), contract, step.get("device"), node.get("timeout_us", 0) / 1e6, build, step.get("file"))


class InProcessStream:
    """A streaming step's generator in this process, pulled one response at a time: a sync
    generator on a thread of its own (it may block), an async one on the event loop. Each
    response is checked as a step's return value is; the step's timeout bounds the whole stream;
    ``close()`` stops the generator (its ``finally`` runs) unless it is stuck past its timeout."""

    def __init__(self, host, name, step, gen, rows, held_by):
        self.host = host
        self.name = name
        self.node = host.nodes[name]
        self.step = step
        self.gen = gen
        self.rows = rows
        self.index = 0
        self.is_async = inspect.isasyncgen(gen)
        self.pump = None if self.is_async else _Pump(gen)
        self.deadline = time.monotonic() + step.timeout_s if step.timeout_s else None
        self._held_by = held_by
        self._stuck = False

    @classmethod
    async def open(cls, host, name, step, inputs, rows, *, held_by=None):
        """The stream of ``step`` on ``inputs``; the step's lock is held until it is closed."""
        await step.lock.acquire()
        try:
            if step.broken is not None:
                raise host.fail(step.broken, node=name)
            try:
                # Calling a generator function runs none of its code; a plain function that returns
                # an iterator (streaming=True) runs here, as the local runtime runs it.
                gen = step.instance.function(**inputs)
            except Exception as exc:  # noqa: BLE001 - the step's own error
                raise host.fail(step.reason(_unwrapped(exc)), node=name) from None
            if not (inspect.isasyncgen(gen) or isinstance(gen, Iterator)):
                gen = iter(gen)
            return cls(host, name, step, gen, rows, held_by)
        except BaseException:
            step.lock.release()
            raise

    async def next(self):
        """The next response's outputs, or ``None`` at the end of the stream."""
        left = None
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out("the stream was closed")
        try:
            if self.is_async:
                pulled = self.gen.__anext__()
                item = await (asyncio.wait_for(pulled, left) if left is not None else pulled)
            else:
                pulled = self.pump.ask("next")
                item = await (asyncio.wait_for(asyncio.shield(pulled), left) if left is not None else pulled)
        except (StopAsyncIteration, StopIteration):
            return None
        except asyncio.TimeoutError:
            if self.is_async:
                raise self._timed_out("the stream was cancelled") from None
            try:  # a moment more for the response under way: a generator that yields on is closed
                await asyncio.wait_for(asyncio.shield(pulled), min(1.0, self.step.timeout_s))
                raise self._timed_out("the stream was closed") from None
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                raise
            except BaseException:  # noqa: BLE001 - its error after its timeout: the timeout is what is said
                raise self._timed_out("the stream was closed") from None
            self._stuck = True  # inside the generator: it cannot be stopped, nor closed
            await self.step.replace_stuck(self.step.instance)
            raise self._timed_out("a fresh instance of the step takes the stuck one's place") from None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the generator's own error, after the responses before it
            raise self.host.fail(f"(after {self.index} responses) {self.step.reason(_unwrapped(exc))}",
                                 node=self.name) from None
        if item is _END:
            return None
        index, self.index = self.index, self.index + 1
        outputs = self._checked(item, index)
        host, name = self.host, self.name
        return {out: host.held(out, value, host.dtypes[(name, out)]) if (name, out) in host.dtypes else value
                for out, value in outputs.items()}

    def _checked(self, item, index):
        step, label = self.step, response_label(index)
        try:
            outputs = serving.as_arrays(step.instance.normalise(item))
            batched = step.gives.max_batch_size > 0
            step.gives.check_outputs(outputs, self.rows if batched else None)
        except serving.Refused as exc:
            reason = str(exc)
            raise self.host.fail(f"{label}: {reason if reason.startswith('output') else 'output ' + reason}",
                                 node=self.name, tensor=exc.tensor) from None
        return outputs

    def _timed_out(self, then):
        return self.host.fail(_past(self.step.timeout_s, self.node, then), node=self.name, kind="StepTimeoutError")

    async def close(self):
        if self._held_by is not None:
            self._held_by.put(_END)  # a whole_stream generator waiting for its stream: its iterator ends
        try:
            if self._stuck:
                return
            if self.is_async:
                await self.gen.aclose()
            else:
                await self.pump.ask("close")
        except Exception:  # noqa: BLE001 - the stream's own error, if any, is the one worth reporting
            pass
        finally:
            self.step.lock.release()


class CalledStream:
    """A streaming step's own decoupled model, called with BLS (``exec``/``async_exec(decoupled=True)``):
    its responses as they come, each read off a thread of its own (the iterator blocks). A failure is
    an ordinary response that carries it in ``err_output`` (a decoupled model's error response never
    reaches a BLS model: docs/triton_decoupled.md); the final flag comes on an empty response.

    The step's model bounds its stream by the step's timeout and says so in ``err_output``; this
    waits that long and :data:`GRACE_S` more before it gives up with its own words. ``close()``
    stops reading: the called model runs on to its end, as Triton 2.51 cannot cancel it."""

    GRACE_S = 2.0

    def __init__(self, host, name, responses, returns, err_output, limit_s):
        self.host = host
        self.name = name
        self.node = host.nodes[name]
        self.returns = returns
        self.err_output = err_output
        self.limit_s = limit_s
        self.deadline = time.monotonic() + limit_s + self.GRACE_S if limit_s else None
        self.pump = _Pump(iter(responses))

    async def next(self):
        while True:
            pulled = self.pump.ask("next")
            try:
                if self.deadline is None:
                    response = await pulled
                else:
                    response = await asyncio.wait_for(asyncio.shield(pulled), max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self.host.fail(_past(self.limit_s, self.node, "the step may still be running"), node=self.name,
                                     kind="StepTimeoutError") from None
            except Exception as exc:  # noqa: BLE001 - the call's own failure (the model went away…)
                raise self.host.fail(f"could not be read (model {self.node['model']!r}): {exc}", node=self.name) from None
            if response is _END:
                return None
            if response.has_error():
                raise self.host.called_failure(self.name, response.error().message())
            err = pb_utils.get_output_tensor_by_name(response, self.err_output)
            if err is None:  # the final flag, on an empty response
                continue
            text = serving.failure_text(err)
            if text is not None:
                raise self.host.called_failure(self.name, text)
            outputs = {}
            for out in self.returns:
                tensor = pb_utils.get_output_tensor_by_name(response, out)
                if tensor is None:
                    raise self.host.fail(f"returned no output {out!r}", node=self.name, tensor=out)
                outputs[out] = tensor
            return outputs

    async def close(self):
        self.pump.asks.put(("close", None))  # after the read under way, if any: nobody waits for it


class _Pump:
    """A sync generator on a daemon thread of its own, which runs it one ``next()`` at a time when
    the event loop asks: a generator that blocks holds no pool's worker and never the loop."""

    def __init__(self, gen):
        self.gen = gen
        self.loop = asyncio.get_running_loop()
        self.asks = queue.SimpleQueue()
        threading.Thread(target=self._work, name="stream-step", daemon=True).start()

    def ask(self, what):
        future = self.loop.create_future()
        self.asks.put((what, future))
        return future

    def _work(self):
        while True:
            what, future = self.asks.get()
            result, error = None, None
            try:
                if what != "close":
                    result = next(self.gen, _END)
                elif hasattr(self.gen, "close"):
                    self.gen.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                error = exc
            _settle_from_thread(self.loop, future, result, error)
            if what == "close":
                return


def _settle_from_thread(loop, future, result, error):
    def settle():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    if future is None:  # nobody waits for it
        return
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def in_daemon_thread(fn, *args):
    """``fn(*args)`` on a daemon thread of its own, as a future of the running loop: a call
    that never returns keeps no pool's worker, and does not keep the stub from exiting."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            result, error = None, exc
        _settle_from_thread(loop, future, result, error)

    threading.Thread(target=run, name="stream-step-call", daemon=True).start()
    return future


class _Tee:
    """The iterators a whole_stream step reads: one per streamed input, fed from one queue of items
    (each a dict of those inputs for one response), so that they advance together."""

    def __init__(self, items, names):
        self._items = items
        self._held = {n: [] for n in names}
        self._ended = False

    def of(self, name):
        held = self._held[name]
        while True:
            if not held and (self._ended or not self._pull()):
                return
            yield held.pop(0)

    def _pull(self):
        item = self._items.get()
        if item is _END:
            self._ended = True
            return False
        for name, value in item.items():
            if name in self._held:
                self._held[name].append(value)
        return True


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


def _text(exc):
    """The wire text an exception carries to the client."""
    wire = getattr(exc, "wire", None)
    return wire.text() if wire is not None else str(exc)
