"""A step exported by value: its code pickled with cloudpickle into ``1/step.pkl``, for a step
with no source file a server could import (a notebook cell, ``__main__`` typed interactively,
``pipelines``' own steps outside ``pipelines.steps``). The pickle loads only on the Python minor
version that wrote it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickletools
import sys
import types
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ..core.step import Step
from ..errors import CompileError
from .requirements import (
    NUMPY_REQUIREMENT,
    ServerNeeds,
    cloudpickle_requirement,
    distributions_of,
    is_installed_module,
    python_version,
)
from .source_top_level import is_ours

__all__ = ["STEP_PICKLE", "PickledStep"]

STEP_PICKLE = "step.pkl"


@dataclass
class PickledStep:
    """A step exported by value, once: the bytes, their digest, and the modules it refers to by name."""

    pipeline: str
    node: str
    step: Step

    @functools.cached_property
    def _result(self) -> tuple[bytes, frozenset[str]]:
        return _export_by_value(self.pipeline, self.node, self.step)

    def data(self) -> bytes:
        return self._result[0]

    def impl(self) -> dict[str, str]:
        return {"pickle": STEP_PICKLE, "sha256": hashlib.sha256(self.data()).hexdigest(), "python": python_version()}

    def needs(self) -> ServerNeeds:
        # cloudpickle's own machinery is in every pickle: required by the range that wrote it.
        modules = [m for m in self._result[1] if m.partition(".")[0] != "cloudpickle"]
        requirements = (NUMPY_REQUIREMENT, cloudpickle_requirement(), *distributions_of(modules, exact=False))
        return ServerNeeds(tuple(dict.fromkeys(requirements)), python=python_version())


class _RecordingPickler(cloudpickle.Pickler):
    """A cloudpickle pickler that notes the module of everything it pickles, to list what the server must import.

    It also sends ``functools.lru_cache`` functions of by-value modules by value: cloudpickle
    would refer to them by name (they are not plain functions), which a server cannot import.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        else:
            module = getattr(obj, "__module__", None) if isinstance(obj, (type, types.FunctionType,
                                                                          types.BuiltinFunctionType)) else None
            self.modules.add(module if isinstance(module, str) else type(obj).__module__)
        if isinstance(obj, functools._lru_cache_wrapper) and _travels_by_value(getattr(obj, "__module__", None)):
            params = obj.cache_parameters()
            # Rebuilt on the server as lru_cache(maxsize, typed)(the function, by value).
            return functools.lru_cache(maxsize=params["maxsize"], typed=params["typed"]), (obj.__wrapped__,)
        return super().reducer_override(obj)


def _travels_by_value(module_name: object) -> bool:
    if not isinstance(module_name, str):
        return False
    if module_name == "__main__":
        return True
    registered = cloudpickle.list_registry_pickle_by_value()
    return any(module_name == r or module_name.startswith(r + ".") for r in registered)


def _names_imported_by(data: bytes) -> set[str]:
    """The modules a pickle imports by name when loaded (its GLOBAL and STACK_GLOBAL opcodes)."""
    memo: dict[int, Any] = {}
    pushed: list[Any] = []
    modules = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(int(arg)))
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif op.name == "STACK_GLOBAL":
            module = pushed[-2] if len(pushed) >= 2 else None
            if isinstance(module, str):
                modules.add(module)
            pushed.append(None)
        elif op.name in ("GLOBAL", "INST"):
            modules.add(str(arg).partition(" ")[0])
            pushed.append(None)
        else:
            pushed.append(None)
    return modules


def _unimportable(module_name: str) -> bool:
    """Whether a server could not import ``module_name``: ours, a script, or a module that is not installed."""
    if is_ours(module_name) or module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    return module is not None and not is_installed_module(module)


def _export_by_value(pipeline: str, node: str, step: Step) -> tuple[bytes, frozenset[str]]:
    impl = step.impl
    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    # By value: our own package (a server need not have it), and the step's module. A module
    # that is not installed goes with its whole top-level package, so the helpers the step
    # calls in sibling modules travel with it; an installed one that imports ``pipelines``
    # goes alone, its package being in the requirements.
    chosen = [sys.modules["pipelines"]]
    if module is not None and module.__name__ != "__main__":
        top = sys.modules.get(module.__name__.partition(".")[0], module)
        chosen.append(module if is_installed_module(module) else top)
    registered = [m for m in dict.fromkeys(chosen) if m.__name__ not in cloudpickle.list_registry_pickle_by_value()]
    for m in registered:
        cloudpickle.register_pickle_by_value(m)
    try:
        buffer = io.BytesIO()
        pickler = _RecordingPickler(buffer)
        pickler.dump(impl)
        data = buffer.getvalue()
        by_name = sorted(m for m in _names_imported_by(data) if _unimportable(m))
    except Exception as exc:
        raise CompileError(
            f"pipeline {pipeline!r}: step {node!r} ({step.name!r}) cannot be exported by value with "
            f"cloudpickle: {type(exc).__name__}: {exc}; move it into an installed module, or drop the "
            "unpicklable objects it refers to (create them in initialize() instead)",
            pipeline=pipeline, step=node,
        ) from exc
    finally:
        for m in registered:
            cloudpickle.unregister_pickle_by_value(m)
    if by_name:
        raise CompileError(
            f"pipeline {pipeline!r}: step {node!r} ({step.name!r}) refers by name to something in "
            f"{', '.join(map(repr, by_name))}, which a server cannot import, and cloudpickle cannot send it "
            "by value; refer to it from a plain function or class, or move it into an installed package",
            pipeline=pipeline, step=node,
        )
    return data, frozenset(pickler.modules)
