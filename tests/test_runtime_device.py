"""Tensors pass between steps without copies on one device (DLPack), copies are
counted when a device changes, and each tensor is released once no consumer needs it.
GPU tests run only where CuPy and a CUDA device are present."""

from __future__ import annotations

import gc
import weakref

import anyio
import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime, gpu_available
from pipelines.runtime.device import CopyCounter, Placement, device_of, resolve_device

V = TensorSpec("FP32", [-1])


@step(inputs={"x": V}, outputs={"x": V})
def identity(x):
    return {"x": x}


def chain(length: int, *, name: str = "identity_chain", **options) -> Pipeline:
    s = identity.with_options(**options) if options else identity
    p = Pipeline(name, inputs={"x": V}, max_batch_size=4)
    ref = p.input("x")
    for i in range(length):
        ref = p.add(s, name=f"id{i}", x=ref)["x"]
    p.output("y", ref)
    return p


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("force_cpu", [False, True])
def test_identity_chain_shares_memory_and_copies_nothing(mode, force_cpu):
    x = np.arange(2 * 1000, dtype=np.float32).reshape(2, 1000)
    seen = []

    @step(inputs={"x": V}, outputs={"x": V})
    def last(x):
        seen.append(x)
        return {"x": x}

    p = chain(6)
    p.output("z", p.add(last, x=p.nodes["id5"]["x"])["x"])

    async def main():
        async with LocalRuntime(p, mode, force_cpu_only_input_tensors=force_cpu) as rt:
            return await rt.infer_with_report({"x": x})

    out, report = anyio.run(main)
    assert np.shares_memory(seen[0], x)  # the request's array, through six steps
    assert report.copies == 0 and report.copy_bytes == 0
    # what the caller is answered is its own, as a server's answer is
    assert not np.shares_memory(out["y"], x) and out["y"].flags.writeable
    np.testing.assert_array_equal(out["z"], x)


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_is_released_once_its_last_consumer_has_it(mode):
    refs = {}
    alive_at = {}

    @step(inputs={"x": V}, outputs={"big": V})
    def make(x):
        big = np.ones((x.shape[0], 100_000), np.float32)
        refs["big"] = weakref.ref(big)
        return {"big": big}

    @step(inputs={"big": V}, outputs={"small": V})
    def shrink(big):
        return {"small": big[:, :4].copy()}

    @step(inputs={"small": V}, outputs={"small": V})
    def later(small):
        gc.collect()
        alive_at["later"] = refs["big"]() is not None
        return {"small": small + 1}

    p = Pipeline(f"release_{mode.replace('-', '_')}", inputs={"x": V}, max_batch_size=4)
    m = p.add(make, x=p.input("x"))
    s = p.add(shrink, big=m["big"])
    p.output("y", p.add(later, small=s["small"])["small"])
    out = p.run({"x": np.zeros((1, 3), np.float32)}, mode=mode)
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 2, np.float32))
    assert alive_at["later"] is False


def test_outputs_nobody_consumes_are_dropped_and_shared_ones_kept():
    @step(inputs={"x": V}, outputs={"used": V, "unused": V})
    def two(x):
        return {"used": x + 1, "unused": x - 1}

    @step(inputs={"a": V, "b": V}, outputs={"y": V})
    def both(a, b):
        return {"y": a * b}

    p = Pipeline("fanout", inputs={"x": V}, max_batch_size=4)
    t = p.add(two, x=p.input("x"))
    p.output("y", p.add(both, a=t["used"], b=t["used"])["y"])  # one tensor, two consumers
    out = p.run({"x": np.full((1, 2), 2, np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((1, 2), 9, np.float32))


def test_auto_device_is_cpu_without_cuda_and_numpy_is_cpu():
    assert resolve_device("auto") == ("gpu" if gpu_available() else "cpu")
    assert device_of(np.zeros(3)) == "cpu"
    counter = CopyCounter()
    x = np.zeros(3, np.float32)
    shared = Placement("cpu").place(x, counter, pipeline="p", step="s", tensor="x")
    assert np.shares_memory(shared, x) and counter.count == 0


@pytest.mark.skipif(gpu_available(), reason="checks the message given when no GPU is present")
def test_a_gpu_step_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(InferenceError, match="step 'id0' asks for device 'gpu'.*cupy"):
        LocalRuntime(chain(1, name="wants_gpu", device="gpu"), "ensemble")


# ------------------------------------------------------------------ GPU (CuPy + CUDA)


def _cupy():
    cupy = pytest.importorskip("cupy")
    if not gpu_available():
        pytest.skip("CuPy is installed but no CUDA device is present")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_tensors_pass_between_steps_without_copies(mode):
    cupy = _cupy()
    x = cupy.arange(8, dtype=cupy.float32).reshape(2, 4)
    seen = []

    @step(inputs={"x": V}, outputs={"x": V})
    def last(x):
        seen.append(x.data.ptr)
        return {"x": x}

    p = chain(4, name="gpu_chain")
    p.output("z", p.add(last, x=p.nodes["id3"]["x"])["x"])

    async def main():
        async with LocalRuntime(p, mode, device="gpu") as rt:
            return await rt.infer_with_report({"x": x})

    out, report = anyio.run(main)
    assert seen == [x.data.ptr]  # the request's device buffer, through four steps
    assert report.copies == 0
    # the caller's answer is its own, still on the GPU
    assert isinstance(out["y"], cupy.ndarray) and out["y"].data.ptr != x.data.ptr


@pytest.mark.gpu
def test_device_changes_are_copied_and_counted():
    cupy = _cupy()
    p = Pipeline("cpu_then_gpu", inputs={"x": V}, max_batch_size=4)
    a = p.add(identity.with_options(device="cpu"), name="on_cpu", x=p.input("x"))
    p.output("y", p.add(identity.with_options(device="gpu"), name="on_gpu", x=a["x"])["x"])
    x = cupy.ones((2, 4), cupy.float32)

    async def main(**options):
        async with LocalRuntime(p, "ensemble", **options) as rt:
            return await rt.infer_with_report({"x": x})

    out, report = anyio.run(main)
    assert isinstance(out["y"], cupy.ndarray)
    assert report.copies == 2 and report.copy_bytes == 2 * x.nbytes  # to CPU, back to GPU

    p2 = chain(3, name="triton_cpu_rule")
    out, report = anyio.run(lambda: _infer(p2, x, force_cpu_only_input_tensors=True))
    assert isinstance(out["y"], np.ndarray)
    assert report.copies == 1 and report.copy_bytes == x.nbytes  # the first step's input lands on CPU


async def _infer(p, x, **options):
    async with LocalRuntime(p, "ensemble", **options) as rt:
        return await rt.infer_with_report({"x": x})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_yolov5_stays_on_the_gpu_in_every_form_and_finds_what_the_cpu_finds(mode):
    cupy = _cupy()
    from pipelines.examples.yolov5 import compare_to_truth, make_sample
    from pipelines.examples.yolov5 import pipeline as yolov5

    samples = [make_sample(seed=s, n_objects=5) for s in (3, 4)]
    images = np.stack([s["image"] for s in samples])

    async def main(x):
        async with LocalRuntime(yolov5, mode) as rt:
            return await rt.infer_with_report({"image": x})

    on_cpu, _ = anyio.run(main, images)
    on_gpu, report = anyio.run(main, cupy.asarray(images))
    assert isinstance(on_gpu["detections"], cupy.ndarray) and report.copies == 0
    found = cupy.asnumpy(on_gpu["detections"])
    np.testing.assert_allclose(found, on_cpu["detections"], rtol=1e-5, atol=1e-3)
    for i, s in enumerate(samples):
        assert compare_to_truth(found[i], s["boxes"], s["classes"]).exact


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ensemble", "bls", "bls-sync"])
def test_with_processes_asked_for_a_step_on_the_gpu_stays_in_this_process(mode):
    # CUDA cannot be used in a forked process: a step the runtime places on the GPU runs in
    # this process whatever the isolation, and its arrays stay on the GPU.
    import os

    cupy = _cupy()
    pid_spec = TensorSpec("INT64", [1])

    @step(inputs={"x": V}, outputs={"x": V, "pid": pid_spec})
    def where(x):
        return {"x": x + 1, "pid": np.full((1,), os.getpid())}

    p = Pipeline("where_on_gpu", inputs={"x": V})
    b = p.add(where, x=p.input("x"))
    p.output("y", b["x"])
    p.output("pid", b["pid"])

    async def main():
        async with LocalRuntime(p, mode, device="gpu", isolation="process") as rt:
            outs = [await rt.infer({"x": cupy.zeros(4, cupy.float32)}) for _ in range(3)]
            return outs, rt.report()

    outs, report = anyio.run(main)
    assert report.in_processes == ()
    for out in outs:
        assert isinstance(out["y"], cupy.ndarray) and int(out["y"][0]) == 1
        assert int(out["pid"][0]) == os.getpid()
