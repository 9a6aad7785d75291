"""DLPack capsules built and read with ctypes: numpy has no BF16 and its DLPack refuses it,
while a pb tensor's ``to_dlpack()`` carries it; and numpy 1.26 will not export a read-only array
(docs/triton.md, docs/gpu.md).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .checks import Refused
from .datatypes import bfloat16


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _ManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CAPSULE = b"dltensor"
_KDL_CPU, _KDL_BFLOAT = 1, 4
_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Held:
    """Keeps a DLPack capsule (and so its producer's memory) alive as long as the array built on it."""

    def __init__(self, capsule: Any, interface: dict[str, Any]) -> None:
        self.capsule = capsule
        self.__array_interface__ = interface


def bf16_from_dlpack(capsule: Any) -> np.ndarray:
    """A host BF16 DLPack capsule (unconsumed) as an ``ml_dtypes.bfloat16`` array, without a copy."""
    managed = _ManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, _CAPSULE))
    t = managed.dl_tensor
    if t.device.device_type != _KDL_CPU or (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (_KDL_BFLOAT, 16, 1):
        raise Refused(f"expected a host BF16 tensor; DLPack says device {t.device.device_type}, dtype code {t.dtype.code}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(2 * t.strides[i] for i in range(t.ndim))
    data = (t.data or 0) + t.byte_offset
    held = _Held(capsule, {"data": (data, False), "shape": shape, "strides": strides, "typestr": "<u2", "version": 3})
    return np.asarray(held).view(bfloat16())


_exported: dict[int, tuple[Any, ...]] = {}


@_DELETER
def _release(managed: Any) -> None:  # called by the consumer, with the GIL (a ctypes callback takes it)
    _exported.pop(ctypes.addressof(managed.contents), None)


def bf16_to_dlpack(array: np.ndarray) -> Any:
    """A DLPack capsule over a host BF16 array (``ml_dtypes.bfloat16``), for ``pb_utils.Tensor.from_dlpack``."""
    return host_capsule(array)


# DLPack's type codes (dlpack.h) by numpy kind; BF16 is numpy "V" (ml_dtypes), kDLBfloat.
_KDL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6, "V": _KDL_BFLOAT}


def host_capsule(array: np.ndarray) -> Any:
    """A legacy ``dltensor`` capsule over a host array, for ``pb_utils.Tensor.from_dlpack``.

    What the Python backend of Triton 2.51 reads right under numpy 1 and numpy 2 alike
    (docs/gpu.md): numpy 2's own export refuses read-only arrays and its
    ``Tensor(name, ndarray)`` writes wrong sizes. The array is made contiguous and kept
    alive until the consumer calls the deleter.
    """
    array = np.ascontiguousarray(array)
    code = _KDL_CODES.get(array.dtype.kind)
    if code is None or (array.dtype.kind == "V" and array.dtype.itemsize != 2):
        raise Refused(f"dtype {array.dtype} has no DLPack type; expected a number, a bool or BF16")
    shape = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
    managed = _ManagedTensor()
    managed.dl_tensor.data = array.ctypes.data if array.size else None
    managed.dl_tensor.device = _Device(_KDL_CPU, 0)
    managed.dl_tensor.ndim = array.ndim
    managed.dl_tensor.dtype = _DType(code, array.dtype.itemsize * 8, 1)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _release
    address = ctypes.addressof(managed)
    _exported[address] = (array, shape, managed)
    return _api.PyCapsule_New(address, _CAPSULE, None)


class HostView:
    """A host array as a DLPack producer: what a step of ``array="dlpack"`` is handed for numpy.

    Every input a step is handed is read-only, and numpy 1.26 refuses to export a read-only
    array through DLPack; this exports it (the step is trusted not to write into it).
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:  # numpy 2 passes max_version=, copy=...
        return host_capsule(self.array)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CPU, 0)
