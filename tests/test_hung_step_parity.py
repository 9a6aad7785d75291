"""A hung step, on the real server and in the local runtime, form by form: the same requests
fail, with the same error, after about as long. Scenario: a step with ``timeout=1`` hangs for
3 s on one request; a good request comes 0.3 s later.

What Triton 2.51 does (measured here, every run): its ensemble times no step out, so both
requests wait for the hung call; a BLS call past its timeout is given up on, but the step model
runs it to its end, so the call queued behind it times out too; the fused model abandons the
call for a fresh instance, which serves the good request.

Who waited for the hung call is told by order, not by a clock: the hung call leaves a mark (a
file, in the server's stub as here) as it ends, before it answers, and each request looks for
the mark as its answer arrives.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, StepTimeoutError, TensorSpec, TimeoutNotEnforcedWarning, step
from pipelines.forms import FORMS
from pipelines.runtime import LocalRuntime
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

V = TensorSpec("FP32", [2])
HANG_S, LATER_S = 3.0, 0.3
#: The folder where a hung call marks its end: a file per scenario, named by the hung request's
#: second value (the server's stubs inherit the variable from the server).
MARKS = "PIPELINES_TEST_HANG_MARKS"
# What each form answers: the hung request, then the good one (error class, or "ok").
EXPECTED = {
    "ensemble": ("ok", "ok"),
    "bls": ("StepTimeoutError", "StepTimeoutError"),
    "bls-sync": ("StepTimeoutError", "StepTimeoutError"),
    "fused": ("StepTimeoutError", "ok"),
}


@step(inputs={"x": V}, outputs={"y": V}, timeout=1.0)
def sometimes_hangs(x):
    if x[0, 0] < 0:
        time.sleep(HANG_S)
        Path(os.environ[MARKS], f"ended-{int(x[0, 1])}").touch()
    return {"y": x + 1}


def hung() -> Pipeline:
    p = Pipeline("parity", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(sometimes_hangs, name="sleepy", x=p.input("x"))["y"])
    return p


_SCENARIOS = itertools.count(1)


class Scenario:
    """One run of the two requests: the hung one (marked by the scenario's number), and the good
    one ``LATER_S`` after it. ``outcomes``: tag -> (error class or "ok", whether the hung call's
    mark was there as the answer arrived)."""

    def __init__(self) -> None:
        self.number = next(_SCENARIOS)
        self.mark = Path(os.environ[MARKS], f"ended-{self.number}")
        self.requests = (("hung", np.array([[-1, self.number]], np.float32), 0.0),
                         ("good", np.ones((1, 2), np.float32), LATER_S))
        self.outcomes: dict[str, tuple[str, bool]] = {}

    def answered(self, tag: str, outcome: str) -> None:
        self.outcomes[tag] = (outcome, self.mark.exists())

    def wait_for_the_hang(self, deadline_s: float = 30.0) -> None:
        """Until the hung call has ended (every form runs it to its end), so that it holds no
        instance in the next scenario; a deadline only against a hang that never ends."""
        deadline = time.monotonic() + deadline_s
        while not self.mark.exists():
            assert time.monotonic() < deadline, f"the hung call of scenario {self.number} never ended"
            time.sleep(0.05)


def on_server(server: TritonServer, model: str) -> Scenario:
    scenario = Scenario()

    def send(tag, x, delay):
        time.sleep(delay)
        with server.client("http", timeout=30) as client:
            try:
                client.infer(model, {"x": x})
                scenario.answered(tag, "ok")
            except Exception as exc:  # the outcome is what is compared
                scenario.answered(tag, type(exc).__name__)

    threads = [threading.Thread(target=send, args=r) for r in scenario.requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return scenario


def locally(mode: str) -> dict[str, tuple[str, bool]]:
    scenario = Scenario()

    async def main():
        async with LocalRuntime(hung(), mode) as rt:
            async def send(tag, x, delay):
                await anyio.sleep(delay)
                try:
                    await rt.infer({"x": x})
                    scenario.answered(tag, "ok")
                except StepTimeoutError:
                    scenario.answered(tag, "StepTimeoutError")

            async with anyio.create_task_group() as tg:
                for request in scenario.requests:
                    tg.start_soon(send, *request)

    anyio.run(main)
    return scenario.outcomes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity") / "models"
    marks = tmp_path_factory.mktemp("marks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeoutNotEnforcedWarning)
        hung().compile("all").write(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MARKS, str(marks))  # for the local runtime's calls, and the server's stubs
        with TritonServer(root) as s:
            yield s


@pytest.mark.parametrize("form", list(FORMS))
def test_a_hung_step_fails_the_same_requests_alike_on_the_server_and_locally(server, form):
    scenario = on_server(server, FORMS[form].model_name("parity", side_by_side=True))
    scenario.wait_for_the_hang()
    remote = scenario.outcomes
    here = locally(form)
    for tag, want in zip(("hung", "good"), EXPECTED[form], strict=True):
        assert remote[tag][0] == want, (form, "server", remote)
        assert here[tag][0] == want, (form, "local", here)
    # Who waited for the hung call to return (its mark was there at the answer), and who was
    # answered before it, at a timeout: the same requests on both sides, as the server does.
    assert remote == here, (form, remote, here)
    waited = {tag for tag, (_, marked) in remote.items() if marked}
    assert waited == ({"hung", "good"} if form == "ensemble" else set()), (form, remote)
