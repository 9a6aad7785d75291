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
import functools
import hashlib
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .. import serving
from ..core.step import Step
from ..serving.sources import SOURCE_DIR
from .requirements import is_installed_module, top_level_distribution
from .source_reach import reach_of
from .source_top_level import HELPERS, PACKAGE, TopLevel, is_ours

__all__ = ["SOURCE_DIR", "SourceFiles", "StepByValueWarning", "is_ours", "source_files"]


class StepByValueWarning(UserWarning):
    """A step travels by value (``step.pkl``), pinned to this Python, since its code has no file a server can import."""


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
        return (_library_files(module, qualname, impl), None) if module_name.startswith(HELPERS + ".") else (None, None)
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
            scan = TopLevel(file.name, _globals_of(file))
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
        problem, reached = reach_of(impl, set(files))
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
        scan = TopLevel(name, {})
        scan.visit(tree)
        imports.update(module for module, required in scan.imports if required)
    home = f"{SOURCE_DIR}/{HELPERS.replace('.', '/')}"
    return SourceFiles(module.__name__, qualname, f"{home}/{Path(file).name}",
                       {f"{home}/{name}": data for name, data in sorted(files.items())},
                       frozenset(imports - {PACKAGE, "__future__"}))


@functools.lru_cache(maxsize=64)
def _parsed_at(path: Path, stamp: tuple[int, int]) -> tuple[bytes, ast.Module]:
    data = path.read_bytes()
    return data, ast.parse(data, filename=str(path))


def _parsed(path: Path) -> tuple[bytes, ast.Module]:
    stat = path.stat()
    return _parsed_at(path, (stat.st_mtime_ns, stat.st_size))


def _clash(name: str) -> str | None:
    """What a server would import for the module ``name`` instead of the copy beside the step, if anything."""
    if name == PACKAGE or name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        return f"the standard library's {name!r}" if name != PACKAGE else "pipelines itself"
    dist = top_level_distribution(name)
    return f"the module {name!r} of the installed distribution {dist!r}" if dist else None


def _kind(module: str, folder: Path) -> str | None:
    """How a server gets the top-level module ``module`` that a file in ``folder`` imports.

    ``None``: it is the standard library or installed; ``"beside"``: a module beside the
    file, copied with it; ``"pipelines"``: the stand-in; else why a server cannot import it.
    """
    if module == "__future__":
        return None
    if module == PACKAGE:
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
