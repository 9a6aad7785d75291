"""A digest of what a step runs: its code and the code it calls, so that a step profile
measured for one version of a step is never taken for another. Read by
:mod:`pipelines.predict.step_profiles` as part of its cache key.

It hashes bytecode, not source text: it works in notebooks and for lambdas, ignores
comments, docstrings and line numbers, and sees through the helpers a step calls.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sys
import sysconfig
import types
from typing import Any

import numpy as np

from ..step import Step

__all__ = ["code_digest"]

#: Attributes of a class that are bookkeeping, not behaviour.
_CLASS_NOISE = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__annotations__",
                          "__firstlineno__", "__static_attributes__", "__slots__"})
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)


def code_digest(step: Step) -> str:
    """A hex digest of ``step``'s code, of the code it calls, and of the declaration that shapes
    what it does (signature, parameters, device, external model).

    Followed: the step's function or class (every method), its closures and defaults, and the
    functions, classes and constants they reach by name in modules of the step's own package,
    of ``__main__``, or anywhere outside the standard library and installed packages (the
    user's own code). Installed libraries count by name only. A mutable global (a list, a
    dict) is state, not code: only its type counts, so a step that counts its calls in one
    keeps its digest. What it leaves out on purpose: options that do not change one execution
    (instance count, dynamic batching, timeout).
    """
    digest = hashlib.sha256()
    declaration = {
        "step": step.name,
        "inputs": {n: s.to_dict() for n, s in step.inputs.items()},
        "outputs": {n: s.to_dict() for n, s in step.outputs.items()},
        "parameters": dict(step.options.parameters),
        "device": step.options.device,
        "external": step.external.to_dict() if step.external is not None else None,
    }
    digest.update(json.dumps(declaration, sort_keys=True, default=repr).encode())
    if step.impl is not None:
        roots = {"__main__", str(getattr(step.impl, "__module__", "") or "").split(".")[0]}
        _Walker(digest, roots).value(step.impl)
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


class _Walker:
    """Feeds one digest with an object and everything of the user's code it reaches."""

    def __init__(self, digest: Any, roots: set[str]) -> None:
        self._digest = digest
        self._roots = roots
        self._seen: set[int] = set()
        self._users: dict[str, bool] = {}
        self._keep: list[Any] = []  # what was seen stays alive, so no id() is reused meanwhile

    def _feed(self, *parts: Any) -> None:
        for part in parts:
            self._digest.update(str(part).encode())
            self._digest.update(b"\0")

    def _first_visit(self, obj: Any) -> bool:
        if id(obj) in self._seen:
            self._feed("seen", _name(obj))
            return False
        self._seen.add(id(obj))
        self._keep.append(obj)
        return True

    def _is_users(self, module_name: str | None) -> bool:
        if not module_name:
            return False
        found = self._users.get(module_name)
        if found is None:
            found = self._users[module_name] = _users_module(module_name, self._roots)
        return found

    # ------------------------------------------------------------ what a value is

    def value(self, obj: Any) -> None:
        if isinstance(obj, _SIMPLE):
            self._feed(type(obj).__name__, repr(obj))
        elif isinstance(obj, (tuple, frozenset)):
            items = list(obj)
            self._feed(type(obj).__name__, len(items))
            for item in (sorted(items, key=repr) if isinstance(obj, frozenset) else items):
                self.value(item)
        elif isinstance(obj, np.ndarray):
            self._feed("ndarray", obj.dtype.str, obj.shape)  # weights change answers, not costs
        elif isinstance(obj, np.generic):
            self._feed("scalar", obj.dtype.str, repr(obj.item()))
        elif isinstance(obj, types.CodeType):
            self._code(obj)
        elif isinstance(obj, functools.partial):
            self._feed("partial")
            self.value(obj.func)
            self.value(tuple(obj.args))
            self.value(tuple(sorted(obj.keywords.items())))
        elif isinstance(obj, types.MethodType):
            self._feed("method")
            self.value(obj.__func__)
        elif isinstance(obj, (staticmethod, classmethod)):
            self.value(obj.__func__)
        elif isinstance(obj, property):
            for part in (obj.fget, obj.fset, obj.fdel):
                if part is not None:
                    self.value(part)
        elif isinstance(obj, types.ModuleType):
            self._feed("module", obj.__name__)
        elif isinstance(obj, types.FunctionType):
            self._function(obj)
        elif inspect.isclass(obj):
            self._class(obj)
        elif callable(obj) and self._is_users(type(obj).__module__):
            self._feed("callable")  # an object with __call__: its class, and its plain settings
            self._class(type(obj))
            for key, item in sorted(getattr(obj, "__dict__", {}).items()):
                if isinstance(item, (*_SIMPLE, tuple, frozenset, np.ndarray, np.generic)):
                    self._feed(key)
                    self.value(item)
        else:
            self._feed("object", _name(obj))

    def _function(self, fn: types.FunctionType) -> None:
        if not self._is_users(fn.__module__):
            self._feed("function", _name(fn))
            return
        if not self._first_visit(fn):
            return
        self._feed("function", fn.__qualname__)
        self._code(fn.__code__)
        self.value(fn.__defaults__ or ())
        self.value(tuple(sorted((fn.__kwdefaults__ or {}).items())))
        for cell in fn.__closure__ or ():
            try:
                self.value(cell.cell_contents)
            except ValueError:  # an empty cell
                self._feed("empty cell")
        self._globals(fn.__code__, fn.__globals__)

    def _class(self, cls: type) -> None:
        if not self._is_users(cls.__module__):
            self._feed("class", _name(cls))
            return
        if not self._first_visit(cls):
            return
        self._feed("class", cls.__qualname__)
        for base in cls.__mro__[1:]:
            self.value(base)
        for key, item in sorted(vars(cls).items()):
            if key in _CLASS_NOISE:
                continue
            self._feed(key)
            self.value(item)

    def _code(self, code: types.CodeType) -> None:
        self._feed("code", code.co_code.hex(), code.co_names, code.co_varnames, code.co_flags)
        for const in code.co_consts:
            self.value(const)

    def _globals(self, code: types.CodeType, namespace: dict[str, Any]) -> None:
        """The names a function's code reads: the user's functions, classes and constants."""
        names = _names(code)
        for name in sorted(names):
            if name not in namespace:
                continue  # a builtin, an attribute, or a local of a nested scope
            item = namespace[name]
            if isinstance(item, types.ModuleType):
                if self._is_users(item.__name__):  # module.helper: the helpers it names
                    for attr in sorted(names):
                        inner = getattr(item, attr, None)
                        if isinstance(inner, (types.FunctionType, type)):
                            self._feed(name, attr)
                            self.value(inner)
                continue
            self._feed("global", name)
            if isinstance(item, (*_SIMPLE, tuple, frozenset, np.ndarray, np.generic, types.FunctionType, type,
                                 functools.partial)):
                self.value(item)
            else:
                self._feed(type(item).__qualname__)


def _users_module(module_name: str, roots: set[str]) -> bool:
    if module_name.split(".")[0] in roots:
        return True
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if not path:
        return False  # built into the interpreter
    return not os.path.realpath(path).startswith(_installed_dirs())


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}"
