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


def test_the_requests_of_one_async_round_all_start_their_steps_at_once():
    """A round lets all its requests in before any of them runs: the first must not judge itself
    alone and run its step inline, holding the event loop while the others wait to start."""
    barrier = threading.Barrier(3, timeout=5)

    @step(inputs={"x": V}, outputs={"y": V}, name="meet")
    def meet(x):
        barrier.wait()  # all three requests of the round inside the step at once, or BrokenBarrierError
        return {"y": x + 1}

    p = Pipeline("round_meets", inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(meet.with_options(instance_count=3), x=p.input("x"))["y"])
    serve(p, "bls", 3)  # submitted together: one round of three


@pytest.mark.parametrize("concurrent", [False, True])
def test_the_gate_counts_the_requests_it_let_in_and_forgets_the_cancelled(concurrent):
    from pipelines.runtime.bls_gate import BlsGate

    gate = BlsGate(instances=1, concurrent=concurrent, max_rows=8)
    seen = {}

    async def one(i, hold, cancel_after=None):
        with anyio.move_on_after(cancel_after):
            async with gate.slot(1):
                seen[i] = gate.admitted
                await anyio.sleep(hold)

    async def main():
        async with anyio.create_task_group() as service:
            service.start_soon(gate.serve)
            async with anyio.create_task_group() as tg:
                for i in range(3):  # one round of three; the third cancelled before a sync round reaches it
                    tg.start_soon(one, i, 0.05, 0.03 if i == 2 else None)
                await anyio.sleep(0.01)
                tg.start_soon(one, 8, 0.0, 0.01)  # cancelled while it waits for a round
                tg.start_soon(one, 7, 1.0, 0.3)  # the next round's, cancelled inside it
            service.cancel_scope.cancel()
        return gate.admitted

    assert anyio.run(main) == 0
    # a sync round lets its requests in one at a time; an async one, all of them at once
    assert seen == ({0: 3, 1: 3, 2: 3, 7: 1} if concurrent else {0: 1, 1: 1, 7: 1})


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

    gc.collect()  # what earlier tests of this process left for the collector is not this runtime's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anyio.run(main)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
