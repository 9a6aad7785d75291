"""The compiled models under numpy 2 in the stub, on the real CPU server, bit for bit.

Under numpy 2, Triton 2.51's stub reads host tensors wrongly with ``as_numpy()`` and writes
wrong sizes with ``Tensor(name, ndarray)`` (docs/gpu.md). The GPU machine forces numpy 2 (its
CuPy needs it), so the models move every numeric tensor through DLPack there. This runs the
same models in a venv made for the test with numpy 2, next to the usual numpy 1 one, and checks
every form's answers against the local runtime's, byte for byte, at every numeric datatype and
with a step that returns a DLPack producer of its own. BYTES, which DLPack cannot carry and the
stub misreads under numpy 2, is refused when the model loads, with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.triton import TritonServer

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import make_python_env  # noqa: E402
from test_dlpack_steps import X, producer_pipeline  # noqa: E402

pytestmark = pytest.mark.server

FORMS = ("ensemble", "bls", "bls_sync", "fused")
NUMERIC = ("BOOL", "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64", "FP16", "FP32", "FP64", "BF16")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _dtype(name: str) -> np.dtype:
    return BF16 if name == "BF16" else TensorSpec(name, [1]).numpy_dtype


def every_dtype_pipeline() -> Pipeline:
    """One input of each numeric datatype; each is turned, passed on to a second step and answered."""
    specs = {f"x_{d.lower()}": TensorSpec(d, [3]) for d in NUMERIC}

    @step(inputs=specs, outputs={f"m_{n[2:]}": s for n, s in specs.items()})
    def turn(**given):
        return {f"m_{n[2:]}": np.ascontiguousarray(v[:, ::-1]) for n, v in given.items()}

    @step(inputs={f"m_{n[2:]}": s for n, s in specs.items()}, outputs={f"y_{n[2:]}": s for n, s in specs.items()})
    def back(**given):
        return {f"y_{n[2:]}": v for n, v in given.items()}  # inputs handed straight on: read-only arrays

    p = Pipeline("every_dtype", inputs=specs, max_batch_size=4)
    turned = p.add(turn, **{n: p.input(n) for n in specs})
    answered = p.add(back, **{f"m_{n[2:]}": turned[f"m_{n[2:]}"] for n in specs})
    for name in specs:
        p.output(f"y_{name[2:]}", answered[f"y_{name[2:]}"])
    return p


def every_dtype_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    given = {}
    for d in NUMERIC:
        if d == "BOOL":
            value = rng.integers(0, 2, (2, 3)).astype(bool)
        elif d.startswith(("FP", "BF")):
            value = rng.standard_normal((2, 3)).astype(np.float32).astype(_dtype(d))
        else:
            info = np.iinfo(_dtype(d))
            value = rng.integers(info.min, info.max, (2, 3), dtype=_dtype(d), endpoint=True)
        given[f"x_{d.lower()}"] = value
    return given


@step(inputs={"s": TensorSpec("BYTES", [1])}, outputs={"t": TensorSpec("BYTES", [1])})
def shout(s):
    return {"t": np.array([[v[0].upper()] for v in s], dtype=object)}


@step(inputs={"x": TensorSpec("FP32", [3])}, outputs={"y": TensorSpec("FP32", [3])})
def left(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return {"y": x + 1}


@step(inputs={"x": TensorSpec("FP32", [3])}, outputs={"y": TensorSpec("FP32", [3])})
def right(x):
    return {"y": x * 2}


def branches_pipeline() -> Pipeline:
    """Two branches side by side: the ensemble carries failures as data, through a gate."""
    p = Pipeline("branches", inputs={"x": TensorSpec("FP32", [3])}, max_batch_size=4)
    p.output("a", p.add(left, x=p.input("x"))["y"])
    p.output("b", p.add(right, x=p.input("x"))["y"])
    return p


def strings_pipeline() -> Pipeline:
    p = Pipeline("strings", inputs={"s": TensorSpec("BYTES", [1])}, max_batch_size=4)
    p.output("t", p.add(shout, s=p.input("s"))["t"])
    return p


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("numpy2") / "models"
    every_dtype_pipeline().compile("all").write(root)
    producer_pipeline("producers").compile("all").write(root)
    strings_pipeline().compile("bls").write(root)
    branches_pipeline().compile("ensemble").write(root)
    assert (root / "branches__gate").is_dir()  # the construction under test
    return root


@pytest.fixture(scope="module", params=["numpy1", "numpy2"])
def server(request, repository, tmp_path_factory):
    if request.param == "numpy1":
        env = None  # this interpreter's: numpy<2, as the package pins it
    else:
        wanted = [line for line in (repository / "requirements.txt").read_text().splitlines()
                  if line and not line.startswith("#") and not line.startswith("numpy")]
        env = make_python_env(tmp_path_factory.mktemp("env") / "venv", "numpy>=2,<3", *wanted)
    with TritonServer(repository, python_env=env) as s:
        s.numpy = request.param
        yield s


@pytest.mark.parametrize("form", FORMS)
def test_every_numeric_dtype_answers_bit_for_bit(server, form):
    given = every_dtype_inputs()
    expected = every_dtype_pipeline().run(given)
    with server.client("http", timeout=60) as client:
        got = client.infer(f"every_dtype_{form}", given)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, (server.numpy, name)
        assert got[name].tobytes() == want.tobytes(), (server.numpy, name)


@pytest.mark.parametrize("form", FORMS)
def test_a_dlpack_producer_step_answers_in_every_form(server, form):
    with server.client("grpc", timeout=60) as client:
        got = client.infer(f"producers_{form}", {"x": X})
    np.testing.assert_array_equal(got["z"], X * 2 + 1)
    np.testing.assert_array_equal(got["seen"], np.ones((2, 1), np.int32))


def test_bytes_are_served_under_numpy1_and_refused_with_the_reason_under_numpy2(server):
    given = {"s": np.array([[b"ab"], [b"cd"]], dtype=object)}
    with server.client("http", timeout=60) as client:
        if server.numpy == "numpy1":
            assert client.infer("strings", given)["t"].tolist() == [[b"AB"], [b"CD"]]
            return
        with pytest.raises(Exception, match=r"(?s)strings.*BYTES.*numpy 2\.\d+.*numpy<2"):
            client.infer("strings", given)


def test_a_gated_ensemble_answers_and_names_the_failing_node(server):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with server.client("http", timeout=60) as client:
        got = client.infer("branches", {"x": x})
        np.testing.assert_array_equal(got["a"], x + 1)
        np.testing.assert_array_equal(got["b"], x * 2)
        with pytest.raises(Exception, match=r"StepError in pipeline 'branches', node 'left'.*negative input"):
            client.infer("branches", {"x": -x - 1})
