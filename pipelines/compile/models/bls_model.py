"""Triton Python-backend BLS executor for one compiled pipeline.

Copied verbatim as ``<model>/1/model.py``. It reads ``bls.json`` beside it and
calls the composing models: in ``"async"`` mode each node starts with
``async_exec()`` as soon as its inputs are ready, in ``"sync"`` mode nodes run
one after another with ``exec()``. Tensors go from call to call through DLPack
(BYTES, which DLPack cannot carry, through numpy), and only the nodes that the
requested outputs need are called.
"""

from __future__ import annotations

import asyncio
import graphlib
import json
import os
import re

import numpy as np

try:  # present only inside Triton's Python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - the module is also imported by tests and linters
    pb_utils = None

_NUMPY_NAMES = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64", np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
}


# How the step adapter starts its errors: pipeline, step or node, and the model where that says more.
_ADAPTER_WHERE = re.compile(r"^pipeline '[^']*' step '[^']*'(?: \(model '[^']*'(?:, serving nodes [^)]*)?\))?")


class RequestFailed(Exception):
    """A request that gets an error response carrying this message."""


class TritonPythonModel:
    def initialize(self, args):
        version_dir = os.path.join(args["model_repository"], str(args["model_version"]))
        if not os.path.isfile(os.path.join(version_dir, "bls.json")):
            version_dir = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(version_dir, "bls.json"), encoding="utf-8") as f:
            plan = json.load(f)
        self.pipeline = plan["pipeline"]
        self.model = plan["model"]
        self.mode = plan["mode"]
        self.max_batch_size = int(plan["max_batch_size"])
        self.inputs = plan["inputs"]
        # The execution plan (pipelines.plan.ExecutionPlan.to_json): nodes, tensors, outputs.
        self.plan = plan["plan"]
        self.timeouts_us = {name: int(us) for name, us in plan.get("timeouts_us", {}).items()}
        self.outputs = {out["name"]: out for out in self.plan["outputs"]}
        self.nodes = {node["name"]: node for node in self.plan["nodes"]}
        self.where = f"pipeline {self.pipeline!r} (model {self.model!r})"
        self._schedules = {}

    def execute(self, requests):
        # Returning a coroutine makes the stub run it on its event loop, as for `async def execute`.
        if self.mode == "async":
            return self._execute_async(requests)
        return [self._answer_sync(request) for request in requests]

    async def _execute_async(self, requests):
        return list(await asyncio.gather(*(self._answer_async(request) for request in requests)))

    # ------------------------------------------------------------------ one request

    def _answer_sync(self, request):
        try:
            run = self._start(request)
            for name in run.schedule.order:
                node = self.nodes[name]
                self._collect(node, run, self._request(node, run).exec())
            return self._respond(run)
        except RequestFailed as exc:
            return _error(str(exc))

    async def _answer_async(self, request):
        try:
            run = self._start(request)
            sorter = graphlib.TopologicalSorter(run.schedule.after)
            sorter.prepare()
            running = {}
            try:
                while sorter.is_active():
                    for name in sorter.get_ready():
                        call = self._request(self.nodes[name], run).async_exec()
                        running[asyncio.ensure_future(call)] = name
                    done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    for future in done:
                        name = running.pop(future)
                        self._collect(self.nodes[name], run, _result(future, name, self))
                        sorter.done(name)
            finally:
                if running:  # a sibling failed: wait for the calls in flight, then drop them
                    await asyncio.gather(*running, return_exceptions=True)
            return self._respond(run)
        except RequestFailed as exc:
            return _error(str(exc))

    def _start(self, request):
        values = self._read_inputs(request)
        wanted = list(request.requested_output_names() or ())
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise RequestFailed(
                f"{self.where}: output {unknown[0]!r} was requested but the pipeline has outputs {list(self.outputs)}"
            )
        key = frozenset(wanted or self.outputs)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = _Schedule(self.plan, key)
        return _Run(schedule, values)

    def _read_inputs(self, request):
        given = {t.name(): t for t in request.inputs()}
        extra = [n for n in given if n not in self.inputs]
        if extra:
            raise RequestFailed(f"{self.where}: unexpected input {extra[0]!r}; the pipeline's inputs are {list(self.inputs)}")
        sizes = {}
        for name, spec in self.inputs.items():
            tensor = given.get(name)
            if tensor is None:
                raise RequestFailed(f"{self.where}: input {name!r} ({spec['dtype']} {spec['dims']}) is missing")
            dtype = _dtype_of(tensor, spec["dtype"])
            if dtype is not None and dtype != spec["dtype"]:
                raise RequestFailed(f"{self.where}: input {name!r} has dtype {dtype}; expected {spec['dtype']}")
            shape = list(_shape_of(tensor))
            body = shape[1:] if self.max_batch_size else shape
            dims = spec["dims"]
            if (self.max_batch_size and not shape) or len(body) != len(dims) or any(
                d != -1 and d != s for d, s in zip(dims, body, strict=False)
            ):
                expected = (["batch"] if self.max_batch_size else []) + dims
                raise RequestFailed(
                    f"{self.where}: input {name!r} has shape {shape}; expected {expected} (-1 is any size)"
                )
            if self.max_batch_size:
                sizes[name] = shape[0]
        if self.max_batch_size:
            if len(set(sizes.values())) > 1:
                raise RequestFailed(f"{self.where}: inputs disagree on the batch size: {sizes}; send one batch size")
            size = next(iter(sizes.values()))
            if size < 1 or size > self.max_batch_size:
                raise RequestFailed(
                    f"{self.where}: batch size {size} (input {next(iter(sizes))!r}); expected 1 to {self.max_batch_size}"
                )
        return {(None, name): given[name] for name in self.inputs}

    def _request(self, node, run):
        inputs = [run.take((source["node"], source["tensor"]), source["input"], source["dtype"]) for source in node["inputs"]]
        return pb_utils.InferenceRequest(
            model_name=node["model"],
            requested_output_names=run.schedule.returns[node["name"]],
            inputs=inputs,
            timeout=self.timeouts_us.get(node["name"], 0),
        )

    def _collect(self, node, run, response):
        if response.has_error():
            message = response.error().message()
            # The step adapter already says "pipeline 'p' step 's' (model ...) ..."; keep only what went wrong.
            own = _ADAPTER_WHERE.match(message)
            detail = message[own.end():].lstrip(": ") if own else f"failed: {message}"
            raise RequestFailed(f"{self.where}: step {node['name']!r} (model {node['model']!r}) {detail}")
        for output in run.schedule.returns[node["name"]]:
            tensor = pb_utils.get_output_tensor_by_name(response, output)
            if tensor is None:
                raise RequestFailed(f"{self.where}: step {node['name']!r} returned no output {output!r}")
            run.values[(node["name"], output)] = tensor

    def _respond(self, run):
        tensors = []
        for name in run.schedule.wanted:
            out = self.outputs[name]
            tensors.append(run.take((out["node"], out["tensor"]), name, out["dtype"]))
        return pb_utils.InferenceResponse(output_tensors=tensors)


class _Run:
    """One request in flight: the tensors so far, each dropped once its last reader has it."""

    def __init__(self, schedule, values):
        self.schedule = schedule
        self.values = values
        self.remaining = dict(schedule.uses)

    def take(self, key, name, dtype):
        tensor = _renamed(self.values[key], name, dtype)
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            del self.values[key]  # the renamed tensor keeps the memory alive through DLPack
        return tensor


class _Schedule:
    """The execution plan cut down to one set of wanted outputs.

    A filter of the plan, no graph walk of its own: each output lists the nodes
    it needs and each tensor its readers, so ``ExecutionPlan.for_outputs`` gives
    the same nodes, returns and reads (a test holds them equal).
    """

    def __init__(self, plan, wanted):
        outputs = [out for out in plan["outputs"] if out["name"] in wanted]
        self.wanted = [out["name"] for out in outputs]
        needed = {name for out in outputs for name in out["needs"]}
        nodes = [node for node in plan["nodes"] if node["name"] in needed]
        self.order = [node["name"] for node in nodes]
        # graphlib wants node -> predecessors; a needed node's predecessors are all needed.
        self.after = {node["name"]: node["after"] for node in nodes}
        exposed = {}
        for out in outputs:
            key = (out["node"], out["tensor"])
            exposed[key] = exposed.get(key, 0) + 1
        self.uses = {}
        for tensor in plan["tensors"]:
            key = (tensor["node"], tensor["name"])
            reads = sum(1 for c in tensor["consumers"] if c in needed) + exposed.get(key, 0)
            if reads:
                self.uses[key] = reads
        self.returns = {
            node["name"]: [o for o in node["returns"] if (node["name"], o) in self.uses] for node in nodes
        }


def _result(future, name, model):
    try:
        return future.result()
    except Exception as exc:  # e.g. the composing model is not loaded
        raise RequestFailed(f"{model.where}: step {name!r} could not be called: {exc}") from exc


def _renamed(tensor, name, dtype):
    if dtype == "BYTES":  # DLPack has no string tensors
        return pb_utils.Tensor(name, tensor.as_numpy())
    return pb_utils.Tensor.from_dlpack(name, tensor.to_dlpack())


def _dtype_of(tensor, expected):
    """The tensor's Triton datatype, or ``None`` where only a copy could tell.

    ``Tensor.triton_dtype()`` cannot be converted to Python in the 2.51 stub,
    so read the dtype from the host array; for a GPU tensor trust Triton,
    which checks every request's datatypes against the config before execute
    (numpy has no BF16, so those are trusted too).
    """
    if expected == "BF16" or not tensor.is_cpu():
        return None
    dtype = tensor.as_numpy().dtype
    if dtype.kind in "OSU":
        return "BYTES"
    return _NUMPY_NAMES.get(dtype, str(dtype))


def _shape_of(tensor):
    return tuple(tensor.shape())


def _error(message):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
