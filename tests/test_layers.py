"""The package's layers (issue 41), as ``import-linter`` checks them from the contracts in
pyproject.toml: the command line on top; the bench and the endpoint; the prediction as a user asks
for it; the measuring (profiling); the simulation (predict), which measures nothing (issue 62);
calibration; then compile, runtime, triton and steps, none importing another; the core at the
bottom. Every import counts, inside functions and under TYPE_CHECKING too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(where: Path) -> subprocess.CompletedProcess[str]:
    # Run in `where`, with its own `pipelines` first on the path, reading its pyproject.toml.
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=where, capture_output=True, text=True, timeout=120,
        env={"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(where)},
    )


def test_the_package_keeps_its_layers():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " kept, 0 broken." in done.stdout, done.stdout


def test_an_import_across_the_layers_breaks_the_contract(tmp_path):
    # A copy of the package whose runtime reaches for a server profile, inside a function (as
    # the replay did): the same contracts must catch it, and name the import.
    done = lint_imports(_package_with(tmp_path, "runtime/local.py", "def _replay(path):\n    from ..calibration "
                                      "import load_profile\n\n    return load_profile(path)\n"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pipelines.runtime.local -> pipelines.calibration" in done.stdout, done.stdout
    assert "The runtime executes: it imports no compiler, server, calibration or bench code BROKEN" in done.stdout


def test_the_simulation_that_reaches_for_the_measuring_breaks_the_contract(tmp_path):
    # A copy of the package whose Predictor watches the machine itself, inside a function (as it did before
    # the measuring moved to profiling/): both the layers and the simulation's own contract name the import.
    done = lint_imports(_package_with(tmp_path, "predict/prediction.py", "def _watch():\n    from "
                                      "..profiling.noise_watch import NoiseWatch\n\n    return NoiseWatch()\n"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pipelines.predict.prediction -> pipelines.profiling.noise_watch" in done.stdout, done.stdout
    assert "The prediction simulates what was measured: it imports nothing of the measuring" in done.stdout
    assert "Layers: the command line on top, the core at the bottom BROKEN" in done.stdout
    assert "Contracts: 3 kept, 2 broken." in done.stdout, done.stdout


def _package_with(tmp_path, module: str, code: str):
    """A copy of the package and its contracts in ``tmp_path``, with ``code`` added at the end of ``module``."""
    shutil.copytree(ROOT / "pipelines", tmp_path / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "pipelines" / module
    path.write_text(path.read_text() + "\n\n" + code)
    return tmp_path
