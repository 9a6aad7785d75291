"""Triton's classification extension: an output asked with a class count comes back as its top k.

Each row (each batch row of a batching model, the whole tensor otherwise) is ranked
by value, highest first, and answered as BYTES ``"<value>:<index>"``, the value
printed as C's ``std::to_string`` prints it (``0.500000`` for floats, ``12`` for
integers), shape ``[batch, k]`` or ``[k]``, k at most the row's size. This is
what Triton 2.51's ``TopkClassifications`` answers (``src/classification.cc``), over
HTTP (``"parameters": {"classification": k}``) and gRPC
(``parameters["classification"].int64_param``) alike; ``tests/test_endpoint_hostile.py``
compares the two servers. Labels files are a model repository's, which the local
endpoint has none of, so no ``":<label>"`` is added.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .status import INVALID, PARSE, Refusal

__all__ = ["classify", "grpc_class_count", "http_class_count"]

# Triton ranks only fixed-size numbers; BOOL, BYTES and half floats it refuses (BYTES crashes 2.51's
# server with SIGFPE, a division by its zero element size: here it is refused as the others are).
_CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})


def http_class_count(name: str, params: Any) -> int:
    """The class count an HTTP request's output parameters ask for (0: none), checked as Triton does."""
    if not isinstance(params, dict) or "classification" not in params:
        return 0
    count = params["classification"]
    if type(count) is not int or count < 0:
        raise Refusal(PARSE, f"Unable to set 'classification' of output '{name}': expected a class count, a whole "
                      f"number >= 0 (0 asks for the tensor itself); got {count!r}", tensor=name)
    return count


def grpc_class_count(name: str, parameters: Any) -> int:
    """The class count a gRPC requested output asks for (0: none), checked as Triton does."""
    if "classification" not in parameters:
        return 0
    param = parameters["classification"]
    if param.WhichOneof("parameter_choice") != "int64_param":
        raise Refusal(INVALID, f"invalid value type for 'classification' parameter of output '{name}', expected "
                      "int64_param", tensor=name)
    if param.int64_param <= 0:
        raise Refusal(INVALID, f"invalid value for 'classification' parameter of output '{name}', expected a "
                      f"class count >= 1; got {param.int64_param}", tensor=name)
    return int(param.int64_param)


def classify(name: str, array: np.ndarray, datatype: str, count: int, *, batched: bool) -> np.ndarray:
    """The top ``count`` classes of output ``name`` as Triton's BYTES ``"value:index"`` strings."""
    if datatype not in _CLASSIFIABLE:
        raise Refusal(INVALID, f"class result not available for output due to unsupported type '{datatype}' "
                      f"(output '{name}'; the classification extension ranks numeric outputs)", tensor=name)
    array = np.asarray(array)
    rows = array.reshape((array.shape[0], -1) if batched and array.ndim > 0 else (1, -1))
    per_row = rows.shape[1]
    k = min(count, per_row)
    as_text = "{:f}".format if array.dtype.kind == "f" else "{:d}".format
    answer = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # highest first, equal values in index order (as std::sort leaves a short row)
        order = (per_row - 1) - np.argsort(row[::-1], kind="stable")[::-1][:k]
        answer[r] = [f"{as_text(row[i].item())}:{i}".encode() for i in order]
    return answer if batched and array.ndim > 0 else answer.reshape(k)
