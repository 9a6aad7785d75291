"""What the local runtime costs: per-step overhead, overlap of branches, batching throughput.

    python benchmarks/runtime_overhead.py [--json OUT.json] [--quick]

1. A chain of 100 no-op steps in each mode, against a plain Python loop of the
   same calls: scheduling overhead per step in µs (target < 50 in "ensemble").
2. A diamond with 4 branches of 20 ms: latency / critical path (target <= 1.1
   in "ensemble" and "bls", about 4 in "bls-sync").
3. A 5 ms step with max_batch_size 8 and dynamic batching under concurrency 32:
   throughput against the step's own batched capacity (target >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime

SPEC = TensorSpec("FP32", [4])


def chain_pipeline(length: int = 100, spec: TensorSpec = SPEC) -> Pipeline:
    @step(inputs={"x": spec}, outputs={"x": spec})
    def noop(x):
        return {"x": x}

    p = Pipeline("chain", inputs={"x": spec}, max_batch_size=8)
    ref = p.input("x")
    for i in range(length):
        ref = p.add(noop, name=f"noop{i}", x=ref)["x"]
    p.output("y", ref)
    return p


def diamond_pipeline(branches: int = 4, seconds: float = 0.020) -> Pipeline:
    @step(inputs={"x": SPEC}, outputs={"x": SPEC})
    def split(x):
        return {"x": x}

    # One step used by every branch is one shared step model (as on a server): give it an
    # instance per branch, or the branches take turns on one instance.
    @step(inputs={"x": SPEC}, outputs={"y": SPEC}, instance_count=branches)
    def branch(x):
        time.sleep(seconds)  # stands for a model that releases the GIL (numpy, onnxruntime, CUDA)
        return {"y": x + 1}

    join_inputs = {f"b{i}": SPEC for i in range(branches)}

    @step(inputs=join_inputs, outputs={"y": SPEC})
    def join(**parts):
        return {"y": sum(parts.values())}

    p = Pipeline("diamond", inputs={"x": SPEC}, max_batch_size=8)
    s = p.add(split, x=p.input("x"))
    refs = {f"b{i}": p.add(branch, name=f"branch{i}", x=s["x"])["y"] for i in range(branches)}
    p.output("y", p.add(join, **refs)["y"])
    return p


def batched_pipeline(seconds: float = 0.005, max_batch_size: int = 8) -> Pipeline:
    @step(inputs={"x": SPEC}, outputs={"y": SPEC}, dynamic_batching={"max_queue_delay_us": 2000},
          max_batch_size=max_batch_size)
    def model(x):
        time.sleep(seconds)  # a fixed cost per call, whatever the batch: what batching amortises
        return {"y": x * 2}

    p = Pipeline("batched", inputs={"x": SPEC}, max_batch_size=max_batch_size)
    p.output("y", p.add(model, x=p.input("x"))["y"])
    return p


async def _sequential(p: Pipeline, mode: str, x: np.ndarray, n: int, warmup: int) -> tuple[float, Any]:
    async with LocalRuntime(p, mode) as rt:
        for _ in range(warmup):
            await rt.infer({"x": x})
        rt.reset_report()
        t = time.perf_counter()
        for _ in range(n):
            await rt.infer({"x": x})
        elapsed = (time.perf_counter() - t) / n
    return elapsed, rt.report()


def per_step_overhead(n: int) -> dict[str, Any]:
    p = chain_pipeline(100)
    x = np.ones((1, 4), np.float32)
    fn = p.nodes["noop0"].step.impl
    t = time.perf_counter()
    for _ in range(n):
        v = {"x": x}
        for _ in range(100):
            v = fn(**v)
    plain = (time.perf_counter() - t) / n
    out: dict[str, Any] = {"plain_loop_us_per_step": plain / 100 * 1e6}
    for mode in MODES:
        latency, report = anyio.run(_sequential, p, mode, x, n, 20)
        out[mode] = {
            "latency_us": latency * 1e6,
            "us_per_step": (latency - plain) / 100 * 1e6,
            "report_overhead_us_per_step": report.overhead_us / 100,
        }
    return out


def diamond(n: int) -> dict[str, Any]:
    p = diamond_pipeline()
    x = np.ones((1, 4), np.float32)
    out: dict[str, Any] = {}
    for mode in MODES:
        latency, report = anyio.run(_sequential, p, mode, x, n, 2)
        out[mode] = {
            "latency_ms": latency * 1e3,
            "critical_path_ms": report.critical_path_us / 1e3,
            "latency_over_critical_path": report.latency_over_critical_path,
            "parallelism": report.parallelism,
        }
    return out


def batching(duration: float, concurrency: int = 32) -> dict[str, Any]:
    seconds, mbs = 0.005, 8
    p = batched_pipeline(seconds, mbs)

    # the step's own capacity: full batches back to back, called directly
    fn = p.nodes["model"].step.impl
    xb = np.ones((mbs, 4), np.float32)
    t, calls = time.perf_counter(), 0
    while time.perf_counter() - t < min(duration, 1.0):
        fn(x=xb)
        calls += 1
    capacity = calls * mbs / (time.perf_counter() - t)

    async def main() -> tuple[int, float, Any]:
        served = 0
        async with LocalRuntime(p, "ensemble") as rt:
            stop = time.perf_counter() + duration

            async def client(i: int) -> None:
                nonlocal served
                x = np.full((1, 4), i, np.float32)
                while time.perf_counter() < stop:
                    out = await rt.infer({"x": x})
                    assert out["y"][0, 0] == 2 * i
                    served += 1

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(concurrency):
                    tg.start_soon(client, i)
            elapsed = time.perf_counter() - t0
        return served, elapsed, rt.report()

    served, elapsed, report = anyio.run(main)
    rate = served / elapsed
    return {
        "capacity_rps": capacity,
        "throughput_rps": rate,
        "ratio": rate / capacity,
        "mean_batch": report.step("model").mean_batch,
        "concurrency": concurrency,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    n = 20 if args.quick else 200
    figures = {
        "chain_100_noop": per_step_overhead(n),
        "diamond_4x20ms": diamond(5 if args.quick else 20),
        "batching_5ms_mbs8_c32": batching(1.0 if args.quick else 5.0),
    }
    chain = figures["chain_100_noop"]
    print(f"chain of 100 no-op steps (plain loop {chain['plain_loop_us_per_step']:.2f} µs/step):")
    for mode in MODES:
        print(f"  {mode:9s} {chain[mode]['us_per_step']:7.1f} µs/step overhead  "
              f"(latency {chain[mode]['latency_us'] / 1e3:.2f} ms)")
    print("diamond, 4 branches of 20 ms:")
    for mode, row in figures["diamond_4x20ms"].items():
        print(f"  {mode:9s} latency {row['latency_ms']:6.1f} ms, critical path {row['critical_path_ms']:5.1f} ms, "
              f"ratio {row['latency_over_critical_path']:.2f}, parallelism {row['parallelism']:.2f}")
    b = figures["batching_5ms_mbs8_c32"]
    print(f"5 ms step, max_batch_size 8, concurrency {b['concurrency']}: {b['throughput_rps']:.0f} req/s against "
          f"capacity {b['capacity_rps']:.0f} req/s = {b['ratio']:.2f} (mean batch {b['mean_batch']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
