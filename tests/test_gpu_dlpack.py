"""Steps in PyTorch and CuPy on a GPU hand tensors to each other through DLPack, without a copy.

Run on the GPU machine (``pytest -m gpu``); without CUDA, CuPy or PyTorch they skip, since
PyTorch is no test dependency (its wheel brings gigabytes of CUDA libraries)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepError, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime, gpu_available

pytestmark = pytest.mark.gpu

V = TensorSpec("FP32", [4])


def _gpu_libraries():
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not gpu_available() or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device that CuPy and PyTorch both see")
    return cupy, torch


def _run(p: Pipeline, mode: str, inputs: dict) -> tuple[dict, object]:
    async def main():
        async with LocalRuntime(p, mode) as rt:
            return await rt.infer_with_report(inputs)

    return anyio.run(main)


@pytest.mark.parametrize("mode", MODES)
def test_cupy_to_torch_to_cupy_keeps_one_device_buffer(mode):
    cupy, torch = _gpu_libraries()
    seen = {}

    @step(inputs={"x": V}, outputs={"y": V}, device="gpu", array="torch")
    def in_torch(x):
        seen["torch_in"] = (type(x), x.data_ptr(), x.device.type)
        return {"y": x}  # the same tensor back: a torch.Tensor, read through DLPack

    @step(inputs={"y": V}, outputs={"z": V}, device="gpu")
    def in_cupy(y):
        seen["cupy_in"] = (type(y), y.data.ptr)
        return {"z": y * 2}

    p = Pipeline(f"torch_cupy_{mode.replace('-', '_')}", inputs={"x": V}, max_batch_size=4)
    p.output("z", p.add(in_cupy, y=p.add(in_torch, x=p.input("x"))["y"])["z"])
    x = cupy.arange(8, dtype=cupy.float32).reshape(2, 4)
    out, report = _run(p, mode, {"x": x})
    assert seen["torch_in"] == (torch.Tensor, x.data.ptr, "cuda")
    assert seen["cupy_in"] == (cupy.ndarray, x.data.ptr)
    assert report.copies == 0
    cupy.testing.assert_array_equal(out["z"], x * 2)


def test_a_cuda_torch_tensor_with_a_wrong_dtype_is_named():
    _, torch = _gpu_libraries()

    @step(inputs={"x": V}, outputs={"y": V}, device="gpu", array="torch")
    def half(x):
        return {"y": x.half()}

    p = Pipeline("torch_wrong_dtype", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(half, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"half.*'y'.*float16.*FP32"):
        p.run({"x": np.ones((1, 4), np.float32)})


def test_a_torch_tensor_that_needs_grad_is_refused_with_the_fix():
    _, torch = _gpu_libraries()

    @step(inputs={"x": V}, outputs={"y": V}, device="gpu", array="torch")
    def with_grad(x):
        return {"y": x.clone().requires_grad_(True)}

    p = Pipeline("torch_grad", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(with_grad, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"with_grad.*'y'.*detach"):
        p.run({"x": np.ones((1, 4), np.float32)})


def test_a_host_torch_step_reads_read_only_inputs_without_a_copy():
    torch = pytest.importorskip("torch")
    seen = {}

    @step(inputs={"x": V}, outputs={"y": V}, array="torch")
    def on_host(x):
        seen["ptr"], seen["device"] = x.data_ptr(), x.device.type
        return {"y": x + 1}

    p = Pipeline("torch_host", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(on_host, x=p.input("x"))["y"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(p.run({"x": x})["y"], x + 1)
    assert seen == {"ptr": x.ctypes.data, "device": "cpu"}
    assert isinstance(torch.zeros(1), torch.Tensor)
