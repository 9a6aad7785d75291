"""Request validation shared by the local runtime, the BLS executor and the step adapter.

``check_request`` compares a request's tensors with the declared specs before any
step runs, and answers an :class:`~pipelines.errors.InputError` that names the
tensor, what was expected and what was given. Pure numpy; arrays are never copied.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import InputError
from .tensor import TensorSpec

__all__ = ["check_request", "is_array"]


def is_array(value: Any) -> bool:
    """Whether ``value`` is already an array (numpy, CuPy, anything with DLPack or the CUDA interface)."""
    if isinstance(value, np.ndarray):
        return True
    return (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and (hasattr(value, "__dlpack__") or hasattr(value, "__cuda_array_interface__") or hasattr(value, "__array__"))
    )


def check_request(
    inputs: Mapping[str, Any],
    specs: Mapping[str, TensorSpec],
    *,
    pipeline: str,
    max_batch_size: int,
    step: str | None = None,
) -> dict[str, Any]:
    """Return the request's arrays, in ``specs`` order, or raise :class:`InputError`.

    ``max_batch_size > 0`` means every tensor carries a leading batch dimension
    that ``specs`` leave out (Triton's convention); all inputs must agree on it,
    and it must lie in ``1..max_batch_size``. Arrays (numpy, CuPy) are passed
    through as they are; other values (lists, scalars) go through ``np.asarray``.
    """
    where = f"pipeline {pipeline!r}" + (f" step {step!r}" if step else "")

    def fail(message: str, tensor: str | None) -> InputError:
        return InputError(f"{where}: {message}", pipeline=pipeline, step=step, tensor=tensor)

    if not isinstance(inputs, Mapping):
        raise fail(
            f"a request is a dict of input name -> array; got {type(inputs).__name__}. "
            f"Pass {{{', '.join(repr(n) for n in specs)}: ...}}",
            None,
        )
    _check_names(inputs, specs, fail)

    out: dict[str, Any] = {}
    batch: tuple[str, int] | None = None
    for name, spec in specs.items():
        value = inputs[name]
        if not is_array(value):
            try:
                value = np.asarray(value)
            except Exception as exc:  # any failure to build an array is the caller's input
                raise fail(
                    f"input {name!r} is a {type(value).__name__} that is not an array ({exc}); "
                    f"expected {_expected(spec, max_batch_size)}",
                    name,
                ) from None
        _check_dtype(name, spec, value, fail)
        shape = tuple(int(d) for d in value.shape)
        _check_shape(name, spec, shape, fail, max_batch_size)
        if max_batch_size > 0:
            size = shape[0]
            if batch is not None and size != batch[1]:
                raise fail(
                    f"inputs {batch[0]!r} and {name!r} have batch sizes {batch[1]} and {size}; "
                    "every input of one request must have the same batch size (first dimension)",
                    name,
                )
            batch = (name, size)
        out[name] = value
    return out


def _check_names(inputs: Mapping[str, Any], specs: Mapping[str, TensorSpec], fail: Any) -> None:
    expected = list(specs)
    extra = [n for n in inputs if n not in specs]
    missing = [n for n in expected if n not in inputs]
    if extra:
        name = extra[0]
        close = difflib.get_close_matches(str(name), missing or expected, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise fail(
            f"got input {name!r}, which is not declared{hint}; expected inputs {expected}, "
            f"given {list(inputs)}; rename or drop {name!r}",
            name if isinstance(name, str) else None,
        )
    if missing:
        name = missing[0]
        raise fail(
            f"input {name!r} ({specs[name]}) is missing; expected inputs {expected}, given {list(inputs)}",
            name,
        )


def _check_dtype(name: str, spec: TensorSpec, value: Any, fail: Any) -> None:
    try:
        dtype = np.dtype(value.dtype)
    except TypeError:
        raise fail(f"input {name!r} has dtype {value.dtype!r}, which is not an array dtype; expected {spec.dtype}", name) from None
    if spec.dtype == "BYTES":
        if dtype.kind not in "OSU":
            raise fail(
                f"input {name!r} expects BYTES (numpy object array of bytes) but was given {dtype} numbers; "
                "encode the values as bytes, e.g. np.array([b'...'], dtype=object)",
                name,
            )
        return
    if dtype.kind in "OSU":
        raise fail(
            f"input {name!r} expects {spec.dtype} numbers ({spec.numpy_dtype}) but was given a BYTES payload "
            f"({dtype}); send a numeric array, e.g. np.asarray(values, dtype=np.{spec.numpy_dtype})",
            name,
        )
    if dtype != spec.numpy_dtype:
        raise fail(
            f"input {name!r} expects dtype {spec.dtype} ({spec.numpy_dtype}) but was given {dtype}; "
            f"cast it with .astype(np.{spec.numpy_dtype})",
            name,
        )


def _check_shape(name: str, spec: TensorSpec, shape: tuple[int, ...], fail: Any, max_batch_size: int) -> None:
    batched = max_batch_size > 0
    want = _expected(spec, max_batch_size)
    rank = spec.rank + (1 if batched else 0)
    if len(shape) != rank:
        hint = _missing_batch_hint(name, spec, shape, max_batch_size) if batched and len(shape) == spec.rank else ""
        raise fail(
            f"input {name!r} expects rank {rank} {want} but was given shape {list(shape)} (rank {len(shape)}){hint}",
            name,
        )
    if batched:
        size = shape[0]
        if size == 0:
            raise fail(f"input {name!r} is an empty batch (shape {list(shape)}); send at least one row of {want}", name)
        if size > max_batch_size:
            raise fail(
                f"input {name!r} has batch size {size} (shape {list(shape)}) but max_batch_size is "
                f"{max_batch_size}; split the request into batches of at most {max_batch_size}",
                name,
            )
    body = shape[1:] if batched else shape
    for axis, (d, s) in enumerate(zip(spec.dims, body, strict=True)):
        if d != -1 and d != s:
            axis_no = axis + (1 if batched else 0)
            raise fail(
                f"input {name!r} expects shape {want} but was given {list(shape)}: dimension {axis_no} "
                f"is {s}, expected {d}",
                name,
            )


def _missing_batch_hint(name: str, spec: TensorSpec, shape: tuple[int, ...], max_batch_size: int) -> str:
    """Which axis to add: ``x[None]`` if ``x`` is one row, ``x[:, None]`` if it is rows of one value each."""

    def fits(body: tuple[int, ...]) -> bool:
        return all(d in (-1, s) for d, s in zip(spec.dims, body, strict=True))

    fixes = []
    if fits(shape):
        fixes.append(f"{name}[None] for a batch of one")
    if shape and 0 < shape[0] <= max_batch_size and fits((*shape[1:], 1)):
        index = ":, None" if len(shape) == 1 else "..., None"
        fixes.append(f"{name}[{index}] for a batch of {shape[0]} rows of {list(spec.dims)}")
    if not fixes:
        return f"; the batch dimension is missing: add it as the first axis (shape [batch, {', '.join(map(str, spec.dims))}])"
    return "; the batch dimension is missing: send " + ", or ".join(fixes)


def _expected(spec: TensorSpec, max_batch_size: int) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    if max_batch_size > 0:
        dims = "batch" + (", " + dims if dims else "")
    return f"{spec.dtype} [{dims}]"
