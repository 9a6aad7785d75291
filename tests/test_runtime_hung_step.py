"""A hung step (issue 11.3): a sync call that runs past its timeout is abandoned, a fresh
instance takes its place so later requests succeed, and the process still exits at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepTimeoutError, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime

V = TensorSpec("FP32", [2])
X = np.zeros((1, 2), np.float32)


def hanging_pipeline(events: dict, *, batching: bool = False) -> Pipeline:
    """One step whose first instance hangs on its first call, until ``events['release']`` is set."""

    class Hangs:
        def initialize(self, config):
            self.index = len(events["inits"])
            events["inits"].append(config["model_instance_name"])

        def execute(self, x):
            if self.index == 0:
                events["release"].wait(60)
            return {"y": x + 1}

        def finalize(self):
            events["finalized"].append(self.index)

    options = {"dynamic_batching": {"max_queue_delay_us": 100}} if batching else {}
    hangs = step(Hangs, name="hangs", inputs={"x": V}, outputs={"y": V}, timeout=1, **options)
    p = Pipeline("hung", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(hangs, x=p.input("x"))["y"])
    return p


@pytest.mark.parametrize(("mode", "batching"), [*((m, False) for m in MODES), ("ensemble", True)])
def test_a_timed_out_instance_is_replaced_and_later_requests_succeed(mode, batching):
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events, batching=batching)

    async def main():
        async with LocalRuntime(p, mode) as rt:
            with pytest.raises(StepTimeoutError, match=r"step 'hangs' ran past its timeout of 1 s.*fresh instance"):
                await rt.infer({"x": X})
            answers = [await rt.infer({"x": X}) for _ in range(3)]  # the fresh instance serves them
            pool = rt._models["hangs"].pool
            return answers, pool.renewed

    try:
        answers, renewed = anyio.run(main)
        assert renewed == 1 and len(events["inits"]) == 2
        for out in answers:
            np.testing.assert_array_equal(out["y"], X + 1)
        assert events["finalized"] == [1]  # the fresh one at close; the stuck one is still running
        events["release"].set()
        with anyio.from_thread.start_blocking_portal() as portal:  # wait for the stuck call to end
            portal.call(_wait_until, lambda: 0 in events["finalized"])
        assert sorted(events["finalized"]) == [0, 1]  # the stuck instance is finalized once it returns
    finally:
        events["release"].set()


async def _wait_until(predicate) -> None:
    with anyio.fail_after(10):
        while not predicate():
            await anyio.sleep(0.02)


def test_a_process_with_a_hung_step_exits_at_once():
    script = textwrap.dedent(
        """
        import threading, numpy as np
        from pipelines import Pipeline, StepTimeoutError, TensorSpec, step

        V = TensorSpec("FP32", [2])

        @step(inputs={"x": V}, outputs={"y": V}, timeout=1)
        def hangs(x):
            threading.Event().wait()  # for ever
            return {"y": x}

        p = Pipeline("hung", inputs={"x": V}, max_batch_size=4)
        p.output("y", p.add(hangs, x=p.input("x"))["y"])
        try:
            p.run({"x": np.zeros((1, 2), np.float32)})
        except StepTimeoutError as exc:
            print("timed out:", exc.step)
        """
    )
    # A process that waited for the abandoned thread would never end; this one must end by itself.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "timed out: hangs" in done.stdout
