"""Steps in any array library: a step may return anything that speaks DLPack, and asks with
``array=`` what it is handed. On the CPU the producer is a minimal one written here (the
protocol and nothing else: no ``dtype``, no ``shape``), as PyTorch or JAX would be; PyTorch
itself is tested where it is installed (the GPU machine), not added to the test dependencies."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import Pipeline, StepDeclarationError, StepError, TensorSpec, step
from pipelines.runtime import MODES
from pipelines.serving import ARRAY_KINDS, Refused, as_array, handing

V = TensorSpec("FP32", [4])


class HostProducer:
    """Host memory behind the DLPack protocol only, as a library other than numpy hands it out."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = np.ascontiguousarray(array)

    def __dlpack__(self, stream=None, **_):  # numpy 2 asks with max_version=..., copy=...; 1.26 without
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


class BrokenProducer(HostProducer):
    def __dlpack__(self, stream=None, **_):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")


@step(inputs={"x": V}, outputs={"y": V})
def doubled_elsewhere(x):
    return {"y": HostProducer(x * 2)}


@step(inputs={"y": V}, outputs={"z": V, "seen": TensorSpec("INT32", [1])}, array="dlpack")
def takes_as_it_comes(y):
    # a "dlpack" step is handed a DLPack producer (here a view over read-only host memory)
    seen = np.full((y.shape[0], 1), int(hasattr(y, "__dlpack__")), np.int32)
    return {"z": HostProducer(np.from_dlpack(y) + 1), "seen": seen}


def producer_pipeline(name: str = "producers") -> Pipeline:
    p = Pipeline(name, inputs={"x": V}, max_batch_size=4)
    a = p.add(doubled_elsewhere, x=p.input("x"))
    b = p.add(takes_as_it_comes, y=a["y"])
    p.output("z", b["z"])
    p.output("seen", b["seen"])
    return p


X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_may_return_any_dlpack_producer_in_every_mode(mode):
    out = producer_pipeline().run({"x": X}, mode=mode)
    np.testing.assert_array_equal(out["z"], X * 2 + 1)
    np.testing.assert_array_equal(out["seen"], np.ones((2, 1), np.int32))
    assert isinstance(out["z"], np.ndarray) and out["z"].dtype == np.float32


def test_the_producer_is_read_without_a_copy():
    source = np.arange(4, dtype=np.float32)
    read = as_array(HostProducer(source))
    assert np.shares_memory(read, source) or read.ctypes.data == np.ascontiguousarray(source).ctypes.data
    assert read.dtype == np.float32 and read.shape == (4,)


@pytest.mark.parametrize("mode", ["ensemble", "bls"])
def test_dtype_is_checked_from_the_dlpack_view_and_the_error_names_step_and_output(mode):
    @step(inputs={"x": V}, outputs={"y": V})
    def wrong_dtype(x):
        return {"y": HostProducer(x.astype(np.int64))}

    p = Pipeline("dtype_from_dlpack", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(wrong_dtype, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"wrong_dtype.*'y'.*int64.*FP32") as info:
        p.run({"x": X}, mode=mode)
    assert info.value.step == "wrong_dtype" and info.value.tensor == "y"


def test_a_producer_that_cannot_export_is_named_with_its_own_reason():
    @step(inputs={"x": V}, outputs={"y": V})
    def needs_grad(x):
        return {"y": BrokenProducer(x)}

    p = Pipeline("broken_export", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(needs_grad, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"needs_grad.*'y'.*BrokenProducer.*DLPack export failed.*detach") as info:
        p.run({"x": X})
    assert info.value.tensor == "y"
    with pytest.raises(Refused, match="'out'"):
        as_array(BrokenProducer(X), "out")


@pytest.mark.parametrize("mode", MODES)
def test_array_numpy_hands_a_read_only_numpy_array(mode):
    seen = {}

    @step(inputs={"y": V}, outputs={"z": V}, array="numpy")
    def wants_numpy(y):
        seen["type"], seen["writeable"] = type(y), y.flags.writeable
        return {"z": y + 1}

    p = Pipeline("wants_numpy", inputs={"x": V}, max_batch_size=4)
    p.output("z", p.add(wants_numpy, y=p.add(doubled_elsewhere, x=p.input("x"))["y"])["z"])
    np.testing.assert_array_equal(p.run({"x": X}, mode=mode)["z"], X * 2 + 1)
    assert seen == {"type": np.ndarray, "writeable": False}


def test_array_kinds_are_checked_when_declared():
    assert ARRAY_KINDS == ("numpy", "cupy", "torch", "dlpack")
    with pytest.raises(StepDeclarationError, match=r"array must be one of 'numpy', 'cupy', 'torch', 'dlpack'.*'jax'"):
        step(lambda x: x, name="s", inputs={"x": V}, outputs={"y": V}, array="jax")
    with pytest.raises(StepDeclarationError, match=r"array='numpy' cannot go with device='gpu'.*host"):
        step(lambda x: x, name="s", inputs={"x": V}, outputs={"y": V}, array="numpy", device="gpu")
    with pytest.raises(StepDeclarationError, match=r"array='cupy' cannot go with device='cpu'"):
        doubled_elsewhere.with_options(array="cupy", device="cpu")
    assert handing(None) is None
    view = handing("dlpack")(np.arange(3, dtype=np.float32))
    assert not isinstance(view, np.ndarray) and view.shape == (3,) and view.__dlpack_device__() == (1, 0)
    with pytest.raises(Refused, match="not a kind of array"):
        handing("tensorflow")


def test_array_torch_hands_torch_tensors_without_a_copy():
    torch = pytest.importorskip("torch")  # on the GPU machine; never a test dependency here
    seen = {}

    @step(inputs={"y": V}, outputs={"z": V}, array="torch")
    def in_torch(y):
        seen["type"] = type(y)
        seen["ptr"] = y.data_ptr()
        return {"z": y * 3}  # a torch.Tensor back: read through DLPack

    p = Pipeline("in_torch", inputs={"x": V}, max_batch_size=4)
    p.output("z", p.add(in_torch, y=p.input("x"))["z"])
    x = np.ascontiguousarray(X)
    out = p.run({"x": x}, mode="ensemble")
    np.testing.assert_array_equal(out["z"], X * 3)
    assert seen["type"] is torch.Tensor and seen["ptr"] == x.ctypes.data


def test_the_step_json_says_array_only_when_asked(tmp_path):
    import json

    producer_pipeline("json_array").compile("ensemble").write(tmp_path / "models")
    plan = json.loads((tmp_path / "models" / "json_array__takes_as_it_comes" / "1" / "step.json").read_text())
    assert plan["array"] == "dlpack"
    plain = json.loads((tmp_path / "models" / "json_array__doubled_elsewhere" / "1" / "step.json").read_text())
    assert "array" not in plain


def test_host_gpu_hops_are_kept_in_a_file_only_when_asked(tmp_path, monkeypatch):
    import json

    from pipelines.serving import HostHops

    quiet = HostHops()
    quiet.attach("m")
    quiet.host_to_device(10)
    assert quiet.to_device == 1 and not list(tmp_path.iterdir())
    monkeypatch.setenv("PIPELINES_HOPS_DIR", str(tmp_path))
    hops = HostHops()
    hops.attach("yolo__nms")
    hops.host_to_device(100)
    hops.device_to_host(28)
    (written,) = tmp_path.iterdir()
    assert written.name.startswith("yolo__nms-")
    assert json.loads(written.read_text()) == {"model": "yolo__nms", "to_device": 1, "to_host": 1, "bytes": 128}
