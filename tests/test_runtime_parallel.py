"""Independent steps overlap in "ensemble" and "bls" (proven with a barrier both
branches must reach), never in "bls-sync"; instances run at once up to their count;
initialize and finalize run once per instance; a failing step cancels its siblings."""

from __future__ import annotations

import re
import threading
import time

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepError, TensorSpec, step
from pipelines.runtime import LocalRuntime

V = TensorSpec("FP32", [2])
X = np.ones((1, 2), np.float32)


class Concurrency:
    """How many steps run at once, at most."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        with self.lock:
            self.now -= 1


def diamond(branch_a, branch_b, *, name="diamond", **options) -> Pipeline:
    @step(inputs={"x": V}, outputs={"x": V})
    def source(x):
        return {"x": x}

    a = step(branch_a, inputs={"x": V}, outputs={"y": V}, name="a", **options)
    b = step(branch_b, inputs={"x": V}, outputs={"y": V}, name="b", **options)

    @step(inputs={"a": V, "b": V}, outputs={"y": V})
    def join(a, b):
        return {"y": a + b}

    p = Pipeline(name, inputs={"x": V}, max_batch_size=4)
    s = p.add(source, x=p.input("x"))
    p.output("y", p.add(join, a=p.add(a, x=s["x"])["y"], b=p.add(b, x=s["x"])["y"])["y"])
    return p


@pytest.mark.parametrize("mode", ["ensemble", "bls"])
def test_branches_overlap(mode):
    barrier = threading.Barrier(2, timeout=10)

    def meet(x):
        barrier.wait()  # breaks (and the step fails) unless the other branch is running too
        return {"y": x + 1}

    p = diamond(meet, meet)
    np.testing.assert_array_equal(p.run({"x": X}, mode=mode)["y"], X * 2 + 2)


@pytest.mark.parametrize("mode", ["ensemble", "bls"])
def test_branches_overlap_on_every_request_not_only_the_first(mode):
    """Later requests find idle worker threads; the branches must still get one each."""
    barrier = threading.Barrier(2, timeout=10)

    def meet(x):
        barrier.wait()
        return {"y": x + 1}

    p = diamond(meet, meet)

    async def main():
        async with LocalRuntime(p, mode, offload="always") as rt:
            return [await rt.infer({"x": X}) for _ in range(5)]

    for out in anyio.run(main):
        np.testing.assert_array_equal(out["y"], X * 2 + 2)


def test_bls_sync_runs_one_step_at_a_time():
    seen = Concurrency()

    def slow(x):
        with seen:
            time.sleep(0.02)  # room for another step to start, if the scheduler let it
        return {"y": x + 1}

    p = diamond(slow, slow)

    async def main():
        async with LocalRuntime(p, "bls-sync") as rt:
            return await rt.infer({"x": X})

    np.testing.assert_array_equal(anyio.run(main)["y"], X * 2 + 2)
    assert seen.peak == 1

    barrier = threading.Barrier(2, timeout=0.3)

    def meet(x):
        barrier.wait()
        return {"y": x}

    with pytest.raises(StepError, match="step 'a'.*BrokenBarrierError"):
        diamond(meet, meet, name="sync_barrier").run({"x": X}, mode="bls-sync")


@pytest.mark.parametrize("count, peak", [(1, 1), (2, 2)])
def test_instances_run_at_once_up_to_their_count(count, peak):
    seen = Concurrency()
    barrier = threading.Barrier(2, timeout=10)

    @step(inputs={"x": V}, outputs={"y": V}, instance_count=count)
    def work(x):
        with seen:
            if count == 2:
                barrier.wait()  # two requests meet inside two instances
            else:
                time.sleep(0.02)
        return {"y": x * 3}

    p = Pipeline(f"instances{count}", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(work, x=p.input("x"))["y"])

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            results = {}

            async def one(i):
                results[i] = await rt.infer({"x": X * i})

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
        return results

    results = anyio.run(main)
    assert all(np.array_equal(results[i]["y"], X * i * 3) for i in range(4))
    assert seen.peak == peak


def test_initialize_and_finalize_run_once_per_instance():
    events = []

    class Counter:
        def initialize(self, config):
            self.name = config["model_instance_name"]
            self.calls = 0
            events.append(("initialize", self.name, config["model_config"]["max_batch_size"]))

        def execute(self, x):
            self.calls += 1
            return {"y": x + self.calls}

        def finalize(self):
            events.append(("finalize", self.name))

    counter = step(Counter, inputs={"x": V}, outputs={"y": V}, instance_count=3, name="counter")
    p = Pipeline("lifecycle", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(counter, x=p.input("x"))["y"])

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            assert sorted(e[0] for e in events) == ["initialize"] * 3
            for _ in range(5):
                await rt.infer({"x": X})
            assert len(events) == 3

    anyio.run(main)
    names = {f"counter_{i}" for i in range(3)}
    assert {e[1] for e in events if e[0] == "initialize"} == names
    assert {e[1] for e in events if e[0] == "finalize"} == names
    assert all(e[2] == 4 for e in events if e[0] == "initialize")


@pytest.mark.parametrize("mode", ["ensemble", "bls"])
def test_a_failing_step_cancels_its_siblings_and_the_runtime_keeps_serving(mode):
    cancelled = []
    fail = [True]

    def broken(x):
        if fail[0]:
            raise ValueError("bad weights")
        return {"y": x}

    async def waits(x):
        if fail[0]:
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                cancelled.append("b")
                raise
        return {"y": x}

    p = diamond(broken, waits, name=f"failing_{mode.replace('-', '_')}")

    async def main():
        async with LocalRuntime(p, mode) as rt:
            with pytest.raises(StepError) as info:
                await rt.infer({"x": X})
            fail[0] = False
            out = await rt.infer({"x": X})
            return info.value, out, rt.report()

    err, out, report = anyio.run(main)
    assert err.step == "a" and err.pipeline == p.name
    assert f"pipeline {p.name!r}, node 'a', step " in str(err) and re.search(r": raised ValueError: bad weights \(at test_runtime_parallel\.py:\d+\)$", str(err))
    assert cancelled == ["b"]
    np.testing.assert_array_equal(out["y"], X * 2)
    assert report.errors == 1 and report.requests == 1


def test_a_failing_step_does_not_wait_for_a_sibling_stuck_in_a_thread():
    release = threading.Event()

    def broken(x):
        raise RuntimeError("boom")

    def stuck(x):
        release.wait(30)
        return {"y": x}

    p = diamond(broken, stuck, name="stuck_sibling")
    try:
        with pytest.raises(StepError, match=r"node 'a', step '[^']+': raised RuntimeError: boom"):
            p.run({"x": X}, mode="ensemble")
        assert not release.is_set()  # answered while the sibling was still running
    finally:
        release.set()


def test_cancelling_a_step_on_its_way_to_a_thread_does_not_lose_the_instance():
    # b is started first and hops to a thread; a fails at once and cancels it, sometimes
    # before the thread has picked the call up. Its one instance must come back either way.
    fail = [True]

    async def broken(x):
        if fail[0]:
            raise ValueError("no")
        return {"y": x}

    def plain(x):
        return {"y": x}

    p = diamond(plain, broken, name="cancel_race")

    async def main():
        async with LocalRuntime(p, "ensemble", offload="always") as rt:
            for _ in range(60):
                with pytest.raises(StepError):
                    await rt.infer({"x": X})
            fail[0] = False
            with anyio.fail_after(10):
                return await rt.infer({"x": X})

    np.testing.assert_array_equal(anyio.run(main)["y"], X * 2)


@pytest.mark.parametrize("share_model", [None, True])
def test_a_step_used_by_two_nodes_is_a_step_model_per_node_or_one_shared_as_on_the_server(share_model):
    """Two parallel uses of one step each get a step model of their own, as they get a composing
    model each in a compiled repository; asked to share (``share_model=True``) they share one
    model's instances: with one instance they take turns, with two they overlap."""
    v = TensorSpec("FP32", [-1])
    state = {"active": 0, "peak": 0, "inits": 0}
    lock = threading.Lock()

    class Slow:
        def initialize(self, config):
            with lock:
                state["inits"] += 1

        def execute(self, x):
            with lock:
                state["active"] += 1
                state["peak"] = max(state["peak"], state["active"])
            time.sleep(0.03)
            with lock:
                state["active"] -= 1
            return {"y": x + 1}

    for count in (1, 2):
        state.update(active=0, peak=0, inits=0)
        slow = step(Slow, name="slow", inputs={"x": v}, outputs={"y": v}, instance_count=count, share_model=share_model)
        p = Pipeline(f"twice{count}", inputs={"x": v}, max_batch_size=4)
        a = p.add(slow, name="left", x=p.input("x"))
        b = p.add(slow, name="right", x=p.input("x"))
        p.output("a", a["y"])
        p.output("b", b["y"])

        async def main(p=p):
            async with LocalRuntime(p, "ensemble", offload="always") as rt:
                return await rt.infer({"x": np.zeros((1, 2), np.float32)})

        out = anyio.run(main)
        np.testing.assert_array_equal(out["a"], np.ones((1, 2), np.float32))
        np.testing.assert_array_equal(out["b"], np.ones((1, 2), np.float32))
        if share_model:
            assert state["inits"] == count  # instances of the step, not of each node
            assert state["peak"] == count
        else:
            assert state["inits"] == 2 * count  # instances of each node's model
            assert state["peak"] == 2  # the two nodes, one call each, at once
