"""isolation="auto": a step starts in this process's threads and moves to processes of its
own once its first calls show that it keeps a core busy (``MOVE_CPU_S``); a light step stays.
The move builds each instance afresh in its process while the thread's instance serves, and
finalizes the thread's instance; nothing is lost or answered twice meanwhile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from replay_helpers import burn_cpu, flat_profile

from pipelines import InferenceError, Pipeline, TensorSpec, step
from pipelines.runtime import LocalRuntime
from pipelines.runtime.instances import MOVE_CPU_S
from pipelines.runtime.step_process import isolation_supported

pytestmark = pytest.mark.skipif(not isolation_supported(), reason="process isolation needs Linux (fork and memfd)")

V = TensorSpec("FP32", [-1])
PID = TensorSpec("INT64", [1])


def busy_and_light(log: Path | None = None, *, batching: bool = False) -> Pipeline:
    """``busy`` burns twice ``MOVE_CPU_S`` of CPU a call; ``light`` and ``sleepy`` burn almost none
    (``sleepy`` sleeps as long: waiting is not what moves a step). ``busy``'s initialize() and
    finalize() write to ``log`` with the process they ran in."""
    options = {"dynamic_batching": {"max_queue_delay_us": 2000}} if batching else {}

    @step(inputs={"x": V}, outputs={"y": V, "pid": PID}, **options)
    class Busy:
        def initialize(self, config):
            if log is not None:
                with log.open("a") as f:
                    f.write(f"initialize {os.getpid()}\n")

        def execute(self, x):
            burn_cpu(2 * MOVE_CPU_S)
            return {"y": x + 1, "pid": np.full((x.shape[0], 1) if batching else (1,), os.getpid())}

        def finalize(self):
            if log is not None:
                with log.open("a") as f:
                    f.write(f"finalize {os.getpid()}\n")

    @step(inputs={"y": V}, outputs={"z": V, "pid": PID}, **options)
    def light(y):
        return {"z": y * 2, "pid": np.full((y.shape[0], 1) if batching else (1,), os.getpid())}

    @step(inputs={"y": V}, outputs={"w": V, "pid": PID}, **options)
    def sleepy(y):
        time.sleep(2 * MOVE_CPU_S)
        return {"w": y - 1, "pid": np.full((y.shape[0], 1) if batching else (1,), os.getpid())}

    p = Pipeline("auto", inputs={"x": V}, max_batch_size=8 if batching else 0)
    b = p.add(Busy, name="busy", x=p.input("x"))
    lt = p.add(light, y=b["y"])
    s = p.add(sleepy, y=b["y"])
    p.output("z", lt["z"])
    p.output("w", s["w"])
    for name, node in (("busy", b), ("light", lt), ("sleepy", s)):
        p.output(f"{name}_pid", node["pid"])
    return p


async def _until_moved(rt: LocalRuntime, request: dict, answers: list[dict], *, seconds: float = 20.0) -> None:
    """Serve ``request`` until ``busy`` answers from another process (its successor arrived)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answers.append(await rt.infer(request))
        if int(np.ravel(answers[-1]["busy_pid"])[0]) != os.getpid():
            return
    raise AssertionError(f"busy never moved to a process in {seconds} s of requests")


@pytest.mark.parametrize("mode", ["ensemble", "bls", "bls-sync"])
def test_a_busy_step_moves_to_a_process_and_light_or_sleeping_ones_stay(tmp_path, mode):
    log = tmp_path / "log"
    x = np.arange(4, dtype=np.float32)
    answers: list[dict] = []

    async def main() -> None:
        async with LocalRuntime(busy_and_light(log), mode, isolation="auto") as rt:
            await _until_moved(rt, {"x": x}, answers)
            for _ in range(5):  # and it stays there
                answers.append(await rt.infer({"x": x}))
            report = rt.report()
            assert report.in_processes == ("busy",)
            assert "steps in processes of their own: busy\n" in str(report)
            assert report.to_dict()["in_processes"] == ["busy"]

    anyio.run(main)
    me = os.getpid()
    assert int(answers[0]["busy_pid"][0]) == me  # it started in a thread
    assert all(int(a["busy_pid"][0]) != me for a in answers[-6:])
    for a in answers:  # the same answers all along, from threads and from the process
        assert int(a["light_pid"][0]) == me and int(a["sleepy_pid"][0]) == me
        np.testing.assert_array_equal(a["z"], (x + 1) * 2)
        np.testing.assert_array_equal(a["w"], x)
    child = int(answers[-1]["busy_pid"][0])
    # initialize() ran again in the step's process, the thread's instance was finalized, and the
    # process's at close: each instance once.
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted([f"initialize {me}", f"initialize {child}", f"finalize {me}", f"finalize {child}"])
    assert lines.index(f"initialize {child}") < lines.index(f"finalize {me}")  # the successor came first


def test_requests_at_once_lose_nothing_while_a_batching_step_moves():
    x = np.arange(3, dtype=np.float32)
    results: list[dict] = []

    async def main() -> dict:
        async with LocalRuntime(busy_and_light(batching=True), isolation="auto") as rt:
            models = dict(rt._models)
            async def client(k: int) -> None:
                for i in range(30):
                    out = await rt.infer({"x": (x + 10 * k + i)[None]})
                    results.append({"k": k, "i": i, **out})

            async with anyio.create_task_group() as tg:
                for k in range(4):
                    tg.start_soon(client, k)
            return models

    models = anyio.run(main)
    assert len(results) == 120
    for r in results:
        base = x + 10 * r["k"] + r["i"]
        np.testing.assert_array_equal(r["z"][0], (base + 1) * 2)
        np.testing.assert_array_equal(r["w"][0], base)
    assert any(int(r["busy_pid"][0, 0]) != os.getpid() for r in results)
    assert models["busy"].pool.moved == 1 and models["light"].pool.moved == 0


def test_the_default_is_auto_with_a_profile_and_thread_without():
    p = busy_and_light()
    assert LocalRuntime(p).isolation == "thread"
    assert LocalRuntime(p, profile=flat_profile()).isolation == "auto"
    assert LocalRuntime(p, profile=flat_profile(), isolation="thread").isolation == "thread"
    assert LocalRuntime(p, isolation="process").isolation == "process"
    with pytest.raises(InferenceError, match=r"isolation must be one of thread, process, auto; got 'stubs'"):
        LocalRuntime(p, isolation="stubs")


def test_one_step_on_two_nodes_moves_once_for_both():
    @step(inputs={"x": V}, outputs={"y": V, "pid": PID})
    def work(x):
        burn_cpu(2 * MOVE_CPU_S)
        return {"y": x + 1, "pid": np.array([os.getpid()])}

    p = Pipeline("twice", inputs={"x": V})
    a = p.add(work, name="a", x=p.input("x"))
    b = p.add(work, name="b", x=a["y"])
    p.output("y", b["y"])
    p.output("a_pid", a["pid"])
    p.output("b_pid", b["pid"])
    x = np.zeros(2, np.float32)

    async def main() -> tuple[list[dict], dict]:
        outs = []
        async with LocalRuntime(p, isolation="auto") as rt:
            models = dict(rt._models)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                outs.append(await rt.infer({"x": x}))
                if int(outs[-1]["a_pid"][0]) != os.getpid() and int(outs[-1]["b_pid"][0]) != os.getpid():
                    break
            return outs, models

    outs, models = anyio.run(main)
    last = outs[-1]
    assert int(last["a_pid"][0]) == int(last["b_pid"][0]) != os.getpid()  # one instance, in one process
    assert models["a"].pool is models["b"].pool and models["a"].pool.moved == 1
    np.testing.assert_array_equal(last["y"], x + 2)


def test_a_step_whose_process_cannot_initialize_keeps_serving_from_its_thread(tmp_path):
    # initialize() fails only outside the process that built the first instance: the move fails,
    # and the thread's instance goes on serving, with the reason kept on the pool.
    parent = os.getpid()

    @step(inputs={"x": V}, outputs={"y": V, "pid": PID})
    class Picky:
        def initialize(self, config):
            if os.getpid() != parent:
                raise RuntimeError("this step's weights live in its first process")

        def execute(self, x):
            burn_cpu(2 * MOVE_CPU_S)
            return {"y": x * 3, "pid": np.array([os.getpid()])}

    p = Pipeline("picky", inputs={"x": V})
    n = p.add(Picky, name="picky", x=p.input("x"))
    p.output("y", n["y"])
    p.output("pid", n["pid"])
    x = np.ones(2, np.float32)

    async def main() -> tuple[list[dict], object]:
        async with LocalRuntime(p, isolation="auto") as rt:
            pool = rt._models["picky"].pool
            outs = [await rt.infer({"x": x}) for _ in range(5)]
            deadline = time.monotonic() + 20
            while pool.move_error is None and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            outs += [await rt.infer({"x": x}) for _ in range(5)]
            assert rt.report().in_processes == ()  # it never moved
            return outs, pool

    outs, pool = anyio.run(main)
    assert "weights live in its first process" in str(pool.move_error)
    assert all(int(o["pid"][0]) == parent for o in outs)
    for o in outs:
        np.testing.assert_array_equal(o["y"], x * 3)
