"""A replayed profile's costs share the server's cores with the steps' own compute: a compute
that ran beside replayed costs is held as long as it would have run on the server's cores."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
from replay_helpers import burn_cpu, flat_profile

from pipelines import Pipeline, TensorSpec, step
from pipelines.calibration import Cost, Profile
from pipelines.runtime import LocalRuntime
from pipelines.runtime.cpu_share import CpuShare
from pipelines.runtime.step_process import isolation_supported

V = TensorSpec("FP32", [-1])


def test_a_compute_beside_sleepers_is_slowed_by_their_share_of_the_servers_cores():
    share = CpuShare(server_cores=2, cores_here=2)
    share.sleeper(+1)
    share.sleeper(+1)
    mark = share.begin(1.0)  # one compute and two sleepers on two cores: each gets 2/3 of a core
    time.sleep(0.01)
    assert share.slowdown(mark) == pytest.approx(1.5)
    share.end(1.0)


def test_computes_alone_are_not_slowed_and_the_clock_follows_changes():
    share = CpuShare(server_cores=1, cores_here=1)
    mark = share.begin(1.0)
    other = share.begin(1.0)  # two computes on one core, here as on the server: as slow in both
    time.sleep(0.01)
    assert share.slowdown(mark) == pytest.approx(1.0)
    share.end(1.0)
    share.end(1.0)
    mark = share.begin(0.0)  # a compute that uses no core (it waits) takes none from the sleepers
    share.sleeper(+1)
    time.sleep(0.01)
    assert share.slowdown(mark) == pytest.approx(1.0)
    share.sleeper(-1)
    share.end(0.0)
    del other


BURN_S = 0.03


@step(inputs={"small": V}, outputs={"small": V})
def burn(small):
    burn_cpu(BURN_S)
    return {"small": small + 1}


@step(inputs={"small": V}, outputs={"small": V})
def pause(small):
    time.sleep(0.02)  # uses no core: the other branch's stub is being slept when burn starts
    return {"small": small}


@step(inputs={"big": V}, outputs={"head": V})
def carry(big):
    return {"head": big[:1].copy()}


def _two_branches() -> Pipeline:
    p = Pipeline("cores", inputs={"small": V, "big": V})
    paused = p.add(pause, small=p.input("small"))["small"]
    p.output("burned", p.add(burn, small=paused)["small"])
    p.output("head", p.add(carry, big=p.input("big"))["head"])
    return p


def _profile(stub_us_per_mib: float) -> Profile:
    # A server of one core whose stubs cost nothing but their bytes: the big input's way into
    # its stub is slept while the other branch burns the CPU.
    return flat_profile(cpu_count=1, ensemble_stub=Cost(0.0, stub_us_per_mib))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_step_computing_beside_a_replayed_stub_is_held_for_the_core_it_shares(isolation):
    if isolation == "process" and not isolation_supported():
        pytest.skip("process isolation needs Linux (fork and memfd)")
    inputs = {"small": np.zeros(1, np.float32), "big": np.zeros(1 << 20, np.float32)}  # 4 MiB

    async def burn_compute_ms(profile: Profile) -> float:
        async with LocalRuntime(_two_branches(), "ensemble", profile=profile, isolation=isolation) as rt:
            for _ in range(2):  # the first call teaches the share of a core the step uses
                await rt.infer(inputs)
            _, report = await rt.infer_with_report(inputs)
        (steps,) = [s for s in report.steps if s.step == "burn"]
        return steps.compute_us / 1e3

    # 4 MiB at 50 ms a MiB: 200 ms slept beside the 30 ms of compute, which would get half the
    # server's core: about 30 ms more
    beside = anyio.run(burn_compute_ms, _profile(50_000))
    alone = anyio.run(burn_compute_ms, _profile(0.0))
    assert beside >= alone + 0.4 * BURN_S * 1e3, (beside, alone)
