"""A folder named ``pipelines`` beside a user's script (empty, or holding their own files) and
the package it may shadow: as ``make`` installs it (compat editable), a regular install and the
``pipelines`` command, the package wins; where an install lets the folder win, ``python -m
pipelines`` names the folder and what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipelines

PACKAGE = Path(pipelines.__file__).parent
SCRIPT = """\
from pipelines import Pipeline, TensorSpec, step


@step(inputs={"x": TensorSpec("FP32", [1])}, outputs={"y": TensorSpec("FP32", [1])})
def same(x):
    return {"y": x}


pipeline = Pipeline("mine", inputs={"x": TensorSpec("FP32", [1])}, max_batch_size=4)
pipeline.output("y", pipeline.add(same, x=pipeline.input("x"))["y"])

if __name__ == "__main__":
    print("built", pipeline.name)
"""


@pytest.fixture(params=("empty", "unrelated files"))
def project(request, tmp_path):
    """A user's directory: ``mypipe.py`` and a folder ``pipelines/`` of their own beside it."""
    (tmp_path / "mypipe.py").write_text(SCRIPT)
    folder = tmp_path / "pipelines"
    folder.mkdir()
    if request.param == "unrelated files":
        (folder / "notes.txt").write_text("my CI pipelines\n")
        (folder / "deploy.yaml").write_text("stages: []\n")
    return tmp_path


def _run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_a_script_beside_the_folder_imports_the_package_as_make_installs_it(project):
    # `make` installs the checkout in setuptools' compat editable mode: the checkout is on sys.path,
    # and a regular package found there beats a folder without __init__.py found earlier.
    done = _run(project, sys.executable, "mypipe.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "built mine"
    done = _run(project, sys.executable, "-m", "pipelines", "graph", "mypipe.py:pipeline")
    assert done.returncode == 0, done.stderr
    assert "same" in done.stdout


SHADOWED = """\
import runpy, sys, types
folder = sys.argv[1]
shadow = types.ModuleType("pipelines")
shadow.__path__ = [folder]  # what Python makes of a folder without __init__.py found first
sys.modules["pipelines"] = shadow
runpy.run_path(sys.argv[2], run_name="__main__")
"""


def test_python_m_pipelines_names_the_folder_that_shadows_the_package_and_what_to_do(project):
    # Where an install lets the folder win (setuptools' default editable finder runs after it), the
    # command names the folder instead of failing on the user's file with Python's "unknown location".
    done = _run(project, sys.executable, "-c", SHADOWED, str(project / "pipelines"), str(PACKAGE / "__main__.py"))
    assert done.returncode == 2
    assert f"the folder {project / 'pipelines'} shadows the pipelines package" in done.stderr
    assert f"installed at {PACKAGE}" in done.stderr
    assert "rename or move that folder, or run from another directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_pipelines_command_is_not_shadowed(project):
    command = Path(sys.executable).parent / "pipelines"
    if not command.exists():
        pytest.skip("the pipelines console script is not installed in this environment")
    done = _run(project, str(command), "graph", "mypipe.py:pipeline")
    assert done.returncode == 0, done.stderr
    assert "same" in done.stdout


def test_a_regular_install_wins_over_a_folder_without_init(project, tmp_path_factory):
    # A wheel puts the package, with its __init__.py, in a sys.path entry; Python takes a regular
    # package found anywhere on sys.path before a folder without __init__.py found earlier.
    site = tmp_path_factory.mktemp("site")
    (site / "pipelines").symlink_to(PACKAGE, target_is_directory=True)
    done = _run(project, sys.executable, "mypipe.py", env={"PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "built mine"
