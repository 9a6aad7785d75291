"""A digest of what a step runs, its code and the code it calls, for the step profile cache's key:
a profile measured for one version of a step is never taken for another. It hashes bytecode, not
source text: it works in notebooks and for lambdas, and ignores comments and line numbers.
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

from ..core.step import Step

__all__ = ["code_digest"]

#: Attributes of a class that are bookkeeping, not behaviour.
_CLASS_NOISE = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__annotations__",
                          "__firstlineno__", "__static_attributes__", "__slots__"})
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_PLAIN = (*_SIMPLE, tuple, frozenset, np.ndarray, np.generic)  # values: data, not code


def code_digest(step: Step) -> str:
    """A hex digest of ``step``'s code, of what it reaches by name in the user's code (its package, ``__main__``,
    anything not installed), and of the declaration that shapes what it does (signature, parameters, device, external
    model; not the options that do not change one execution, such as instance count, batching, timeout). A mutable
    global (a list, a dict) is state, not code: only its type counts, so a step that counts its calls in one keeps its
    digest."""
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
        self._seen: dict[int, Any] = {}  # what was seen stays alive, so no id() is reused meanwhile
        self._is_users = functools.cache(lambda name: bool(name) and _users_module(name, roots))

    def _feed(self, *parts: Any) -> None:
        for part in parts:
            self._digest.update(str(part).encode() + b"\0")

    def _enter(self, kind: str, obj: Any) -> bool:
        """Whether to follow a function or class: the user's, not seen yet (else its name is fed)."""
        if not self._is_users(obj.__module__):
            self._feed(kind, _name(obj))
            return False
        if id(obj) in self._seen:
            self._feed("seen", _name(obj))
            return False
        self._seen[id(obj)] = obj
        self._feed(kind, obj.__qualname__)
        return True

    def value(self, obj: Any) -> None:
        if isinstance(obj, _SIMPLE):
            self._feed(type(obj).__name__, repr(obj))
        elif isinstance(obj, (tuple, frozenset)):
            self._feed(type(obj).__name__, len(obj))
            for item in (sorted(obj, key=repr) if isinstance(obj, frozenset) else obj):
                self.value(item)
        elif isinstance(obj, np.ndarray):
            self._feed("ndarray", obj.dtype.str, obj.shape)  # weights change answers, not costs
        elif isinstance(obj, np.generic):
            self._feed("scalar", obj.dtype.str, repr(obj.item()))
        elif isinstance(obj, types.CodeType):
            self._code(obj)
        elif isinstance(obj, functools.partial):
            self._feed("partial")
            for part in (obj.func, tuple(obj.args), tuple(sorted(obj.keywords.items()))):
                self.value(part)
        elif isinstance(obj, types.MethodType):
            self._feed("method")
            self.value(obj.__func__)
        elif isinstance(obj, (staticmethod, classmethod)):
            self.value(obj.__func__)
        elif isinstance(obj, property):
            for part in filter(None, (obj.fget, obj.fset, obj.fdel)):
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
                if isinstance(item, _PLAIN):
                    self._feed(key)
                    self.value(item)
        else:
            self._feed("object", _name(obj))

    def _function(self, fn: types.FunctionType) -> None:
        if not self._enter("function", fn):
            return
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
        if not self._enter("class", cls):
            return
        for base in cls.__mro__[1:]:
            self.value(base)
        for key in sorted(vars(cls).keys() - _CLASS_NOISE):
            self._feed(key)
            self.value(vars(cls)[key])

    def _code(self, code: types.CodeType) -> None:
        self._feed("code", code.co_code.hex(), code.co_names, code.co_varnames, code.co_flags)
        for const in code.co_consts:
            self.value(const)

    def _globals(self, code: types.CodeType, namespace: dict[str, Any]) -> None:
        """The names a function's code reads: the user's functions, classes and constants."""
        names = _names(code)
        for name in sorted(names & namespace.keys()):  # not a builtin, an attribute, or a nested scope's local
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
            if isinstance(item, (*_PLAIN, types.FunctionType, type, functools.partial)):
                self.value(item)
            else:
                self._feed(type(item).__qualname__)


def _users_module(module_name: str, roots: set[str]) -> bool:
    if module_name.split(".")[0] in roots:
        return True
    path = getattr(sys.modules.get(module_name), "__file__", None)  # none: built into the interpreter
    return bool(path) and not os.path.realpath(path).startswith(_installed_dirs())


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it read."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}"
