"""The BLS modes model the BLS model itself: like Triton's Python backend, each BLS
instance runs one execute() at a time, so "bls-sync" serialises requests and "bls"
runs the requests of one call side by side."""

from __future__ import annotations

import gc
import threading
import time
import warnings

import anyio
import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, TensorSpec, step
from pipelines.runtime import LocalRuntime

V = TensorSpec("FP32", [-1])


def tracked_pipeline(name):
    active, peak, lock = [0], [0], threading.Lock()

    @step(inputs={"x": V}, outputs={"y": V}, name="slow")
    def slow(x):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return {"y": x + 1}

    p = Pipeline(name, inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(slow.with_options(instance_count=4), x=p.input("x"))["y"])
    return p, peak


def serve(p, mode, n, **options):
    async def main():
        results = [None] * n
        async with LocalRuntime(p, mode, **options) as rt:
            async def one(i):
                results[i] = await rt.infer({"x": np.full((1, 2), i, np.float32)})

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        return results

    results = anyio.run(main)
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r["y"], np.full((1, 2), i + 1, np.float32))


def test_one_bls_sync_instance_answers_one_request_at_a_time():
    p, peak = tracked_pipeline("gate_sync")
    serve(p, "bls-sync", 6)
    assert peak[0] == 1


def test_more_bls_sync_instances_overlap_requests():
    p, peak = tracked_pipeline("gate_sync4")
    # One call takes up to max_batch_size (8) queued requests, as Triton's dynamic
    # batcher gives them to a free instance: 32 requests keep the 4 instances busy.
    serve(p, "bls-sync", 32, bls_instance_count=4)
    assert 1 < peak[0] <= 4


def test_async_bls_runs_the_requests_of_one_call_side_by_side():
    p, peak = tracked_pipeline("gate_async")
    serve(p, "bls", 8)
    assert 1 < peak[0] <= 4  # queued requests share a call; the step has 4 instances


def threads_pipeline(name):
    """A step that notes the thread each of its calls ran on (10 ms: not cheap enough to run
    inline for that alone)."""
    threads = []

    @step(inputs={"x": V}, outputs={"y": V}, name="noted")
    def noted(x):
        threads.append(threading.get_ident())
        time.sleep(0.01)
        return {"y": x + 1}

    p = Pipeline(name, inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(noted.with_options(instance_count=4), x=p.input("x"))["y"])
    return p, threads


@pytest.mark.parametrize(("mode", "options", "inline"), [
    ("bls-sync", {}, True),  # one request in the round at a time: its steps run as one request's do
    ("bls-sync", {"bls_instance_count": 2}, False),  # two rounds at once: threads, so they overlap
    ("bls", {}, False),  # the requests of a round run side by side
    ("ensemble", {}, False),
])
def test_a_request_alone_in_the_bls_rounds_runs_its_steps_inline(mode, options, inline):
    p, threads = threads_pipeline(f"alone_{mode.replace('-', '_')}_{len(options)}")
    serve(p, mode, 8, **options)
    on_the_loop = [t == threading.get_ident() for t in threads]
    assert len(on_the_loop) == 8
    # the first request of a round of one runs inline in every mode; the rest tell the modes apart
    assert all(on_the_loop) if inline else not all(on_the_loop)


def test_ensemble_mode_has_no_gate():
    p, peak = tracked_pipeline("gate_ens")
    serve(p, "ensemble", 8)
    assert peak[0] > 1


def test_a_bad_instance_count_is_refused():
    p, _ = tracked_pipeline("gate_bad")
    with pytest.raises(InferenceError, match="bls_instance_count must be an int >= 1"):
        LocalRuntime(p, "bls", bls_instance_count=0)


@pytest.mark.parametrize("mode", ["bls", "bls-sync", "fused"])
def test_a_runtime_closed_and_opened_again_leaves_no_stream_unclosed(mode):
    p, _ = tracked_pipeline(f"gate_close_{mode.replace('-', '_')}")

    async def main():
        rt = LocalRuntime(p, mode)
        for i in range(2):  # the gate's queue is made afresh for each opening
            async with rt:
                out = await rt.infer({"x": np.full((1, 2), i, np.float32)})
                np.testing.assert_array_equal(out["y"], np.full((1, 2), i + 1, np.float32))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anyio.run(main)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
