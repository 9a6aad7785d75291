"""What a step's code reaches through the files that travel with it, as cloudpickle would send
it: a use of ``pipelines`` (the step then cannot travel as its file), and the modules its
functions import when they run (those beside it travel too). :mod:`.step_sources` asks it.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .source_top_level import is_ours

__all__ = ["reach_of"]

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_MANY = 1000  # items of a container looked into: a big array of numbers holds no code


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names(code: types.CodeType) -> tuple[set[str], set[str], list[tuple[str, int]]]:
    """The globals a code object reads, the attributes it reads, and the modules it imports (with their level)."""
    globs, attrs, imports = set(), set(), []
    for c in _codes(code):
        before: list[dis.Instruction] = []
        for ins in dis.get_instructions(c):
            if ins.opname in _GLOBAL_OPS:
                globs.add(ins.argval)
            elif ins.opname in _ATTR_OPS:
                attrs.add(ins.argval)
            elif ins.opname == "IMPORT_NAME":
                # LOAD_CONST level, LOAD_CONST fromlist, IMPORT_NAME name
                level = before[-2].argval if len(before) >= 2 and before[-2].opname == "LOAD_CONST" else 0
                imports.append((ins.argval.partition(".")[0], level if isinstance(level, int) else 0))
            before = [*before[-1:], ins]
    return globs, attrs, imports


def _file_of(obj: Any) -> Path | None:
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    file = getattr(module, "__file__", None) if module is not None else None
    return Path(file).resolve() if file else None


def reach_of(impl: Any, homes: set[Path]) -> tuple[str | None, list[tuple[str, int]]]:
    """What the step's code reaches through the files that travel: a use of ``pipelines`` (why it
    cannot travel so), and the modules its functions import when they run.

    It follows what cloudpickle would send: each function's globals, defaults and closure,
    each class's attributes and bases, the items of containers, the attributes read from a
    module of these files; code of installed libraries is not looked into.
    """
    homes = {h.resolve() for h in homes}
    stack: list[tuple[str, Any]] = [(getattr(impl, "__qualname__", "the step"), impl)]
    seen: set[int] = set()
    imports: list[tuple[str, int]] = []
    while stack:
        label, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            if is_ours(obj.__name__):
                return f"the step's code uses {label} (the module {obj.__name__}), which a server need not have", []
            continue
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            owner = getattr(obj, "__module__", None)
        else:
            owner = type(obj).__module__
        if is_ours(owner):
            what = obj.__name__ if isinstance(obj, type) else f"a {type(obj).__name__}"
            return (f"the step's code uses {label} ({what} of pipelines), which a server need not have; "
                    "the step travels by value, which carries it"), []
        if isinstance(obj, types.FunctionType):
            if Path(obj.__code__.co_filename).resolve() not in homes:
                continue
            globs, attrs, found = _names(obj.__code__)
            imports += found
            scope = obj.__globals__
            for name in globs:
                if name in scope:
                    value = scope[name]
                    stack.append((name, value))
                    if isinstance(value, types.ModuleType) and _file_of(value) in homes:
                        stack += [(f"{name}.{a}", vars(value)[a]) for a in attrs if a in vars(value)]
            stack += [(label, v) for v in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values())]
            for cell in obj.__closure__ or ():
                try:
                    stack.append((label, cell.cell_contents))
                except ValueError:  # an empty cell
                    pass
        elif isinstance(obj, type):
            if _file_of(obj) in homes:
                stack += [(f"{obj.__qualname__}.{k}", v) for k, v in vars(obj).items()]
                stack += [(b.__qualname__, b) for b in obj.__bases__]
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append((label, obj.__func__))
        elif isinstance(obj, property):
            stack += [(label, f) for f in (obj.fget, obj.fset, obj.fdel) if f is not None]
        elif isinstance(obj, functools.partial):
            stack += [(label, v) for v in (obj.func, *obj.args, *obj.keywords.values())]
        elif isinstance(obj, functools._lru_cache_wrapper):
            stack.append((label, obj.__wrapped__))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(label, v) for v in list(obj)[:_MANY]]
        elif isinstance(obj, dict):
            stack += [(label, v) for v in [*obj.keys(), *obj.values()][:_MANY]]
        elif _file_of(type(obj)) in homes:
            stack.append((label, type(obj)))
            stack += [(label, v) for v in getattr(obj, "__dict__", {}).values()]
    return None, imports
