"""The local runtime's "fused" mode: Python steps cross no process (no server copy),
external steps are still called through BLS (copied at their boundary), and the model's
instance count gates its executions."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, TensorSpec, external_model, step
from pipelines.runtime.local import LocalRuntime, run_many

V = TensorSpec("FP32", [-1])
X = np.ones((1, 1024), np.float32)


@step(inputs={"x": V}, outputs={"y": V})
def halve(x):
    return {"y": x / 2}


@step(inputs={"x": V}, outputs={"y": V})
def negate(x):
    return {"y": -x}


def one_step() -> Pipeline:
    p = Pipeline("one_step", inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(negate, x=p.input("x"))["y"])
    return p


def with_external() -> Pipeline:
    detector = external_model(
        "detector", inputs={"x": V}, outputs={"y": V}, backend="onnxruntime", stand_in=lambda x: {"y": x * 10}
    )
    p = Pipeline("ext", inputs={"x": V}, max_batch_size=8)
    a = p.add(halve, x=p.input("x"))
    p.output("y", p.add(halve, name="again", x=p.add(detector, x=a["y"])["y"])["y"])
    return p


def _one(pipeline, mode, **options):
    async def main():
        async with LocalRuntime(pipeline, mode=mode, **options) as rt:
            return await rt.infer_with_report({"x": X})

    return anyio.run(main)


@pytest.mark.parametrize(("pipeline", "copies"), [(one_step, 0), (with_external, 2 * 2)])
def test_server_copies_are_made_only_at_an_external_steps_boundary(pipeline, copies):
    outputs, report = _one(pipeline(), "fused", server_copies=True)
    np.testing.assert_array_equal(outputs["y"], -X if pipeline is one_step else X * 2.5)
    assert report.copies == copies  # the detector's input and output, two crossings each
    _, bls = _one(pipeline(), "bls", server_copies=True)
    assert bls.copies == 2 * 2 * len(pipeline().nodes)


def test_the_fused_instance_count_gates_executions():
    rt = LocalRuntime(one_step(), "fused", fused_instance_count=3, bls_instance_count=5)
    assert rt._bls_gate.instances == 3
    assert LocalRuntime(one_step(), "bls", fused_instance_count=3, bls_instance_count=5)._bls_gate.instances == 5
    with pytest.raises(InferenceError, match="fused_instance_count must be an int >= 1; got 0"):
        LocalRuntime(one_step(), "fused", fused_instance_count=0)
    results, _ = run_many(with_external(), [{"x": X}] * 6, mode="fused", concurrency=3, fused_instance_count=2)
    for out in results:
        np.testing.assert_array_equal(out["y"], X * 2.5)
