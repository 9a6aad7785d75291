"""A real yolov5 ``.onnx`` file as a detector step: :func:`onnx_detector` declares it
from the file's own shapes as an external Triton model (backend ``onnxruntime``), and
:class:`OnnxRuntimeDetector` runs it locally through onnxruntime. :func:`check_onnx_declared`
checks the tensors declared for any ONNX file (``onnx_model``) against the file's own.

The weight-free stand-in with the same layout is :mod:`pipelines.steps.detector`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.step import Step, external_model
from ..core.tensor import TensorSpec
from ..errors import DtypeMismatchError, ShapeMismatchError, StepDeclarationError, StepError, UnknownTensorError
from ._xp import array_namespace, to_numpy

__all__ = ["OnnxRuntimeDetector", "OnnxTensor", "check_onnx_declared", "onnx_detector", "read_onnx_signature"]


class OnnxRuntimeDetector:
    """The local stand-in of :func:`onnx_detector`: an onnxruntime session on the file.

    :func:`onnx_detector` subclasses it with the file and tensor names set. A
    model with a fixed batch gets batches of exactly that size: the local
    runtime cuts larger ones (see :class:`~pipelines.core.step.ExternalModel`).
    """

    model_file: str = ""
    input_name: str = "images"
    output_name: str = "output0"
    input_dtype: str = "float32"
    providers: tuple[str, ...] | None = None
    step_name: str = "detector"

    def initialize(self, config: Mapping[str, Any] | None = None) -> None:
        try:
            import onnxruntime
        except ImportError:
            raise StepError(
                f"step {self.step_name!r} runs {self.model_file!r} locally through onnxruntime, which is "
                "not installed; install it with `pip install 'pipelines[onnx]'` (or onnxruntime-gpu)",
                step=self.step_name,
            ) from None
        if not os.path.exists(self.model_file):
            raise StepError(
                f"step {self.step_name!r}: ONNX model file {self.model_file!r} does not exist",
                step=self.step_name,
            )
        providers = list(self.providers) if self.providers else ["CPUExecutionProvider"]
        self.session = onnxruntime.InferenceSession(self.model_file, providers=providers)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if self.input_name not in inputs or self.output_name not in outputs:
            raise StepError(
                f"step {self.step_name!r}: {self.model_file!r} has inputs {inputs} and outputs "
                f"{outputs}, but the step declares input {self.input_name!r} and output {self.output_name!r}; "
                "pass input_name=... and output_name=... to onnx_detector",
                step=self.step_name,
            )

    def execute(self, **inputs: Any) -> dict[str, Any]:
        images = inputs[self.input_name]
        xp = array_namespace(images)
        host = np.ascontiguousarray(to_numpy(images), dtype=self.input_dtype)
        single = host.ndim == 3
        batch = host[None] if single else host
        result = np.asarray(self.session.run([self.output_name], {self.input_name: batch})[0])
        result = result[0] if single else result
        return {self.output_name: result if xp is np else xp.asarray(result)}

    def finalize(self) -> None:
        self.session = None


@dataclass(frozen=True)
class OnnxTensor:
    """One input or output of an ONNX file: its dtype and dims (``None`` where not a fixed size).

    ``datatype`` is the dtype as Triton names it (``FP32``, ``BYTES``…), as a ``TensorSpec`` does.
    """

    name: str
    dtype: np.dtype
    dims: tuple[int | None, ...]
    datatype: str = ""


def read_onnx_signature(model_file: str | os.PathLike[str]) -> tuple[list[OnnxTensor], list[OnnxTensor]]:
    """The graph inputs and outputs an ONNX file declares, read with ``onnx`` (weights are not loaded)."""
    path = os.fspath(model_file)
    try:
        import onnx
    except ImportError:
        raise StepDeclarationError(
            f"reading the input and output shapes of {path!r} needs the onnx package; "
            "install it with `pip install 'pipelines[onnx]'`"
        ) from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError… for a file that is not ONNX
        raise StepDeclarationError(f"{path!r} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    initializers = {t.name for t in model.graph.initializer}  # old exports list weights as inputs too

    def tensors(values: Any) -> list[OnnxTensor]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
            kind = onnx.TensorProto.DataType.Name(t.elem_type)
            out.append(OnnxTensor(v.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims,
                                  _ONNX_TYPES.get(kind, kind)))
        return out

    return tensors(model.graph.input), tensors(model.graph.output)


#: ONNX's element types, as Triton's datatype names.
_ONNX_TYPES = {"FLOAT": "FP32", "DOUBLE": "FP64", "FLOAT16": "FP16", "BFLOAT16": "BF16", "STRING": "BYTES",
               "BOOL": "BOOL", **{k: k for k in ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                                                 "UINT64")}}


def check_onnx_declared(
    name: str,
    model_file: str,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
    *,
    fixed_batch: int | None = None,
    max_batch_size: int | None = None,
) -> None:
    """Raise a :class:`~pipelines.DeclarationError` where the tensors declared for the ONNX file
    ``model_file`` are not the file's own: a name it lacks (or an input of it left out), another
    element type, another rank, or another static size.

    Declared dims leave out the batch axis when the pipeline batches; the step does not know
    yet whether it will (``max_batch_size`` ``None``), so a file of one more axis than a spec
    must have a free first axis (or a ``fixed_batch`` of its size), and a file of the spec's own
    rank is one for a pipeline that does not batch. ``-1`` and a symbolic dim match any size.
    Without ``onnx`` installed, nothing is read, and the file is checked when the step runs.
    """
    try:
        stat = os.stat(model_file)
        file_inputs, file_outputs = _signature(model_file, (stat.st_mtime_ns, stat.st_size))
    except StepDeclarationError as exc:
        if "needs the onnx package" in str(exc):
            return
        raise StepDeclarationError(f"step {name!r}: {exc}", step=name) from None
    for kind, declared, tensors in (("input", inputs, file_inputs), ("output", outputs, file_outputs)):
        by_name = {t.name: t for t in tensors}
        for tensor_name, spec in declared.items():
            tensor = by_name.get(tensor_name)
            if tensor is None:
                raise UnknownTensorError(
                    f"step {name!r} declares {kind} {tensor_name!r}, which {model_file!r} does not have; its "
                    f"{kind}s are {list(by_name)}: declare the file's own names (Triton's onnxruntime backend "
                    "maps tensors by name)",
                    step=name, tensor=tensor_name,
                )
            _check_tensor(name, model_file, kind, spec, tensor, fixed_batch=fixed_batch, max_batch_size=max_batch_size)
    for tensor in file_inputs:
        if tensor.name not in inputs:
            raise UnknownTensorError(
                f"step {name!r}: {model_file!r} has input {tensor.name!r} {_file_side(tensor)}, which the step does "
                f"not declare; onnxruntime must be fed every input of the file, so declare it in inputs= "
                f"(the file's inputs are {[t.name for t in file_inputs]})",
                step=name, tensor=tensor.name,
            )


@functools.lru_cache(maxsize=16)
def _signature(path: str, stamp: tuple[int, int]) -> tuple[list[OnnxTensor], list[OnnxTensor]]:
    # Read once per version of the file: declaring and each compile of its pipeline ask again.
    return read_onnx_signature(path)


def _check_tensor(name: str, path: str, kind: str, spec: TensorSpec, tensor: OnnxTensor, *,
                  fixed_batch: int | None, max_batch_size: int | None) -> None:
    head = f"step {name!r}: {kind} {tensor.name!r} is declared {spec}, but {path!r} has it as {_file_side(tensor)}"
    whole = max_batch_size == 0 and fixed_batch is None  # a step that never batches declares every axis

    def suggest() -> str:
        return _suggest(tensor, spec, whole=whole)
    if tensor.datatype and tensor.datatype != spec.dtype:
        raise DtypeMismatchError(
            f"{head}; the element types differ, so declare {suggest()} or export the file with "
            f"{spec.dtype}",
            step=name, tensor=tensor.name,
        )
    file_dims, dims = list(tensor.dims), list(spec.dims)
    batch = None
    if fixed_batch is not None or (max_batch_size or 0) > 0 or (
            max_batch_size is None and len(file_dims) == len(dims) + 1):
        if len(file_dims) != len(dims) + 1:
            fixed = ("" if not file_dims or file_dims[0] is None or fixed_batch is not None
                     else f", and pass fixed_batch={file_dims[0]}")
            raise ShapeMismatchError(
                f"{head}; the ranks differ: declared dims leave out the batch axis, which the file has first, "
                f"so declare {_suggest(tensor, spec, whole=False, batch=True)}{fixed}",
                step=name, tensor=tensor.name,
            )
        batch, file_dims = file_dims[0], file_dims[1:]
        if fixed_batch is not None and batch not in (None, fixed_batch):
            raise ShapeMismatchError(
                f"{head}; its first axis is a batch of {batch}, not fixed_batch={fixed_batch}: "
                f"pass fixed_batch={batch}",
                step=name, tensor=tensor.name,
            )
        if fixed_batch is None and batch is not None:
            raise ShapeMismatchError(
                f"{head}; its first axis is a fixed batch of {batch}, so pass fixed_batch={batch} "
                "(or export the file with a dynamic batch axis)",
                step=name, tensor=tensor.name,
            )
    elif len(file_dims) != len(dims):
        raise ShapeMismatchError(
            f"{head}; the ranks differ, so declare {suggest()}",
            step=name, tensor=tensor.name,
        )
    if any(f is not None and d != -1 and f != d for f, d in zip(file_dims, dims, strict=True)):
        raise ShapeMismatchError(
            f"{head}; the fixed sizes differ (-1 matches any size), so declare {suggest()}",
            step=name, tensor=tensor.name,
        )


def _file_side(tensor: OnnxTensor) -> str:
    return f"{tensor.datatype or tensor.dtype} {_shape(tensor)}"


def _suggest(tensor: OnnxTensor, spec: TensorSpec, *, whole: bool, batch: bool = False) -> str:
    """The spec that matches the file: its datatype, and its dims, with the batch axis left out
    unless the step declares ``whole`` shapes (``max_batch_size=0``), where the file has one;
    ``batch``: the file's first axis is known to be the batch."""
    dims = list(tensor.dims)
    if batch or (not whole and (len(dims) == spec.rank + 1 or (len(dims) > 1 and dims[0] is None))):
        dims = dims[1:]
    return f"TensorSpec({tensor.datatype or str(tensor.dtype)!r}, {[-1 if d is None else d for d in dims]})"


def _pick(tensors: list[OnnxTensor], name: str | None, what: str, path: str, step_name: str) -> OnnxTensor:
    names = [t.name for t in tensors]
    if name is None:
        if len(tensors) != 1:
            raise StepDeclarationError(
                f"step {step_name!r}: {path!r} has {what}s {names}; name the image one with {what}_name=...",
                step=step_name,
            )
        return tensors[0]
    for t in tensors:
        if t.name == name:
            return t
    raise StepDeclarationError(
        f"step {step_name!r}: {path!r} has {what}s {names}, not {name!r}; pass {what}_name=... with one of them",
        step=step_name,
    )


def _batch_of(images: OnnxTensor, rows: OnnxTensor, path: str, step_name: str) -> int | None:
    """The fixed batch both tensors share, or None for a dynamic batch axis."""
    if len(images.dims) != 4 or len(rows.dims) != 3:
        raise StepDeclarationError(
            f"step {step_name!r}: {path!r} maps {images.name} {_shape(images)} to {rows.name} {_shape(rows)}; "
            "a yolov5 detector maps images [batch, 3, height, width] to rows [batch, candidates, 5 + classes]",
            step=step_name,
        )
    a, b = images.dims[0], rows.dims[0]
    if a != b:
        raise StepDeclarationError(
            f"step {step_name!r}: {path!r} has a batch of {a or 'any size'} in {images.name} but "
            f"{b or 'any size'} in {rows.name}; the two must agree",
            step=step_name,
        )
    return a


def _shape(t: OnnxTensor) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in t.dims) + "]"


def onnx_detector(
    model_file: str | os.PathLike[str],
    *,
    name: str = "detector",
    input_name: str | None = None,
    output_name: str | None = None,
    num_candidates: int | None = None,
    num_classes: int | None = None,
    providers: Sequence[str] | None = None,
    **options: Any,
) -> Step:
    """A yolov5 ``.onnx`` file as a detector step, declared from the file's own shapes.

    The file's one input (``images [batch, 3, 640, 640]``) and one output
    (``output0 [batch, 25200, 85]``) are read with ``onnx``; name them with
    ``input_name``/``output_name`` when there are several. A dynamic batch axis
    (``python export.py --dynamic``) compiles to a batching ``onnxruntime``
    model; a fixed one (the default export's batch of 1) compiles to
    ``max_batch_size: 0`` with the file's exact dims, and runs locally that many
    rows at a time. ``num_candidates``/``num_classes`` fill dims the file leaves
    open, and must match the ones it fixes. Locally it runs through onnxruntime
    (``pip install 'pipelines[onnx]'``), imported when the step is initialised.
    ``options`` are the step's model options.
    """
    path = os.path.abspath(os.fspath(model_file))
    if not os.path.isfile(path):
        raise StepDeclarationError(f"step {name!r}: ONNX model file {path!r} does not exist", step=name)
    file_inputs, file_outputs = read_onnx_signature(path)
    images = _pick(file_inputs, input_name, "input", path, name)
    rows = _pick(file_outputs, output_name, "output", path, name)
    fixed_batch = _batch_of(images, rows, path, name)
    candidates, width = rows.dims[1], rows.dims[2]
    for given, found, what in ((num_candidates, candidates, "num_candidates"),
                               (num_classes, None if width is None else width - 5, "num_classes")):
        if given is not None and found is not None and given != found:
            raise StepDeclarationError(
                f"step {name!r}: {what}={given} but {path!r} gives {rows.name} {_shape(rows)}; drop {what}",
                step=name,
            )
    if num_candidates is not None:
        candidates = num_candidates
    if num_classes is not None:
        width = 5 + num_classes
    stand_in = type(
        "OnnxDetector",
        (OnnxRuntimeDetector,),
        {
            "__module__": __name__,
            "model_file": path,
            "input_name": images.name,
            "output_name": rows.name,
            "input_dtype": images.dtype.name,
            "providers": tuple(providers) if providers else None,
            "step_name": name,
        },
    )
    return external_model(
        name,
        inputs={images.name: TensorSpec(images.dtype, [-1 if d is None else d for d in images.dims[1:]])},
        outputs={rows.name: TensorSpec(rows.dtype, [-1 if candidates is None else candidates,
                                                    -1 if width is None else width])},
        backend="onnxruntime",
        model_file=path,
        stand_in=stand_in,
        fixed_batch=fixed_batch,
        **options,
    )
