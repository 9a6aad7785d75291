"""Triton Python-backend adapter that serves one pipeline step.

Copied verbatim as ``<model>/1/model.py``. It reads ``step.json`` beside it,
loads the step (by import, or from ``step.pkl`` by value), runs its lifecycle,
and answers each list of requests with one batched call, falling back to one
call per request so that a failing request cannot take its neighbours down.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import traceback

import numpy as np

try:  # present only inside Triton's Python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - the module is also imported by tests and linters
    pb_utils = None

from pipelines.errors import InputError, StepError
from pipelines.step import Step, check_outputs, instance_config
from pipelines.tensor import TensorSpec


class TritonPythonModel:
    def initialize(self, args):
        version_dir = os.path.join(args["model_repository"], str(args["model_version"]))
        if not os.path.isfile(os.path.join(version_dir, "step.json")):
            version_dir = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(version_dir, "step.json"), encoding="utf-8") as f:
            plan = json.load(f)
        self.pipeline = plan["pipeline"]
        self.step_name = plan["step"]
        self.where = _where(self.pipeline, self.step_name, plan.get("model"), plan.get("nodes") or [self.step_name])
        self.max_batch_size = int(plan["max_batch_size"])
        self.gpu = plan.get("device") == "gpu"
        self.step = Step(
            name=plan["step"],
            inputs={n: TensorSpec.from_dict(s) for n, s in plan["inputs"].items()},
            outputs={n: TensorSpec.from_dict(s) for n, s in plan["outputs"].items()},
            impl=_load_impl(plan, version_dir),
        )
        instance_name = args.get("model_instance_name", "")
        match = re.search(r"_(\d+)$", instance_name)
        config = instance_config(
            self.step,
            pipeline=self.pipeline,
            node=plan["nodes"][0] if len(plan.get("nodes", ())) == 1 else None,
            model_name=args.get("model_name"),
            instance_index=int(match.group(1)) if match else 0,
            device="gpu" if args.get("model_instance_kind") == "GPU" else "cpu",
            max_batch_size=self.max_batch_size,
            parameters=plan.get("parameters") or {},
            model_config=json.loads(args["model_config"]) if "model_config" in args else None,
        )
        # Triton's own values for the keys it gives, exactly as it gave them.
        config.update({k: args[k] for k in ("model_version", "model_instance_name", "model_instance_kind",
                                            "model_instance_device_id") if k in args})
        self.instance = self.step.instantiate(config)
        self.ensemble = _EnsembleExtras(plan.get("ensemble") or {}, self.where)

    def execute(self, requests):
        inputs, errors = [], []
        for request in requests:
            try:
                if self.ensemble.upstream_failed(request):
                    inputs.append(None)  # a step upstream failed: running on its stand-ins would be garbage
                    errors.append(UPSTREAM_FAILED)
                    continue
                inputs.append(self._read(request))
                errors.append(None)
            except Exception as exc:  # a bad request is answered alone; the others go on
                inputs.append(None)
                errors.append(self._message(exc))
        results = self._run(inputs, errors)
        responses = []
        for request, result, error in zip(requests, results, errors, strict=True):
            wanted = set(request.requested_output_names() or ())
            if error is not None:
                if self.ensemble.err_output not in wanted:
                    responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error)))
                    continue
                result = self.ensemble.placeholders(request, self.step, self.max_batch_size)
            wanted = wanted or set(result)
            tensors = [_to_tensor(name, value) for name, value in result.items() if name in wanted]
            tensors += self.ensemble.extra_tensors(request, result, wanted, error, self.max_batch_size)
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self):
        instance = getattr(self, "instance", None)
        if instance is not None:
            instance.finalize()

    # ------------------------------------------------------------------ helpers

    def _read(self, request):
        arrays = {}
        for name, spec in self.step.inputs.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise InputError(f"{self.where}: input {name!r} ({spec}) is missing from the request")
            arrays[name] = _to_array(tensor, gpu=self.gpu)
        check_inputs(self.step, arrays, max_batch_size=self.max_batch_size, where=self.where)
        return arrays

    def _run(self, inputs, errors):
        """One result dict per request (``None`` where ``errors`` holds the reason)."""
        good = [i for i, e in enumerate(errors) if e is None]
        results = [None] * len(inputs)
        batched = self.max_batch_size > 0
        if batched and len(good) > 1 and _concatenable(self.step, [inputs[i] for i in good]):
            sizes = [len(next(iter(inputs[i].values()))) for i in good]
            joined = {
                name: _concat([inputs[i][name] for i in good]) for name in self.step.inputs
            }
            try:
                out = self._call(joined, batch_size=sum(sizes))
            except Exception:
                out = None  # run one by one below, so only the culprit fails
            if out is not None:
                bounds = np.cumsum(sizes)[:-1]
                parts = {name: _split(value, bounds) for name, value in out.items()}
                for k, i in enumerate(good):
                    results[i] = {name: parts[name][k] for name in out}
                return results
        for i in good:
            try:
                size = len(next(iter(inputs[i].values()))) if batched and inputs[i] else None
                results[i] = self._call(inputs[i], batch_size=size)
            except Exception as exc:
                errors[i] = self._message(exc)
        return results

    def _call(self, arrays, *, batch_size):
        outputs = self.instance.execute(arrays)
        outputs = {name: _host_or_device(value) for name, value in outputs.items()}
        check_outputs(self.step, outputs, batched=self.max_batch_size > 0, batch_size=batch_size)
        return outputs

    def _message(self, exc):
        """``pipeline 'p' step 's' <what went wrong>``, the words the local runtime uses too."""
        if isinstance(exc, (InputError, StepError)):
            text = str(exc)
            if text.startswith(self.where):
                return text
            own = f"step {self.step_name!r} "
            if text.startswith(own):  # check_outputs and friends speak of the step alone
                return f"{self.where} {text[len(own):]}"
            return f"{self.where}: {text}"
        tail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return f"{self.where} raised {tail}"


# What a step writes in its __err__ when it did not run because a step upstream failed.
UPSTREAM_FAILED = b"\x00upstream"


def _where(pipeline, step, model, nodes):
    """How the step's errors start: the node as the user named it, and the model where that differs."""
    if len(nodes) > 1:  # a shared model cannot tell which node called it; the ensemble's gate can
        named = ", ".join(repr(n) for n in nodes)
        return f"pipeline {pipeline!r} step {step!r} (model {model!r}, serving nodes {named})"
    if nodes[0] != step:
        return f"pipeline {pipeline!r} step {nodes[0]!r} (model {model!r})"
    return f"pipeline {pipeline!r} step {step!r}"


class _EnsembleExtras:
    """What an ensemble adds to a step model: output copies, and failures carried as data.

    Triton's ensemble asks a step for every output its ``output_map`` names, so a copy
    is paid on each call of a node that has one. A failure is written in the
    ``__err__`` output only when the caller asked for it (the ensemble does; the BLS
    forms do not and get error responses, which they handle safely).
    """

    def __init__(self, data, where):
        self.copies = data.get("copies") or {}
        self.err_inputs = data.get("err_inputs") or []
        self.err_output = data.get("err_output")
        self.dims = data.get("placeholders") or {}
        self.where = where

    def upstream_failed(self, request):
        for name in self.err_inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None and any(tensor.as_numpy().reshape(-1)):
                return True
        return False

    def placeholders(self, request, step, max_batch_size):
        """Stand-in outputs of the declared dtypes, for the steps downstream to skip and the gate to drop."""
        lead = []
        if max_batch_size > 0:
            given = request.inputs()
            lead = [int(given[0].shape()[0])] if given and len(given[0].shape()) else [1]
        out = {}
        for name, spec in step.outputs.items():
            shape = lead + list(self.dims.get(name, [1 if d == -1 else d for d in spec.dims]))
            out[name] = np.full(shape, b"", dtype=np.object_) if spec.dtype == "BYTES" else np.zeros(
                shape, spec.numpy_dtype
            )
        return out

    def extra_tensors(self, request, result, wanted, error, max_batch_size):
        tensors = [_to_tensor(alias, result[original]) for alias, original in self.copies.items() if alias in wanted]
        if self.err_output in wanted:
            text = b""
            if error is not None:  # only what went wrong: the gate knows which node this was
                text = error if isinstance(error, bytes) else error[len(self.where):].encode("utf-8")
            rows = len(next(iter(result.values()))) if max_batch_size > 0 and result else None
            shape = [rows, 1] if rows is not None else [1]
            tensors.append(pb_utils.Tensor(self.err_output, np.full(shape, text, dtype=np.object_)))
        return tensors


def check_inputs(step, arrays, *, max_batch_size, where):
    """Raise :class:`InputError` if a request's tensor breaks the step's declared dtype or dims."""
    batched = max_batch_size > 0
    sizes = set()
    for name, spec in step.inputs.items():
        value = arrays[name]
        shape = tuple(value.shape)
        kind = np.dtype(value.dtype).kind
        ok = kind in "OSU" if spec.dtype == "BYTES" else np.dtype(value.dtype) == spec.numpy_dtype
        if not ok:
            raise InputError(f"{where}: input {name!r} has dtype {np.dtype(value.dtype)}; expected {spec.dtype}")
        body = shape[1:] if batched else shape
        if (batched and len(shape) < 1) or not spec.shape_matches(body):
            expected = (["batch"] if batched else []) + list(spec.dims)
            raise InputError(f"{where}: input {name!r} has shape {list(shape)}; expected {expected} (-1 is any size)")
        if batched:
            sizes.add(shape[0])
    if batched:
        if len(sizes) > 1:
            raise InputError(f"{where}: inputs disagree on the batch size {sorted(sizes)}; send one batch size")
        size = sizes.pop() if sizes else 0
        if size < 1 or size > max_batch_size:
            raise InputError(f"{where}: batch size {size}; expected 1 to {max_batch_size}")


def _load_impl(plan, version_dir):
    """The step's function or class: imported by name, or unpickled from step.pkl after two checks."""
    import hashlib
    import importlib
    import sys

    impl = plan["impl"]
    if "pickle" not in impl:
        obj = importlib.import_module(impl["module"])
        for part in impl["qualname"].split("."):
            obj = getattr(obj, part)
        return getattr(obj, "impl", obj) if type(obj).__name__ == "Step" else obj
    path = os.path.join(version_dir, impl["pickle"])
    with open(path, "rb") as f:
        data = f.read()
    # Unpickling runs code: refuse a file that is not the one compiled with this plan.
    if hashlib.sha256(data).hexdigest() != impl.get("sha256"):
        raise RuntimeError(
            f"{path} does not match the sha256 recorded in step.json; it was changed or replaced "
            "after compilation: compile the pipeline again"
        )
    wrote, runs = impl.get("python"), f"{sys.version_info.major}.{sys.version_info.minor}"
    if wrote != runs:
        raise RuntimeError(
            f"{impl['pickle']} was written by Python {wrote}; this server runs {runs}: "
            f"compile with Python {runs} or serve with {wrote}"
        )
    return pickle.loads(data)


def _to_array(tensor, *, gpu):
    """A request tensor as numpy (CPU) or CuPy (GPU step), without a copy where DLPack allows."""
    if tensor.is_cpu():
        array = tensor.as_numpy()
        if gpu:
            import cupy

            return cupy.asarray(array)
        return array
    import cupy  # only a GPU step is handed GPU tensors (FORCE_CPU_ONLY_INPUT_TENSORS "no")

    return cupy.from_dlpack(tensor.to_dlpack())


def _host_or_device(value):
    if isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__"):
        return value
    return np.asarray(value)


def _to_tensor(name, value):
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "U":
            value = np.char.encode(value, "utf-8")
        if value.dtype.kind == "S":
            value = value.astype(np.object_)
        return pb_utils.Tensor(name, np.ascontiguousarray(value))
    # A GPU array stays on the GPU; DLPack must never be used on a numpy array (see TRITON_NOTES).
    return pb_utils.Tensor.from_dlpack(name, value)


def _concatenable(step, inputs):
    for name in step.inputs:
        bodies = {tuple(arrays[name].shape[1:]) for arrays in inputs}
        if len(bodies) > 1:
            return False
    return True


def _concat(arrays):
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=0)
    import cupy

    return cupy.concatenate(arrays, axis=0)


def _split(value, bounds):
    if isinstance(value, np.ndarray):
        return np.split(value, bounds, axis=0)
    import cupy

    return cupy.split(value, bounds.tolist(), axis=0)
