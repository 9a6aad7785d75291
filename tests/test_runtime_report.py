"""The cost report: per-step queue wait, compute and overhead, copies, critical path
and parallelism, for one request and aggregated; printed as a table, as dict and JSON;
and compare() setting ensemble against BLS with ratios."""

from __future__ import annotations

import json
import time

import anyio
import numpy as np

from pipelines import InputError, Pipeline, TensorSpec, step
from pipelines.runtime import LocalRuntime, Report, compare

V = TensorSpec("FP32", [2])


def unbalanced() -> Pipeline:
    """A diamond whose slow branch (30 ms) is the critical path; the fast one takes 1 ms."""

    @step(inputs={"x": V}, outputs={"x": V})
    def source(x):
        return {"x": x}

    @step(inputs={"x": V}, outputs={"y": V})
    def slow(x):
        time.sleep(0.03)
        return {"y": x + 1}

    @step(inputs={"x": V}, outputs={"y": V})
    def fast(x):
        time.sleep(0.001)
        return {"y": x + 2}

    @step(inputs={"a": V, "b": V}, outputs={"y": V})
    def join(a, b):
        return {"y": a + b}

    p = Pipeline("unbalanced", inputs={"x": V}, max_batch_size=4)
    s = p.add(source, x=p.input("x"))
    p.output("y", p.add(join, a=p.add(slow, x=s["x"])["y"], b=p.add(fast, x=s["x"])["y"])["y"])
    return p


async def serve(p, mode, n):
    async with LocalRuntime(p, mode) as rt:
        _, single = await rt.infer_with_report({"x": np.zeros((1, 2), np.float32)})
        for _ in range(n - 1):
            await rt.infer({"x": np.zeros((1, 2), np.float32)})
        try:
            await rt.infer({"x": np.zeros((1, 3), np.float32)})
        except InputError:
            pass
        return single, rt.report()


def test_one_request_report_shows_where_the_time_goes():
    single, _ = anyio.run(serve, unbalanced(), "ensemble", 1)
    assert isinstance(single, Report) and single.requests == 1 and single.errors == 0
    assert [s.step for s in single.steps] == ["source", "slow", "fast", "join"]
    assert single.critical_path == ("source", "slow", "join")
    assert single.step("slow").compute_us >= 30_000
    assert single.critical_path_us >= single.step("slow").compute_us
    assert single.latency_us >= single.critical_path_us
    assert abs(single.parallelism - single.step_time_us / single.latency_us) < 1e-9
    assert single.latency_over_critical_path >= 1.0
    assert single.copies == 0 and single.copy_bytes == 0


def test_aggregated_report_counts_requests_and_errors_and_converts():
    _, report = anyio.run(serve, unbalanced(), "bls", 3)
    assert report.requests == 3 and report.errors == 1
    assert all(s.calls == 3 and s.batches == 3 for s in report.steps)
    data = report.to_dict()
    assert data["requests"] == 3 and data["critical_path"] == ["source", "slow", "join"]
    assert {s["step"] for s in data["steps"]} == {"source", "slow", "fast", "join"}
    assert json.loads(report.to_json()) == json.loads(json.dumps(data))
    text = str(report)
    for word in ("queue wait", "compute", "overhead", "slow", "critical path", "parallelism", "copies"):
        assert word in text


def test_compare_sets_ensemble_against_bls_sync_with_ratios():
    _, ensemble = anyio.run(serve, unbalanced(), "ensemble", 2)
    _, sync = anyio.run(serve, unbalanced(), "bls-sync", 2)
    cmp = compare(ensemble, sync)
    assert cmp.ratio("latency_us") == sync.latency_us / ensemble.latency_us
    assert sync.parallelism <= 1.0 + 1e-6  # one step at a time: step time cannot exceed wall time
    text = str(cmp)
    assert "ensemble" in text and "bls-sync" in text and "b / a" in text and "slow.compute " in text
    assert "_us" not in text  # each value names its own unit: no "latency_us 24.18 ms"
    data = cmp.to_dict()
    assert data["a"] == "ensemble" and data["b"] == "bls-sync"
    assert data["figures"]["latency_us"]["ratio"] == cmp.ratio("latency_us")
    json.loads(cmp.to_json())


def test_reset_report_forgets_the_warm_up():
    async def main():
        async with LocalRuntime(unbalanced(), "ensemble") as rt:
            await rt.infer({"x": np.zeros((1, 2), np.float32)})
            rt.reset_report()
            assert rt.report().requests == 0
            await rt.infer({"x": np.zeros((1, 2), np.float32)})
            return rt.report()

    assert anyio.run(main).requests == 1
