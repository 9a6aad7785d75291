"""An ONNX file run by onnxruntime on named numpy arrays, checked once against the tensors a model
declares, as Triton's onnxruntime backend checks a config against its file. The bundled server's
stand-in for that backend runs it, and so can the local runtime; onnxruntime is imported only
when a session opens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .datatypes import Spec

__all__ = ["ONNX_DATATYPES", "OnnxFileError", "OnnxSession", "config_specs"]

#: onnxruntime's tensor types, as Triton's datatype names.
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}


class OnnxFileError(Exception):
    """An ONNX file cannot serve the tensors declared for it, or onnxruntime is not installed.

    Raised inside a Triton stub, where the package's own errors may be absent (the model then
    fails to load with these words); the package's local stand-in says it again as a ``StepError``.
    """


def config_specs(model_config: Mapping[str, Any], what: str) -> tuple[dict[str, Spec], dict[str, Spec]]:
    """The inputs and outputs a model config declares (Triton's ``args["model_config"]``, parsed, or
    the local runtime's), as specs; a reshaped tensor is refused, since no stand-in applies it."""

    def spec(entry: Mapping[str, Any]) -> Spec:
        if entry.get("reshape"):
            raise OnnxFileError(f"{what} does not apply the reshape of tensor {entry['name']!r}; declare the file's own dims")
        dtype = str(entry.get("data_type", "")).removeprefix("TYPE_")
        return Spec("BYTES" if dtype == "STRING" else dtype, tuple(int(d) for d in entry.get("dims", ())))

    return ({e["name"]: spec(e) for e in model_config.get("input", ())},
            {e["name"]: spec(e) for e in model_config.get("output", ())})


class OnnxSession:
    """``path`` opened with onnxruntime and checked against ``inputs`` and ``outputs``.

    The specs leave out the batch dimension when ``max_batch_size`` > 0, as a Triton config
    does; the file must then have a free first axis. ``None`` (a step run outside a known
    pipeline) takes a file with or without one more leading axis than the specs. Every input
    of the file must be declared, and every declared output must be one of the file's (a
    config may leave some out).
    ``intra_op_threads``/``inter_op_threads`` are the onnxruntime backend's parameters of those
    names (0: onnxruntime's default). ``what`` names the model in the errors.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        inputs: Mapping[str, Spec],
        outputs: Mapping[str, Spec],
        *,
        max_batch_size: int | None,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        what: str = "the model",
    ) -> None:
        self.path = os.fspath(path)
        self.what = what
        try:
            import onnxruntime
        except ImportError:
            raise OnnxFileError(
                f"{what} runs {self.path!r} through onnxruntime, which is not installed in this Python; "
                "install it with `pip install 'pipelines[onnx]'` (or onnxruntime-gpu)"
            ) from None
        if not os.path.isfile(self.path):
            raise OnnxFileError(f"{what}: ONNX model file {self.path!r} does not exist")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(intra_op_threads)
        options.inter_op_num_threads = int(inter_op_threads)
        try:
            self.session = onnxruntime.InferenceSession(
                self.path, sess_options=options, providers=list(providers or ["CPUExecutionProvider"])
            )
        except Exception as exc:  # onnxruntime's own classes (Fail, InvalidGraph…) for a file it cannot load
            raise OnnxFileError(f"{what}: onnxruntime cannot load {self.path!r}: {exc}") from None
        self.max_batch_size = max_batch_size
        given = {t.name: t for t in self.session.get_inputs()}
        made = {t.name: t for t in self.session.get_outputs()}
        for name in given:
            if name not in inputs:
                raise OnnxFileError(
                    f"{what}: {self.path!r} has input {name!r}, which the config does not declare; "
                    f"it declares {list(inputs)} and the file has {list(given)}"
                )
        for kind, declared, found in (("input", inputs, given), ("output", outputs, made)):
            for name, spec in declared.items():
                if name not in found:
                    raise OnnxFileError(
                        f"{what}: the config declares {kind} {name!r}, which {self.path!r} does not have; "
                        f"its {kind}s are {list(found)}"
                    )
                self._check(kind, name, spec, found[name])
        self.inputs = dict(inputs)
        self.outputs = list(outputs)

    def _check(self, kind: str, name: str, spec: Spec, tensor: Any) -> None:
        dtype = ONNX_DATATYPES.get(tensor.type, tensor.type)
        if dtype != spec.dtype:
            raise OnnxFileError(
                f"{self.what}: {kind} {name!r} is {spec.dtype} in the config but {dtype} in {self.path!r}"
            )
        if dtype == "BF16":
            raise OnnxFileError(f"{self.what}: {kind} {name!r} is BF16, which onnxruntime's Python API cannot "
                                "take or give as numpy")
        shape = tensor.shape
        if shape is None:  # the file does not say its rank
            return
        file_dims = [d if isinstance(d, int) and d > 0 else -1 for d in shape]
        batching = self.max_batch_size is not None and self.max_batch_size > 0
        unknown = self.max_batch_size is None and len(file_dims) == len(spec.dims) + 1
        want = ([-1] if batching or unknown else []) + list(spec.dims)
        mismatch = len(file_dims) != len(want) or any(
            f != -1 and w != -1 and f != w for f, w in zip(file_dims, want, strict=False)
        )
        if batching and file_dims and file_dims[0] != -1:
            mismatch = True  # a batching config needs a free first axis in the file
        if mismatch:
            batch = " with the batch dimension first (max_batch_size > 0)" if batching else ""
            raise OnnxFileError(
                f"{self.what}: {kind} {name!r} has dims {file_dims} in {self.path!r}, but the config declares "
                f"{want}{batch} (-1 is any size)"
            )

    def run(self, arrays: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The outputs named in ``outputs`` (default: every declared one) for these inputs."""
        names = list(outputs) if outputs else self.outputs
        feeds = {name: _feed(arrays[name], spec) for name, spec in self.inputs.items()}
        return dict(zip(names, self.session.run(names, feeds), strict=True))

    def close(self) -> None:
        self.session = None


def _feed(value: Any, spec: Spec) -> np.ndarray:
    array = np.asarray(value)
    if spec.dtype == "BYTES":  # Triton carries bytes; onnxruntime's string tensors take str
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.flat],
                        dtype=object).reshape(array.shape)
    return np.ascontiguousarray(array)
