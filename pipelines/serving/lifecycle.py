"""A step's lifecycle in every runtime: the config its ``initialize`` gets, one live instance
(initialised, executed, finalised), its exits told as failures; and its code loaded in a server.
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .arrays import handing
from .checks import Fail, Refused, normalise_outputs
from .wire import code_home


def instance_config(
    *,
    step: str,
    inputs: Mapping[str, Any],
    outputs: Mapping[str, Any],
    parameters: Mapping[str, Any],
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


def model_plan(args: Mapping[str, Any], filename: str) -> tuple[str, dict[str, Any]]:
    """A model's version folder and the JSON file ``filename`` in it, from Triton's ``args``.

    The folder is the one Triton names, or else the one this package was copied into
    (beside ``model.py``), e.g. when the stub was started on a copy of the model.
    """
    import os

    version_dir = os.path.join(args["model_repository"], str(args["model_version"]))
    if not os.path.isfile(os.path.join(version_dir, filename)):
        version_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(version_dir, filename), encoding="utf-8") as f:
        return version_dir, json.load(f)


def load_impl(impl: Mapping[str, Any], directory: str) -> Any:
    """A step's function or class from its ``impl`` record (``step.json``): imported by
    ``module``/``qualname``, from its own source file copied beside the model (``path``, see
    ``sources``), or unpickled from the file ``impl["pickle"]`` in ``directory`` after two
    checks (the sha256 recorded at compile time, and the Python that wrote it).

    A failed check is a ``RuntimeError``, the one builtin error the package still raises: this
    runs only inside a Triton stub, where the ``pipelines`` package (and its errors) may be
    absent. The model then fails to load; the server's log holds these words.
    """
    import hashlib
    import importlib
    import os
    import pickle
    import sys

    if "path" in impl:  # the step's own source file, copied beside the model
        from .sources import load_source

        return load_source(impl, directory)
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
