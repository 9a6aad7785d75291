"""Test data and probes for tests that run the real tritonserver.

``write_test_repository`` writes a tiny hand-made model repository (Python-backend models);
``leftovers`` finds processes and shared-memory regions a server left behind, by scanning
/proc and /dev/shm directly rather than trusting the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# Test data: Python-backend models written into a temporary repository.
_DOUBLE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("y", (x * 2).astype(np.float32)),
                pb_utils.Tensor("z", (x + 1).astype(np.float32)),
            ]))
        return responses
"""

_ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
            flag = pb_utils.get_input_tensor_by_name(request, "flag").as_numpy()
            count = pb_utils.get_input_tensor_by_name(request, "count").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_out", np.array([t + b"!" for t in text.ravel()], dtype=object).reshape(text.shape)),
                pb_utils.Tensor("flag_out", np.logical_not(flag)),
                pb_utils.Tensor("count_out", (count * 3).astype(np.int64)),
            ]))
        return responses
"""

_SLOW = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "seconds").as_numpy()
            time.sleep(float(seconds.ravel()[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("done", seconds)]))
        return responses
"""

_FAIL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError("step 'fail' refused: input x is negative")
            )
            for _ in requests
        ]
"""

_WHERE = """
import importlib.util
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        has_pipelines = importlib.util.find_spec("pipelines") is not None
        where = np.array([sys.prefix.encode(), np.__version__.encode(), str(has_pipelines).encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("where", where)]) for _ in requests]
"""

_CONFIGS = {
    "double": """
        backend: "python"
        max_batch_size: 8
        input [{ name: "x", data_type: TYPE_FP32, dims: [4] }]
        output [{ name: "y", data_type: TYPE_FP32, dims: [4] }, { name: "z", data_type: TYPE_FP32, dims: [4] }]
    """,
    "echo": """
        backend: "python"
        max_batch_size: 0
        input [
          { name: "text", data_type: TYPE_STRING, dims: [-1] },
          { name: "flag", data_type: TYPE_BOOL, dims: [-1] },
          { name: "count", data_type: TYPE_INT64, dims: [-1] }
        ]
        output [
          { name: "text_out", data_type: TYPE_STRING, dims: [-1] },
          { name: "flag_out", data_type: TYPE_BOOL, dims: [-1] },
          { name: "count_out", data_type: TYPE_INT64, dims: [-1] }
        ]
    """,
    "slow": """
        backend: "python"
        max_batch_size: 0
        input [{ name: "seconds", data_type: TYPE_FP32, dims: [1] }]
        output [{ name: "done", data_type: TYPE_FP32, dims: [1] }]
        instance_group [{ kind: KIND_CPU, count: 2 }]
    """,
    "fail": """
        backend: "python"
        max_batch_size: 0
        input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]
        output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]
    """,
}
_CONFIGS["where"] = """
    backend: "python"
    max_batch_size: 0
    input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]
    output [{ name: "where", data_type: TYPE_STRING, dims: [3] }]
"""
_MODELS = {"double": _DOUBLE, "echo": _ECHO, "slow": _SLOW, "fail": _FAIL, "where": _WHERE}


def write_test_repository(root: Path, models: tuple[str, ...] = ("double",)) -> Path:
    """Write the named test models (double, echo, slow, fail, where) into a repository at ``root``.

    ``where`` answers the stub's ``sys.prefix``, its numpy version and whether ``pipelines`` imports.
    """
    for name in models:
        version = root / name / "1"
        version.mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(textwrap.dedent(_CONFIGS[name]).strip() + "\n")
        (version / "model.py").write_text(_MODELS[name].lstrip())
    return root


def write_broken_repository(root: Path) -> Path:
    """A repository whose one model cannot load: its model.py raises on import."""
    version = root / "broken" / "1"
    version.mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text(textwrap.dedent(_CONFIGS["fail"]))
    (version / "model.py").write_text("raise RuntimeError('broken model cannot be imported')\n")
    return root


def leftovers(*markers: str) -> list[str]:
    """Live processes whose command line holds one of ``markers``, and /dev/shm entries named by one."""
    found = []
    needles = [m.encode() for m in markers]
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError):
            continue
        if state != b"Z" and any(n in cmdline for n in needles):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
            found.append(f"process {entry}: {command}")
    for name in os.listdir("/dev/shm"):
        if any(name.startswith(m) for m in markers):
            found.append(f"/dev/shm/{name}")
    return found


def wait_for_no_leftovers(*markers: str, timeout: float = 15.0, paths: tuple[Path, ...] = ()) -> list[str]:
    """``leftovers(*markers)`` and the ``paths`` that exist, once none is left (or what is left after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        found = leftovers(*markers) + [str(path) for path in paths if path.exists()]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def make_python_env(root: Path, *requirements: str) -> Path:
    """A fresh virtual environment at ``root`` holding only ``requirements`` (no ``pipelines``).

    It is made without pip, and this interpreter's pip installs into it (``pip --python``),
    which is several seconds faster than bootstrapping pip in the new environment.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    if requirements:
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "-q", *requirements],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return root
