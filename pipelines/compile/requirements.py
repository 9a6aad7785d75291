"""What a server's Python needs to run a repository's models, and the ``requirements.txt`` that says it.

Only a step exported by value (``step.pkl``) pins the Python minor version and needs cloudpickle;
a step that travels as its source file or by reference needs neither.

Each model records its needs in its ownership marker when it is written; the
repository's ``requirements.txt`` is then rebuilt from the markers of every
model in it, so it stays right as pipelines are written and removed. Lines a
user wrote above our header are kept as they were.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "NUMPY_REQUIREMENT",
    "ServerNeeds",
    "cloudpickle_requirement",
    "distributions_of",
    "is_installed_module",
    "python_version",
    "render_requirements",
    "top_level_distribution",
]

#: The numpy line of the compiling Python: numpy 1 serves every datatype; under numpy 2, Triton 2.51's
#: stub misreads numpy arrays, so the models move tensors through DLPack and cannot carry BYTES (docs/gpu.md).
NUMPY_REQUIREMENT = "numpy<2" if int(importlib.metadata.version("numpy").split(".")[0]) < 2 else "numpy>=2"
#: Our own distribution: the in-server code never imports it, and it must not be required.
_OWN_DISTRIBUTION = "pipelines"

HEADER = "# --- written by pipelines from the models in this repository; rewritten on every write ---"


@dataclass(frozen=True)
class ServerNeeds:
    """What one model needs from the server's Python: pip requirements, and an exact minor version or ``None``."""

    requirements: tuple[str, ...] = ()
    python: str | None = None


def python_version() -> str:
    """This interpreter's ``major.minor``: a pickle of code loads only on the same one."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def cloudpickle_requirement() -> str:
    """The cloudpickle release line that wrote a step file (pickles are not promised across minor releases)."""
    version = importlib.metadata.version("cloudpickle")
    parts = version.split(".")
    return f"cloudpickle~={'.'.join(parts[:3])}" if len(parts) >= 3 else f"cloudpickle~={version}.0"


@functools.lru_cache(maxsize=1)
def _packages() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _distribution_root(name: str) -> Path | None:
    try:
        return Path(importlib.metadata.distribution(name).locate_file("")).resolve()
    except (importlib.metadata.PackageNotFoundError, OSError, TypeError):
        return None


def _stdlib_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if k in paths}
    sites = {Path(paths[k]).resolve() for k in ("purelib", "platlib") if k in paths}
    return [r for r in roots if not any(s == r for s in sites)]


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _site_packages(path: Path) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in path.parts)


def is_installed_module(module: ModuleType) -> bool:
    """Whether a server's Python can import ``module`` by name: the standard library, or an installed distribution.

    The module's *file* decides, not its name: a ``pipes.py`` beside a script
    shares its name with the standard library's ``pipes``, and a server would
    import the wrong one. Our own package never counts: a server need not have it.
    """
    name = module.__name__
    top = name.partition(".")[0]
    if top == _OWN_DISTRIBUTION:
        return False
    file = getattr(module, "__file__", None)
    if file is None:
        # Built into the interpreter, or a namespace package with no file to judge by.
        return name in sys.builtin_module_names or (top in getattr(sys, "stdlib_module_names", ()) and top != name)
    path = Path(file).resolve()
    if top in getattr(sys, "stdlib_module_names", ()):
        return any(_inside(path, root) for root in _stdlib_roots()) and not _site_packages(path)
    for dist in _packages().get(top, ()):
        root = _distribution_root(dist)
        if root is not None and _inside(path, root) and _site_packages(path):
            return True
    return False


def distributions_of(module_names: Iterable[str], *, exact: bool = True) -> tuple[str, ...]:
    """The installed distributions that provide ``module_names`` (not ours, not the standard library).

    ``exact`` pins ``dist==version``: for a step referenced by module, whose code is not in the
    repository, the version it was compiled against. Otherwise ``dist~=version``: a package a
    step exported by value refers to by name, or a step's source file imports, whose API it uses.
    """
    found = set()
    for name in module_names:
        top = (name or "").partition(".")[0]
        if not top or top in getattr(sys, "stdlib_module_names", ()) or top in sys.builtin_module_names:
            continue
        module = sys.modules.get(top)
        if module is not None and not is_installed_module(module):
            continue
        for dist in _packages().get(top, ()):
            if dist.lower().replace("_", "-") == _OWN_DISTRIBUTION:
                continue
            try:
                found.add(_pin(dist, importlib.metadata.version(dist), exact=exact))
            except importlib.metadata.PackageNotFoundError:
                continue
    return tuple(sorted(found, key=str.lower))


def top_level_distribution(name: str) -> str | None:
    """The installed distribution that provides the top-level module ``name`` (not ours), if one does."""
    for dist in _packages().get(name, ()):
        if dist.lower().replace("_", "-") != _OWN_DISTRIBUTION:
            return dist
    return None


def _pin(dist: str, version: str, *, exact: bool) -> str:
    if exact:
        return f"{dist}=={version}"
    public = version.split("+", 1)[0]  # pip refuses a local label ("+cpu") after ~=
    return f"{dist}~={public}" if "." in public else f"{dist}>={public}"  # ~= needs two components


_SPECIFIER = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?)\s*([^;]*)$")


def one_line_each(requirements: Iterable[str]) -> list[str]:
    """One line per distribution, its specifiers joined (``numpy<2`` and ``numpy~=1.26.4``: ``numpy<2,~=1.26.4``).

    pip reads two lines for one distribution as one requirement too, but a reader of the file
    should not have to; names are compared as pip does (case, ``_`` and ``.`` as ``-``).
    """
    merged: dict[str, tuple[str, list[str]]] = {}
    kept = []
    for line in requirements:
        found = _SPECIFIER.match(line)
        if found is None:  # an environment marker, a URL: kept as written
            kept.append(line)
            continue
        name, spec = found.group(1), found.group(2).strip()
        key = re.sub(r"[-_.]+", "-", name).lower()
        _, specs = merged.setdefault(key, (name, []))
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if part not in specs:
                specs.append(part)
    return [name + ",".join(sorted(specs)) for _, (name, specs) in sorted(merged.items())] + sorted(kept)


def render_requirements(markers: Sequence[Mapping[str, Any]], previous: str | None) -> str | None:
    """The text of ``requirements.txt`` for models with these markers (``None``: no file is needed)."""
    kept = previous.split(HEADER, 1)[0] if previous and HEADER in previous else (previous or "")
    if kept and not kept.endswith("\n"):
        kept += "\n"
    requirements = one_line_each({r for m in markers for r in m.get("requirements") or ()})
    pythons = sorted({m["python"] for m in markers if m.get("python")})
    if not markers:
        return kept or None
    lines = [HEADER]
    if len(pythons) == 1:
        lines.append(f"# Python {pythons[0]} exactly (major.minor): steps travel by value in step.pkl, "
                     "which loads only on the Python that wrote it")
    elif pythons:
        lines.append(f"# Python {' and '.join(pythons)} are both needed by steps travelling by value: "
                     "compile every pipeline of this repository with one Python")
    else:
        lines.append("# Python: any version the packages below support (no step travels by value)")
    lines += requirements
    return kept + "\n".join(lines) + "\n"
