"""Triton Python-backend model that runs a whole pipeline in its own process (the fused form).

Copied verbatim as ``<model>/1/model.py``, with the ``serving/`` package beside it. It reads
``fused.json`` and loads each Python step from ``steps/<model>/`` in its own
version folder (by import, or from ``step.pkl`` after the digest and Python
checks), one instance of each step per instance of this model.

The requests of one ``execute()`` call run as one batch through the plan (a
failed batch is run again one request at a time, so only the culprit fails),
and only the nodes that the requested outputs need run. Independent nodes run
concurrently: sync steps on a thread pool, ``async def`` steps awaited, external
model steps called with BLS ``async_exec()``. Arrays go from step to step as
they are, without a copy (a GPU array stays on its device). A node in a ``when``
block runs once on the rows its conditions select (none: not called), a select is
merged here, and an output of a branch is filled for the other rows
(``serving.Branches``). It imports only the
standard library, numpy and ``serving``, so a server needs no ``pipelines``
package.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import time

import numpy as np

try:  # in a repository: the copies beside this file (the stub imports this file as "<version>.model")
    from . import serving, stream_calls, stream_run
except ImportError:  # in the package, for tests and linters
    from pipelines import serving
    from pipelines.compile.models import stream_calls, stream_run

pb_utils = serving.pb_utils  # Triton's triton_python_backend_utils in a stub; None elsewhere

#: The model's plan in its version folder (written by pipelines/compile/fused.py).
PLAN_FILE = "fused.json"
#: A folder in the server's environment: each instance then times its sync Python steps and writes the times
#: there as it is finalized (``pipelines.profiling.server_steps`` sets it on the server it starts). Unset, as on
#: any other server, nothing is timed.
STEP_TIMES = "PIPELINES_STEP_TIMES"


_Step = stream_calls.InProcessStep  # one step's instance in this model (its earlier name here)


class _StepTimes:
    """Each timed call of a step in this instance: ``[node, rows, wall µs]``, kept in memory (at most
    :attr:`LIMIT`) and written as JSON on finalize, so that timing costs a list append a call."""

    LIMIT = 100_000

    def __init__(self, folder, model):
        self.path = os.path.join(folder, f"{model}-{os.getpid()}-{id(self)}.json")
        self.calls = []

    def timed(self, name, rows, call):
        def run(*args):
            began = time.perf_counter()
            try:
                return call(*args)
            finally:
                if len(self.calls) < self.LIMIT:  # list.append holds the GIL: safe from the pool's threads
                    self.calls.append((name, rows, (time.perf_counter() - began) * 1e6))

        return run

    def write(self):
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(self.calls, f)


class NodeFailed(Exception):
    """A node, or a request's input, failed: ``wire`` says where and why (``serving.WireError``)."""

    def __init__(self, wire):
        super().__init__(wire.text())
        self.wire = wire


class TritonPythonModel:
    def initialize(self, args):
        version_dir, data = serving.model_plan(args, PLAN_FILE)
        self.pipeline = data["pipeline"]
        folder = os.environ.get(STEP_TIMES)
        self.times = _StepTimes(folder, args.get("model_name", self.pipeline)) if folder else None
        serving.HOPS.attach(args.get("model_name", self.pipeline))
        self.max_batch_size = int(data["max_batch_size"])
        self.join_rows = int(data["join_rows"])
        self.inputs = {n: serving.Spec.from_dict(s) for n, s in data["inputs"].items()}
        self.takes = serving.Contract(self.inputs, self.max_batch_size)
        gpu = bool(data.get("gpu"))
        self.readers = {n: _where_it_is if gpu and s.dtype != "BF16" else serving.tensor_reader(s, gpu=False)
                        for n, s in self.inputs.items()}
        outputs = {n: serving.Spec.from_dict(s) for n, s in data["outputs"].items()}
        self.writers = {n: serving.tensor_writer(s, pb_utils) for n, s in outputs.items()}
        self.plan = data["plan"]
        self.output_names = [out["name"] for out in self.plan["outputs"]]
        self.nodes = {node["name"]: {**node, **data["nodes"][node["name"]]} for node in self.plan["nodes"]}
        self.dtypes = {(t["node"], t["name"]): t["dtype"] for t in self.plan["tensors"]}
        # Tensors between Python steps stay Python objects; only the model's own and external ones cross the stub.
        external = {name for name, node in self.nodes.items() if node["kind"] == "external"}
        serving.refuse_strings_under_numpy_2(
            args.get("model_name", self.pipeline),
            [n for n, spec in {**self.inputs, **outputs}.items() if spec.dtype == "BYTES"]
            + [t["name"] for t in self.plan["tensors"] if t["dtype"] == "BYTES" and t["node"] in external],
        )
        self._schedules = {}
        self._dtype_writers = {}
        # A streaming pipeline: where each node runs (once per request or per response; compile/fused.py).
        self.streams = data.get("streams")
        self._layouts = {}
        # One request streams at a time in an instance, as one execute() runs at a time in a
        # fused model that does not stream: a stream holds its steps' instances to its end.
        self.streaming = asyncio.Lock() if self.streams else None
        # ... so its streams run in execute() itself, on an event loop of the instance's own: the
        # first response is not kept waiting for a hop to the stub's event-loop thread.
        self.loop = asyncio.new_event_loop() if self.streams else None
        self.branches = serving.Branches(self.plan)
        if not self.branches.any and not any(self.branches.fills.values()):
            self.branches = None  # a static DAG: every node, every row
        match = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
        self.steps = {}
        try:
            for name, node in self.nodes.items():
                if node["kind"] == "python" and node["model"] not in self.steps:
                    self.steps[node["model"]] = stream_calls.load_step(version_dir, self.pipeline, name, node,
                                                                     int(match.group(1)) if match else 0)
        except BaseException:
            self.finalize()
            raise
        widest = max((sum(1 for n in g if self.nodes[n]["kind"] == "python") for g in self.plan["groups"]), default=1)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(2, widest), thread_name_prefix="fused-step")

    def execute(self, requests):
        # A decoupled model answers by its response senders; execute() returns once they are done,
        # and Triton keeps the next requests queued for this instance meanwhile.
        if self.streams is not None:
            for request in requests:  # in turn, as they would take the instance's streaming lock
                self.loop.run_until_complete(self._stream_request(request))
            return None
        # Returning a coroutine makes the stub run it on its event loop, as for `async def execute`.
        return self._execute(requests)

    def finalize(self):
        if getattr(self, "times", None) is not None:
            self.times.write()
        for step in getattr(self, "steps", {}).values():
            step.instance.finalize()
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_running():
            loop.close()

    # ------------------------------------------------------------------ a batch of requests

    async def _execute(self, requests):
        responses = [None] * len(requests)
        runs = []  # (index, arrays, rows, wanted outputs)
        for i, request in enumerate(requests):
            try:
                runs.append((i, *self._read(request)))
            except NodeFailed as exc:
                responses[i] = _error(exc.wire.text())
        rows = [run[2] or 1 for run in runs]
        if len(runs) > 1 and sum(rows) <= self.join_rows and serving.concatenable([run[1] for run in runs]):
            wanted = set().union(*(run[3] for run in runs))
            wanted = tuple(n for n in self.output_names if n in wanted)
            joined = {name: serving.concat_rows([run[1][name] for run in runs]) for name in self.inputs}
            try:
                values = await self._run(joined, sum(rows), wanted)
            except NodeFailed:
                values = None  # run one by one below, so only the culprit fails
            if values is not None:
                bounds = np.cumsum(rows)[:-1]
                parts = {name: serving.split_rows(values[name], bounds) for name in wanted}
                for k, (i, _, _, want) in enumerate(runs):
                    responses[i] = self._respond(want, {name: parts[name][k] for name in want})
                return responses
        answers = await asyncio.gather(*(self._answer(*run[1:]) for run in runs))
        for run, answer in zip(runs, answers, strict=True):
            responses[run[0]] = answer
        return responses

    async def _answer(self, arrays, rows, wanted):
        try:
            return self._respond(wanted, await self._run(arrays, rows, wanted))
        except NodeFailed as exc:
            return _error(exc.wire.text())

    def _read(self, request):
        """A request's arrays, its rows (``None`` without batching) and the outputs it wants."""
        try:
            given = serving.request_tensors(request, self.inputs)
            arrays = {name: read(given[name]) for name, read in self.readers.items()}
            rows = self.takes.check_inputs(arrays)
        except serving.Refused as exc:
            raise NodeFailed(serving.WireError("InputError", self.pipeline, str(exc), tensor=exc.tensor)) from None
        asked = list(request.requested_output_names() or ())
        unknown = serving.unknown_output(asked, self.output_names, self.pipeline)
        if unknown is not None:
            raise NodeFailed(unknown)
        wanted = tuple(n for n in self.output_names if n in asked) if asked else tuple(self.output_names)
        return arrays, rows, wanted

    def _respond(self, wanted, values):
        return pb_utils.InferenceResponse(output_tensors=[self.writers[n](n, values[n]) for n in wanted])

    # ------------------------------------------------------------------ a streaming pipeline

    async def _stream_requests(self, requests):
        await asyncio.gather(*(self._stream_request(request) for request in requests))

    async def _stream_request(self, request):
        """One request of a streaming pipeline: its responses, one by one, through its response sender."""
        sender = request.get_response_sender()
        async with self.streaming:
            try:
                arrays, rows, wanted = self._read(request)
            except NodeFailed as exc:
                sender.send(_error(exc.wire.text()))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            schedule = self._schedule(wanted)
            layout = self._layouts.get(wanted)
            if layout is None:
                layout = self._layouts[wanted] = serving.StreamLayout(schedule, self.streams)
            values = {(None, name): value for name, value in arrays.items()}
            branch = serving.Rows(self.branches, rows, values.__getitem__) if self.branches is not None else None
            await stream_run.StreamRun(self, sender, schedule, layout, values, rows, branch, alone=True).run()

    def _schedule(self, wanted):
        schedule = self._schedules.get(wanted)
        if schedule is None:
            schedule = self._schedules[wanted] = serving.Schedule(self.plan, wanted)
        return schedule

    # What stream_run.StreamRun asks of its host (see its module docstring). Nothing is released:
    # each response reads the request's tensors again.

    def start_node(self, name, values, rows, schedule, branch, alone):
        node, count = self.nodes[name], rows
        if branch is not None:
            left = branch.settle(node, schedule.returns[name], lambda key, _dtype: values[key])
            if left is not None:
                values.update({(name, out): value for out, value in left.items()})
                return _nothing()
            count = branch.count(self.branches.when[name])
        inputs = {s["input"]: serving.read_only(self.gathered(name, (s["node"], s["tensor"]), values, branch))
                  for s in node["inputs"]}
        return self._node(name, inputs, count, schedule, inline=alone)

    async def open_stream(self, name, values, rows, schedule, branch):
        node = self.nodes[name]
        step = self.steps[node["model"]]
        inputs = {}
        for source in node["inputs"]:
            value = serving.read_only(self.gathered(name, (source["node"], source["tensor"]), values, branch))
            inputs[source["input"]] = _placed(value, step.device) if step.device is not None else value
        return await stream_calls.InProcessStream.open(self, name, step, inputs, rows)

    def whole_step(self, name):
        return self.steps[self.nodes[name]["model"]]

    def gathered(self, name, key, values, branch):
        value = values[key]
        if branch is not None:  # only the rows of the node's `when` blocks
            value = branch.gather(value, self.branches.terms_of(key), self.branches.when[name])
        return value

    def held(self, name, array, dtype):
        return array

    def respond(self, schedule, values, branch):
        return self._respond(schedule.wanted, self._answer_values(schedule, values, branch))

    def fail(self, reason, node=None, tensor=None, kind="StepError"):
        step = self.nodes[node]["step"] if node is not None else None
        return NodeFailed(serving.WireError(kind, self.pipeline, reason, node, step, tensor))

    # ------------------------------------------------------------------ one run through the plan

    async def _run(self, arrays, rows, wanted):
        """The ``wanted`` outputs of one run (one request, or several joined) through the plan."""
        schedule = self._schedule(wanted)
        values = {(None, name): value for name, value in arrays.items()}
        remaining = dict(schedule.uses)
        branches = self.branches
        branch = serving.Rows(branches, rows, values.__getitem__) if branches is not None else None

        def release(keys):
            for key in keys:
                remaining[key] -= 1
                if remaining[key] == 0:
                    del values[key]  # the step holds its own reference

        def start(name, alone):
            node, count = self.nodes[name], rows
            if branch is not None:
                count = self._branch_rows(node, branch, values, schedule, release)
                if not count:
                    return _nothing()
            inputs = {}
            for source in node["inputs"]:
                key = (source["node"], source["tensor"])
                value = values[key]
                if branch is not None:  # only the rows of the node's `when` blocks
                    value = branch.gather(value, branches.terms_of(key), branches.when[name])
                inputs[source["input"]] = serving.read_only(value)  # shared, as in the local runtime
                release([key])
            if branch is not None:
                release(branches.conditions[name])
            return self._node(name, inputs, count, schedule, inline=alone)

        def collect(name, future):
            outputs = future.result()
            if outputs is None:  # merged or skipped in start()
                return
            for out in schedule.returns[name]:
                values[(name, out)] = outputs[out]

        await serving.run_concurrently(schedule.after, start, collect)
        return self._answer_values(schedule, values, branch)

    def _answer_values(self, schedule, values, branch):
        """The wanted outputs' values: an output declared as ~flag negated, an output of a branch filled."""
        def value(name, key):
            found = values[key]
            return serving.negated(found) if name in schedule.negated else found

        if branch is None:
            return {name: value(name, key) for name, key in schedule.outputs}
        branches = self.branches
        return {name: branch.filled(value(name, key), branches.terms_of(key), branches.fills[name])
                for name, key in schedule.outputs}

    def _branch_rows(self, node, branch, values, schedule, release):
        """How many rows ``node`` runs on; 0 once it is done: a select merged, or no row to run."""
        name = node["name"]
        left = branch.settle(node, schedule.returns[name], lambda key, _dtype: values[key])
        if left is None:
            return branch.count(self.branches.when[name])
        values.update({(name, out): value for out, value in left.items()})
        release(self.branches.reads(node))
        return 0

    async def _node(self, name, inputs, rows, schedule, *, inline):
        node = self.nodes[name]
        if node["kind"] == "external":
            return await self._external(node, inputs, schedule.returns[name])
        step = self.steps[node["model"]]
        if step.device is not None:
            inputs = {k: _placed(v, step.device) for k, v in inputs.items()}
        try:
            async with step.lock:
                if step.broken is not None:
                    raise NodeFailed(serving.WireError("StepError", self.pipeline, step.broken, name, node["step"]))
                if step.timeout_s:
                    outputs = await self._within_timeout(step, node, inputs)
                elif step.is_async:
                    outputs = await step.instance.execute_async(inputs)
                else:
                    execute = step.instance.execute if self.times is None else \
                        self.times.timed(name, rows, step.instance.execute)
                    if inline:
                        # The only node ready with nothing in flight: a thread hop would buy no overlap.
                        outputs = execute(inputs)
                    else:
                        outputs = await asyncio.get_running_loop().run_in_executor(self.pool, execute, inputs)
            step.gives.check_outputs(serving.as_arrays(outputs), rows if self.max_batch_size > 0 else None)
        except serving.Refused as exc:
            raise NodeFailed(serving.WireError("StepError", self.pipeline, str(exc), name, node["step"], exc.tensor)) from None
        except NodeFailed:
            raise
        except Exception as exc:
            reason = serving.exception_reason(exc, step.instance.home, step.file)
            raise NodeFailed(serving.WireError("StepError", self.pipeline, reason, name, node["step"])) from None
        return outputs

    async def _within_timeout(self, step, node, inputs):
        """One call of a step that has a timeout, given up once it runs past it.

        An ``async def`` step is cancelled. A sync call cannot be stopped: it runs on in a
        daemon thread of its own (so the stub can still exit), its instance is abandoned
        (it may hold a lock or half-written state) and finalized if the call ever returns,
        and a fresh instance takes its place before the step's lock is let go, so later
        requests are answered, as the local runtime does.
        """
        limit, instance = step.timeout_s, step.instance
        if step.is_async:
            try:
                return await asyncio.wait_for(instance.execute_async(inputs), limit)
            except asyncio.TimeoutError:
                raise NodeFailed(_timed_out(self.pipeline, node, limit, "the call was cancelled")) from None
        call = stream_calls.in_daemon_thread(instance.execute, inputs)
        try:
            return await asyncio.wait_for(asyncio.shield(call), limit)
        except asyncio.TimeoutError:
            pass
        call.add_done_callback(lambda done: _finalize_abandoned(done, instance))
        try:
            step.instance = await stream_calls.in_daemon_thread(step.renew)
        except Exception as exc:  # build() wraps the step's own error in a wire error: say the step's
            step.broken = (f"its instance was abandoned by a call that ran past its timeout of {limit:g} s, and "
                           f"a fresh one could not be made: {serving.exception_reason(exc.__cause__ or exc)}")
        raise NodeFailed(_timed_out(self.pipeline, node, limit, "a fresh instance of the step takes the stuck one's "
                                    "place, which may still be running"))

    async def _external(self, node, inputs, returns):
        """An external model step, called through BLS on its own composing model."""
        tensors = [self._writer(s["dtype"])(s["input"], inputs[s["input"]]) for s in node["inputs"]]
        request = pb_utils.InferenceRequest(
            model_name=node["model"], requested_output_names=list(returns), inputs=tensors, timeout=node["timeout_us"]
        )
        limit = node["timeout_us"] / 1e6
        try:
            call = request.async_exec()
            # Triton's own request timeout drops only a queued request, not one that hangs while running.
            response = await (asyncio.wait_for(call, limit) if limit else call)
        except asyncio.TimeoutError:
            raise NodeFailed(_timed_out(self.pipeline, node, limit, "the step may still be running")) from None
        except Exception as exc:  # e.g. the composing model is not loaded
            reason = f"could not be called (model {node['model']!r}): {exc}"
            raise NodeFailed(serving.WireError("StepError", self.pipeline, reason, node["name"], node["step"])) from exc
        if response.has_error():
            message = response.error().message()
            raise NodeFailed(serving.called_model_error(message, self.pipeline, node["name"], node["step"], node["model"]))
        outputs = {}
        for out in returns:
            tensor = pb_utils.get_output_tensor_by_name(response, out)
            if tensor is None:
                raise NodeFailed(
                    serving.WireError("StepError", self.pipeline, f"returned no output {out!r}", node["name"], node["step"], out)
                )
            if self.dtypes[(node["name"], out)] == "BF16":  # as_numpy() refuses BF16 (docs/triton.md)
                outputs[out] = serving.bf16_from_dlpack(tensor.to_dlpack())
            else:
                outputs[out] = _where_it_is(tensor)
        return outputs

    def _writer(self, dtype):
        writer = self._dtype_writers.get(dtype)
        if writer is None:
            writer = self._dtype_writers[dtype] = serving.tensor_writer(serving.Spec(dtype, ()), pb_utils)
        return writer


_where_it_is = serving.pb_array  # a pb tensor as an array where it lies: numpy on the host, CuPy on a GPU


def _placed(value, device):
    """``value`` on the step's ``device`` ("cpu" or "gpu"), moved only when it is elsewhere."""
    on_host = isinstance(value, np.ndarray)
    if device == "gpu" and on_host and value.dtype.kind not in "OSU":
        import cupy

        serving.HOPS.host_to_device(value.nbytes)
        return cupy.asarray(value)
    if device == "cpu" and not on_host:
        serving.HOPS.device_to_host(value.nbytes)
        return value.get()
    return value


def _timed_out(pipeline, node, limit, then):
    reason = (f"ran past its timeout of {limit:g} s (model {node['model']!r}); the request was answered "
              f"with this error, and {then}")
    return serving.WireError("StepTimeoutError", pipeline, reason, node["name"], node["step"])


def _finalize_abandoned(done, instance):
    """An abandoned call returned at last: its instance is finalized, and what it gave is dropped."""
    if not done.cancelled():
        done.exception()  # read, so that asyncio does not log it as never retrieved
    try:
        instance.finalize()
    except Exception:  # noqa: BLE001 - nobody is left to tell; its request had its timeout error
        pass


async def _nothing():
    return None


def _error(message):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
