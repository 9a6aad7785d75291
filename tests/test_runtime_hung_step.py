"""A hung step (issue 11.3): a sync call that runs past its timeout is abandoned, a fresh
instance takes its place so later requests succeed, and the process still exits at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepTimeoutError, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime

V = TensorSpec("FP32", [2])
X = np.zeros((1, 2), np.float32)


def hanging_pipeline(
    events: dict, *, batching: bool = False, delay_us: int = 100, renewal_s: float = 0.0
) -> Pipeline:
    """One step whose first instance hangs on its first call, until ``events['release']`` is set;
    a fresh instance takes ``renewal_s`` to initialize."""

    class Hangs:
        def initialize(self, config):
            self.index = len(events["inits"])
            events["inits"].append(config["model_instance_name"])
            if self.index:
                time.sleep(renewal_s)

        def execute(self, x):
            if self.index == 0:
                events["release"].wait(60)
            return {"y": x + 1}

        def finalize(self):
            events["finalized"].append(self.index)

    options = {"dynamic_batching": {"max_queue_delay_us": delay_us}} if batching else {}
    hangs = step(Hangs, name="hangs", inputs={"x": V}, outputs={"y": V}, timeout=1, **options)
    p = Pipeline("hung", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(hangs, x=p.input("x"))["y"])
    return p


# The fused mode replaces a stuck instance, as the fused model does on the server; the ensemble
# mode does so only when asked (enforce_timeouts=True): Triton's ensemble times no step out.
REPLACING = [("fused", False), ("ensemble", False), ("ensemble", True)]


@pytest.mark.parametrize(("mode", "batching"), REPLACING)
def test_a_timed_out_instance_is_replaced_and_later_requests_succeed(mode, batching):
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events, batching=batching)

    async def main():
        async with LocalRuntime(p, mode, enforce_timeouts=True) as rt:
            with pytest.raises(StepTimeoutError, match=r"node 'hangs', step '[^']+': ran past its timeout of 1 s.*fresh instance"):
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


@pytest.mark.parametrize(("mode", "batching"), [*((m, False) for m in MODES), ("ensemble", True)])
def test_a_request_queued_behind_a_hung_call_fails_only_where_the_server_fails_it(mode, batching):
    """The server's BLS calls are dropped once queued past the step's timeout; its fused model
    lets them wait for the instance that replaces the stuck one (and the ensemble mode, asked to
    time steps out, does the same)."""
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events, batching=batching, renewal_s=0.5)  # the fresh one comes after the queued call's timeout
    outcome: dict[str, object] = {}

    async def queued(rt):
        await anyio.sleep(0.05)  # behind the hung call, not in its batch
        try:
            outcome["queued"] = await rt.infer({"x": X})
        except StepTimeoutError as exc:
            outcome["queued"] = exc

    async def main():
        # Two BLS instances, so the queued request makes its call at once rather than in the next round.
        async with LocalRuntime(p, mode, bls_instance_count=2, enforce_timeouts=True) as rt:
            async with anyio.create_task_group() as tg:
                tg.start_soon(queued, rt)
                with pytest.raises(StepTimeoutError, match="ran past its timeout of 1 s"):
                    await rt.infer({"x": X})

    try:
        anyio.run(main)
    finally:
        events["release"].set()
    got = outcome["queued"]
    if mode in ("bls", "bls-sync"):
        assert isinstance(got, StepTimeoutError), got
        assert "ran past its timeout of 1 s (waiting for a free instance)" in str(got), got
    else:
        assert not isinstance(got, BaseException), got
        np.testing.assert_array_equal(got["y"], X + 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_that_got_stuck_is_rerun_one_request_at_a_time_where_the_server_reruns_it(mode):
    """Two requests in one batch on the instance that hangs: the fused mode (and the ensemble
    mode asked to time steps out) reruns each alone on the fresh instance, as the fused model
    reruns a failed joined run one request at a time; the BLS modes fail both, as the server's
    BLS calls time out while the stuck call holds its instance."""
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events, batching=True, delay_us=200_000, renewal_s=0.5)
    got: list[object] = []

    async def one(rt):
        try:
            got.append(await rt.infer({"x": X}))
        except StepTimeoutError as exc:
            got.append(exc)

    async def main():
        async with LocalRuntime(p, mode, bls_instance_count=2, enforce_timeouts=True) as rt:
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, rt)
                tg.start_soon(one, rt)

    try:
        anyio.run(main)
    finally:
        events["release"].set()
    assert len(got) == 2
    if mode in ("bls", "bls-sync"):
        assert all(isinstance(g, StepTimeoutError) for g in got), got
        assert len(events["inits"]) == 1  # no fresh instance: the stuck call holds the only one
    else:
        for g in got:
            assert not isinstance(g, BaseException), g
            np.testing.assert_array_equal(g["y"], X + 1)
        assert len(events["inits"]) == 2  # one fresh instance served both reruns


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
            p.run({"x": np.zeros((1, 2), np.float32)}, mode="fused")
        except StepTimeoutError as exc:
            print("timed out:", exc.step)
        """
    )
    # A process that waited for the abandoned thread would never end; this one must end by itself.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "timed out: hangs" in done.stdout


@pytest.mark.parametrize("mode", ["bls", "bls-sync"])
def test_a_bls_call_past_its_timeout_keeps_its_instance_and_the_calls_behind_it_time_out_until_it_returns(mode):
    """As on the server: the step model runs the call the BLS model gave up on to its end."""
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events)

    async def main():
        async with LocalRuntime(p, mode) as rt:
            with pytest.raises(StepTimeoutError, match="ran past its timeout of 1 s"):
                await rt.infer({"x": X})
            with pytest.raises(StepTimeoutError, match=r"ran past its timeout of 1 s \(waiting for a free instance\)"):
                await rt.infer({"x": X})  # the stuck call still holds the one instance
            events["release"].set()
            await _wait_until(lambda: rt._models["hangs"].pool.try_acquire_peek())
            return await rt.infer({"x": X}), rt._models["hangs"].pool.renewed

    try:
        out, renewed = anyio.run(main)
    finally:
        events["release"].set()
    np.testing.assert_array_equal(out["y"], X + 1)
    assert renewed == 0 and len(events["inits"]) == 1  # the same instance serves again


def test_the_ensemble_mode_times_no_step_out_as_triton_s_ensemble_does():
    """A hung step holds its request, and the request queued behind it, until it returns."""
    events = {"inits": [], "finalized": [], "release": threading.Event()}
    p = hanging_pipeline(events)
    got: list[object] = []

    async def one(rt, delay):
        await anyio.sleep(delay)
        got.append(await rt.infer({"x": X}))

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, rt, 0.0)
                tg.start_soon(one, rt, 0.05)
                await anyio.sleep(1.5)  # past the step's timeout of 1 s: nothing has failed
                assert got == []
                events["release"].set()

    try:
        anyio.run(main)
    finally:
        events["release"].set()
    assert len(got) == 2 and len(events["inits"]) == 1
    for out in got:
        np.testing.assert_array_equal(out["y"], X + 1)
