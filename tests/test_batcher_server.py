"""Triton's dynamic batcher forms *payloads*, and the simulation follows it
(``pipelines/predict/batcher.py``, docs/simulation.md, "The queues"): a payload
formed while the instance is busy waits for it, and a request that arrives meanwhile joins it
only if it wakes the batcher's thread (enough rows to make up what the payload lacks of
its next preferred size). Checked here on the real server, and beside it in the simulation,
with the same arrivals: an execution of 700 ms, a queue delay of 100 ms."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from batcher_runs import batches_of

from pipelines import DynamicBatching, Pipeline, TensorSpec, step
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

V = TensorSpec("FP32", [1])
EXECUTE_S = 0.7
DELAY_S = 0.1


class Hold:
    """Writes the marks of each batch it is handed to its log, then takes EXECUTE_S."""

    def initialize(self, config):
        self.log = Path(config["parameters"]["log"])

    def execute(self, x):
        with open(self.log, "a") as f:
            f.write(" ".join(f"{v:g}" for v in x[:, 0]) + "\n")
        time.sleep(EXECUTE_S)
        return {"y": x}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("payloads")
    log = root / "batches.log"
    hold = step(Hold, name="hold", inputs={"x": V}, outputs={"y": V}, parameters={"log": str(log)},
                dynamic_batching=DynamicBatching(max_queue_delay_us=int(DELAY_S * 1e6)))
    p = Pipeline("payloads", inputs={"x": V}, max_batch_size=4)
    p.output("y", p.add(hold, x=p.input("x"))["y"])
    with TritonServer(p.compile("ensemble").write(root / "repo"), exit_timeout=1) as server:
        yield server, log


def on_the_server(served, arrivals: dict[int, float]) -> list[list[float]]:
    """Each request (a mark) sent at its offset in seconds; the batches the step was handed, each
    as its requests' offsets (requests sent at once reach the server in any order)."""
    server, log = served
    seen = log.stat().st_size if log.exists() else 0
    ready = threading.Barrier(len(arrivals))
    start: list[float] = []

    def send(mark: int, at: float) -> None:
        with server.client("grpc", timeout=60) as c:
            c.ready("payloads")  # connected before the clock starts
            if ready.wait(timeout=60) == 0:
                start.append(time.monotonic())
            while not start:
                time.sleep(0.001)
            time.sleep(max(0.0, start[0] + at - time.monotonic()))
            c.infer("payloads", {"x": np.array([[mark]], np.float32)})

    with ThreadPoolExecutor(len(arrivals)) as pool:
        list(pool.map(lambda item: send(*item), arrivals.items()))
    with open(log) as f:
        f.seek(seen)
        return [sorted(arrivals[int(float(v))] for v in line.split()) for line in f]


def in_the_simulation(arrivals: dict[int, float]) -> list[list[float]]:
    """The same arrivals in the simulated batcher, each batch as its requests' offsets."""
    batches, _ = batches_of({mark: at * 1e6 for mark, at in arrivals.items()}, execution=EXECUTE_S * 1e6,
                            delay=DELAY_S * 1e6)
    return [sorted(arrivals[mark] for mark in batch) for batch in batches]


# 1 runs from 0.1 s to 0.8 s; 2's payload is formed at 0.45 s and waits for the instance; the
# late requests come at 0.6 s, before the thread's 500 ms wait on its empty queue runs out
# (0.95 s: then it would look, and move them into 2's payload).
LATE_ONE = {1: 0.0, 2: 0.35, 3: 0.6}
LATE_THREE = {1: 0.0, 2: 0.35, 3: 0.6, 4: 0.6, 5: 0.6}
LATE_FOUR = {1: 0.0, 2: 0.35, 3: 0.6, 4: 0.6, 5: 0.6, 6: 0.6}


@pytest.mark.parametrize(("arrivals", "batches"), [
    # 3 arrives while 2's payload waits: one row of the four the thread waits for does not wake
    # it, so the instance takes 2 alone (everything waiting at 0.8 s would be one batch).
    (LATE_ONE, [[0.0], [0.35], [0.6]]),
    # Three rows would fill 2's payload to 4, but the thread counts from what it lacked when it
    # last looked (4): they wait too.
    (LATE_THREE, [[0.0], [0.35], [0.6, 0.6, 0.6]]),
    # Four rows wake it: three of them fill 2's payload, the fourth goes on its own.
    (LATE_FOUR, [[0.0], [0.35, 0.6, 0.6, 0.6], [0.6]]),
], ids=["one-late", "three-late", "four-late"])
def test_a_payload_waiting_for_the_instance_takes_late_requests_as_triton_does(served, arrivals, batches):
    assert in_the_simulation(arrivals) == batches
    # A loaded machine can send a request late enough to change the scenario (2 after 3's
    # time, say): it is run again, three times at most, until the server kept to its times.
    seen = [on_the_server(served, arrivals)]
    while seen[-1] != batches and len(seen) < 3:
        seen.append(on_the_server(served, arrivals))
    assert seen[-1] == batches, seen
