"""A hung step, on the real server and in the local runtime, form by form: the same requests
fail, with the same error, after about as long. Scenario: a step with ``timeout=1`` hangs for
3 s on one request; a good request comes 0.3 s later.

What Triton 2.51 does (measured here, every run): its ensemble times no step out, so both
requests wait for the hung call; a BLS call past its timeout is given up on, but the step model
runs it to its end, so the call queued behind it times out too; the fused model abandons the
call for a fresh instance, which serves the good request.
"""

from __future__ import annotations

import threading
import time
import warnings

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
    return {"y": x + 1}


def hung() -> Pipeline:
    p = Pipeline("parity", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(sometimes_hangs, name="sleepy", x=p.input("x"))["y"])
    return p


REQUESTS = (("hung", np.full((1, 2), -1, np.float32), 0.0), ("good", np.ones((1, 2), np.float32), LATER_S))


def _outcome(fn) -> tuple[str, float]:
    t = time.perf_counter()
    try:
        fn()
        return "ok", time.perf_counter() - t
    except Exception as exc:  # the outcome is what is compared
        return type(exc).__name__, time.perf_counter() - t


def on_server(server: TritonServer, model: str) -> dict[str, tuple[str, float]]:
    out: dict[str, tuple[str, float]] = {}

    def send(tag, x, delay):
        time.sleep(delay)
        with server.client("http", timeout=30) as client:
            out[tag] = _outcome(lambda: client.infer(model, {"x": x}))

    threads = [threading.Thread(target=send, args=r) for r in REQUESTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def locally(mode: str) -> dict[str, tuple[str, float]]:
    out: dict[str, tuple[str, float]] = {}

    async def main():
        async with LocalRuntime(hung(), mode) as rt:
            async def send(tag, x, delay):
                await anyio.sleep(delay)
                t = time.perf_counter()
                try:
                    await rt.infer({"x": x})
                    out[tag] = ("ok", time.perf_counter() - t)
                except StepTimeoutError:
                    out[tag] = ("StepTimeoutError", time.perf_counter() - t)

            async with anyio.create_task_group() as tg:
                for request in REQUESTS:
                    tg.start_soon(send, *request)

    anyio.run(main)
    return out


def waited_for_the_hang(outcomes: dict[str, tuple[str, float]], tag: str) -> bool:
    """Whether request ``tag`` was answered only once the hung call returned."""
    sent = dict(zip(("hung", "good"), (0.0, LATER_S), strict=True))[tag]
    # A request queued behind the hang is answered as it ends, a hair either side of HANG_S: the
    # line is drawn between the last timeout (2 s after it was sent at LATER_S) and the hang's end.
    return sent + outcomes[tag][1] >= (HANG_S + 2.0 + LATER_S) / 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity") / "models"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeoutNotEnforcedWarning)
        hung().compile("all").write(root)
    with TritonServer(root) as s:
        yield s


@pytest.mark.parametrize("form", list(FORMS))
def test_a_hung_step_fails_the_same_requests_alike_on_the_server_and_locally(server, form):
    remote = on_server(server, FORMS[form].model_name("parity", side_by_side=True))
    time.sleep(HANG_S)  # the hung call ends before the next form's scenario
    here = locally(form)
    for tag, want in zip(("hung", "good"), EXPECTED[form], strict=True):
        assert remote[tag][0] == want, (form, "server", remote)
        assert here[tag][0] == want, (form, "local", here)
        # Who waited for the hung call to return, and who was answered before it (at a timeout):
        # the same requests on both sides. The hang (3 s) is far from every timeout (1 s, 2 s queued).
        assert waited_for_the_hang(remote, tag) == waited_for_the_hang(here, tag), (form, tag, remote, here)
