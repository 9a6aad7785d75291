"""How a server model's streaming request calls a step: in its own process (:class:`InProcessStep`,
:class:`InProcessStream`, the fused model's steps and a BLS model's ``whole_stream`` steps), or as a
decoupled model with BLS (:class:`CalledStream`). Copied beside the fused and BLS models with
``stream_run.py``; only the standard library and ``serving``.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import os
import queue
import threading
import time
from collections.abc import Iterator

try:  # in a repository: the copy beside this file (the stub imports it as "<version>.stream_calls")
    from . import serving
except ImportError:  # in the package, for tests and linters
    from pipelines import serving

pb_utils = serving.pb_utils

END = serving.END  # the end of a generator, or of a whole_stream step's items (serving.Tee ends on it)


def response_label(index):
    """How an error names a stream's response (``index`` counts from 0): numbered from 1, as
    ``pipelines run`` shows responses and a streaming step's own model names them."""
    return f"response {index + 1}"


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
                items.put(END)  # it may be waiting for the stream: end its iterator
                await self.replace_stuck(self.instance)
                raise host.fail(_past(self.timeout_s, node, "a fresh instance of the step takes its place"),
                                node=name, kind="StepTimeoutError") from None
            except asyncio.CancelledError:
                items.put(END)  # the request ends: let the call finish on the iterator's end
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
    """A streaming step's generator in this process, pulled one response at a time: an async
    generator on the event loop; a sync one on a thread of its own (it may block), or on the
    event loop itself when nothing else runs beside the stream (``next(alone=True)``) and no
    timeout is to be kept, which spares each response two thread hops. Each
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
        self.pump = None  # the thread a sync generator is pulled on, made when first needed
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

    async def next(self, alone=False):
        """The next response's outputs, or ``None`` at the end of the stream; ``alone``: nothing
        else runs in this process now, so a sync generator may be pulled on the event loop."""
        left = None
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out("the stream was closed")
        try:
            if self.is_async:
                pulled = self.gen.__anext__()
                item = await (asyncio.wait_for(pulled, left) if left is not None else pulled)
            elif alone and left is None and self._held_by is None:
                # Nothing to overlap and no deadline to watch: a thread would only add two hops.
                # (A whole_stream generator waits on responses the event loop hands it.)
                item = next(self.gen, END)
            else:
                if self.pump is None:
                    self.pump = _Pump(self.gen)
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
        if item is END:
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
            self._held_by.put(END)  # a whole_stream generator waiting for its stream: its iterator ends
        try:
            if self._stuck:
                return
            if self.is_async:
                await self.gen.aclose()
            elif self.pump is not None:
                await self.pump.ask("close")
            elif hasattr(self.gen, "close"):
                self.gen.close()
        except Exception:  # noqa: BLE001 - the stream's own error, if any, is the one worth reporting
            pass
        finally:
            self.step.lock.release()


class CalledStream:
    """A streaming step's own decoupled model, called with BLS (``exec``/``async_exec(decoupled=True)``):
    its responses as they come, each read off a thread of its own (the iterator blocks), or on the
    event loop itself when nothing else runs beside the stream and no deadline is kept. A failure is
    an ordinary response that carries it in ``err_output`` (a decoupled model's error response never
    reaches a BLS model: docs/triton_decoupled.md); the final flag comes on an empty response.

    The step's model bounds its stream by the step's timeout and says so in ``err_output``; this
    waits that long and :data:`GRACE_S` more before it gives up with its own words. ``close()``
    stops answering from it: the called model runs on to its end, as Triton 2.51 cannot cancel it,
    and the stream is read to its end off the request's path, so that Triton lets it go."""

    GRACE_S = 2.0

    def __init__(self, host, name, responses, returns, err_output, limit_s):
        self.host = host
        self.name = name
        self.node = host.nodes[name]
        self.returns = returns
        self.err_output = err_output
        self.limit_s = limit_s
        self.deadline = time.monotonic() + limit_s + self.GRACE_S if limit_s else None
        self.responses = iter(responses)
        self.pump = None  # the thread the responses are read on, made when first needed
        self.ended = False  # the iterator gave its end

    async def next(self, alone=False):
        while True:
            try:
                if self.deadline is None and alone and self.pump is None:
                    # Nothing to overlap and no deadline: the iterator waits without the GIL.
                    response = next(self.responses, END)
                elif self.deadline is None:
                    response = await self._ask()
                else:
                    response = await asyncio.wait_for(asyncio.shield(self._ask()), max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self.host.fail(_past(self.limit_s, self.node, "the step may still be running"), node=self.name,
                                     kind="StepTimeoutError") from None
            except Exception as exc:  # noqa: BLE001 - the call's own failure (the model went away…)
                raise self.host.fail(f"could not be read (model {self.node['model']!r}): {exc}", node=self.name) from None
            if response is END:
                self.ended = True
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

    def _ask(self):
        if self.pump is None:
            self.pump = _Pump(self.responses)
        return self.pump.ask("next")

    async def close(self):
        # Triton 2.51 keeps an iterator left before its end for ever, with every response the
        # called model still sends it (docs/triton_decoupled.md): read it to its end on the pump's
        # thread (made now if the stream was read on the event loop), after the read under way,
        # if any; nobody waits for it. An ended one is held a while (KEPT), by nothing else.
        responses, self.responses = self.responses, None
        if responses is None:  # closed already
            return
        if self.pump is None and self.ended:
            KEPT.keep(responses)
            return
        if self.pump is None:
            self.pump = _Pump(responses)
        self.pump.asks.put(("drain", None))


class _Kept:
    """Ended BLS response iterators, held :data:`HOLD_S` before this process lets them go.

    Triton 2.51's stub drops its own reference to an ended iterator on a thread of its own, without
    the GIL; if that is the last one, the responses' numpy arrays are freed without the GIL, and
    the stub's memory is corrupted (it dies, some thousands of streams later). Let go later, by a
    thread of this process (with the GIL), the last reference is this one (docs/triton_decoupled.md).
    An iterator holds every response it gave until it is let go: a thread lets them go on time."""

    HOLD_S = 2.0

    def __init__(self):
        self._lock = threading.Lock()
        self._held = collections.deque()
        self._reaper = None

    def keep(self, iterator):
        with self._lock:
            self._held.append((time.monotonic() + self.HOLD_S, iterator))
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="stream-iterators", daemon=True)
                self._reaper.start()

    def _reap(self):
        while True:
            time.sleep(self.HOLD_S / 2)
            now = time.monotonic()
            with self._lock:
                due = []
                while self._held and self._held[0][0] <= now:
                    due.append(self._held.popleft())
            due.clear()  # let go here, outside the lock


KEPT = _Kept()


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
                if what == "next":
                    result = next(self.gen, END)
                elif what == "drain":  # a BLS response iterator: to its end, what comes is dropped
                    while next(self.gen, END) is not END:
                        pass
                elif hasattr(self.gen, "close"):
                    self.gen.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                error = exc
            _settle_from_thread(self.loop, future, result, error)
            if what == "drain":
                # Held by KEPT alone: a request's frames, kept a while by its exception's traceback,
                # would else keep the iterator and every response in it.
                gen, self.gen = self.gen, None
                KEPT.keep(gen)
            if what != "next":
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
