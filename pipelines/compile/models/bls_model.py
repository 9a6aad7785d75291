"""Triton Python-backend BLS executor for one compiled pipeline.

Copied verbatim as ``<model>/1/model.py``. It reads ``bls.json`` beside it and
calls the composing models: in ``"async"`` mode each node starts with
``async_exec()`` as soon as its inputs are ready, in ``"sync"`` mode nodes run
one after another with ``exec()``. Tensors go from call to call through DLPack
(BYTES, which DLPack cannot carry, through numpy), and only the nodes that the
requested outputs need are called. A node in a ``when`` block is called once with
the rows its conditions select (none: not called), a select is merged here, and an
output of a branch is filled for the other rows (``serving.Branches``). It imports
only the standard library and ``serving``, copied beside it, so a server needs no
``pipelines`` package.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections import defaultdict

try:  # in a repository: the copies beside this file (the stub imports this file as "<version>.model")
    from . import serving, stream_calls, stream_run
except ImportError:  # in the package, for tests and linters
    from pipelines import serving
    from pipelines.compile.models import stream_calls, stream_run

pb_utils = serving.pb_utils  # Triton's triton_python_backend_utils in a stub; None elsewhere


class RequestFailed(Exception):
    """A request that gets an error response carrying this message (``serving.WireError`` text)."""


class TritonPythonModel:
    def initialize(self, args):
        version_dir, plan = serving.model_plan(args, "bls.json")
        self.pipeline = plan["pipeline"]
        self.model = plan["model"]
        self.mode = plan["mode"]
        self.max_batch_size = int(plan["max_batch_size"])
        self.inputs = {n: serving.Spec.from_dict(spec) for n, spec in plan["inputs"].items()}
        model_config = json.loads(args["model_config"]) if "model_config" in args else None
        self.takes = serving.Contract(
            self.inputs, self.max_batch_size,
            checked_by_triton=serving.config_declares(model_config, self.inputs, self.max_batch_size),
        )
        # The execution plan (pipelines.core.plan.ExecutionPlan.to_json): nodes, tensors, outputs.
        self.plan = plan["plan"]
        self.timeouts_us = {name: int(us) for name, us in plan.get("timeouts_us", {}).items()}
        self.outputs = {out["name"]: out for out in self.plan["outputs"]}
        self.nodes = {node["name"]: node for node in self.plan["nodes"]}
        self._schedules = {}
        self.branches = serving.Branches(self.plan)
        if not self.branches.any and not any(self.branches.fills.values()):
            self.branches = None  # a static DAG: every node, every row
        self._writers = {}
        serving.refuse_strings_under_numpy_2(
            self.model,
            [n for n, spec in self.inputs.items() if spec.dtype == "BYTES"]
            + [t["name"] for t in self.plan["tensors"] if t["dtype"] == "BYTES"],
        )
        self._pool = None  # threads for sync calls that have a timeout
        # A streaming pipeline: where each node runs (once per request or per response; compile/fused.py).
        self.streams = plan.get("streams")
        if self.streams is not None:
            self._stream_setup(args, version_dir, plan)

    def execute(self, requests):
        if self.streams is not None and self.loop is not None:  # one stream at a time: in execute() itself
            for request in requests:  # in turn, as they would take the instance's streaming lock
                self.loop.run_until_complete(self._stream_request(request))
            return None
        # Returning a coroutine makes the stub run it on its event loop, as for `async def execute`
        # (a decoupled model's in the background: execute() returns at once, responses go by sender).
        if self.streams is not None:
            return self._stream_requests(requests)
        if self.mode == "async":
            return self._execute_async(requests)
        return [self._answer_sync(request) for request in requests]

    async def _execute_async(self, requests):
        if len(requests) == 1:  # no task to make for a lone request
            return [await self._answer_async(requests[0])]
        return list(await asyncio.gather(*(self._answer_async(request) for request in requests)))

    # ------------------------------------------------------------------ one request

    def _answer_sync(self, request):
        try:
            run = self._start(request)
            for name in run.schedule.order:
                node = self.nodes[name]
                if run.branch is not None and self._done_here(node, run):
                    continue
                self._collect(node, run, self._exec_within_timeout(node, self._request(node, run)))
            return self._respond(run)
        except RequestFailed as exc:
            return _error(str(exc))

    async def _answer_async(self, request):
        try:
            run = self._start(request)
            if run.schedule.chain:  # each node needs the one before: await them in turn, nothing to schedule
                for name in run.schedule.order:
                    node = self.nodes[name]
                    if run.branch is not None and self._done_here(node, run):
                        continue
                    call = self._request(node, run).async_exec()
                    limit = self.timeouts_us.get(name, 0) / 1e6
                    try:
                        # Triton's own request timeout stops only a queued request: wait no longer than it.
                        response = await (asyncio.wait_for(call, limit) if limit else call)
                    except asyncio.TimeoutError:
                        raise RequestFailed(_timed_out(self, node)) from None
                    except Exception as exc:  # e.g. the composing model is not loaded
                        raise _call_failed(exc, name, self) from exc
                    self._collect(node, run, response)
                return self._respond(run)

            def start(name, alone):
                if run.branch is not None and self._done_here(self.nodes[name], run):
                    return _nothing()
                call = self._request(self.nodes[name], run).async_exec()
                limit = self.timeouts_us.get(name, 0) / 1e6
                # Triton's own request timeout stops only a queued request.
                return asyncio.wait_for(call, limit) if limit else call

            def collect(name, future):
                response = _result(future, name, self)
                if response is not None:  # None: merged or skipped here
                    self._collect(self.nodes[name], run, response)

            await serving.run_concurrently(run.schedule.after, start, collect)
            return self._respond(run)
        except RequestFailed as exc:
            return _error(str(exc))

    def _exec_within_timeout(self, node, request):
        """``request.exec()``, given up after the step's timeout: Triton's ``timeout=`` only
        drops a request still queued, so a step that hangs while running would hold this one."""
        limit = self.timeouts_us.get(node["name"], 0) / 1e6
        if not limit:
            return request.exec()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="bls-exec")
        call = self._pool.submit(request.exec)
        try:
            return call.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            raise RequestFailed(_timed_out(self, node)) from None

    def _start(self, request):
        values = self._read_inputs(request)
        wanted = list(request.requested_output_names() or ())
        unknown = serving.unknown_output(wanted, self.outputs, self.pipeline)
        if unknown is not None:
            raise RequestFailed(unknown.text())
        key = frozenset(wanted or self.outputs)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = serving.Schedule(self.plan, key)
        run = _Run(schedule, values)
        if self.branches is not None:
            rows = values[(None, next(iter(self.inputs)))].shape()[0] if self.max_batch_size > 0 else 1
            run.branch = serving.Rows(self.branches, rows, lambda key: self._array(run.values[key], "BOOL"))
        return run

    def _read_inputs(self, request):
        if self.takes.checked_by_triton:  # Triton checked them against the config, which declares them
            return {(None, name): pb_utils.get_input_tensor_by_name(request, name) for name in self.inputs}
        try:
            given = serving.request_tensors(request, self.inputs)
            self.takes.check_inputs({name: _Described(given[name], spec.dtype) for name, spec in self.inputs.items()})
        except serving.Refused as exc:
            raise RequestFailed(serving.WireError("InputError", self.pipeline, str(exc), tensor=exc.tensor).text()) from None
        return {(None, name): given[name] for name in self.inputs}

    def _request(self, node, run, extra=()):
        # run.take inlined: this runs once per step of every request, and calls cost in a stub.
        values, remaining = run.values, run.remaining
        inputs = []
        branch = run.branch
        for source in node["inputs"]:
            key = (source["node"], source["tensor"])
            if branch is None:
                inputs.append(_renamed(values[key], source["input"], source["dtype"]))
            else:  # only the rows of the node's `when` blocks
                inputs.append(self._gathered(values[key], key, node, source, branch))
            remaining[key] -= 1
            if not remaining[key]:
                del values[key]  # the renamed tensor keeps the memory alive through DLPack
        if branch is not None:
            run.release(self.branches.conditions[node["name"]])
        timeout = self.timeouts_us.get(node["name"], 0)
        wanted = run.schedule.returns[node["name"]]
        if extra:
            wanted = [*wanted, *extra]
        if timeout:
            return pb_utils.InferenceRequest(
                model_name=node["model"], requested_output_names=wanted, inputs=inputs, timeout=timeout,
            )
        return pb_utils.InferenceRequest(model_name=node["model"], requested_output_names=wanted, inputs=inputs)

    def _collect(self, node, run, response):
        if response.has_error():
            # The step adapter's words, said again with the node this executor knows.
            said = serving.called_model_error(
                response.error().message(), self.pipeline, node["name"], node["step"], node["model"]
            )
            raise RequestFailed(said.text())
        for output in run.schedule.returns[node["name"]]:
            tensor = pb_utils.get_output_tensor_by_name(response, output)
            if tensor is None:
                reason = f"returned no output {output!r}"
                raise RequestFailed(
                    serving.WireError("StepError", self.pipeline, reason, node["name"], node["step"], output).text()
                )
            run.values[(node["name"], output)] = tensor

    def _respond(self, run):
        tensors = []
        for name in run.schedule.wanted:
            out = self.outputs[name]
            key = (out["node"], out["tensor"])
            terms = self.branches.terms_of(key) if run.branch is not None else None
            if terms and run.branch.count(terms) == run.branch.n and run.values[key] is not serving.SKIPPED:
                terms = None  # the branch ran on every row: nothing to fill, the tensor goes out as it is
            if terms:  # an output of a branch: `otherwise` in the rows that did not run it
                value = run.values[key]
                array = value if value is serving.SKIPPED else self._array(value, out["dtype"])
                if name in run.schedule.negated:  # declared as ~flag: its rows negated, the fill as given
                    array = serving.negated(array)
                filled = run.branch.filled(array, terms, self.branches.fills[name])
                tensors.append(self._tensor(name, filled, out["dtype"]))
                run.release([key])
            elif name in run.schedule.negated:  # declared as ~flag
                tensors.append(self._tensor(name, serving.negated(self._array(run.values[key], "BOOL")), "BOOL"))
                run.release([key])
            else:
                tensors.append(run.take(key, name, out["dtype"]))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # ------------------------------------------------------------------ a streaming pipeline

    def _stream_setup(self, args, version_dir, plan):
        self.err_output = plan["err_output"]
        self.dtypes = {(t["node"], t["name"]): t["dtype"] for t in self.plan["tensors"]}
        self._layouts = {}
        match = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
        self.whole_steps = {}  # the whole_stream steps, which run in this process (compile/bls.py)
        for name, node in plan.get("in_process", {}).items():
            if node["model"] not in self.whole_steps:
                self.whole_steps[node["model"]] = stream_calls.load_step(
                    version_dir, self.pipeline, name, node, int(match.group(1)) if match else 0)
        # One request at a time where it calls exec() (bls-sync), or holds a whole_stream step's
        # instance to its stream's end: two such steps could else wait on each other's request.
        alone = self.mode == "sync" or bool(self.whole_steps)
        self.streaming = asyncio.Lock() if alone else None
        # ... and those streams run in execute() itself, on an event loop of the instance's own: the
        # first response is not kept waiting for a hop to the stub's event-loop thread.
        self.loop = asyncio.new_event_loop() if alone else None

    def finalize(self):
        for step in getattr(self, "whole_steps", {}).values():
            step.instance.finalize()
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_running():
            loop.close()

    async def _stream_requests(self, requests):
        await asyncio.gather(*(self._stream_request(request) for request in requests))

    async def _stream_request(self, request):
        """One request of a streaming pipeline: its responses, one by one, through its response sender."""
        sender = request.get_response_sender()
        if self.streaming is None:
            return await self._stream_one(request, sender)
        async with self.streaming:
            return await self._stream_one(request, sender)

    async def _stream_one(self, request, sender):
        try:
            run = self._start(request)
        except RequestFailed as exc:
            sender.send(_error(str(exc)))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        key = tuple(run.schedule.wanted)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = serving.StreamLayout(run.schedule, self.streams)
        rows = self._rows_of(run.values) if self.max_batch_size > 0 else None
        await stream_run.StreamRun(self, sender, run.schedule, layout, run.values, rows, run.branch,
                                   sequential=self.mode == "sync", alone=self.streaming is not None).run()

    def _rows_of(self, values):
        return values[(None, next(iter(self.inputs)))].shape()[0]

    # What stream_run.StreamRun asks of its host (see its module docstring). Nothing is released:
    # each response reads the request's tensors again.

    def start_node(self, name, values, rows, schedule, branch, alone):
        return self._stream_node(self.nodes[name], _kept(schedule, values, branch))

    async def _stream_node(self, node, run):
        if run.branch is not None and self._done_here(node, run):
            return None
        request = self._request(node, run)
        if self.mode == "sync":
            response = self._exec_within_timeout(node, request)
        else:
            limit = self.timeouts_us.get(node["name"], 0) / 1e6
            try:
                call = request.async_exec()
                response = await (asyncio.wait_for(call, limit) if limit else call)
            except asyncio.TimeoutError:
                raise RequestFailed(_timed_out(self, node)) from None
            except Exception as exc:  # e.g. the composing model is not loaded
                raise _call_failed(exc, node["name"], self) from exc
        self._collect(node, run, response)
        return None  # its outputs are in the run's values already

    async def open_stream(self, name, values, rows, schedule, branch):
        node = self.nodes[name]
        run = _kept(schedule, values, branch)
        request = self._request(node, run, extra=[self.err_output])
        try:
            if self.mode == "sync":
                responses = request.exec(decoupled=True)
            else:
                responses = await request.async_exec(decoupled=True)
        except Exception as exc:  # e.g. the composing model is not loaded
            raise _call_failed(exc, name, self) from exc
        limit = self.timeouts_us.get(name, 0) / 1e6
        return stream_calls.CalledStream(self, name, responses, run.schedule.returns[name], self.err_output, limit)

    def whole_step(self, name):
        return self.whole_steps[self.nodes[name]["model"]]

    def gathered(self, name, key, values, branch):
        value = values[key]
        if value is serving.SKIPPED:
            return value
        dtype = self.dtypes.get(key) or self.inputs[key[1]].dtype
        array = self._array(value, dtype)
        if branch is not None:  # only the rows of the node's `when` blocks
            array = branch.gather(array, self.branches.terms_of(key), self.branches.when[name])
        return array

    def held(self, name, array, dtype):
        return self._tensor(name, array, dtype)

    def respond(self, schedule, values, branch):
        return self._respond(_kept(schedule, values, branch))

    def fail(self, reason, node=None, tensor=None, kind="StepError"):
        step = self.nodes[node]["step"] if node is not None else None
        return RequestFailed(serving.WireError(kind, self.pipeline, reason, node, step, tensor).text())

    def called_failure(self, name, text):
        """A streaming step's failure, carried in its model's ``__err__``, said again with its node."""
        node = self.nodes[name]
        return RequestFailed(serving.called_model_error(text, self.pipeline, name, node["step"], node["model"]).text())

    # ------------------------------------------------------------------ when blocks

    def _done_here(self, node, run):
        """Whether ``node`` needs no call: a select (merged here), or no row holds its conditions."""
        def value_of(key, dtype):
            value = run.values[key]
            return value if value is serving.SKIPPED else self._array(value, dtype)

        left = run.branch.settle(node, run.schedule.returns[node["name"]], value_of)
        if left is None:
            return False
        for out, value in left.items():
            if value is not serving.SKIPPED:  # a select's merge, of the dtype its branches have
                value = self._tensor(out, value, next(s["dtype"] for s in node["inputs"] if s["input"] == "then"))
            run.values[(node["name"], out)] = value
        run.release(self.branches.reads(node))
        return True

    def _gathered(self, tensor, key, node, source, branch):
        src, terms = self.branches.terms_of(key), self.branches.when[node["name"]]
        if src == terms or self.max_batch_size == 0 or branch.count(terms) == branch.count(src):
            # the same rows (a block that holds on every row the tensor has): passed on as it is, no copy
            return _renamed(tensor, source["input"], source["dtype"])
        rows = branch.gather(self._array(tensor, source["dtype"]), src, terms)
        return self._tensor(source["input"], rows, source["dtype"])

    def _array(self, tensor, dtype):
        if dtype == "BF16":  # as_numpy() refuses BF16 (docs/triton.md)
            return serving.bf16_from_dlpack(tensor.to_dlpack())
        return serving.pb_array(tensor)

    def _tensor(self, name, array, dtype):
        writer = self._writers.get(dtype)
        if writer is None:
            writer = self._writers[dtype] = serving.tensor_writer(serving.Spec(dtype, ()), pb_utils)
        return writer(name, array)


class _Run:
    """One request in flight: the tensors so far, each dropped once its last reader has it."""

    def __init__(self, schedule, values):
        self.schedule = schedule
        self.values = values
        self.remaining = dict(schedule.uses)
        self.branch = None  # serving.Rows of a conditional plan

    def release(self, keys):
        for key in keys:
            self.remaining[key] -= 1
            if self.remaining[key] == 0:
                del self.values[key]

    def take(self, key, name, dtype):
        tensor = _renamed(self.values[key], name, dtype)
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            del self.values[key]  # the renamed tensor keeps the memory alive through DLPack
        return tensor




#: a tensor's reads left in a streaming request: never zero, as each response reads the request's again
_NEVER = 1 << 40


def _kept(schedule, values, branch):
    """A run over ``values`` that releases nothing (a streaming request's, or one response's)."""
    run = _Run(schedule, values)
    run.remaining = defaultdict(lambda: _NEVER)
    run.branch = branch
    return run


async def _nothing():
    return None


def _timed_out(model, node):
    limit = model.timeouts_us.get(node["name"], 0) / 1e6
    reason = (
        f"ran past its timeout of {limit:g} s (model {node['model']!r}); the request was answered "
        "with this error, and the step may still be running"
    )
    return serving.WireError("StepTimeoutError", model.pipeline, reason, node["name"], node["step"]).text()


def _result(future, name, model):
    try:
        return future.result()
    except asyncio.TimeoutError:
        raise RequestFailed(_timed_out(model, model.nodes[name])) from None
    except Exception as exc:  # e.g. the composing model is not loaded
        raise _call_failed(exc, name, model) from exc


def _call_failed(exc, name, model):
    node = model.nodes[name]
    reason = f"could not be called (model {node['model']!r}): {exc}"
    return RequestFailed(serving.WireError("StepError", model.pipeline, reason, name, node["step"]).text())


def _renamed(tensor, name, dtype):
    if dtype == "BYTES":  # DLPack has no string tensors
        return pb_utils.Tensor(name, tensor.as_numpy())
    return pb_utils.Tensor.from_dlpack(name, tensor.to_dlpack())


class _Described:
    """A request tensor as the checks see it: its dtype and shape.

    ``Tensor.triton_dtype()`` cannot be converted to Python in the 2.51 stub, so
    the dtype is read from the host array; a GPU or BF16 tensor (which numpy
    cannot show) is taken to be what the config says, as Triton checked every
    request's datatypes against the config before execute.
    """

    __slots__ = ("dtype", "shape")

    def __init__(self, tensor, declared):
        if declared == "BF16" or not tensor.is_cpu():
            self.dtype = serving.numpy_dtype(declared)
            self.shape = tuple(tensor.shape())
        else:
            array = serving.pb_array(tensor)
            self.dtype, self.shape = array.dtype, array.shape


def _error(message):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
