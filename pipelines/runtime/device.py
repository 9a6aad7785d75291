"""Where arrays live, and moving them between steps: numpy on CPU, CuPy on GPU.

Tensors cross from one step to the next through ``xp.from_dlpack`` (no copy on
one device). A copy happens only when a step asks for another device, or when
Triton's rule that Python-backend inputs land on CPU is mimicked; every copy is
counted in a :class:`CopyCounter` so the cost report can show it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, InferenceError
from ..serving import read_only

__all__ = [
    "DEVICES",
    "CopyCounter",
    "Placement",
    "array_module",
    "device_of",
    "gpu_available",
    "resolve_device",
]

DEVICES = ("cpu", "gpu")

# DLPack device types (dlpack.h): which of them mean host memory.
_DL_HOST = {1, 3}  # kDLCPU, kDLCUDAHost (pinned host memory is readable by numpy)


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device (cached: probing is slow)."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver, or a driver too old for this CuPy
        return False


def resolve_device(device: str | None) -> str | None:
    """``"auto"`` becomes ``"gpu"`` when CuPy and a CUDA device are present, else ``"cpu"``."""
    if device == "auto":
        return "gpu" if gpu_available() else "cpu"
    if device not in (None, *DEVICES):
        raise ArgumentError(f"device must be 'cpu', 'gpu', 'auto' or None; got {device!r}")
    return device


def device_of(array: Any) -> str:
    """``"gpu"`` for a CUDA array (CuPy, or anything with the CUDA interface), else ``"cpu"``."""
    if isinstance(array, np.ndarray):
        return "cpu"
    if hasattr(array, "__cuda_array_interface__"):
        return "gpu"
    probe = getattr(array, "__dlpack_device__", None)
    if probe is not None:
        try:
            kind = int(probe()[0])
        except Exception:  # a broken producer: treat as host memory, numpy will complain if not
            return "cpu"
        return "cpu" if kind in _DL_HOST else "gpu"
    return "cpu"


def array_module(device: str) -> Any:
    """``numpy`` for ``"cpu"``, ``cupy`` for ``"gpu"``."""
    if device == "gpu":
        import cupy

        return cupy
    return np


@dataclass
class CopyCounter:
    """Copies made between devices for one request: how many, and how many bytes."""

    count: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += int(nbytes)


@dataclass(frozen=True)
class Placement:
    """How one step receives its inputs.

    ``device`` is the step's own device, or ``None`` to take inputs where they
    are. ``cpu_inputs`` mimics Triton's Python backend, which moves inputs to
    CPU unless the model sets ``FORCE_CPU_ONLY_INPUT_TENSORS`` to ``"no"``.
    """

    device: str | None = None
    cpu_inputs: bool = False

    @property
    def target(self) -> str | None:
        return "cpu" if self.cpu_inputs else self.device

    def place(self, array: Any, copies: CopyCounter, *, pipeline: str, step: str, tensor: str) -> Any:
        """The array on this step's device: a zero-copy DLPack view when it is already there."""
        target = self.target
        source = device_of(array)
        if target is None or target == source:
            return _share(array, source)
        try:
            moved = _copy(array, target)
        except Exception as exc:  # noqa: BLE001 - any backend failure becomes an error naming the tensor
            raise InferenceError(
                f"pipeline {pipeline!r} step {step!r}: could not copy input {tensor!r} from {source} to "
                f"{target} ({type(exc).__name__}: {exc}); check that CuPy and a CUDA device are present, "
                "or set the step's device to None",
                pipeline=pipeline,
                step=step,
                tensor=tensor,
            ) from exc
        copies.add(getattr(array, "nbytes", 0))
        return moved


def _share(array: Any, device: str) -> Any:
    """Hand the same memory to the next step through DLPack; no copy is made."""
    if isinstance(array, np.ndarray) and (array.dtype.kind == "O" or array.dtype.kind in "SU"):
        return read_only(array)  # DLPack carries no strings (Triton's BYTES); the array itself is shared
    try:
        shared = array_module(device).from_dlpack(array)
    except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):
        # dtypes DLPack lacks (ml_dtypes' bfloat16), or readonly arrays in numpy 1.26:
        # passing the array object itself shares the memory just the same.
        shared = array
    return read_only(shared)  # numpy 1.26's from_dlpack is read-only already, numpy 2's is not


def _copy(array: Any, target: str) -> Any:
    import cupy  # only reached when a GPU is in play

    return cupy.asnumpy(array) if target == "cpu" else cupy.asarray(array)
