"""Tensors on the KServe v2 wire: JSON ``data``, binary tensor data, gRPC contents <-> numpy.

Binary layout is Triton's: little-endian, row major, no padding; BOOL one byte an
element; BYTES each element a 4-byte length then its bytes (tritonclient's own
``serialize_byte_tensor``/``deserialize_bytes_tensor`` do that part). A request
that cannot be decoded becomes a :class:`~pipelines.endpoint.status.Refusal`
with the status a Triton server answers it with.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from ..tensor import DATATYPES, datatype_of
from .status import INVALID, PARSE, Refusal

__all__ = [
    "array_from_bytes",
    "array_from_contents",
    "array_from_json",
    "array_to_bytes",
    "array_to_json",
    "datatype_of_array",
]

# gRPC's typed contents fields, by datatype (FP16 and BF16 travel only as raw bytes).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def datatype_of_array(array: Any) -> str:
    return datatype_of(np.asarray(array).dtype)


def _dtype(name: str, datatype: str) -> np.dtype:
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        # Triton's words; the list of valid names is ours.
        raise Refusal(INVALID, f"invalid datatype for input {name}: {datatype!r}; expected one of {', '.join(DATATYPES)}",
                      tensor=name)
    return dtype


# Triton's HTTP front end carries half floats only as binary tensor data, both ways (2.51).
_BINARY_ONLY = ("FP16", "BF16")


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise Refusal(PARSE, f"Unable to parse 'shape' of input {name!r}: expected a list of sizes >= 0, got {shape!r}",
                      tensor=name)
    return tuple(int(d) for d in shape)


def array_from_json(name: str, datatype: str, shape: Any, data: Any) -> np.ndarray:
    """An input given as JSON ``data`` (flat or nested, as the protocol allows)."""
    dtype = _dtype(name, datatype)
    if datatype in _BINARY_ONLY:
        raise Refusal(INVALID, f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                      f"format for input {name}", tensor=name)
    dims = _shape(name, shape)
    count = math.prod(dims)
    try:
        if datatype == "BYTES":
            flat = np.empty(count, dtype=object)
            items = list(_flatten(data))
            if len(items) != count:
                raise ValueError(f"{len(items)} elements for shape {list(dims)}")
            for i, item in enumerate(items):
                if not isinstance(item, str):
                    raise ValueError(f"element {i} is {type(item).__name__}, not a string")
                # JSON carries BYTES as text; it reaches the pipeline as the bytes it encodes
                flat[i] = item.encode("utf-8", "surrogateescape")
            return flat.reshape(dims)
        array = np.asarray(data)
        if array.dtype.kind not in "biuf" or array.size != count:
            raise ValueError(
                f"{array.size} {array.dtype} elements for shape {list(dims)}"
                if array.dtype.kind in "biuf" else f"elements of JSON type {array.dtype} for {datatype}"
            )
        if datatype == "BOOL" and array.dtype.kind != "b":
            raise ValueError("BOOL data must be true/false")
        if dtype.kind in "iu" and array.dtype.kind == "f":
            raise ValueError(f"{datatype} data must be integers")
        return array.astype(dtype).reshape(dims)
    except (ValueError, TypeError) as exc:
        raise Refusal(PARSE, f"Unable to parse 'data' of input {name!r} ({datatype} {list(dims)}): {exc}",
                      tensor=name) from None


def _flatten(data: Any):
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


def array_from_bytes(name: str, datatype: str, shape: Any, raw: bytes | memoryview, *, model: str) -> np.ndarray:
    """An input given as binary tensor data (HTTP) or raw contents (gRPC)."""
    dtype = _dtype(name, datatype)
    dims = _shape(name, shape)
    count = math.prod(dims)
    if datatype == "BYTES":
        try:
            flat = deserialize_bytes_tensor(bytes(raw))
        except struct.error:
            flat = None
        if flat is None or flat.size != count:
            raise Refusal(
                INVALID,
                f"unexpected size for input {name!r} for model {model!r}: {len(raw)} bytes do not hold "
                f"{count} BYTES elements (each a 4-byte length and its bytes) for shape {list(dims)}",
                tensor=name,
            )
        return flat.reshape(dims)
    want = count * dtype.itemsize
    if len(raw) != want:
        raise Refusal(
            INVALID,
            f"unexpected size for input {name!r}, expecting {want} bytes ({datatype} {list(dims)}) "
            f"but got {len(raw)} for model {model!r}",
            tensor=name,
        )
    # A copy: steps may write into their inputs, and a buffer of the request is read-only.
    little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    return np.frombuffer(raw, dtype=little).astype(dtype).reshape(dims)


def array_from_contents(name: str, datatype: str, shape: Sequence[int], contents: Any, *, model: str) -> np.ndarray:
    """An input given in a gRPC ``InferTensorContents`` (the typed fields, not raw bytes)."""
    dtype = _dtype(name, datatype)
    dims = _shape(name, list(shape))
    field = _CONTENTS.get(datatype)
    if field is None:
        raise Refusal(INVALID, f"input {name!r}: {datatype} data must be sent as raw_input_contents", tensor=name)
    values = list(getattr(contents, field))
    if len(values) != math.prod(dims):
        raise Refusal(
            INVALID,
            f"unexpected number of elements for input {name!r} for model {model!r}: "
            f"{len(values)} for shape {list(dims)}",
            tensor=name,
        )
    if datatype == "BYTES":
        return np.array(values + [b""], dtype=object)[:-1].reshape(dims)  # keep bytes objects, not a bytes_ array
    return np.asarray(values, dtype=dtype).reshape(dims)


def array_to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """Binary tensor data for an output."""
    if datatype == "BYTES":
        flat = np.asarray(array, dtype=object)
        if flat.size == 0:
            return b""
        return serialize_byte_tensor(flat).item()
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()


def array_to_json(array: np.ndarray, datatype: str, name: str = "") -> list:
    """JSON ``data`` for output ``name``: flat, row major, as Triton answers."""
    if datatype in _BINARY_ONLY:
        raise Refusal(INVALID, f"sending {datatype} data via JSON is not supported. Please use the binary data "
                      "format for output", tensor=name or None)
    flat = np.asarray(array).reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()
