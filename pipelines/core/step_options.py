"""A step's per-model options, which become its ``config.pbtxt``: dynamic batching, instances,
device, parameters (:class:`ModelOptions`); and what an external model is (:class:`ExternalModel`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .. import serving
from ..errors import StepDeclarationError

__all__ = ["DynamicBatching", "ExternalModel", "ModelOptions", "ParameterValue", "parameter_text"]


_INSTANCE_KINDS = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU", "model": "KIND_MODEL"}


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's ``dynamic_batching``: gather requests into one batch.

    ``max_queue_delay_us`` is how long the first request may wait for others.
    """

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.preferred_batch_sizes)
        if any(s <= 0 for s in sizes):
            raise StepDeclarationError(f"preferred_batch_sizes must be positive; got {list(sizes)}")
        if int(self.max_queue_delay_us) < 0:
            raise StepDeclarationError(f"max_queue_delay_us must be >= 0; got {self.max_queue_delay_us}")
        object.__setattr__(self, "preferred_batch_sizes", sizes)
        object.__setattr__(self, "max_queue_delay_us", int(self.max_queue_delay_us))


#: A step parameter keeps its type (str, int, float, bool) on its way to ``initialize``.
ParameterValue = str | int | float | bool


def _parameter_value(key: str, value: Any) -> ParameterValue:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        value = value.item()  # a numpy scalar: its Python value
    if not isinstance(value, (str, int, float, bool)):
        raise StepDeclarationError(
            f"parameter {key!r} is {value!r} ({type(value).__name__}); a parameter is a str, int, float or bool "
            "(it travels in step.json and the model config)"
        )
    return value


def parameter_text(value: ParameterValue) -> str:
    """How Triton's config holds a parameter (``string_value``): a str as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class ModelOptions:
    """The per-model options of a step; ``None`` means "as the pipeline does".

    ``instance_kind`` is ``"auto"``, ``"cpu"``, ``"gpu"`` or ``"model"``
    (Triton's ``KIND_*``). ``device`` places the step in the local runtime:
    ``"cpu"``, ``"gpu"``, or ``None`` to follow its inputs. ``array`` is what the
    step is handed: ``"numpy"``, ``"cupy"``, ``"torch"`` (through DLPack, without a
    copy on one device), ``"dlpack"`` (a DLPack producer: CuPy as it is, host memory as a
    view that exports even read-only inputs, which numpy 1.26 refuses),
    or ``None`` for numpy on the CPU and CuPy on a GPU. ``timeout`` (seconds)
    bounds one call of the step in the compiled BLS and fused forms and in their
    local modes (an ensemble has no per-step timeout, and neither has its mode).
    ``share_model``: whether the nodes that use this step share one composing model and
    its instances (``True``) or each get one of their own (``False``); ``None`` means no
    for a Python step and yes for an external model (:mod:`pipelines.core.plan`, model names).
    """

    max_batch_size: int | None = None
    instance_count: int = 1
    instance_kind: str = "auto"
    dynamic_batching: DynamicBatching | None = None
    device: str | None = None
    parameters: Mapping[str, ParameterValue] = field(default_factory=dict)
    timeout: float | None = None
    array: str | None = None
    share_model: bool | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and (
            isinstance(self.max_batch_size, bool) or int(self.max_batch_size) < 0
        ):
            raise StepDeclarationError(f"max_batch_size must be >= 0; got {self.max_batch_size!r}")
        if int(self.instance_count) < 1:
            raise StepDeclarationError(f"instance_count must be >= 1; got {self.instance_count!r}")
        if self.instance_kind not in _INSTANCE_KINDS:
            raise StepDeclarationError(
                f"instance_kind must be one of {sorted(_INSTANCE_KINDS)}; got {self.instance_kind!r}"
            )
        if self.device not in (None, "cpu", "gpu"):
            raise StepDeclarationError(f"device must be 'cpu', 'gpu' or None; got {self.device!r}")
        if self.timeout is not None and float(self.timeout) <= 0:
            raise StepDeclarationError(f"timeout must be > 0 seconds; got {self.timeout!r}")
        if self.share_model is not None and not isinstance(self.share_model, bool):
            raise StepDeclarationError(f"share_model must be True, False or None; got {self.share_model!r}")
        if self.array not in (None, *serving.ARRAY_KINDS):
            raise StepDeclarationError(
                f"array must be one of {', '.join(map(repr, serving.ARRAY_KINDS))} or None; got {self.array!r}"
            )
        clash: dict[tuple[str | None, str | None], str] = {
            ("numpy", "gpu"): "numpy arrays live on the host", ("cupy", "cpu"): "CuPy arrays live on a GPU"
        }
        if (self.array, self.device) in clash:
            raise StepDeclarationError(
                f"array={self.array!r} cannot go with device={self.device!r}: {clash[(self.array, self.device)]}; "
                "drop one of them, or ask for array='torch' or 'dlpack', which live on either"
            )
        db = self.dynamic_batching
        if db is True:
            db = DynamicBatching()
        elif db is False:
            db = None
        elif isinstance(db, Mapping):
            db = DynamicBatching(**db)
        elif db is not None and not isinstance(db, DynamicBatching):
            raise StepDeclarationError(
                f"dynamic_batching must be True, a dict or DynamicBatching; got {db!r}"
            )
        params = {}
        for key, value in dict(self.parameters).items():
            if not isinstance(key, str):
                raise StepDeclarationError(f"parameter names must be strings; got {key!r}")
            params[key] = _parameter_value(key, value)
        object.__setattr__(self, "dynamic_batching", db)
        object.__setattr__(self, "parameters", MappingProxyType(params))
        object.__setattr__(self, "instance_count", int(self.instance_count))
        if self.max_batch_size is not None:
            object.__setattr__(self, "max_batch_size", int(self.max_batch_size))

    @property
    def config_instance_kind(self) -> str:
        return _INSTANCE_KINDS[self.instance_kind]


@dataclass(frozen=True)
class ExternalModel:
    """An existing Triton model a step stands for: its backend or platform and its file.

    ``model_filename`` is the name the file gets in ``<model>/1/``; by default
    the backend's usual name (``model.onnx``, ``model.plan``, ``model.pt``…).
    ``fixed_batch`` is set when the model's first axis is a fixed batch (an
    export without a dynamic batch axis, e.g. ``[1, 3, 640, 640]``): in a
    batching pipeline it compiles to ``max_batch_size: 0`` with that batch as the
    first of its dims, and the local runtime feeds it that many rows at a time.
    """

    backend: str | None = None
    platform: str | None = None
    model_file: str | None = None
    model_filename: str | None = None
    fixed_batch: int | None = None

    def __post_init__(self) -> None:
        if not self.backend and not self.platform:
            raise StepDeclarationError(
                "an external model needs a backend (e.g. 'onnxruntime') or a platform "
                "(e.g. 'tensorrt_plan')"
            )
        if self.fixed_batch is not None and (
            isinstance(self.fixed_batch, bool) or not isinstance(self.fixed_batch, int) or self.fixed_batch < 1
        ):
            raise StepDeclarationError(f"an external model's fixed_batch is an int >= 1; got {self.fixed_batch!r}")
        if self.model_file is not None:
            object.__setattr__(self, "model_file", os.fspath(self.model_file))
        if self.model_filename is None and self.model_file is not None:
            object.__setattr__(self, "model_filename", _default_filename(self))

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "platform": self.platform,
            "model_file": self.model_file,
            "model_filename": self.model_filename,
            "fixed_batch": self.fixed_batch,
        }


_DEFAULT_FILENAMES = {
    "onnxruntime": "model.onnx",
    "onnxruntime_onnx": "model.onnx",
    "tensorrt": "model.plan",
    "tensorrt_plan": "model.plan",
    "pytorch": "model.pt",
    "pytorch_libtorch": "model.pt",
    "tensorflow": "model.savedmodel",
    "tensorflow_savedmodel": "model.savedmodel",
    "openvino": "model.xml",
    "fil": "xgboost.model",
}


def _default_filename(ext: ExternalModel) -> str:
    key = ext.backend or ext.platform or ""
    return _DEFAULT_FILENAMES.get(key, os.path.basename(ext.model_file or "model"))
