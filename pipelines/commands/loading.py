"""``MODULE:ATTR`` -> the :class:`~pipelines.Pipeline` it names: how the command line and
the benchmark find a user's pipeline (a module path or a ``.py`` file, then an attribute).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

from ..core.graph import Graph
from ..core.step import Step
from ..errors import PipelinesError

__all__ = ["load_pipeline", "load_pipeline_and_module"]


def load_pipeline(spec: str) -> Graph:
    """Import ``MODULE:ATTR`` and return the :class:`Pipeline` it names.

    ``ATTR`` is a Pipeline or a function that takes no arguments and returns one.
    """
    return load_pipeline_and_module(spec)[0]


def load_pipeline_and_module(spec: str) -> tuple[Graph, ModuleType]:
    """The pipeline ``spec`` names and the module it came from (the benchmark reads its samples)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise PipelinesError(f"{spec!r} is not MODULE:ATTR; expected e.g. pipelines.examples.yolov5:pipeline")
    module = _import(spec, module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise PipelinesError(
            f"{spec!r}: module {module_name!r} has no attribute {attr!r}; pipelines there: {_pipelines_in(module)}"
        ) from None
    if isinstance(obj, Step):
        # A Step is callable too: calling it would run the step, not build a pipeline.
        raise PipelinesError(
            f"{spec!r} is the step {obj.name!r}, not a Pipeline; name the Pipeline that uses it "
            f"(pipelines in {module_name!r}: {_pipelines_in(module)})"
        )
    if callable(obj) and not isinstance(obj, Graph):
        try:
            inspect.signature(obj).bind()
        except TypeError as exc:  # it needs arguments the command line cannot give
            raise PipelinesError(
                f"{spec!r} is a callable that cannot be called without arguments ({exc}); name a Pipeline, "
                f"or a function that takes none and returns one (pipelines in {module_name!r}: {_pipelines_in(module)})"
            ) from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        obj = obj()
    if not isinstance(obj, Graph):
        raise PipelinesError(
            f"{spec!r} is a {type(obj).__name__}, not a Pipeline (pipelines in {module_name!r}: {_pipelines_in(module)})"
        )
    return obj, module


def _line_in(exc: BaseException, path: Path) -> str:
    """`` (line N)`` of the innermost frame in ``path`` that ``exc`` passed through, or ``""``."""
    line = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if Path(frame.f_code.co_filename) == path:
            line = lineno
    return f" (line {line})" if line is not None else ""


def _pipelines_in(module: ModuleType) -> list[str] | str:
    return [n for n, v in vars(module).items() if isinstance(v, Graph)] or "none"


def _import(spec: str, module_name: str) -> ModuleType:
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise PipelinesError(f"{spec!r}: file {str(path)!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module  # so its steps pickle by reference to this module while it runs
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # its modules beside it import as under `python file.py`, and travel with it
            sys.path.insert(0, folder)
        try:
            mod_spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[path.stem]
            if not isinstance(exc, (ImportError, SyntaxError)):
                raise
            # the file's own imports or text: the user's to fix
            where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else _line_in(exc, path)
            raise PipelinesError(f"{spec!r}: importing {str(path)!r} failed{where}: {type(exc).__name__}: {exc}") from None
        return module
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except (ImportError, SyntaxError) as exc:
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise PipelinesError(f"{spec!r}: cannot import module {module_name!r}{where} ({type(exc).__name__}: {exc})") from None
    finally:
        sys.path.remove(os.getcwd())
