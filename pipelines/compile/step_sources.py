"""A step that travels as its own source file: the ``.py`` file its code lives in, and the
single-file modules beside it that the file imports, copied into ``1/steps_src/`` and imported
there by the step model (``serving/sources.py``), with no pickle and no Python-version pin.

:func:`source_files` decides whether a step's file can travel so, or says why not (the step
then travels by value, :mod:`.step_pickle`). A file travels when a server can import it:

- it is a top-level module with a ``.py`` file (a script, or ``pipelines compile file.py:p``),
  not a module of a package, and the step is found in it by its qualified name;
- what runs when it is imported needs only the standard library, installed distributions
  (they go into ``requirements.txt``), modules beside it (copied too, under the same rules),
  and the public names of ``pipelines`` and of its helpers' package ``pipelines.steps``
  (``from pipelines import step, Pipeline…``, ``from pipelines.steps import onnx_model``),
  which the server stands in for with declarations that do nothing;
- it does no work when imported, outside its ``if __name__ == "__main__":`` block
  (compiling, running or writing a pipeline, reading ``sys.argv``): a server would do it again;
- the step's own code (and the functions, classes and values of these files it reaches) uses
  nothing of ``pipelines``.

The library's own steps (``pipelines.steps``) travel the same way, as their module and the
modules of that package it imports (:func:`_library_files`).
"""

from __future__ import annotations

import ast
import dis
import functools
import hashlib
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .. import serving
from ..core.step import Step
from ..serving.sources import SOURCE_DIR
from .requirements import is_installed_module, top_level_distribution

__all__ = ["SOURCE_DIR", "SourceFiles", "StepByValueWarning", "is_ours", "source_files"]

_PACKAGE = "pipelines"


class StepByValueWarning(UserWarning):
    """A step travels by value (``step.pkl``), pinned to this Python, since its code has no file a server can import."""


def is_ours(name: object) -> bool:
    """Whether ``name`` is ``pipelines`` or one of its modules."""
    return isinstance(name, str) and (name == _PACKAGE or name.startswith(_PACKAGE + "."))


#: The library's helpers for declaring steps: a file may import their public names, as it may
#: ``pipelines``' own, and a server stands in for them (``serving/sources.py``).
_HELPERS = _PACKAGE + ".steps"


def public_names(module_name: str) -> frozenset[str] | None:
    """The names a step's file may import from ``module_name`` (``pipelines``, ``pipelines.steps``
    or one of its public modules), for a server to stand in for; ``None``: none, it is internal."""
    if module_name != _PACKAGE and module_name != _HELPERS and not (
        module_name.startswith(_HELPERS + ".") and not module_name.rpartition(".")[2].startswith("_")
    ):
        return None
    module = sys.modules.get(module_name)
    if module is None:
        return None
    exported = getattr(module, "__all__", None)
    names = exported if exported is not None else [n for n in vars(module) if not n.startswith("_")]
    return frozenset(names)


@dataclass(frozen=True)
class SourceFiles:
    """The files a step travels in: ``main`` (the step's file) and the modules beside it, by path in ``1/``.

    ``module`` is the name ``main`` is imported under on the server; ``imports``, the
    modules the files import, whose distributions the server needs.
    """

    module: str
    qualname: str
    main: str
    files: Mapping[str, bytes]
    imports: frozenset[str] = field(default_factory=frozenset)

    def impl(self) -> dict[str, Any]:
        """The ``impl`` record of ``step.json`` (``serving.sources.load_source`` reads it)."""
        return {
            "path": self.main,
            "module": self.module,
            "qualname": self.qualname,
            "sha256": {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(self.files.items())},
        }


def source_files(step: Step) -> tuple[SourceFiles | None, str | None]:
    """The files ``step`` can travel in, or ``None`` and why not (``None`` for ``pipelines``' own
    steps other than those of ``pipelines.steps``, which travel as their modules)."""
    impl = step.impl
    module_name = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if is_ours(module_name):
        return (_library_files(module, qualname, impl), None) if module_name.startswith(_HELPERS + ".") else (None, None)
    if module is None or not isinstance(qualname, str):
        return None, "its code is an object, not a function or a class defined in a file"
    file = getattr(module, "__file__", None)
    if not file or not str(file).endswith(".py"):
        where = ("__main__, which has no .py file (typed interactively, in a notebook cell or with python -c)"
                 if module_name == "__main__" else f"the module {module_name!r}, which has no .py file")
        return None, f"it was defined in {where}; define it in a .py file to serve it on any Python"
    path = Path(file).resolve()
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.parent:
        return None, (f"{path.name} is a module of the package {spec.parent!r}, which is not installed "
                      "(pip install it, and the step travels by reference)")
    if "<locals>" in qualname:
        return None, f"it is defined inside a function ({qualname}); define it at the top level of {path.name}"
    home = serving.code_home(impl)
    if home is None or Path(home).resolve() != path:
        return None, f"its code is not written in {path.name}"
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (found is impl or (isinstance(found, Step) and found.impl is impl)):
        return None, f"{path.name} has no {qualname!r} that is the step's code (it was renamed or redefined)"
    name = path.stem.replace(".", "_")
    clash = _clash(name)
    if clash:
        return None, f"{path.name} is named like {clash}, which a server would import instead"
    return _gather(path, name, qualname, impl)


def _gather(path: Path, name: str, qualname: str, impl: Any) -> tuple[SourceFiles | None, str | None]:
    """Every file that travels with ``path``, and the modules they import; or why they cannot travel."""
    folder = path.parent
    files: dict[Path, bytes] = {}
    imports: set[str] = set()
    todo = [path]
    while todo:
        while todo:
            file = todo.pop()
            if file in files:
                continue
            try:
                data, tree = _parsed(file)
            except (OSError, SyntaxError, ValueError) as exc:  # gone or changed since it was imported
                return None, f"{file.name} could not be read again ({type(exc).__name__}: {exc})"
            files[file] = data
            scan = _TopLevel(file.name, _globals_of(file))
            scan.visit(tree)
            if scan.problem:
                return None, scan.problem
            if scan.work:
                return None, (f"{file.name} does its work when imported ({scan.work[0]}, outside "
                              "`if __name__ == \"__main__\":`), which a server would do again: move that work "
                              "under the guard and the step travels as its file")
            for module, required in scan.imports:
                kind = _kind(module, folder)
                if kind == "beside":
                    todo.append(folder / f"{module}.py")
                elif kind not in (None, "pipelines") and required:
                    return None, f"{file.name} imports {module!r}, {kind}, so the file cannot travel as it is"
                imports.add(module)
        # The modules the step's code imports when it runs: those beside it travel too.
        problem, reached = _reached(impl, set(files))
        if problem:
            return None, problem
        for module, level in reached:
            kind = "a relative import" if level else _kind(module, folder)
            if kind == "beside":
                todo.append(folder / f"{module}.py")
            elif kind == "pipelines":
                return None, "the step's code imports pipelines when it runs, which a server need not have"
            elif kind is not None:
                return None, f"the step's code imports {module!r} when it runs, {kind}"
            imports.add(module)
        todo = [f for f in todo if f not in files]
    copies = {f"{SOURCE_DIR}/{name + '.py' if file == path else file.name}": data for file, data in files.items()}
    return SourceFiles(name, qualname, f"{SOURCE_DIR}/{name}.py", copies, frozenset(imports)), None


def _library_files(module: Any, qualname: Any, impl: Any) -> SourceFiles | None:
    """A step of the library's own ``pipelines.steps`` as its module and the modules of that package it
    imports, copied to ``steps_src/pipelines/steps/``: the server imports them under their own names,
    below stand-ins of ``pipelines`` (``serving/sources.py``), as it imports a user's file. ``None``:
    the step is not found in its module by its name (it travels by value)."""
    file = getattr(module, "__file__", None)
    if module is None or not file or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (found is impl or (isinstance(found, Step) and found.impl is impl)):
        return None
    folder = Path(file).resolve().parent
    files: dict[str, bytes] = {}
    imports: set[str] = set()
    todo = [Path(file).resolve().name]
    while todo:
        name = todo.pop()
        if name in files:
            continue
        data, tree = _parsed(folder / name)
        files[name] = data
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # `from .nms import ...`, `from . import nms`
                todo += [f"{node.module}.py"] if node.module else [f"{a.name}.py" for a in node.names]
        # What runs on import needs its distribution on the server; a function's own import
        # (onnxruntime in a stand-in's initialize) is the user's to install where it runs.
        scan = _TopLevel(name, {})
        scan.visit(tree)
        imports.update(module for module, required in scan.imports if required)
    home = f"{SOURCE_DIR}/{_HELPERS.replace('.', '/')}"
    return SourceFiles(module.__name__, qualname, f"{home}/{Path(file).name}",
                       {f"{home}/{name}": data for name, data in sorted(files.items())},
                       frozenset(imports - {_PACKAGE, "__future__"}))


@functools.lru_cache(maxsize=64)
def _parsed_at(path: Path, stamp: tuple[int, int]) -> tuple[bytes, ast.Module]:
    data = path.read_bytes()
    return data, ast.parse(data, filename=str(path))


def _parsed(path: Path) -> tuple[bytes, ast.Module]:
    stat = path.stat()
    return _parsed_at(path, (stat.st_mtime_ns, stat.st_size))


def _clash(name: str) -> str | None:
    """What a server would import for the module ``name`` instead of the copy beside the step, if anything."""
    if name == _PACKAGE or name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        return f"the standard library's {name!r}" if name != _PACKAGE else "pipelines itself"
    dist = top_level_distribution(name)
    return f"the module {name!r} of the installed distribution {dist!r}" if dist else None


def _kind(module: str, folder: Path) -> str | None:
    """How a server gets the top-level module ``module`` that a file in ``folder`` imports.

    ``None``: it is the standard library or installed; ``"beside"``: a module beside the
    file, copied with it; ``"pipelines"``: the stand-in; else why a server cannot import it.
    """
    if module == "__future__":
        return None
    if module == _PACKAGE:
        return "pipelines"
    loaded = sys.modules.get(module)
    beside = folder / f"{module}.py"
    file = getattr(loaded, "__file__", None) if loaded is not None else None
    if (loaded is None and beside.is_file()) or (file and Path(file).resolve() == beside.resolve()):
        clash = _clash(module)
        return "beside" if clash is None else f"a module beside it named like {clash}"
    if (folder / module).is_dir() and (loaded is None or (file and Path(file).resolve().parent.parent == folder)):
        return "a package beside it: only single-file modules beside a file travel with it"
    if loaded is None:
        if module in sys.builtin_module_names or module in getattr(sys, "stdlib_module_names", ()):
            return None
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return "which is not installed here"
        loaded = SimpleNamespace(__name__=module, __file__=spec.origin if spec.has_location else None)
    if is_installed_module(loaded):  # type: ignore[arg-type]
        return None
    where = getattr(loaded, "__file__", None)
    return f"from {where}, which is neither installed nor beside it" if where else "which is not installed"


def _globals_of(file: Path) -> Mapping[str, Any]:
    """The globals of the module imported from ``file`` here, if one was."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and str(path).endswith(file.name) and Path(path).resolve() == file:
            return vars(module)
    return {}


#: What a script does rather than declares: run on import, it would run again in every stub.
_WORK = frozenset({"compile", "compile_pipeline", "write", "run", "serve", "bench", "predict", "advise", "compare",
                   "calibrate"})


class _TopLevel(ast.NodeVisitor):
    """What runs when a file is imported: its imports (and whether each is required), what it
    asks of ``pipelines``, and the work it does (``work``: compiling or running a pipeline,
    reading ``sys.argv``). Function bodies and the ``__main__`` block do not run then.

    ``scope``, the globals of the file as imported here, tells a pipeline from other objects.
    """

    def __init__(self, filename: str, scope: Mapping[str, Any]) -> None:
        self.filename = filename
        self.scope = scope
        self.imports: list[tuple[str, bool]] = []
        self.problem: str | None = None
        self.work: list[str] = []
        self._optional = 0
        self._aliases: dict[str, str] = {}  # a name the file binds to a module of pipelines: that module

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "parse_args" or (name in _WORK and self._pipelines_object(func)):
            self.work.append(f"{ast.unparse(func)}(...) at line {node.lineno}")
        self.generic_visit(node)

    def _pipelines_object(self, expr: ast.expr) -> bool:
        while isinstance(expr, (ast.Attribute, ast.Call, ast.Subscript)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        if not isinstance(expr, ast.Name):
            return False
        if expr.id in self._aliases:
            return True
        value = self.scope.get(expr.id)
        if value is None:
            return False
        if isinstance(value, types.ModuleType):
            return is_ours(value.__name__)
        return is_ours(value.__module__ if isinstance(value, (type, types.FunctionType)) else type(value).__module__)

    def _refuse(self, what: str) -> None:
        self.problem = self.problem or (f"{self.filename} {what}; on a server, where pipelines need not be, "
                                        "only the public names of pipelines and pipelines.steps "
                                        "(`from pipelines import ...`, `from pipelines.steps import ...`) "
                                        "are stood in for")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.partition(".")[0]
            if top == _PACKAGE:
                if public_names(alias.name) is None:
                    self._refuse(f"imports {alias.name}")
                # `import pipelines.steps` binds `pipelines`; `import pipelines.steps as s`, the module.
                self._aliases[alias.asname or _PACKAGE] = alias.name if alias.asname else _PACKAGE
            self.imports.append((top, not self._optional))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.problem = self.problem or f"{self.filename} has a relative import (from {'.' * node.level})"
            return
        top = (node.module or "").partition(".")[0]
        if node.module == "sys" and any(alias.name == "argv" for alias in node.names):
            self.work.append(f"sys.argv at line {node.lineno}")
        if top == _PACKAGE:
            public = public_names(node.module or "")
            if public is None:
                self._refuse(f"imports from {node.module}")
            else:
                for alias in node.names:
                    if alias.name not in public and public_names(f"{node.module}.{alias.name}") is None:
                        self._refuse(f"imports {alias.name!r} from {node.module}")
        self.imports.append((top, not self._optional))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr == "argv":
            self.work.append(f"sys.argv at line {node.lineno}")
        chain = _dotted(node)
        if chain is not None and chain[0] in self._aliases:
            # The longest public module the chain names, then one public name of it.
            module, rest = self._aliases[chain[0]], list(chain[1:])
            while rest and public_names(f"{module}.{rest[0]}") is not None:
                module = f"{module}.{rest.pop(0)}"
            if rest and rest[0] not in (public_names(module) or ()):
                self._refuse(f"uses {module}.{rest[0]}")
            return
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if _is_main_guard(node.test) or _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_catches_import_errors(h) for h in node.handlers)
        self._optional += optional
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= optional
        self._optional += 1  # a fallback, run only when the body failed
        for handler in node.handlers:
            self.visit(handler)
        self._optional -= 1
        for stmt in [*node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def _definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators, defaults and annotations run when the function is defined; the body does not.
        for expr in [*getattr(node, "decorator_list", ()), *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(expr)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _definition


def _dotted(node: ast.expr) -> tuple[str, ...] | None:
    """``a.b.c`` as ``("a", "b", "c")``; ``None`` for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, *reversed(parts)) if isinstance(node, ast.Name) else None


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception",
                                                    "BaseException") for n in names)


# ------------------------------------------------------------------ what the step's code reaches

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


def _reached(impl: Any, homes: set[Path]) -> tuple[str | None, list[tuple[str, int]]]:
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
