"""A step's own source file, imported inside a Triton stub: the file and the modules beside it
that the compiler copied into ``steps_src/``, with ``pipelines`` (and its public modules, such as
``pipelines.steps``) stood in for, since a server need not have the package (docs/compiling.md,
"How a step reaches the server").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SOURCE_DIR", "load_source"]

#: The folder of a model's version folder (or of a fused model's step folder) that holds the files.
SOURCE_DIR = "steps_src"
_PACKAGE = "pipelines"

#: The files this process imported, by module name: their digest and the module. Two steps of
#: one file (in a fused model) share it, as they share it where the script runs.
_LOADED: dict[str, tuple[str, types.ModuleType]] = {}


def load_source(impl: Mapping[str, Any], directory: str) -> Any:
    """The step's function or class from its ``impl`` record (``step.json``): ``path``, the file
    it lives in (relative to ``directory``), imported as the module ``module``, and ``qualname``
    in it; ``sha256`` holds the digest of every copied file, each checked first.

    The file is imported under its own name, not ``__main__``, so a script's
    ``if __name__ == "__main__":`` block does not run; the rest of its top level does.
    A failure is a ``RuntimeError`` naming the file (see ``serving.load_impl``).
    """
    digests = impl["sha256"]
    for rel, digest in sorted(digests.items()):
        path = os.path.join(directory, rel)
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                raise RuntimeError(
                    f"{path} does not match the sha256 recorded in step.json; it was changed or replaced "
                    "after compilation: compile the pipeline again"
                )
    path = os.path.join(directory, impl["path"])
    module = _imported(path, impl["module"], digests[impl["path"]])
    obj: Any = module
    for part in impl["qualname"].split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RuntimeError(
                f"{os.path.basename(path)} has no {impl['qualname']!r} once imported on the server (its "
                "definition runs only under `if __name__ == '__main__':`, or depends on something the "
                "server does not have): define the step at the top level of the file"
            ) from None
    return obj


def _imported(path: str, name: str, digest: str) -> types.ModuleType:
    loaded = _LOADED.get(name)
    if loaded is not None:
        if loaded[0] == digest:
            return loaded[1]
        raise RuntimeError(
            f"{path}: another file named {os.path.basename(path)}, with other contents, was imported in this "
            "process already (two steps of one fused model come from different files of one name): rename one"
        )
    folder = os.path.dirname(path)
    ours = name.startswith(_PACKAGE + ".")
    carried = None
    if ours:
        # A module of the library's own steps (``pipelines.steps.nms``), copied with the modules of
        # its package that it imports: imported under its own name, below the stand-in package.
        carried = folder
        for _ in range(name.count(".") - 1):
            carried = os.path.dirname(carried)
    elif folder not in sys.path:
        sys.path.insert(0, folder)  # the modules beside it, imported by their own names as beside the script
    key = name
    try:
        with _pipelines_stood_in(carried):
            # In a stub the name is free (the compiler refuses names a server imports); a process
            # that already holds a module of that name (a test) gets the copy under another one.
            if not ours and key in sys.modules:
                key = f"_pipelines_source_{name}"
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(key, None)
        raise RuntimeError(
            f"importing {os.path.basename(path)}, the step's source file, failed on the server: "
            f"{type(exc).__name__}: {exc}; keep the script's own work under `if __name__ == '__main__':`"
        ) from exc
    _LOADED[name] = (digest, module)
    return module


@contextlib.contextmanager
def _pipelines_stood_in(carried: str | None = None) -> Iterator[None]:
    """``import pipelines`` (and ``import pipelines.steps``, ``from pipelines.steps.nms import nms``…)
    gives stand-ins while the file (and what it imports) runs; ``carried``, a folder holding copies
    of some of the package's own modules, gives those modules instead.

    In a stub, where nothing imported the package, the stand-in stays, for the imports the
    step's modules make later. In a process that has the real package (a test), it comes back.
    """
    ours = [k for k in sys.modules if k == _PACKAGE or k.startswith(_PACKAGE + ".")]
    real = {k: sys.modules.pop(k) for k in ours} if not isinstance(sys.modules.get(_PACKAGE), _StandIn) else {}
    if _PACKAGE not in sys.modules:
        sys.modules[_PACKAGE] = _FINDER.create_module(importlib.machinery.ModuleSpec(_PACKAGE, _FINDER,
                                                                                     is_package=True))
    if carried is not None:
        # Each step of a fused model carries its own copies: every stood-in package finds its
        # modules in all of them (the same files, checked against one digest each).
        for name, module in list(sys.modules.items()):
            if isinstance(module, _StandIn) and (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
                folder = os.path.join(carried, *name.split(".")[1:])
                if os.path.isdir(folder) and folder not in module.__path__:
                    module.__path__.append(folder)
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    try:
        yield
    finally:
        if real:
            for k in [k for k in sys.modules if k == _PACKAGE or k.startswith(_PACKAGE + ".")]:
                del sys.modules[k]
            sys.modules.update(real)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StandInFinder)]


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``pipelines.<module>`` while ``pipelines`` is the stand-in: another stand-in, so that a
    file that declares with the library's helpers (``from pipelines.steps import onnx_model``)
    imports on a server that has no package. The compiler lets only public modules' names through."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not (fullname.startswith(_PACKAGE + ".") and isinstance(sys.modules.get(_PACKAGE), _StandIn)):
            return None
        # A module the compiler copied (a library step's, and those it imports) is the real one;
        # its packages stay stand-ins, so that only what was copied runs.
        found = importlib.machinery.PathFinder.find_spec(fullname, path) if path else None
        if found is not None and found.submodule_search_locations is None:
            return found
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        spec.submodule_search_locations = list(found.submodule_search_locations) if found is not None else []
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__spec__ = spec  # find_spec() asks every module for one
        module.__path__ = list(spec.submodule_search_locations or [])  # a package: its modules are found here
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _StandInFinder()


def _step(impl: Any = None, **_options: Any) -> Any:
    """``pipelines.step`` on a server: the function or class itself, which the model calls."""
    return impl if impl is not None else _same


def _same(obj: Any) -> Any:
    return obj


class _StandIn(types.ModuleType):
    """``pipelines`` (or one of its modules) on a server: ``pipelines.step`` hands back what it
    decorates; every other name is inert.

    The compiler lets a file travel this way only when it imports nothing but the public names
    of ``pipelines`` and ``pipelines.steps`` and the step's code uses none of them (else the
    step goes by value).
    """

    __all__: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "step" and self.__name__ in (_PACKAGE, f"{_PACKAGE}.core.step"):
            return _step
        if attr.endswith("Error"):  # the library's copied steps raise and catch them
            return _error_class(attr)
        return _Inert(f"{self.__name__}.{attr}")


@functools.cache
def _error_class(name: str) -> type[Exception]:
    """One of ``pipelines``' errors on a server: an exception of the same name, which says so in its type."""
    return type(name, (RuntimeError,), {"__module__": _PACKAGE})


def _refused(self: _Inert, *_: Any) -> Any:
    raise RuntimeError(
        f"{self._name} was used as a value while the step's source file was imported on the server, where "
        "pipelines' names are stand-ins that do nothing (a server need not have the package); move that "
        "code under `if __name__ == '__main__':` or into a function"
    )


class _Inert:
    """A ``pipelines`` declaration on a server: a pipeline built at a file's top level builds nothing.

    It takes calls, attributes, items, ``with`` and the operators of conditions; used as a
    value (iterated, counted, tested) it raises, rather than let the file compute with nothing.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"<{self._name}: a stand-in on this server>"

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert(f"{self._name}(...)")

    def __getattr__(self, attr: str) -> _Inert:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __getitem__(self, key: Any) -> _Inert:
        return _Inert(f"{self._name}[...]")

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __enter__(self) -> _Inert:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[Any, ...]:
        return ()  # a class deriving from a pipelines class: defined, on object alone

    def _combined(self, *_: Any) -> _Inert:
        return _Inert(f"{self._name} (combined)")

    __and__ = __or__ = __xor__ = __rand__ = __ror__ = __invert__ = _combined
    __iter__ = __len__ = __bool__ = __contains__ = __int__ = __float__ = __index__ = _refused
