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

from ..core.tensor import DATATYPES, datatype_of
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
    """An input given as JSON ``data`` (flat or nested, as the protocol allows).

    Each element must be of the JSON type its datatype takes, as Triton reads it: ``true``
    is no number (Triton: "attempt to access JSON non-number as double"), and a number too
    large for a double (``1e999``) is refused, as Triton refuses it.
    """
    dtype = _dtype(name, datatype)
    if datatype in _BINARY_ONLY:
        raise Refusal(INVALID, f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                      f"format for input {name}", tensor=name)
    dims = _shape(name, shape)
    count = math.prod(dims)
    try:
        items = _flat(data)
        if len(items) != count:
            raise ValueError(f"{len(items)} elements for shape {list(dims)}")
        wanted = _JSON_TYPES["BYTES" if datatype == "BYTES" else dtype.kind]
        found = set(map(type, items)) - wanted
        if found:
            got = ", ".join(sorted(_JSON_NAMES.get(t, t.__name__) for t in found))
            expected = " or ".join(sorted({_JSON_NAMES[t] for t in wanted}))
            raise ValueError(f"{datatype} takes JSON {expected} elements; got {got}")
        if datatype == "BYTES":
            flat = np.empty(count, dtype=object)
            # JSON carries BYTES as text; it reaches the pipeline as the bytes it encodes
            flat[:] = [item.encode("utf-8", "surrogateescape") for item in items]
            return flat.reshape(dims)
        array = np.array(items)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ValueError("a number too large to be stored in a double")
        return array.astype(dtype).reshape(dims)
    except (ValueError, TypeError, OverflowError) as exc:
        raise Refusal(PARSE, f"Unable to parse 'data' of input {name!r} ({datatype} {list(dims)}): {exc}",
                      tensor=name) from None


# The JSON types (as Python reads them) each datatype's elements may be, by numpy kind.
_JSON_TYPES: dict[str, set[type]] = {"BYTES": {str}, "b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}
_JSON_NAMES = {str: "string", bool: "true/false", int: "integer", float: "number", type(None): "null",
               list: "array", dict: "object"}


def _flat(data: Any) -> list:
    """The elements of JSON ``data``, row major, however deeply nested (a lone value is one element)."""
    if not isinstance(data, list):
        return [data]
    while any(isinstance(item, list) for item in data):
        data = [leaf for item in data for leaf in (item if isinstance(item, list) else (item,))]
    return data


def array_from_bytes(name: str, datatype: str, shape: Any, raw: bytes | memoryview, *, model: str) -> np.ndarray:
    """An input given as binary tensor data (HTTP) or raw contents (gRPC).

    The array is a view of ``raw``, not a copy: the request's body (or message) is the
    tensor's memory. It is copied only where numpy could not use it as it is (misaligned
    for its dtype). Steps get read-only views of their inputs whatever the buffer.
    """
    dtype = _dtype(name, datatype)
    dims = _shape(name, shape)
    count = math.prod(dims)
    if datatype == "BYTES":
        try:
            flat = deserialize_bytes_tensor(raw)  # struct reads a memoryview as well as bytes
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
    little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    array = np.frombuffer(raw, dtype=little)
    if not array.dtype.isnative or not array.flags.aligned:
        array = array.astype(dtype)  # a big-endian machine, or a tensor at an odd offset of the body
    return array.reshape(dims)


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


def array_to_bytes(array: np.ndarray, datatype: str) -> bytes | memoryview:
    """Binary tensor data for an output: a view of the array's own memory where it is laid out as the wire's."""
    if datatype == "BYTES":
        flat = np.asarray(array, dtype=object)
        if flat.size == 0:
            return b""
        return serialize_byte_tensor(flat).item()
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.size == 0:
        return b""
    return memoryview(array.reshape(-1).view(np.uint8))


def array_to_json(array: np.ndarray, datatype: str, name: str = "") -> list:
    """JSON ``data`` for output ``name``: flat, row major, as Triton answers.

    NaN and Infinity have no JSON form: an output holding one is refused with the way
    to get it (binary data), rather than written as text no JSON parser must accept.
    """
    if datatype in _BINARY_ONLY:
        raise Refusal(INVALID, f"sending {datatype} data via JSON is not supported. Please use the binary data "
                      "format for output", tensor=name or None)
    flat = np.asarray(array).reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v) for v in flat]
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        bad = flat[~np.isfinite(flat)][0]
        raise Refusal(INVALID, f"output '{name}' holds {bad} ({datatype}), which JSON cannot carry (it has no NaN "
                      "or Infinity); ask for this output as binary data (binary_data: true, or "
                      "InferRequestedOutput(name, binary_data=True))", tensor=name or None)
    return flat.tolist()
