"""The Python environment the Python backend's stubs run in: this interpreter's, or another one.

The stub's embedded interpreter finds its ``site-packages`` through the ``python`` first on
``PATH`` (``PYTHONPATH`` alone is not enough: numpy is then not found), so choosing an
environment means putting its ``bin/`` first on the server's ``PATH``, and choosing the stub
built for its Python version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ServerStartError

__all__ = ["PythonEnvironment", "current_environment", "probe_environment"]

_PROBE = (
    "import json, sys\n"
    "try:\n"
    "    import numpy\n"
    "    numpy_version = numpy.__version__\n"
    "except Exception:\n"
    "    numpy_version = None\n"
    "print(json.dumps({'version': '%d.%d' % sys.version_info[:2], 'numpy': numpy_version}))\n"
)


@dataclass(frozen=True)
class PythonEnvironment:
    """A Python environment (a venv or a conda env root): its ``bin/`` and its Python version."""

    root: Path
    python_version: str  # "3.11"

    @property
    def bin(self) -> Path:
        return self.root / "bin"


def current_environment() -> PythonEnvironment:
    """The environment of the running interpreter (where ``pipelines`` itself is installed)."""
    return PythonEnvironment(Path(sys.prefix), f"{sys.version_info.major}.{sys.version_info.minor}")


def probe_environment(root: str | os.PathLike[str]) -> PythonEnvironment:
    """Check that ``root`` is a Python environment a stub can run in; say what is missing if not."""
    root = Path(root).expanduser().resolve()
    python = root / "bin" / "python"
    if not python.exists():
        raise ServerStartError(
            f"python_env={str(root)!r} has no bin/python; pass the root of a virtual environment "
            "(python -m venv DIR) or of a conda environment"
        )
    try:
        answer = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(answer.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ServerStartError(
            f"python_env={str(root)!r}: {python} does not run ({exc}); repair or recreate it"
        ) from None
    numpy_version = found["numpy"]
    if numpy_version is None:
        raise ServerStartError(
            f"python_env={str(root)!r} has no numpy, which the Python backend's stub needs; "
            f"install it there: {python} -m pip install 'numpy<2'"
        )
    return PythonEnvironment(root, found["version"])
