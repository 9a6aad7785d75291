"""Triton's datatypes as numpy sees them (BF16 from ``ml_dtypes``), a tensor's spec, and which
numpy this interpreter has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# Triton 2.51's stub reads and writes numpy arrays wrongly under numpy 2 (docs/gpu.md), and DLPack
# right under both: which one this interpreter has decides how the models move tensors.
NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


#: Triton datatype name -> numpy dtype, as tritonclient maps them; BYTES is numpy
#: ``object_`` holding ``bytes``. BF16 is resolved by :func:`numpy_dtype`.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}


def bfloat16() -> np.dtype:
    """numpy has no BF16: it is ``ml_dtypes.bfloat16``, as in tritonclient (imported only when used)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(datatype: str) -> np.dtype:
    return bfloat16() if datatype == "BF16" else NUMPY_DTYPES[datatype]


@dataclass(frozen=True)
class Spec:
    """A tensor's Triton datatype name and dims (without the batch dimension; ``-1`` is any size)."""

    dtype: str
    dims: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype} {list(self.dims)}"

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def shape_matches(self, shape: tuple[int, ...]) -> bool:
        """Whether a concrete shape (without batch dimension) fits these dims."""
        return len(shape) == len(self.dims) and all(d == -1 or d == s for d, s in zip(self.dims, shape, strict=False))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Spec:
        return cls(str(data["dtype"]), tuple(int(d) for d in data["dims"]))
