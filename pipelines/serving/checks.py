"""The checks of a request's inputs and a step's outputs, in the words every form says them,
and the :class:`Contract` that prepares them once per model.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .datatypes import numpy_dtype


class Refused(Exception):
    """A check of this module failed: ``str()`` says why, ``tensor`` names the tensor.

    The package turns it into ``InputError`` or ``StepError``; a model on the
    server puts it on the wire with :func:`error_text`.
    """

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


#: ``fail(message, tensor)`` builds the exception a check raises.
Fail = Callable[[str, "str | None"], Exception]


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
    inputs: Mapping[str, Any], specs: Mapping[str, Any], *, max_batch_size: int, fail: Fail = Refused
) -> dict[str, Any]:
    """Return the request's arrays, in ``specs`` order, or raise ``fail(message, tensor)``.

    ``max_batch_size > 0`` means every tensor carries a leading batch dimension
    that ``specs`` leave out (Triton's convention); all inputs must agree on it,
    and it must lie in ``1..max_batch_size``. Arrays (numpy, CuPy) are passed
    through as they are; other values (lists, scalars) go through ``np.asarray``.
    """
    if not isinstance(inputs, Mapping):
        raise fail(
            f"a request is a dict of input name -> array; got {type(inputs).__name__}. "
            f"Pass {{{', '.join(repr(n) for n in specs)}: ...}}",
            None,
        )
    check_names(list(inputs), specs, fail)
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
                    f"expected {expected(spec, max_batch_size)}",
                    name,
                ) from None
        check_dtype(name, spec, value.dtype, fail)
        shape = tuple(int(d) for d in value.shape)
        check_shape(name, spec, shape, max_batch_size, fail)
        if max_batch_size > 0:
            batch = check_same_batch(batch, name, shape[0], fail)
        out[name] = value
    return out


def check_names(given: list[str], specs: Mapping[str, Any], fail: Fail = Refused) -> None:
    expected_names = list(specs)
    extra = [n for n in given if n not in specs]
    missing = [n for n in expected_names if n not in given]
    if extra:
        name = extra[0]
        close = difflib.get_close_matches(str(name), missing or expected_names, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise fail(
            f"got input {name!r}, which is not declared{hint}; expected inputs {expected_names}, "
            f"given {given}; rename or drop {name!r}",
            name if isinstance(name, str) else None,
        )
    if missing:
        name = missing[0]
        raise fail(f"input {name!r} ({specs[name]}) is missing; expected inputs {expected_names}, given {given}", name)


def check_dtype(name: str, spec: Any, given: Any, fail: Fail = Refused) -> None:
    try:
        dtype = np.dtype(given)
    except TypeError:
        raise fail(f"input {name!r} has dtype {given!r}, which is not an array dtype; expected {spec.dtype}", name) from None
    if spec.dtype == "BYTES":
        if dtype.kind not in "OSU":
            raise fail(
                f"input {name!r} expects BYTES (numpy object array of bytes) but was given {dtype} numbers; "
                "encode the values as bytes, e.g. np.array([b'...'], dtype=object)",
                name,
            )
        return
    want = numpy_dtype(spec.dtype)
    if dtype.kind in "OSU":
        raise fail(
            f"input {name!r} expects {spec.dtype} numbers ({want}) but was given a BYTES payload "
            f"({dtype}); send a numeric array, e.g. np.asarray(values, dtype=np.{want})",
            name,
        )
    if dtype != want:
        raise fail(f"input {name!r} expects dtype {spec.dtype} ({want}) but was given {dtype}; cast it with .astype(np.{want})", name)


def check_shape(name: str, spec: Any, shape: tuple[int, ...], max_batch_size: int, fail: Fail = Refused) -> None:
    batched = max_batch_size > 0
    want = expected(spec, max_batch_size)
    rank = len(spec.dims) + (1 if batched else 0)
    if len(shape) != rank:
        if batched and len(shape) == len(spec.dims):
            hint = _missing_batch_hint(name, spec, shape, max_batch_size)
        elif batched:
            hint = f"; the ranks differ: the declared dims {list(spec.dims)} leave out the batch dimension, which comes first"
        elif len(shape) == rank + 1:
            hint = (f"; this pipeline does not batch (max_batch_size is 0), so a request is one {want}: send the "
                    f"{shape[0]} rows one by one, or declare the pipeline with max_batch_size to batch them")
        else:
            hint = "; the ranks differ (this pipeline does not batch, so the dims are the whole shape)"
        raise fail(f"input {name!r} expects rank {rank} {want} but was given shape {list(shape)} (rank {len(shape)}){hint}", name)
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
            raise fail(
                f"input {name!r} expects shape {want} but was given {list(shape)}: dimension "
                f"{axis + (1 if batched else 0)} is {s}, expected {d}",
                name,
            )


def _missing_batch_hint(name: str, spec: Any, shape: tuple[int, ...], max_batch_size: int) -> str:
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


def check_same_batch(first: tuple[str, int] | None, name: str, size: int, fail: Fail = Refused) -> tuple[str, int]:
    """``(name, size)`` of the first input; raise if this one's batch size differs."""
    if first is not None and size != first[1]:
        raise fail(
            f"inputs {first[0]!r} and {name!r} have batch sizes {first[1]} and {size}; "
            "every input of one request must have the same batch size (first dimension)",
            name,
        )
    return first or (name, size)


def expected(spec: Any, max_batch_size: int) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    if max_batch_size > 0:
        dims = "batch" + (", " + dims if dims else "")
    return f"{spec.dtype} [{dims}]"


def normalise_outputs(names: list[str], result: Any, fail: Fail = Refused) -> dict[str, Any]:
    """Accept a dict, a tuple in declaration order, or a lone array for a one-output step."""
    if type(result) is dict:  # the common case, before the slower ABC check
        outputs = dict(result)
    elif isinstance(result, Mapping):
        outputs = dict(result)
    elif isinstance(result, tuple) and len(result) == len(names):
        outputs = dict(zip(names, result, strict=False))
    elif len(names) == 1 and hasattr(result, "shape"):
        outputs = {names[0]: result}
    else:
        raise fail(f"returned {type(result).__name__}; expected a dict with outputs {names}", None)
    if len(outputs) != len(names) or any(n not in outputs for n in names):
        missing = [n for n in names if n not in outputs]
        if missing:
            raise fail(f"did not return output(s) {missing}; it returned {sorted(outputs)}", missing[0])
        extra = [n for n in outputs if n not in names]
        raise fail(f"returned undeclared output(s) {extra}; it declares {names}", extra[0])
    return outputs


def check_outputs(
    specs: Mapping[str, Any], outputs: Mapping[str, Any], *, batched: bool, batch_size: int | None, fail: Fail = Refused
) -> None:
    """Raise ``fail(message, tensor)`` if an output breaks its declared dtype or dims."""
    for name, spec in specs.items():
        value = outputs[name]
        shape = tuple(getattr(value, "shape", ()))
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            raise fail(f"output {name!r} is a {type(value).__name__}; expected an array of {spec}", name)
        dtype = np.dtype(dtype)
        ok = dtype.kind in "OSU" if spec.dtype == "BYTES" else dtype == numpy_dtype(spec.dtype)
        if not ok:
            raise fail(
                f"output {name!r} has dtype {dtype}; it declares {spec.dtype} ({numpy_dtype(spec.dtype)}); "
                "cast it before returning",
                name,
            )
        if batched and (len(shape) < 1 or (batch_size is not None and shape[0] != batch_size)):
            raise fail(
                f"output {name!r} has shape {list(shape)}; expected the batch dimension {batch_size} first, "
                f"then {list(spec.dims)}",
                name,
            )
        body = shape[1:] if batched else shape
        if len(body) != len(spec.dims) or any(d != -1 and d != s for d, s in zip(spec.dims, body, strict=False)):
            want = ([batch_size] if batched else []) + list(spec.dims)
            raise fail(f"output {name!r} has shape {list(shape)}; it declares {want} (-1 is any size)", name)


# ------------------------------------------------------------------ the same checks, prepared once


def config_declares(model_config: Mapping[str, Any] | None, specs: Mapping[str, Any], max_batch_size: int) -> bool:
    """Whether Triton's config of a model (``args["model_config"]``, parsed) declares exactly these
    inputs and ``max_batch_size``, with nothing optional, ragged or reshaped: then every request
    reaching ``execute()`` has already been checked against them by Triton."""
    if not model_config or int(model_config.get("max_batch_size", 0)) != max_batch_size:
        return False
    declared = {}
    for entry in model_config.get("input", ()):
        if entry.get("optional") or entry.get("allow_ragged_batch") or entry.get("is_shape_tensor") or entry.get("reshape"):
            return False
        dtype = str(entry.get("data_type", ""))
        dtype = "BYTES" if dtype == "TYPE_STRING" else dtype.removeprefix("TYPE_")
        declared[entry.get("name")] = (dtype, [int(d) for d in entry.get("dims", ())])
    return declared == {name: (spec.dtype, list(spec.dims)) for name, spec in specs.items()}


class Contract:
    """A model's specs prepared once (at ``initialize``) for a fast yes or no on each call.

    Only a "no" pays for the full checks above, which say what is wrong in the
    same words everywhere.
    """

    def __init__(self, specs: Mapping[str, Any], max_batch_size: int, *, checked_by_triton: bool = False) -> None:
        self.specs = dict(specs)
        self.max_batch_size = max_batch_size
        # Triton itself refuses, before execute(), a request whose inputs break the model's
        # config (docs/triton.md); where that config declares these very specs, the inputs
        # need no second look (see config_declares). Outputs are always checked.
        self.checked_by_triton = checked_by_triton
        self._first = next(iter(self.specs), None)
        lead = 1 if max_batch_size > 0 else 0
        # (name, numpy dtype or None for BYTES, rank, the exact shape after the batch or None, fixed axes)
        self._rows = [
            (
                name,
                None if spec.dtype == "BYTES" else numpy_dtype(spec.dtype),
                len(spec.dims) + lead,
                None if -1 in spec.dims else tuple(spec.dims),
                [(axis + lead, d) for axis, d in enumerate(spec.dims) if d != -1],
            )
            for name, spec in self.specs.items()
        ]

    def _fits(self, value: Any, dtype: Any, rank: int, body: tuple[int, ...] | None, fixed: list[tuple[int, int]]) -> bool:
        if dtype is None:
            if np.dtype(value.dtype).kind not in "OSU":
                return False
        elif value.dtype != dtype:
            return False
        shape = value.shape
        if len(shape) != rank:
            return False
        if body is not None:
            return (shape[1:] if self.max_batch_size > 0 else shape) == body
        for axis, d in fixed:
            if shape[axis] != d:
                return False
        return True

    def check_inputs(self, arrays: Mapping[str, Any], fail: Fail = Refused) -> int | None:
        """The batch size of a request's arrays (``None`` without batching), or raise ``fail``."""
        batched = self.max_batch_size > 0
        if self.checked_by_triton:
            return arrays[self._first].shape[0] if batched and self._first is not None else None
        size = None
        for name, dtype, rank, body, fixed in self._rows:
            value = arrays[name]
            if not self._fits(value, dtype, rank, body, fixed):
                break
            if batched:
                rows = value.shape[0]
                if (size is not None and rows != size) or rows < 1 or rows > self.max_batch_size:
                    break
                size = rows
        else:
            return size
        check_request(arrays, self.specs, max_batch_size=self.max_batch_size, fail=fail)
        return size  # the full checks found nothing (cannot happen): let the request through

    def check_outputs(self, outputs: Mapping[str, Any], batch_size: int | None, fail: Fail = Refused) -> None:
        """Raise ``fail`` if an output breaks its declaration (``batch_size``: the request's rows)."""
        for name, dtype, rank, body, fixed in self._rows:
            value = outputs[name]
            if not (
                hasattr(value, "dtype")
                and self._fits(value, dtype, rank, body, fixed)
                and (batch_size is None or value.shape[0] == batch_size)
            ):
                check_outputs(self.specs, outputs, batched=self.max_batch_size > 0, batch_size=batch_size, fail=fail)
                return
