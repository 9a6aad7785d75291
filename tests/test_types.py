"""The public API type-checks (issue 62): mypy, configured in pyproject.toml's [tool.mypy], is
clean on the modules that define what ``pipelines/__init__.py`` exports, and a user's own type
checker sees those types (``p.predict(profile)`` takes a profile and gives a Prediction)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipelines

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy's own dependency reads TOML
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CHECKED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mypy_cache")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        # In the checkout, with its pyproject.toml; a cache of its own, so a parallel `make lint` does not race it.
        return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    return run


def test_the_modules_of_the_public_api_type_check(mypy):
    done = mypy()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"no issues found in {len(CHECKED)} source files" in done.stdout, done.stdout


def test_mypy_checks_every_module_that_defines_an_export():
    defined = {"pipelines/__init__.py"}
    for name in pipelines.__all__:
        value = getattr(pipelines, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            defined.add(Path(inspect.getfile(value)).resolve().relative_to(ROOT).as_posix())
    assert defined <= set(CHECKED), f"add to [tool.mypy] files in pyproject.toml: {sorted(defined - set(CHECKED))}"


def test_a_users_type_checker_sees_what_the_api_takes_and_gives(mypy, tmp_path):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""
        from pipelines import Pipeline, Prediction, TensorSpec

        p = Pipeline("p", inputs={"x": TensorSpec("FP32", [4])})
        table: Prediction = p.predict("profile.json", concurrency=4)
        p.predict(42)
        p.advise("profile.json").best.configuration.nothing
        p.compile(target=3)
    """))
    done = mypy(str(script))
    errors = [line.split(": error: ", 1)[1] for line in done.stdout.splitlines() if ": error: " in line]
    assert done.returncode == 1 and len(errors) == 3, done.stdout + done.stderr
    assert 'Argument 1 to "predict" of "Pipeline" has incompatible type "int"' in errors[0], errors
    assert '"Configuration" has no attribute "nothing"' in errors[1], errors
    assert 'Argument "target" to "compile" of "Pipeline" has incompatible type "int"' in errors[2], errors
