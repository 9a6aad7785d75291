"""The embedded server's lifecycle under faults, timed: leaving ``with`` with clients left open
(and whether ``finalize()`` ran), a step's stub killed under load (time until it answers again,
and how many requests failed), and the owner SIGKILLed (time until nothing of its server is left).

    python benchmarks/server_lifecycle.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.errors import InferenceError
from pipelines.triton import TritonServer
from pipelines.triton.cleanup import live_processes
from pipelines.triton.stubs import server_stubs

F4 = TensorSpec("FP32", [4])
X = np.ones((1, 4), np.float32)


class Finalizes:
    def initialize(self, config):
        self.marker = Path(config["parameters"]["marker"])

    def execute(self, x):
        return {"y": x + 1}

    def finalize(self):
        self.marker.write_text("finalized")


def repository(root: Path, marker: Path) -> Path:
    finalizes = step(Finalizes, name="fin", inputs={"x": F4}, outputs={"y": F4}, parameters={"marker": str(marker)})
    p = Pipeline("life", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(finalizes, x=p.input("x"))["y"])
    return p.compile("both").write(root / "repo")


def leave_with_clients_open(root: Path) -> tuple[float, bool]:
    marker = root / "finalized"
    marker.unlink(missing_ok=True)
    with TritonServer(repository(root, marker)) as server:
        server.client("http").infer("life_ensemble", {"x": X})  # left open on purpose
        started = time.monotonic()
    return time.monotonic() - started, marker.exists()


def kill_a_stub_under_load(root: Path) -> tuple[float, int, int]:
    with TritonServer(repository(root, root / "unused")) as server:
        done, failed, answered = threading.Event(), [0], [0]

        def load(model: str) -> None:
            with server.client("http", timeout=60) as client:
                while not done.is_set():
                    try:
                        client.infer(model, {"x": X})
                        answered[0] += 1
                    except InferenceError:
                        failed[0] += 1

        threads = [threading.Thread(target=load, args=(m,)) for m in ("life_ensemble", "life_bls", "life__fin")]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        (stub,) = [s for s in server_stubs(server.pid) if s.model == "life__fin"]
        os.kill(stub.pid, signal.SIGKILL)
        killed = time.monotonic()
        while not server.stub_restarts and time.monotonic() - killed < 120:
            time.sleep(0.01)
        back = time.monotonic() - killed
        done.set()
        for thread in threads:
            thread.join()
    return back, failed[0], answered[0]


_OWNER = """
import sys, threading, time
from pipelines.triton import TritonServer
servers = []
starter = threading.Thread(target=lambda: servers.append(TritonServer(sys.argv[1]).start()))
starter.start(); starter.join()
print(servers[0].shm_prefix, servers[0].workdir, servers[0].pid, flush=True)
time.sleep(3600)
"""


def kill_the_owner(root: Path) -> float:
    repo = repository(root, root / "unused")
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_OWNER), str(repo)], stdout=subprocess.PIPE)
    prefix, workdir, pid = owner.stdout.readline().decode().split()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    killed = time.monotonic()
    while (
        live_processes(pgid=int(pid), marker=prefix.encode())
        or any(n.startswith(prefix) for n in os.listdir("/dev/shm"))
        or Path(workdir).exists()
    ):
        time.sleep(0.01)
    return time.monotonic() - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    exits, finalized, backs, failures, cleanups = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            root = Path(tmp) / str(i)
            root.mkdir()
            took, ran = leave_with_clients_open(root)
            exits.append(took)
            finalized.append(ran)
            back, failed, _ = kill_a_stub_under_load(root / "kill")
            backs.append(back)
            failures.append(failed)
            cleanups.append(kill_the_owner(root / "owner"))
    print(
        f"leave 'with' with an HTTP client open: median {statistics.median(exits):.2f} s, finalize() ran {sum(finalized)}/{len(finalized)}"
    )
    print(
        f"stub killed under load (3 clients): answering again after median {statistics.median(backs):.2f} s "
        f"(max {max(backs):.2f}), failed requests per kill: {failures}"
    )
    print(
        f"owner SIGKILLed: nothing of its server left after median {statistics.median(cleanups):.2f} s (max {max(cleanups):.2f})"
    )


if __name__ == "__main__":
    main()
