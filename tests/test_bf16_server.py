"""BF16 on the real tritonserver: a pipeline whose tensors are BF16 at its inputs, between
steps and at its outputs answers in every form, over HTTP and gRPC, bit for bit what the
local runtime answers, from a stub Python without the ``pipelines`` package. numpy has no BF16 and the Python backend's ``as_numpy()`` refuses it;
the step adapter carries it by DLPack (pipelines.serving.bf16_from_dlpack / bf16_to_dlpack)."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMS = ("ensemble", "bls", "bls_sync")


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"h": TensorSpec("BF16", [4])})
def to_bf16(x):
    return {"h": x.astype(BF16)}


@step(inputs={"h": TensorSpec("BF16", [4]), "b": TensorSpec("BF16", [-1])}, outputs={"s": TensorSpec("BF16", [4])})
def scale(h, b):
    return {"s": (h.astype(np.float32) * b.astype(np.float32).sum(axis=1, keepdims=True)).astype(BF16)}


@step(inputs={"h": TensorSpec("BF16", [4])}, outputs={"f": TensorSpec("FP32", [4]), "t": TensorSpec("BF16", [4, 1])})
def widen(h):
    return {"f": h.astype(np.float32) + 1, "t": h[..., None]}


def bf16_pipeline() -> Pipeline:
    p = Pipeline("brain", inputs={"x": TensorSpec("FP32", [4]), "b": TensorSpec("BF16", [-1])}, max_batch_size=4)
    h = p.add(to_bf16, x=p.input("x"))["h"]
    s = p.add(scale, h=h, b=p.input("b"))["s"]
    w = p.add(widen, h=h)  # runs beside `scale`: the ensemble carries both through its gate
    p.output("s", s)
    p.output("f", w["f"])
    p.output("t", w["t"])
    return p


def inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal((3, 5)).astype(np.float32).astype(BF16),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The stub's Python has only what requirements.txt names (ml_dtypes among it), not ``pipelines``."""
    root = tmp_path_factory.mktemp("bf16") / "models"
    bf16_pipeline().compile("both").write(root)
    assert any(line.startswith("ml_dtypes==") for line in (root / "requirements.txt").read_text().splitlines())
    env = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(env)], check=True)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(root / "requirements.txt")],
                   check=True, capture_output=True)
    with TritonServer(root, python_env=env) as s:
        yield s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("form", FORMS)
def test_bf16_inputs_wires_and_outputs_answer_as_the_local_runtime(server, form, protocol):
    given = inputs(seed=len(form) + len(protocol))
    expected = bf16_pipeline().run(given)
    with server.client(protocol, timeout=60) as client:
        got = client.infer(f"brain_{form}", given)
        only = client.infer(f"brain_{form}", given, outputs=["t"])
    assert sorted(got) == ["f", "s", "t"] and sorted(only) == ["t"]
    for name, want in expected.items():
        assert got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name].view(np.uint8), want.view(np.uint8), err_msg=name)
    np.testing.assert_array_equal(only["t"].view(np.uint16), expected["t"].view(np.uint16))
    assert expected["s"].dtype == BF16 and expected["t"].shape == (3, 4, 1)
