"""Typed tensor declarations and the datatype tables behind them.

``TensorSpec("FP32", [4])`` reads like Triton's own config: a datatype name and
dims without the batch dimension, where ``-1`` marks a variable size. The tables
map each Triton datatype name to its numpy dtype and to the config's ``TYPE_*``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TensorSpecError
from ..serving import NUMPY_DTYPES, Spec

__all__ = [
    "DATATYPES",
    "TensorSpec",
    "config_dtype",
    "datatype_of",
    "numpy_dtype",
]

try:  # tritonclient carries BF16 as ml_dtypes.bfloat16 (ml_dtypes is one of its dependencies)
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - tritonclient always brings ml_dtypes
    _bfloat16 = None

#: Triton datatype name -> numpy dtype, as tritonclient maps them.
#: BYTES is numpy ``object_`` holding ``bytes`` (tritonclient's convention);
#: BF16 has no numpy dtype of its own and is carried as ``ml_dtypes.bfloat16``,
#: the type tritonclient uses for it, which round-trips bit for bit.
#: The table itself lives in :mod:`pipelines.serving`, which a server reads too.
DATATYPES: dict[str, np.dtype] = {
    **{name: dtype for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"},
    "BF16": np.dtype(_bfloat16) if _bfloat16 is not None else np.dtype(np.float32),
    "BYTES": NUMPY_DTYPES["BYTES"],
}

# The config schema names BYTES "TYPE_STRING"; every other name maps one to one.
_CONFIG_NAMES = {name: "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}" for name in DATATYPES}
_FROM_NUMPY = {dtype: name for name, dtype in DATATYPES.items()}
_FROM_NUMPY[np.dtype(np.bytes_)] = "BYTES"
_FROM_NUMPY[np.dtype(np.str_)] = "BYTES"


def _normalise_datatype(dtype: Any) -> str:
    """Accept "FP32", "fp32", "TYPE_FP32", "TYPE_STRING" or a numpy dtype."""
    if isinstance(dtype, str):
        name = dtype.strip().upper()
        if name.startswith("TYPE_"):
            name = name[len("TYPE_"):]
            if name == "STRING":
                name = "BYTES"
        if name in DATATYPES:
            return name
        raise TensorSpecError(
            f"unknown datatype {dtype!r}; expected one of Triton's names: {', '.join(DATATYPES)}"
        )
    try:
        return datatype_of(np.dtype(dtype))
    except TypeError:
        raise TensorSpecError(
            f"unknown datatype {dtype!r}; expected a Triton name such as 'FP32' or a numpy dtype"
        ) from None


def datatype_of(dtype: np.dtype) -> str:
    """The Triton datatype name of a numpy dtype (``bytes``/``str`` arrays are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype in _FROM_NUMPY:
        return _FROM_NUMPY[dtype]
    if dtype.kind in "SU":
        return "BYTES"
    raise TensorSpecError(f"numpy dtype {dtype} has no Triton datatype")


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype that carries a Triton datatype."""
    return DATATYPES[_normalise_datatype(datatype)]


def config_dtype(datatype: str) -> str:
    """The ``model_config.proto`` enum name (``TYPE_*``) of a Triton datatype."""
    return _CONFIG_NAMES[_normalise_datatype(datatype)]


def _normalise_dims(dims: Iterable[int]) -> tuple[int, ...]:
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Iterable):
        raise TensorSpecError(f"dims must be a list of ints such as [3, -1]; got {dims!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TensorSpecError(f"dims must be ints (-1 for a variable size); got {d!r} in {dims!r}")
        if int(d) < -1:
            raise TensorSpecError(f"dim {d} in {list(dims)!r} is invalid; use a size >= 0, or -1 for variable")
        out.append(int(d))
    return tuple(out)


@dataclass(frozen=True, init=False)
class TensorSpec(Spec):
    """A tensor's datatype and dims, in Triton's terms.

    ``dims`` exclude the batch dimension when the model batches
    (``max_batch_size > 0``); ``-1`` marks a variable size. The data part
    (``dtype``, ``dims``, ``shape_matches``) is :class:`pipelines.serving.Spec`,
    which the models on a server use; this adds the checks of a declaration.
    """

    def __init__(self, dtype: Any, dims: Iterable[int] = ()) -> None:
        object.__setattr__(self, "dtype", _normalise_datatype(dtype))
        object.__setattr__(self, "dims", _normalise_dims(dims))

    def __repr__(self) -> str:
        return f"TensorSpec({self.dtype!r}, {list(self.dims)!r})"

    @property
    def numpy_dtype(self) -> np.dtype:
        return DATATYPES[self.dtype]

    @property
    def config_dtype(self) -> str:
        return _CONFIG_NAMES[self.dtype]

    def dims_compatible(self, other: TensorSpec) -> bool:
        """Whether a tensor of ``other``'s dims may feed one of these dims.

        Ranks must agree; a ``-1`` on either side matches any size.
        """
        if self.rank != other.rank:
            return False
        return all(a == b or a == -1 or b == -1 for a, b in zip(self.dims, other.dims, strict=False))

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(data["dtype"], data["dims"])
