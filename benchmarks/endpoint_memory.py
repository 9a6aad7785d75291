"""The local endpoint's memory under large requests: RSS of `pipelines serve --local` before, during and after.

Serves this file's two pipelines in a child process (so the client's own arrays are not counted)
and sends each ``--requests`` binary requests of ``--mib`` MiB over HTTP and gRPC:

- ``reduce``: a large input, a small output (what the request body costs);
- ``echo``: the input comes back (what the response costs too).

Prints the server's RSS (``VmRSS``) after start-up and one small request, its peak (``VmHWM``)
and its RSS after every large request, per protocol. Run from the repository root::

    .venv/bin/python benchmarks/endpoint_memory.py --mib 100 --requests 3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipelines import Pipeline, TensorSpec, step

VECTOR = TensorSpec("FP32", [-1])


@step(inputs={"x": VECTOR}, outputs={"total": TensorSpec("FP32", [1])})
def total(x):
    return {"total": x.sum(axis=1, keepdims=True)}


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def same(x):
    return {"y": x}


reduce = Pipeline("reduce", inputs={"x": VECTOR}, max_batch_size=1)
reduce.output("total", reduce.add(total, x=reduce.input("x"))["total"])

echo = Pipeline("echo", inputs={"x": VECTOR}, max_batch_size=1)
echo.output("y", echo.add(same, x=echo.input("x"))["y"])


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _mb(kib: int) -> str:
    return f"{kib / 1024:,.0f} MB"


def _serve(name: str, limit: int) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "serve", "--local", f"{__file__}:{name}", "--http-max-input-size",
         str(limit)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    while not lines or not lines[-1].startswith("ready"):
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the endpoint exited before it was ready: {proc.stderr.read()}")
        lines.append(line)
    http_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("HTTP"))
    grpc_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("gRPC"))
    return proc, http_url, grpc_url


def _ask(protocol: str, url: str, model: str, x: np.ndarray, output: str) -> np.ndarray:
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    client = module.InferenceServerClient(url, **({"network_timeout": 300} if protocol == "http" else {}))
    try:
        tensor = module.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(model, [tensor]).as_numpy(output)
    finally:
        client.close()


def measure(name: str, output: str, mib: int, requests: int) -> None:
    proc, http_url, grpc_url = _serve(name, limit=(mib + 1) << 20)
    try:
        small = np.ones((1, 16), np.float32)
        for protocol, url in (("http", http_url), ("grpc", grpc_url)):
            _ask(protocol, url, f"{name}_bls", small, output)  # warm: the first request's imports and pools
        baseline = _kib(proc.pid, "VmRSS")
        print(f"{name}: baseline {_mb(baseline)}")
        x = np.ones((1, (mib << 20) // 4), np.float32)
        for protocol, url in (("http", http_url), ("grpc", grpc_url)):
            after = []
            for _ in range(requests):
                got = _ask(protocol, url, f"{name}_bls", x, output)
                assert got.shape[1] in (1, x.shape[1])
                time.sleep(0.2)
                after.append(_kib(proc.pid, "VmRSS"))
            peak = _kib(proc.pid, "VmHWM")
            time.sleep(2.0)
            settled = _kib(proc.pid, "VmRSS")
            print(f"  {protocol:4} {requests} x {mib} MiB: RSS 0.2 s after each {', '.join(_mb(a) for a in after)}; "
                  f"2 s later {_mb(settled)} ({_mb(settled - baseline)} over baseline); peak so far {_mb(peak)} "
                  f"({(peak - baseline) / 1024 / mib:.1f}x the request over baseline)")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=100, help="size of each large request (default: 100)")
    parser.add_argument("--requests", type=int, default=3, help="large requests per protocol (default: 3)")
    args = parser.parse_args()
    measure("reduce", "total", args.mib, args.requests)
    measure("echo", "y", args.mib, args.requests)


if __name__ == "__main__":
    main()
