"""A shared model repository on the real tritonserver, with a stub Python that has only what
the repository's requirements.txt names (no ``pipelines``): pipeline A in its three forms,
pipeline B, and a hand-made model serve side by side, the hand-made model untouched; step
parameters keep their types; a step file changed after compilation, or pickled by another
Python, is refused with a message that says why and what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from server_fixtures import write_test_repository
from test_repository_write import models_in, snapshot

from pipelines import Pipeline, PipelinesError, TensorSpec, step
from pipelines.compile.configs import parse_config
from pipelines.examples.yolov5 import make_sample
from pipelines.examples.yolov5 import pipeline as yolov5
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

F4 = TensorSpec("FP32", [4])
PARAMETERS = {"threshold": 0.5, "count": 3, "strict": True, "label": "x"}


@step(inputs={"x": F4}, outputs={"y": F4}, parameters=PARAMETERS)
class Typed:
    """Answers ``x > threshold`` as 1.0, or -1.0 everywhere if a parameter lost its type."""

    def initialize(self, config):
        params = config["parameters"]
        self.ok = all(type(params[k]) is type(v) for k, v in PARAMETERS.items())
        self.threshold = params["threshold"]

    def execute(self, x):
        return {"y": (x > self.threshold).astype(np.float32) if self.ok else -np.ones_like(x)}


@step(inputs={"x": F4}, outputs={"y": F4})
def double(x):
    return {"y": x * 2}


@step(inputs={"x": F4}, outputs={"y": F4})
def plus_one(x):
    return {"y": x + 1}


# From an installed package: referenced by module, and its distribution is in requirements.txt.
sort = step(np.sort, name="sort", inputs={"a": F4}, outputs={"sorted": F4})


def pipeline_a(second=double) -> Pipeline:
    p = Pipeline("alpha", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(second, x=p.add(Typed, x=p.input("x"))["y"])["y"])
    return p


def pipeline_b() -> Pipeline:
    p = Pipeline("beta", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(plus_one, x=p.add(sort, a=p.input("x"))["sorted"])["y"])
    return p


def fresh_environment(python: str, requirements: Path, where: Path) -> Path:
    """A new virtual environment holding only ``pip install -r requirements`` (installed by our pip, so not
    even pip is in it)."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install", "-q",
                    "--no-compile", "-r", str(requirements)], check=True, capture_output=True)
    return where


def base_python() -> str:
    return getattr(sys, "_base_executable", sys.executable)


def other_python() -> tuple[str, str] | None:
    """Another CPython minor version that has a Triton stub and numpy<2 wheels, and its version."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    for version in ("3.10", "3.12"):
        if version == mine:
            continue
        pyenv = sorted(Path("~/.pyenv/versions").expanduser().glob(f"{version}.*/bin/python{version}"))
        for candidate in [*map(str, pyenv), shutil.which(f"python{version}")]:
            if candidate and subprocess.run([candidate, "-c", "import venv"], capture_output=True).returncode == 0:
                return candidate, version
    return None


X = np.array([[0.1, 0.9, 0.4, 0.7], [3.0, -1.0, 2.0, 0.0]], np.float32)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared") / "models"
    write_test_repository(root, ("double",))
    hand_made = snapshot(root / "double")
    pipeline_a(plus_one).compile("ensemble").write(root)
    pipeline_b().compile("ensemble").write(root)
    pipeline_a().compile("both").write(root)  # rewrites only alpha's models: its old form goes
    yolov5.compile("both").write(root)  # the built-in example: its steps live in pipelines, so travel by value
    env = fresh_environment(base_python(), root / "requirements.txt", tmp_path_factory.mktemp("env") / "venv")
    models = models_in(root)
    with TritonServer(root, python_env=env, model_control_mode="explicit", load_models=models) as server:
        yield root, server, hand_made, env


def test_two_pipelines_and_a_hand_made_model_serve_from_one_repository(shared):
    root, server, hand_made, env = shared
    assert [m for m in models_in(root) if not m.startswith("yolov5")] == [
        "alpha__Typed", "alpha__double", "alpha_bls", "alpha_bls_sync", "alpha_ensemble",
        "beta", "beta__plus_one", "beta__sort", "double",
    ]
    expected_a = (X > 0.5).astype(np.float32) * 2
    with server.client("http") as http, server.client("grpc") as grpc:
        for client in (http, grpc):
            for form in ("ensemble", "bls", "bls_sync"):
                np.testing.assert_array_equal(client.infer(f"alpha_{form}", {"x": X})["y"], expected_a)
            np.testing.assert_array_equal(client.infer("beta", {"x": X})["y"], np.sort(X) + 1)
            np.testing.assert_array_equal(client.infer("double", {"x": X})["y"], X * 2)
    # Byte for byte as written by hand (the stub adds only its own __pycache__ when it imports model.py).
    assert {k: v for k, v in snapshot(root / "double").items() if "__pycache__" not in k} == hand_made


def test_the_yolov5_example_serves_without_pipelines_as_it_runs_locally(shared):
    _, server, _, _ = shared
    image = make_sample()["image"][None]
    local = yolov5.run({"image": image}, mode="ensemble")["detections"]
    assert (local[0, :, 4] > 0).sum() >= 5  # the sample's objects were found
    with server.client("grpc") as client:
        for form in ("ensemble", "bls", "bls_sync"):
            remote = client.infer(f"yolov5_{form}", {"image": image})["detections"]
            np.testing.assert_allclose(remote, local, rtol=1e-5, atol=1e-4)


def test_the_stub_python_has_only_what_requirements_txt_names(shared):
    root, _, _, env = shared
    lines = [line for line in (root / "requirements.txt").read_text().splitlines() if line and line[0] != "#"]
    (numpy_line,) = [line for line in lines if line.startswith("numpy")]  # one line per distribution
    assert "<2" in numpy_line[len("numpy"):].split(",")
    assert any(line.startswith("cloudpickle~=") for line in lines)
    assert any(spec.startswith("==") for spec in numpy_line[len("numpy"):].split(","))  # beta's sort is numpy's
    assert not any(line.lower().startswith("pipelines") for line in lines)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([str(env / "bin" / "python"), "-c", "import pipelines"], capture_output=True, text=True,
                           cwd=env, env=clean)  # not from a source tree in the working directory
    assert probe.returncode != 0 and "No module named 'pipelines'" in probe.stderr


def test_parameters_keep_their_types_locally_and_on_the_server(shared):
    root, server, _, _ = shared
    local = pipeline_a().run({"x": X}, mode="ensemble")["y"]
    with server.client("http") as client:
        remote = client.infer("alpha_ensemble", {"x": X})["y"]
    np.testing.assert_array_equal(local, (X > 0.5).astype(np.float32) * 2)  # -1 had a type been lost
    np.testing.assert_array_equal(remote, local)
    config = parse_config((root / "alpha__Typed" / "config.pbtxt").read_text())
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "threshold": "0.5", "count": "3", "strict": "true", "label": "x",
    }


def test_a_step_file_changed_after_compilation_is_refused(shared):
    root, server, _, _ = shared
    pipeline_a().compile("ensemble").write(root.parent / "other")
    p = Pipeline("gamma", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(plus_one, x=p.input("x"))["y"])
    p.compile("ensemble").write(root)
    # Someone swaps in another step file: it would run their code when unpickled.
    shutil.copyfile(root.parent / "other" / "alpha__double" / "1" / "step.pkl", root / "gamma__plus_one" / "1" / "step.pkl")
    with server.client("http") as client, pytest.raises(PipelinesError) as info:
        client.load_model("gamma__plus_one")
    assert "does not match the sha256 recorded in step.json" in str(info.value)
    assert "compile the pipeline again" in str(info.value)


def test_a_step_pickled_by_another_python_gets_an_error_naming_both_versions_and_the_fix(tmp_path):
    root = tmp_path / "models"
    p = Pipeline("delta", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(double, x=p.input("x"))["y"])
    p.compile("ensemble").write(root)
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    other = other_python()
    if other is None:  # no second Python here: a server of this Python, and a file that says it is from 3.9
        plan = root / "delta__double" / "1" / "step.json"
        plan.write_text(plan.read_text().replace(f'"python": "{mine}"', '"python": "3.9"'))
        wrote, runs, env, extra = "3.9", mine, fresh_environment(base_python(), root / "requirements.txt",
                                                                  tmp_path / "venv"), {}
    else:
        python, runs = other
        wrote, env = mine, fresh_environment(python, root / "requirements.txt", tmp_path / "venv")
        libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                                capture_output=True, text=True, check=True).stdout.strip()
        # The stub links against libpython of its version; a pyenv build keeps it in its own lib/.
        extra = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
    with TritonServer(root, python_env=env, model_control_mode="explicit", env=extra) as server, \
            server.client("http") as client, pytest.raises(PipelinesError) as info:
        client.load_model("delta__double")
    assert (f"step.pkl was written by Python {wrote}; this server runs {runs}: "
            f"compile with Python {runs} or serve with {wrote}") in str(info.value)
