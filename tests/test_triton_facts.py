"""The Triton facts the in-server code relies on (docs/triton.md), each checked on the bundled
tritonserver with a hand-written Python model, or against the source that states it."""

from __future__ import annotations

import importlib.metadata
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipelines.errors import InferenceError
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

# Each model answers what it saw as a BYTES "said" (the exception's text, or what it found).
_MODELS = {
    # DLPack from a numpy array on a CPU server.
    "numpy_dlpack": ("x", "TYPE_FP32", """
        x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
        try:
            pb_utils.Tensor.from_dlpack("y", x.copy())
            said = "accepted"
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
    """),
    # DLPack and BYTES.
    "bytes_dlpack": ("x", "TYPE_STRING", """
        t = pb_utils.get_input_tensor_by_name(request, "x")
        try:
            t.to_dlpack()
            said = "accepted"
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
    """),
    # BF16 and numpy; BF16 and DLPack.
    "bf16": ("x", "TYPE_BF16", """
        t = pb_utils.get_input_tensor_by_name(request, "x")
        try:
            t.as_numpy()
            said = "as_numpy accepted"
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
        copy = pb_utils.Tensor.from_dlpack("y", t.to_dlpack())
        said += f" | from_dlpack(to_dlpack()) gave {copy.shape()}"
    """),
}

_TEMPLATE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
{body}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("said", np.array([said.encode()], dtype=object))]))
        return responses
"""

_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [{{ name: "{input}" data_type: {dtype} dims: [ 2 ] }}]
output [{{ name: "said" data_type: TYPE_STRING dims: [ 1 ] }}]
"""

# An async execute() that waits (at most 2 s) for another execute() of the same instance to start.
_ONE_AT_A_TIME = """
import asyncio
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.directory = os.path.join(args["model_repository"], "marks")
        os.makedirs(self.directory, exist_ok=True)

    async def execute(self, requests):
        mine = os.path.join(self.directory, f"{os.getpid()}-{time.monotonic_ns()}")
        open(mine, "w").close()
        met = False
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not met:
            met = any(os.path.join(self.directory, f) != mine for f in os.listdir(self.directory))
            await asyncio.sleep(0.01)
        os.remove(mine)
        said = "met another execute" if met else "alone"
        return [pb_utils.InferenceResponse([pb_utils.Tensor("said", np.array([said.encode()], dtype=object))])
                for _ in requests]
"""


# A BLS model sends requests that break the receiver's config; the receiver says if it ran.
_SENDER = """
import numpy as np
import triton_python_backend_utils as pb_utils

CASES = {
    "dtype": {"x": np.ones((1, 4), np.float64), "k": np.ones((1, 1), np.int32)},
    "dims": {"x": np.ones((1, 3), np.float32), "k": np.ones((1, 1), np.int32)},
    "rank": {"x": np.ones((1, 4, 1), np.float32), "k": np.ones((1, 1), np.int32)},
    "batch_above_max": {"x": np.ones((3, 4), np.float32), "k": np.ones((3, 1), np.int32)},
    "batch_sizes_differ": {"x": np.ones((2, 4), np.float32), "k": np.ones((1, 1), np.int32)},
    "missing": {"x": np.ones((1, 4), np.float32)},
}


class TritonPythonModel:
    def execute(self, requests):
        said = []
        for case, tensors in CASES.items():
            call = pb_utils.InferenceRequest(
                model_name="receiver", requested_output_names=["said"],
                inputs=[pb_utils.Tensor(n, v) for n, v in tensors.items()],
            )
            response = call.exec()
            text = response.error().message() if response.has_error() else "answered"
            said.append(f"{case}: {text}")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("said", np.array([s.encode() for s in said], dtype=object))])
                for _ in requests]
"""

_RECEIVER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError("EXECUTED")) for _ in requests]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("facts") / "models"
    for name, (input_name, dtype, body) in _MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(_CONFIG.format(name=name, input=input_name, dtype=dtype))
        (root / name / "1" / "model.py").write_text(
            _TEMPLATE.format(body=textwrap.indent(textwrap.dedent(body).strip(), " " * 12))
        )
    (root / "one_at_a_time" / "1").mkdir(parents=True)
    (root / "one_at_a_time" / "config.pbtxt").write_text(
        _CONFIG.format(name="one_at_a_time", input="x", dtype="TYPE_FP32") + "instance_group [{ count: 1 kind: KIND_CPU }]\n"
    )
    (root / "one_at_a_time" / "1" / "model.py").write_text(_ONE_AT_A_TIME)
    (root / "two_instances" / "1").mkdir(parents=True)
    (root / "two_instances" / "config.pbtxt").write_text(
        _CONFIG.format(name="two_instances", input="x", dtype="TYPE_FP32") + "instance_group [{ count: 2 kind: KIND_CPU }]\n"
    )
    (root / "two_instances" / "1" / "model.py").write_text(_TEMPLATE.format(body=textwrap.indent(
        "import os, time\ntime.sleep(0.3)  # held, so that requests at once need both instances\nsaid = str(os.getpid())",
        " " * 12)))
    (root / "sender" / "1").mkdir(parents=True)
    (root / "sender" / "config.pbtxt").write_text(
        'name: "sender" backend: "python" max_batch_size: 0\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
        'output [{ name: "said" data_type: TYPE_STRING dims: [ -1 ] }]\n'
    )
    (root / "sender" / "1" / "model.py").write_text(_SENDER)
    (root / "receiver" / "1").mkdir(parents=True)
    (root / "receiver" / "config.pbtxt").write_text(
        'name: "receiver" backend: "python" max_batch_size: 2\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "k" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
        'output [{ name: "said" data_type: TYPE_STRING dims: [ 1 ] }]\n'
    )
    (root / "receiver" / "1" / "model.py").write_text(_RECEIVER)
    # The model whose stub dies cannot unload: do not wait Triton's default 30 s for it at exit.
    with TritonServer(root, exit_timeout=5) as s, s.client("http", timeout=60) as client:
        yield client


def said(client, model: str, x: np.ndarray) -> str:
    return client.infer(model, {"x": x})["said"][0].decode()


def test_dlpack_from_a_numpy_array_kills_the_stub_on_a_cpu_server(server):
    # Not an exception the model could catch: its stub process dies, and the model stays broken.
    with pytest.raises(InferenceError, match="Stub process 'numpy_dlpack_0' is not healthy"):
        said(server, "numpy_dlpack", np.ones(2, np.float32))


def test_a_bytes_tensor_has_no_dlpack(server):
    text = said(server, "bytes_dlpack", np.array([b"a", b"b"], dtype=object))
    assert "DLPack does not have support for string tensors" in text, text


def test_bf16_cannot_be_numpy_but_travels_by_dlpack(server):
    text = said(server, "bf16", np.ones(2, np.float32).astype(ml_dtypes.bfloat16))
    assert "Tensor dtype is BF16 and cannot be converted to NumPy" in text, text
    assert text.endswith("from_dlpack(to_dlpack()) gave [2]"), text


def test_one_instance_runs_one_execute_at_a_time_even_an_async_one(server):
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: said(server, "one_at_a_time", np.ones(2, np.float32)), range(2)))
    assert answers == ["alone", "alone"], answers


def test_each_instance_of_a_python_model_runs_in_a_process_of_its_own(server):
    with ThreadPoolExecutor(4) as pool:
        pids = set(pool.map(lambda _: said(server, "two_instances", np.ones(2, np.float32)), range(8)))
    assert len(pids) == 2 and all(p.isdigit() for p in pids), pids


def test_triton_refuses_a_bls_request_that_breaks_the_config_before_execute(server):
    answers = server.infer("sender", {"x": np.ones(2, np.float32)})["said"]
    said = dict(a.decode().split(": ", 1) for a in answers)
    assert sorted(said) == sorted(["dtype", "dims", "rank", "batch_above_max", "batch_sizes_differ", "missing"])
    for case, text in said.items():
        assert "EXECUTED" not in text and text != "answered", (case, text)


def test_the_bundled_server_declares_numpy_below_2():
    requires = importlib.metadata.requires("nvidia-pytriton") or []
    assert any(r.replace(" ", "").startswith("numpy") and "<2" in r.replace(" ", "") for r in requires), requires


def test_the_docs_state_each_fact_with_its_test():
    text = (Path(__file__).parents[1] / "docs" / "triton.md").read_text()
    for name in (
        "test_dlpack_from_a_numpy_array_kills_the_stub_on_a_cpu_server",
        "test_a_bytes_tensor_has_no_dlpack",
        "test_bf16_cannot_be_numpy_but_travels_by_dlpack",
        "test_one_instance_runs_one_execute_at_a_time_even_an_async_one",
        "test_each_instance_of_a_python_model_runs_in_a_process_of_its_own",
        "test_the_bundled_server_declares_numpy_below_2",
        "test_triton_refuses_a_bls_request_that_breaks_the_config_before_execute",
    ):
        assert name in text, name
