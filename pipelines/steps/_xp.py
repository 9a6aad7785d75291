"""The array module of an array: numpy for numpy arrays, CuPy for CuPy arrays.

Steps take ``xp = array_namespace(arr)`` from their inputs and call only
``xp.*``, so one body runs on CPU and GPU and never copies a device array to
the host behind the caller's back. CuPy is imported only when an array is not
a numpy array, so CPU-only installs never pay for it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_namespace", "stable_argsort", "to_numpy"]

_cupy: ModuleType | None = None
_cupy_checked = False


def _import_cupy() -> ModuleType | None:
    global _cupy, _cupy_checked
    if not _cupy_checked:
        try:
            import cupy
        except Exception:  # not installed, or installed without a usable CUDA
            cupy = None
        _cupy, _cupy_checked = cupy, True
    return _cupy


def array_namespace(*arrays: Any) -> ModuleType:
    """``numpy`` or ``cupy``: the module that owns the first non-numpy array, else numpy."""
    for arr in arrays:
        if isinstance(arr, np.ndarray) or np.isscalar(arr):
            continue
        cupy = _import_cupy()
        if cupy is not None:
            return cupy.get_array_module(arr)
    return np


def to_numpy(arr: Any) -> np.ndarray:
    """A host copy of ``arr`` (no copy when it is already a numpy array)."""
    if isinstance(arr, np.ndarray):
        return arr
    getter = getattr(arr, "get", None)  # cupy.ndarray.get() copies device -> host
    if getter is not None and array_namespace(arr) is not np:
        return getter()
    return np.asarray(arr)


def stable_argsort(arr: Any) -> Any:
    """Indices that sort ``arr`` ascending, ties in their original order.

    CuPy's sort is always stable and takes no ``kind``; numpy's must be asked.
    """
    xp = array_namespace(arr)
    return xp.argsort(arr, kind="stable") if xp is np else xp.argsort(arr)
