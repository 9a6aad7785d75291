"""Where the parts of a Triton install live, and the backend directory a server is started with."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ServerStartError

__all__ = ["TritonInstallation", "backend_directory", "find_installation", "find_tritonserver"]


@dataclass(frozen=True)
class TritonInstallation:
    """Where the parts of a Triton install live: the binary, the Python backend, its stub, and libraries."""

    binary: Path
    python_backend: Path
    stub: Path
    libs: Path | None


def find_installation(python_version: str | None = None) -> TritonInstallation:
    """Locate the ``tritonserver`` shipped in the ``nvidia-pytriton`` wheel of the running Python.

    ``python_version`` ("3.10") picks the stub for the Python the models run in; the running one by default.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerStartError(
            "no tritonserver found: the 'nvidia-pytriton' package is not installed in "
            f"{sys.prefix}; install it with: pip install 'pipelines[server]' (or nvidia-pytriton)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package / "tritonserver"
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    installation = TritonInstallation(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=(package.parent / "nvidia_pytriton.libs") if (package.parent / "nvidia_pytriton.libs").is_dir() else None,
    )
    for what, path in (
        ("tritonserver binary", installation.binary),
        ("Python backend", installation.python_backend),
        (f"Python backend stub for Python {version}", installation.stub),
    ):
        if not path.exists():
            raise ServerStartError(
                f"the {what} is missing from the nvidia-pytriton install: expected {path}; "
                "reinstall nvidia-pytriton (0.5 or newer) for this Python, or run the models in a Python it has a stub for"
            )
    return installation


def find_tritonserver() -> Path:
    """Path of the ``tritonserver`` binary of the ``nvidia-pytriton`` wheel."""
    return find_installation().binary


def backend_directory(installation: TritonInstallation, target: Path) -> Path:
    """A ``--backend-directory`` at ``target``: the Python backend with the stub for this Python."""
    python = target / "python"
    shutil.copytree(installation.python_backend, python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(installation.stub, python / "triton_python_backend_stub")
    return target
