"""Dynamic batching: concurrent requests are gathered into batches up to
max_batch_size, run once, and split back; nobody gets another caller's rows, and
one bad request in a batch does not take the others down."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepError, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime

V = TensorSpec("FP64", [2])


def batched_pipeline(name, fn, *, max_batch_size=8, delay_us=20_000, instance_count=1, pipeline_batch=4):
    s = step(fn, inputs={"x": V}, outputs={"y": V}, name="model", max_batch_size=max_batch_size,
             dynamic_batching={"max_queue_delay_us": delay_us}, instance_count=instance_count)

    @step(inputs={"x": V}, outputs={"x": V})
    def pre(x):
        return {"x": x + 0.0}

    p = Pipeline(name, inputs={"x": V}, max_batch_size=pipeline_batch)
    p.output("y", p.add(s, x=p.add(pre, x=p.input("x"))["x"])["y"])
    return p


async def fire(rt, requests):
    results = {}

    async def one(i, req):
        try:
            results[i] = await rt.infer(req)
        except Exception as exc:  # each caller keeps its own error
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            tg.start_soon(one, i, req)
    return results


@pytest.mark.parametrize("mode", MODES)
def test_64_concurrent_requests_get_their_own_rows(mode):
    sizes = []
    lock = threading.Lock()

    def model(x):
        with lock:
            sizes.append(x.shape[0])
        return {"y": x * 2 + np.arange(x.shape[0])[:, None] * 0}  # rows stay rows

    p = batched_pipeline(f"batch64_{mode.replace('-', '_')}", model)
    # request i carries (i % 3 + 1) rows, each row tagged with i and its row number
    requests = [{"x": np.stack([[i, r] for r in range(i % 3 + 1)]).astype(np.float64)} for i in range(64)]

    async def main():
        # Several BLS instances, as on a server: one instance runs one execute() at a time,
        # and a lone bls-sync instance would never let two requests reach the step together.
        async with LocalRuntime(p, mode, bls_instance_count=8) as rt:
            results = await fire(rt, requests)
            return results, rt.report()

    results, report = anyio.run(main)
    for i, req in enumerate(requests):
        np.testing.assert_array_equal(results[i]["y"], req["x"] * 2)
    assert sum(sizes) == sum(r["x"].shape[0] for r in requests)  # every row ran exactly once
    assert max(sizes) > 1 and max(sizes) <= 8
    cost = report.step("model")
    assert cost.calls == 64 and cost.batches == len(sizes) and cost.mean_batch > 1


def test_a_bad_request_in_a_batch_does_not_take_the_others_down():
    gate = threading.Event()

    def model(x):
        gate.wait(10)  # hold the first batch so the rest queue up behind it
        if (x < 0).any():
            raise ValueError("negative input")
        return {"y": x * 2}

    p = batched_pipeline("poisoned", model, delay_us=50_000)
    requests = [{"x": np.full((1, 2), -1.0 if i in (3, 11) else float(i))} for i in range(16)]

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            async with anyio.create_task_group() as tg:
                box = {}

                async def run():
                    box["results"] = await fire(rt, requests)

                tg.start_soon(run)
                await anyio.sleep(0.05)
                gate.set()
            after = await rt.infer({"x": np.ones((1, 2))})
            return box["results"], after, rt.report()

    results, after, report = anyio.run(main)
    for i, req in enumerate(requests):
        if i in (3, 11):
            assert isinstance(results[i], StepError), results[i]
            assert results[i].step == "model" and "negative input" in str(results[i])
        else:
            np.testing.assert_array_equal(results[i]["y"], req["x"] * 2)
    np.testing.assert_array_equal(after["y"], np.full((1, 2), 2.0))
    assert report.errors == 2


def test_two_instances_batch_in_parallel():
    barrier = threading.Barrier(2, timeout=10)

    def model(x):
        barrier.wait()  # two batches meet, one in each instance
        return {"y": x * 2}

    # batches of one row: the two requests cannot share a batch, so they need both instances
    p = batched_pipeline("two_instances", model, max_batch_size=1, delay_us=0, instance_count=2, pipeline_batch=1)

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            return await fire(rt, [{"x": np.full((1, 2), float(i))} for i in range(2)])

    results = anyio.run(main)
    for i in range(2):
        np.testing.assert_array_equal(results[i]["y"], np.full((1, 2), 2.0 * i))


@pytest.mark.parametrize("mode", ["ensemble", "fused"])
def test_requests_whose_rows_differ_in_shape_are_not_batched_together(mode):
    # As Triton's dynamic batcher: only rows of one shape join a batch (no ragged batching).
    seen = []

    def model(x):
        seen.append((x.shape, set(np.unique(x).tolist())))  # every row of request n is filled with n
        return {"y": x * 2}

    ragged = TensorSpec("FP64", [-1])
    s = step(model, inputs={"x": ragged}, outputs={"y": ragged}, name="model", max_batch_size=8,
             dynamic_batching={"max_queue_delay_us": 50_000})
    p = Pipeline(f"ragged_{mode}", inputs={"x": ragged}, max_batch_size=4)
    p.output("y", p.add(s, x=p.input("x"))["y"])
    requests = [{"x": np.full((1, n), float(n))} for n in (2, 2, 3, 2, 3)]

    async def main():
        async with LocalRuntime(p, mode) as rt:
            return await fire(rt, requests)

    results = anyio.run(main)
    for i, req in enumerate(requests):
        assert not isinstance(results[i], Exception), results[i]
        np.testing.assert_array_equal(results[i]["y"], req["x"] * 2)
    assert all(values == {float(shape[1])} for shape, values in seen)  # each call: requests of one width
    assert {shape[1] for shape, _ in seen} == {2, 3}
    assert sum(shape[0] for shape, _ in seen) == len(requests) and len(seen) < len(requests)  # some joined
