"""What runs inside a Triton server: request and output checks, a step's lifecycle,
the error wire format, and BF16 through DLPack. Standard library and numpy only.

The compiler copies this file beside each ``model.py`` of a repository, so a
server needs no ``pipelines`` package; the package uses the same functions, so
the local runtime and the server check with one set of words.
"""

from __future__ import annotations

import ctypes
import difflib
import inspect
import json
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# Triton 2.51's stub reads and writes numpy arrays wrongly under numpy 2 (docs/gpu.md), and DLPack
# right under both: which one this interpreter has decides how the models move tensors.
NUMPY_2 = int(np.__version__.split(".")[0]) >= 2

# ------------------------------------------------------------------ datatypes

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


# ------------------------------------------------------------------ checks

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


# ------------------------------------------------------------------ a step's lifecycle


def instance_config(
    *,
    step: str,
    inputs: Mapping[str, Any],
    outputs: Mapping[str, Any],
    parameters: Mapping[str, str],
    max_batch_size: int | None,
    pipeline: str | None = None,
    node: str | None = None,
    model_name: str | None = None,
    instance_index: int = 0,
    device: str = "cpu",
    model_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dict a class step's ``initialize(config)`` receives, in every runtime.

    It holds the keys of the ``args`` Triton gives a Python model (``model_name``,
    ``model_instance_name``, ``model_instance_kind``, ``model_config`` as a
    dict…) plus plain ones: ``parameters`` (name -> value, with the type it was
    declared with), ``pipeline``, ``step``,
    ``node``, ``instance_index``, ``device`` and ``max_batch_size``.
    """
    name = model_name or node or step
    params = dict(parameters)
    if model_config is None:
        model_config = {
            "name": name,
            "max_batch_size": max_batch_size or 0,
            "input": [_config_entry(n, s) for n, s in inputs.items()],
            "output": [_config_entry(n, s) for n, s in outputs.items()],
            # Triton's config holds each as a string: a str as it is, anything else as JSON.
            "parameters": {k: {"string_value": v if isinstance(v, str) else json.dumps(v)} for k, v in params.items()},
        }
    return {
        "model_name": name,
        "model_version": "1",
        "model_instance_name": f"{name}_{instance_index}",
        "model_instance_kind": "GPU" if device == "gpu" else "CPU",
        "model_instance_device_id": "0",
        "model_config": dict(model_config),
        "pipeline": pipeline,
        "node": node or step,
        "step": step,
        "instance_index": instance_index,
        "device": device,
        "max_batch_size": max_batch_size,
        "parameters": params,
    }


def _config_entry(name: str, spec: Any) -> dict[str, Any]:
    config_dtype = "TYPE_STRING" if spec.dtype == "BYTES" else f"TYPE_{spec.dtype}"
    return {"name": name, "data_type": config_dtype, "dims": list(spec.dims)}


class StepExited(Exception):
    """A step called ``sys.exit()``: told as its failure, not let through as a ``SystemExit``,
    which would end a stub's event loop or thread with the request never answered."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"sys.exit({self.code!r}) was called; a step returns its outputs or raises, never exits"


class StepInterrupted(Exception):
    """A step raised ``KeyboardInterrupt`` itself: told as its failure. Let through, it ended the
    fused model's event loop (every later request hung) and a local batcher (later requests
    were cancelled). The user's own Ctrl-C, on the main thread of their process, still stops."""

    def __init__(self, interrupt: KeyboardInterrupt) -> None:
        super().__init__(str(interrupt))

    def __str__(self) -> str:
        said = super().__str__()
        return (f"KeyboardInterrupt{f'({said!r})' if said else '()'} was raised inside the step; a step returns its "
                "outputs or raises an Exception")


def _users_ctrl_c() -> bool:
    """Whether a KeyboardInterrupt here may be the user's Ctrl-C: on the main thread of a process
    that is not a Triton stub (signals reach only the main thread; a stub's are Triton's)."""
    return threading.current_thread() is threading.main_thread() and "triton_python_backend_utils" not in sys.modules


def _as_step_failure(exc: SystemExit | KeyboardInterrupt) -> BaseException:
    """What a step's ``sys.exit()`` or ``KeyboardInterrupt`` is raised as: its failure, or the user's Ctrl-C."""
    if isinstance(exc, SystemExit):
        return StepExited(exc.code)
    return exc if _users_ctrl_c() else StepInterrupted(exc)


def is_coroutine_callable(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def``, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


def _handed(fn: Callable[..., Any], hand: Callable[[Any], Any], is_async: bool) -> Callable[..., Any]:
    """``fn`` given each input as ``hand`` makes it (the ``array=`` a step declared)."""
    if is_async:

        async def handed_async(**inputs: Any) -> Any:
            return await fn(**{name: hand(value) for name, value in inputs.items()})

        return handed_async

    def handed(**inputs: Any) -> Any:
        return fn(**{name: hand(value) for name, value in inputs.items()})

    return handed


def _exits_raise(fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    if is_async:
        async def guarded_async(**inputs: Any) -> Any:
            try:
                return await fn(**inputs)
            except (SystemExit, KeyboardInterrupt) as exc:
                raise _as_step_failure(exc) from None

        return guarded_async

    def guarded(**inputs: Any) -> Any:
        try:
            return fn(**inputs)
        except (SystemExit, KeyboardInterrupt) as exc:
            raise _as_step_failure(exc) from None

    return guarded


class StepInstance:
    """One live instance of a step: initialised once, executed many times, finalised once.

    ``impl`` is the step's function or class; a class gets ``initialize(config)``,
    ``execute(**inputs)`` (or ``__call__``) and ``finalize()``, the lifecycle of
    Triton's Python backend. ``fail`` builds the error for a result that is not
    the declared outputs.
    """

    def __init__(
        self,
        name: str,
        impl: Any,
        outputs: list[str],
        config: dict[str, Any],
        fail: Fail = Refused,
        *,
        array: str | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.outputs = list(outputs)
        self._names = frozenset(self.outputs)
        self._fail = fail
        if inspect.isclass(impl):
            obj = impl()
            init = getattr(obj, "initialize", None)
            if init is not None:
                init(config)
            self._obj = obj
            fn = getattr(obj, "execute", None)
            if fn is None:
                fn = obj.__call__ if callable(obj) else None
            if fn is None:
                raise fail(f"class {impl.__name__} needs an execute() or __call__() method", None)
            self._fn = fn
        else:
            self._obj = None
            self._fn = impl
        self.home = code_home(impl)
        hand = handing(array)
        if hand is not None:
            self._fn = _handed(self._fn, hand, self.is_async)
        self._fn = _exits_raise(self._fn, self.is_async)

    @property
    def is_async(self) -> bool:
        """Whether the step is an ``async def`` (then use :meth:`execute_async`)."""
        return is_coroutine_callable(self._fn)

    def execute(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Call the step with its inputs as keyword arguments; return a dict of outputs."""
        result = self._fn(**inputs)
        if type(result) is dict and result.keys() == self._names:  # the common case, checked cheaply
            return dict(result)  # a copy: the runtimes may replace values, the step may keep its dict
        return normalise_outputs(self.outputs, result, self._fail)

    @property
    def function(self) -> Callable[..., Any]:
        """What :meth:`execute` calls with the inputs as keyword arguments (for a caller that must save a call)."""
        return self._fn

    def normalise(self, result: Any) -> dict[str, Any]:
        """A result of :attr:`function` as the dict of outputs, or this instance's error."""
        return normalise_outputs(self.outputs, result, self._fail)

    async def execute_async(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Await an ``async def`` step with its inputs as keyword arguments; return a dict of outputs."""
        return normalise_outputs(self.outputs, await self._fn(**inputs), self._fail)

    def finalize(self) -> None:
        fin = getattr(self._obj, "finalize", None)
        if fin is not None:
            fin()


# ------------------------------------------------------------------ the error wire format


@dataclass(frozen=True)
class WireError:
    """What a model tells the client about a failure, in the text of its error response.

    ``kind`` is the library's error class name (``InputError``, ``StepError``…);
    ``node`` is the name the user gave in the pipeline, ``step`` the step's own.
    """

    kind: str
    pipeline: str
    reason: str
    node: str | None = None
    step: str | None = None
    tensor: str | None = None

    def text(self) -> str:
        """``StepError in pipeline 'p', node 'n', step 's', tensor 't': reason`` (absent parts left out)."""
        where = f"{self.kind} in pipeline {self.pipeline!r}"
        for label, value in (("node", self.node), ("step", self.step), ("tensor", self.tensor)):
            if value is not None:
                where += f", {label} {value!r}"
        return f"{where}: {self.reason}"


# Names follow Triton's rules (pipelines.names), so they never hold a quote.
_WIRE = re.compile(
    r"(?P<kind>[A-Z][A-Za-z]*Error) in pipeline '(?P<pipeline>[^']*)'"
    r"(?:, node '(?P<node>[^']*)')?(?:, step '(?P<step>[^']*)')?(?:, tensor '(?P<tensor>[^']*)')?: (?P<reason>.*)",
    re.S,
)


def parse_error(text: str) -> WireError | None:
    """The :class:`WireError` in a server's error text (Triton may add words before it), or ``None``."""
    found = _WIRE.search(text)
    if found is None:
        return None
    return WireError(**found.groupdict())


def request_tensors(request: Any, specs: Mapping[str, Any]) -> dict[str, Any]:
    """A pb request's input tensors by name; ``Refused`` names a missing or undeclared one."""
    given = {t.name(): t for t in request.inputs()}
    if len(given) != len(specs) or any(n not in given for n in specs):
        check_names(list(given), specs)
    return given


def unknown_output(asked: list[str], outputs: Any, pipeline: str) -> WireError | None:
    """The error for a request that asks for an output the pipeline does not have, if it does."""
    unknown = [n for n in asked if n not in outputs]
    if not unknown:
        return None
    reason = f"output {unknown[0]!r} was requested but the pipeline has outputs {list(outputs)}"
    return WireError("InputError", pipeline, reason, tensor=unknown[0])


def called_model_error(message: str, pipeline: str, node: str, step: str, model: str) -> WireError:
    """A called composing model's error response, said again with the node that called it."""
    said = parse_error(message) or WireError("StepError", pipeline, f"failed (model {model!r}): {message}")
    return WireError(said.kind, pipeline, said.reason, node, step, said.tensor)


def read_only(value: Any) -> Any:
    """``value`` as a step may take it: a numpy array becomes a read-only view of the same memory.

    Where arrays pass from step to step without a copy (the local runtime, the fused model), a
    step that wrote into its input would change what a sibling or a later step reads (on the
    server each step model gets its own copy); a read-only view makes that write an error that
    names the step, in every form that shares memory. The owner of the memory keeps writing it.
    """
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    return value


def exception_reason(exc: BaseException, home: str | None = None, shown: str | None = None) -> str:
    """How a step's own exception is told: ``raised ValueError: what it said (at steps.py:42)``.

    The place is the last line of the traceback in the step's own file (``home``), else in
    any file that is neither this package's nor Python's or an installed library's: the same
    words in every form and locally, since a step's code keeps its file name wherever it runs.
    """
    where = raised_at(exc, home, shown)
    return f"raised {type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


def raised_at(exc: BaseException, home: str | None = None, shown: str | None = None) -> str | None:
    """``file.py:line`` where a step's code raised ``exc`` (see :func:`exception_reason`), or ``None``.

    ``shown`` names ``home`` where its own name says nothing: a step that travelled by value
    has cloudpickle's ``<dynamic-code>`` for a file, and its ``step.json`` keeps the real name.
    """
    given = getattr(exc, "_step_location", None)  # worked out where it was raised (another process)
    if isinstance(given, str):
        return given
    ours, theirs = None, None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if home is not None and filename == home:
            ours = f"{shown or _basename(filename)}:{tb.tb_lineno}"
        elif _users_file(filename):
            theirs = f"{_basename(filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return ours or theirs


def code_home(impl: Any) -> str | None:
    """The file a step's code lives in: its function's, or its class's ``execute``/``__call__``."""
    target = impl
    if inspect.isclass(impl):
        target = getattr(impl, "execute", None) or getattr(impl, "__call__", None)  # noqa: B004 - the method itself
    target = inspect.unwrap(target) if callable(target) else target
    code = getattr(target, "__code__", None)
    return code.co_filename if code is not None else None


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


_HERE = __file__.rsplit("/", 1)[0] + "/"  # this package, or the model's version folder on a server


def _users_file(filename: str) -> bool:
    if filename.startswith("<") or filename.startswith(_HERE):
        return False
    return not any(part in filename for part in ("/site-packages/", "/dist-packages/", "/lib/python3"))


# ------------------------------------------------------------------ BF16 through DLPack
# numpy has no BF16, and numpy's DLPack refuses it; a pb tensor's to_dlpack()
# carries it. These read and build DLPack capsules with ctypes (docs/triton.md).


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


# ------------------------------------------------------------------ a step's code, loaded in a server


def model_plan(args: Mapping[str, Any], filename: str) -> tuple[str, dict[str, Any]]:
    """A model's version folder and the JSON file ``filename`` in it, from Triton's ``args``.

    The folder is the one Triton names, or else the one this file was copied into
    (beside ``model.py``), e.g. when the stub was started on a copy of the model.
    """
    import os

    version_dir = os.path.join(args["model_repository"], str(args["model_version"]))
    if not os.path.isfile(os.path.join(version_dir, filename)):
        version_dir = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(version_dir, filename), encoding="utf-8") as f:
        return version_dir, json.load(f)


def load_impl(impl: Mapping[str, Any], directory: str) -> Any:
    """A step's function or class from its ``impl`` record (``step.json``): imported by
    ``module``/``qualname``, or unpickled from the file ``impl["pickle"]`` in ``directory``
    after two checks (the sha256 recorded at compile time, and the Python that wrote it).

    A failed check is a ``RuntimeError``, the one builtin error the package still raises: this
    runs only inside a Triton stub, where the ``pipelines`` package (and its errors) may be
    absent. The model then fails to load; the server's log holds these words.
    """
    import hashlib
    import importlib
    import os
    import pickle
    import sys

    if "pickle" not in impl:
        obj: Any = importlib.import_module(impl["module"])
        for part in impl["qualname"].split("."):
            obj = getattr(obj, part)
        return getattr(obj, "impl", obj) if type(obj).__name__ == "Step" else obj
    path = os.path.join(directory, impl["pickle"])
    with open(path, "rb") as f:
        data = f.read()
    # Unpickling runs code: refuse a file that is not the one compiled with this plan.
    if hashlib.sha256(data).hexdigest() != impl.get("sha256"):
        raise RuntimeError(
            f"{path} does not match the sha256 recorded in step.json; it was changed or replaced "
            "after compilation: compile the pipeline again"
        )
    wrote, runs = impl.get("python"), f"{sys.version_info.major}.{sys.version_info.minor}"
    if wrote != runs:
        raise RuntimeError(
            f"{impl['pickle']} was written by Python {wrote}; this server runs {runs}: "
            f"compile with Python {runs} or serve with {wrote}"
        )
    return pickle.loads(data)


# ------------------------------------------------------------------ pb tensors in and out
# ``pb`` is the stub's ``triton_python_backend_utils``, passed in by the model that imports it.


def tensor_reader(spec: Spec, *, gpu: bool) -> Callable[[Any], Any]:
    """How a pb tensor becomes an array: numpy (CPU), CuPy (``gpu``), or BF16 by DLPack."""
    if spec.dtype == "BF16":  # as_numpy() refuses BF16; its DLPack capsule carries it (docs/triton.md)
        return lambda tensor: bf16_from_dlpack(tensor.to_dlpack())
    if spec.dtype == "BYTES":  # DLPack has no strings; the stub's as_numpy() reads them
        return _bytes_array
    return _device_array if gpu else host_array


def host_array(tensor: Any) -> np.ndarray:
    """A host pb tensor (numbers) as numpy: ``as_numpy()`` under numpy 1, DLPack under numpy 2.

    Under numpy 2 the 2.51 stub's ``as_numpy()`` returns wrong data without an error
    (docs/gpu.md); ``np.from_dlpack`` reads the same memory right, under either.
    """
    return np.from_dlpack(tensor) if NUMPY_2 else tensor.as_numpy()


def _bytes_array(tensor: Any) -> np.ndarray:
    return tensor.as_numpy()


def _device_array(tensor: Any) -> Any:
    import cupy  # only GPU steps are handed GPU tensors (FORCE_CPU_ONLY_INPUT_TENSORS "no")

    if tensor.is_cpu():
        array = host_array(tensor)
        HOPS.host_to_device(array.nbytes)
        return cupy.asarray(array)
    return cupy.from_dlpack(tensor.to_dlpack())


class HostHops:
    """The copies this process made between host and GPU for a GPU step: how many, how many bytes.

    A GPU step handed a tensor that Triton put in host memory pays one here; none between GPU
    steps is the goal. With ``PIPELINES_HOPS_DIR`` set when the server starts, each model keeps
    its tally there, rewritten in place at every copy (``<model>-<pid>.json``), so a benchmark
    reads it between requests (benchmarks/gpu_server.py); without it, counting costs nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.model = ""
        self.to_device = self.to_host = self.bytes = 0

    def attach(self, model: str) -> None:
        """Name the model this process serves, and open its tally file if one is asked for."""
        import os

        folder = os.environ.get("PIPELINES_HOPS_DIR")
        self.model = model
        if folder and self._fd is None:
            self._fd = os.open(os.path.join(folder, f"{model}-{os.getpid()}.json"), os.O_WRONLY | os.O_CREAT, 0o644)
            self._write()

    def host_to_device(self, nbytes: int) -> None:
        with self._lock:
            self.to_device += 1
            self.bytes += int(nbytes)
            self._write()

    def device_to_host(self, nbytes: int) -> None:
        with self._lock:
            self.to_host += 1
            self.bytes += int(nbytes)
            self._write()

    def _write(self) -> None:
        if self._fd is not None:
            import os

            text = json.dumps({"model": self.model, "to_device": self.to_device, "to_host": self.to_host,
                               "bytes": self.bytes})
            os.pwrite(self._fd, text.ljust(256).encode(), 0)  # one fixed-size write: a reader never sees half


HOPS = HostHops()


def failure_tensor(text: str, rows: int | None) -> np.ndarray:
    """How an ensemble's step carries a failure as data: UINT8, a flag byte (1 failed, 0 not), then the text.

    One row per request row (``rows``), or one flat row when the model does not batch. Numbers,
    not BYTES, so that a stub under numpy 2 can carry it through DLPack (docs/gpu.md).
    """
    row = np.frombuffer(b"\x01" + text.encode("utf-8") if text else b"\x00", dtype=np.uint8)
    return row.copy() if rows is None else np.tile(row, (rows, 1))


def failure_text(tensor: Any) -> str | None:
    """The failure a :func:`failure_tensor` carries (read from a pb tensor), or ``None`` when it carries none."""
    array = pb_array(tensor)
    if not isinstance(array, np.ndarray):
        array = array.get()  # a GPU step's model wrote it from the host; Triton may have moved it
    row = array.reshape(-1) if array.ndim < 2 else (array[0] if len(array) else array.reshape(-1))
    if row.size == 0 or row[0] == 0:
        return None
    return row[1:].tobytes().decode("utf-8", errors="replace")


def refuse_strings_under_numpy_2(model: str, strings: list[str]) -> None:
    """At load, refuse the BYTES tensors that Triton 2.51's stub cannot carry under numpy 2.

    DLPack has no strings, and under numpy 2 the stub's ``as_numpy()`` and ``Tensor(name,
    ndarray)`` misread a BYTES buffer's lengths and abort the stub (docs/gpu.md): a clear
    refusal when the model loads is better than a stub that dies on the first request.
    """
    if NUMPY_2 and strings:
        raise Refused(
            f"model {model!r} carries BYTES tensors {sorted(set(strings))}, which Triton 2.51's Python backend "
            f"cannot read or write under numpy {np.__version__} (its stub misreads them and aborts); serve it from "
            "a Python environment with numpy<2, or carry the strings as UINT8 codes",
            sorted(set(strings))[0],
        )


def pb_array(tensor: Any) -> Any:
    """A pb tensor of any dtype as an array where it lies: numpy on the host, CuPy on a GPU."""
    if not tensor.is_cpu():
        import cupy

        return cupy.from_dlpack(tensor.to_dlpack())
    if NUMPY_2:
        try:
            return np.from_dlpack(tensor)
        except Exception:  # noqa: BLE001 - the stub's own exception type: a BYTES tensor, which DLPack cannot carry
            pass
    return tensor.as_numpy()


def tensor_writer(spec: Spec, pb: Any) -> Callable[[str, Any], Any]:
    """How an array becomes a pb tensor named ``name``: ``writer(name, array)``."""
    if spec.dtype == "BYTES":
        return lambda name, value: pb.Tensor(name, bytes_tensor(value))
    if spec.dtype == "BF16":
        return lambda name, value: pb.Tensor.from_dlpack(name, bf16_to_dlpack(np.asarray(value)))

    def tensor(name: str, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            if NUMPY_2:  # Tensor(name, ndarray) writes wrong sizes under numpy 2 (docs/gpu.md)
                return pb.Tensor.from_dlpack(name, host_capsule(value))
            return pb.Tensor(name, value if value.flags.c_contiguous else np.ascontiguousarray(value))
        # A GPU array stays on the GPU, passed as the array object (docs/gpu.md).
        return pb.Tensor.from_dlpack(name, value)

    return tensor


def bytes_tensor(value: Any) -> np.ndarray:
    """A BYTES tensor as a model on the server receives it: an object array of ``bytes``.

    What Triton's serialisation does to it on the way (the Python backend's, and
    tritonclient's, alike): ``str`` items and ``U`` arrays are encoded as UTF-8,
    ``S`` items kept, anything else written as ``str(item)``. An array that is
    already all ``bytes`` comes back as it is, without a copy.
    """
    value = np.asarray(value)
    if value.dtype.kind == "U":
        value = np.char.encode(value, "utf-8")
    if value.dtype.kind == "O" and not all(type(item) is bytes for item in value.flat):
        encoded = np.empty(value.shape, dtype=np.object_)
        encoded.flat = [
            bytes(item) if isinstance(item, bytes) else str(item).encode("utf-8") for item in value.flat
        ]
        value = encoded
    return np.ascontiguousarray(value.astype(np.object_, copy=False))


def as_arrays(outputs: dict[str, Any]) -> dict[str, Any]:
    """A step's outputs as numpy (host) or CuPy (GPU) arrays, in place.

    What every form does before checking a step's outputs. Anything that speaks
    DLPack (PyTorch, JAX, CuPy, numpy, a producer of one's own) is taken without a
    copy, and its dtype and shape are then DLPack's; lists and scalars are read with
    ``np.asarray``, so a list is taken (or refused, by its dtype) alike everywhere.
    """
    for name, value in outputs.items():
        if type(value) is not np.ndarray:
            outputs[name] = as_array(value, name)
    return outputs


def as_array(value: Any, name: str = "value") -> Any:
    """``value`` as numpy or CuPy over the same memory; ``Refused`` says why it cannot be read."""
    if isinstance(value, np.ndarray) or _is_cupy(value):
        return value
    if not hasattr(value, "__dlpack__"):
        return np.asarray(value)
    try:
        if _dlpack_on_host(value):
            return _host_from_dlpack(value)
        import cupy

        return cupy.from_dlpack(value)
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - every producer fails in its own words (a torch tensor that needs grad...)
        raise Refused(
            f"{name!r} is a {type(value).__module__}.{type(value).__name__} whose DLPack export failed "
            f"({type(exc).__name__}: {exc}); return a DLPack-capable array on the host or on a CUDA device "
            "(a PyTorch tensor may need .detach())",
            name,
        ) from None


def _is_cupy(value: Any) -> bool:
    return type(value).__module__.partition(".")[0] == "cupy" and hasattr(value, "__cuda_array_interface__")


# DLPack device types (dlpack.h) that numpy can read: kDLCPU, kDLCUDAHost (pinned host memory).
DL_HOST = frozenset({1, 3})


def _dlpack_on_host(value: Any) -> bool:
    probe = getattr(value, "__dlpack_device__", None)
    return probe is None or int(probe()[0]) in DL_HOST


def _host_from_dlpack(value: Any) -> np.ndarray:
    try:
        return np.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError) as exc:
        # numpy has no BF16 and refuses it: a BF16 producer is read from its capsule instead
        try:
            return bf16_from_dlpack(value.__dlpack__())
        except Exception:  # noqa: BLE001 - not BF16 either: numpy's own reason is the one to tell
            raise exc from None


# ------------------------------------------------------------------ what a step asks to be handed

#: What ``@step(array=...)`` may ask for; ``None`` is numpy on the CPU and CuPy on a GPU.
ARRAY_KINDS = ("numpy", "cupy", "torch", "dlpack")


def handing(kind: str | None) -> Callable[[Any], Any] | None:
    """The function that turns an input array into what a step of ``array=kind`` takes, or ``None`` for as-is.

    ``"dlpack"`` hands host memory as a :class:`HostView`, which exports even a read-only input.

    Every hand-over is DLPack on the same device, with no copy, except ``"numpy"`` given a GPU
    array (or ``"cupy"`` a host one), which copies, as asked.
    """
    if kind is None:
        return None
    if kind == "dlpack":
        return _to_dlpack
    if kind == "numpy":
        return _to_numpy
    if kind == "cupy":
        return _to_cupy
    if kind == "torch":
        return _to_torch
    raise Refused(f"array={kind!r} is not a kind of array; expected one of {', '.join(ARRAY_KINDS)} or None", None)


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


def _to_dlpack(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU":
        return HostView(value)
    return value


def _to_numpy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value
    if _dlpack_on_host(value):
        return read_only(_host_from_dlpack(value))
    import cupy

    return cupy.asnumpy(cupy.from_dlpack(value))


def _to_cupy(value: Any) -> Any:
    import cupy

    if _is_cupy(value) or (isinstance(value, np.ndarray) and value.dtype.kind in "OSU"):
        return value
    if isinstance(value, np.ndarray) or _dlpack_on_host(value):
        return cupy.asarray(np.asarray(value) if isinstance(value, np.ndarray) else _host_from_dlpack(value))
    return cupy.from_dlpack(value)


def _to_torch(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype.kind in "OSU"):
        return value  # BYTES stay numpy: no other array library holds strings
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU":
        # numpy refuses to export a read-only array (every input is one); our own capsule shares it anyway
        return torch.utils.dlpack.from_dlpack(host_capsule(value))
    return torch.from_dlpack(value)


# ------------------------------------------------------------------ requests batched into one call


def concatenable(requests: list[Mapping[str, Any]]) -> bool:
    """Whether the requests' arrays agree on every dim but the first, so they join into one batch."""
    first = requests[0]
    return all(tuple(a[n].shape[1:]) == tuple(first[n].shape[1:]) for a in requests[1:] for n in first)


def concat_rows(arrays: list[Any]) -> Any:
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=0)
    import cupy

    return cupy.concatenate(arrays, axis=0)


def split_rows(value: Any, bounds: Any) -> list[Any]:
    """``value`` cut along its first axis at ``bounds`` (views, not copies)."""
    if isinstance(value, np.ndarray):
        return np.split(value, bounds, axis=0)
    import cupy

    return cupy.split(value, [int(b) for b in bounds], axis=0)


# ------------------------------------------------------------------ running a plan's nodes concurrently


async def run_concurrently(
    after: Mapping[str, Any], start: Callable[[str, bool], Any], collect: Callable[[str, Any], None]
) -> None:
    """Start each node as soon as the nodes it comes ``after`` are done (``graphlib``).

    ``start(name, alone)`` returns the node's awaitable (``alone``: it is the only
    node ready and nothing else is in flight); ``collect(name, future)`` takes its
    finished future, and may raise to stop the run: the calls still in flight are
    then awaited and dropped.
    """
    import asyncio
    import graphlib

    sorter = graphlib.TopologicalSorter(after)
    sorter.prepare()
    running: dict[Any, str] = {}
    try:
        while sorter.is_active():
            ready = sorter.get_ready()
            alone = len(ready) == 1 and not running
            for name in ready:
                running[asyncio.ensure_future(start(name, alone))] = name
            if len(running) == 1:  # one call in flight: await it, without asyncio.wait's own future
                future = next(iter(running))
                await asyncio.gather(future, return_exceptions=True)  # collect() says what went wrong
                done: Any = (future,)
            else:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                name = running.pop(future)
                collect(name, future)
                sorter.done(name)
    finally:
        if running:  # a sibling failed: wait for the calls in flight, then drop them
            await asyncio.gather(*running, return_exceptions=True)


# ------------------------------------------------------------------ the plan, cut to the outputs a request wants


class Schedule:
    """The execution plan cut down to one set of wanted outputs.

    A filter of the plan, no graph walk of its own: each output lists the nodes
    it needs and each tensor its readers, so ``ExecutionPlan.for_outputs`` gives
    the same nodes, returns and reads (a test holds them equal).
    """

    def __init__(self, plan: Mapping[str, Any], wanted: Any) -> None:
        outputs = [out for out in plan["outputs"] if out["name"] in wanted]
        self.wanted = [out["name"] for out in outputs]
        needed = {name for out in outputs for name in out["needs"]}
        nodes = [node for node in plan["nodes"] if node["name"] in needed]
        self.order = [node["name"] for node in nodes]
        # Every node needs the one before it: running them in turn is all an async executor can do.
        self.chain = all(prev in node["after"] for prev, node in zip(self.order, nodes[1:], strict=False))
        # graphlib wants node -> predecessors; a needed node's predecessors are all needed.
        self.after = {node["name"]: node["after"] for node in nodes}
        exposed = {}
        for out in outputs:
            key = (out["node"], out["tensor"])
            exposed[key] = exposed.get(key, 0) + 1
        self.uses = {}
        for tensor in plan["tensors"]:
            key = (tensor["node"], tensor["name"])
            reads = sum(1 for c in tensor["consumers"] if c in needed) + exposed.get(key, 0)
            if reads:
                self.uses[key] = reads
        self.returns = {
            node["name"]: [o for o in node["returns"] if (node["name"], o) in self.uses] for node in nodes
        }


# ------------------------------------------------------------------ when blocks: rows gathered, run once, scattered back


class _Skipped:
    """What a node that no row ran leaves for its outputs (see :class:`Branches`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIPPED"


#: The value of every output of a node whose ``when`` held for no row: the node was not called.
SKIPPED = _Skipped()


class Branches:
    """A plan's ``when`` blocks, decided once: the conditions each node runs under, which
    nodes are selects, and each output's fill. Every executor (the local runtime, the BLS
    and fused models) runs a conditional plan through it and :class:`Rows`.

    A tensor holds the rows of its producer's conditions only, in order (a pipeline input,
    every row); a node with conditions reads each input gathered to its own rows.
    """

    def __init__(self, plan: Mapping[str, Any]) -> None:
        self.when: dict[str, frozenset[tuple[Any, str, bool]]] = {
            node["name"]: frozenset((t["node"], t["tensor"], bool(t["negated"])) for t in node.get("when", ()))
            for node in plan["nodes"]
        }
        self.selects = frozenset(node["name"] for node in plan["nodes"] if node.get("kind") == "select")
        self.conditions = {
            node["name"]: [(t["node"], t["tensor"]) for t in node.get("when", ())] for node in plan["nodes"]
        }
        self.any = bool(self.selects) or any(self.when.values())
        self.fills = {out["name"]: out.get("otherwise") for out in plan["outputs"]}
        self.batched = int(plan["max_batch_size"]) > 0

    def terms_of(self, key: tuple[Any, str]) -> frozenset[tuple[Any, str, bool]]:
        """The conditions under which the tensor ``key`` (producer, name) exists."""
        return frozenset() if key[0] is None else self.when[key[0]]


_ALL = object()  # Rows' mask for the rows of no condition: every row


class Rows:
    """One run's rows (one request, or requests joined into one batch) against a plan's
    :class:`Branches`: which rows each set of conditions selects, and the gathers and
    scatters between them. ``read(key)`` gives a condition tensor as a host array; each
    condition is read once, when a node first needs it, so it may be released after that.
    """

    def __init__(self, branches: Branches, rows: int | None, read: Callable[[Any], Any]) -> None:
        self.branches = branches
        self.n = int(rows or 1) if branches.batched else 1
        self._read = read
        self._masks: dict[Any, Any] = {frozenset(): _ALL}
        self._terms: dict[Any, np.ndarray] = {}

    def mask(self, terms: frozenset) -> Any:
        """The rows where every condition of ``terms`` holds: a bool array, or ``_ALL``."""
        found = self._masks.get(terms)
        if found is None:
            found = np.ones(self.n, dtype=bool)
            for term in terms:
                found &= self._term(term)
            self._masks[terms] = found
        return found

    def _term(self, term: tuple[Any, str, bool]) -> np.ndarray:
        found = self._terms.get(term)
        if found is None:
            node, tensor, negated = term
            values = np.asarray(_on_host(self._read((node, tensor))), dtype=bool).reshape(-1)
            where = self.mask(self.branches.terms_of((node, tensor)))
            found = np.zeros(self.n, dtype=bool)
            # A row outside the condition's own rows holds neither it nor its negation.
            found[slice(None) if where is _ALL else where] = ~values if negated else values
            self._terms[term] = found
        return found

    def count(self, terms: frozenset) -> int:
        """How many rows run under ``terms``."""
        mask = self.mask(terms)
        return self.n if mask is _ALL else int(mask.sum())

    def read_conditions(self, node: str) -> None:
        """Work out ``node``'s rows now, while its conditions are still held."""
        self.mask(self.branches.when[node])

    def gather(self, value: Any, source: frozenset, terms: frozenset) -> Any:
        """``value``, which holds the rows of ``source``, cut to the rows of ``terms`` (a subset of them)."""
        if source == terms or not self.branches.batched:
            return value
        inner, outer = self.mask(terms), self.mask(source)
        positions = np.flatnonzero(inner if outer is _ALL else inner[outer])
        if len(positions) == len(value):
            return value
        return value[_index_for(value, positions)]

    def merge(self, node: str, sources: Mapping[str, tuple[Any, frozenset]]) -> Any:
        """A select node's output: ``then``'s rows where its condition holds, ``otherwise``'s elsewhere.

        ``sources`` maps ``"condition"``, ``"then"`` and ``"otherwise"`` to (value, the
        conditions of its producer); the condition's value is read through ``read``.
        """
        terms = self.branches.when[node]
        (ckey, _), (then, then_terms), (other, other_terms) = (
            sources["condition"], sources["then"], sources["otherwise"]
        )
        holds, fails = terms | {(*ckey, False)}, terms | {(*ckey, True)}
        if not self.branches.batched:
            return then if self.count(holds) else other
        outer = self.mask(terms)
        parts = []
        for value, value_terms, rows in ((then, then_terms, holds), (other, other_terms, fails)):
            if self.count(rows):
                inner = self.mask(rows)
                positions = np.flatnonzero(inner if outer is _ALL else inner[outer])
                parts.append((positions, _on_host(self.gather(value, value_terms, rows))))
        first = parts[0][1]
        merged = np.empty((self.count(terms), *first.shape[1:]), dtype=first.dtype)
        for positions, value in parts:
            merged[positions] = value
        return merged

    def filled(self, value: Any, source: frozenset, fill: Mapping[str, Any] | None) -> Any:
        """An output that holds the rows of ``source``, with ``fill`` in every other row."""
        if not source:
            return value
        mask = self.mask(source)
        k = self.count(source)
        if not self.branches.batched:
            return value if k else _fill_array(fill, None)
        if k == self.n:
            return value
        if value is SKIPPED:
            return _fill_array(fill, self.n)
        value = _on_host(value)
        out = np.empty((self.n, *value.shape[1:]), dtype=value.dtype)
        out[...] = _fill_values(fill, value.dtype)
        out[mask] = value
        return out


def _fill_values(fill: Mapping[str, Any], dtype: Any = None) -> np.ndarray:
    """A plan's fill (``pipelines.plan.Fill`` as JSON) as an array of its own shape."""
    if fill["dtype"] == "BYTES":
        values = np.empty(len(fill["data"]), dtype=object)
        values[:] = [text.encode("latin-1") for text in fill["data"]]
    else:
        values = np.asarray(fill["data"], dtype=dtype if dtype is not None else numpy_dtype(fill["dtype"]))
    return values.reshape(fill["shape"])


def _fill_array(fill: Mapping[str, Any], rows: int | None) -> np.ndarray:
    """Every row filled: ``rows`` of the output's dims (a ``-1`` dim, no row ran it: size 0)."""
    body = tuple(0 if d == -1 else d for d in fill["dims"])
    values = _fill_values(fill)
    out = np.empty(body if rows is None else (rows, *body), dtype=values.dtype)
    out[...] = values
    return out


def _on_host(value: Any) -> Any:
    """A CuPy array copied to the host (a mask or a scatter works on numpy); numpy as it is."""
    if isinstance(value, np.ndarray) or not hasattr(value, "get"):
        return value
    return value.get()


def _index_for(value: Any, positions: np.ndarray) -> Any:
    """``positions`` in the array module of ``value`` (CuPy indexes with CuPy arrays)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__cuda_array_interface__"):
        return positions
    import cupy

    return cupy.asarray(positions)
