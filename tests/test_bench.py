"""A user benchmarks ensemble against BLS: the load generator's promises, the figures it
reports, and one real run against the local runtime and the embedded Triton server.

The real run measures a diamond whose branch refuses one input sample in four, so
every configuration has errors whose exact number is known in advance.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines import Pipeline, TensorSpec, step
from pipelines.bench import (
    BenchmarkResult,
    BenchSettings,
    Configuration,
    LatencySummary,
    LoadPlan,
    Measurement,
    StabilityRule,
    render,
    run_benchmark,
    run_load,
)
from pipelines.bench.command import parse_levels
from pipelines.bench.report_tables import prediction_table
from pipelines.bench.verdict import compare_ratios, verdict
from pipelines.errors import PipelinesError
from pipelines.forms import FORMS
from pipelines.forms import form as form_of
from pipelines.percentiles import percentiles
from pipelines.runtime.report import CostRecorder
from pipelines.triton.statistics import breakdown, parse_statistics

VECTOR = TensorSpec("FP32", [-1])


# ---------------------------------------------------------------- percentiles and stability


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=1e-6, max_value=10.0, allow_nan=False), min_size=1, max_size=300))
def test_percentiles_are_observed_latencies_in_order(seconds):
    s = LatencySummary.of(seconds)
    observed = {round(v * 1000.0, 9) for v in seconds}
    assert s.count == len(seconds)
    assert s.min_ms <= s.p50_ms <= s.p90_ms <= s.p95_ms <= s.p99_ms <= s.max_ms
    assert s.min_ms - 1e-9 <= s.avg_ms <= s.max_ms + 1e-9
    for p in (s.p50_ms, s.p90_ms, s.p95_ms, s.p99_ms):
        assert round(p, 9) in observed


def _perf_analyzer_percentile(sorted_values, p):
    # inference_profiler.cc: size_t index = (percentile / 100.0) * (latencies.size() - 1) + 0.5;
    return sorted_values[int((p / 100.0) * (len(sorted_values) - 1) + 0.5)]


def test_one_percentile_definition_picks_perf_analyzers_observation():
    ties = 0
    for n in range(1, 300):
        values = np.sort(np.random.default_rng(n).random(n))
        ours = percentiles(values, (50, 90, 95, 99))
        for p, got in zip((50, 90, 95, 99), ours, strict=True):
            expected = _perf_analyzer_percentile(values, p)
            if got != expected:
                # Only at an exact tie, where numpy rounds to the even index: one neighbour apart.
                ties += 1
                index = (p / 100.0) * (n - 1)
                assert abs(index % 1 - 0.5) < 1e-9, (n, p)
                assert abs(int(np.searchsorted(values, got)) - int(np.searchsorted(values, expected))) == 1
    assert ties < 0.1 * 299 * 4
    # The local cost report uses the same definition as the benchmark.
    recorder = CostRecorder(pipeline="p", mode="ensemble", steps=[], critical_path=lambda costs: ([], 0.0))
    latencies = np.random.default_rng(0).random(101)
    for t in latencies:
        recorder.record((), start=0.0, end=float(t), copies=0, copy_bytes=0)
    report = recorder.report()
    assert (report.latency_p50_us / 1e6, report.latency_p99_us / 1e6) == pytest.approx(percentiles(latencies, (50, 99)))
    assert LatencySummary.of(latencies).p50_ms == pytest.approx(report.latency_p50_us / 1e3)


def test_no_latency_at_all():
    with pytest.raises(ValueError):
        percentiles([], (50,))
    empty = LatencySummary.of([])
    assert empty.count == 0 and empty.p50_ms is None and empty.avg_ms is None


class _W:
    def __init__(self, throughput, avg_latency):
        self.throughput, self.avg_latency = throughput, avg_latency


def test_stability_rule_compares_the_last_windows_like_perf_analyzer():
    rule = StabilityRule(tolerance=0.1, windows=3, max_trials=5)
    assert not rule.is_stable([_W(100, 0.01), _W(100, 0.01)])  # too few windows yet
    assert rule.is_stable([_W(50, 0.02), _W(100, 0.010), _W(105, 0.0105), _W(98, 0.0099)])
    assert not rule.is_stable([_W(100, 0.01), _W(130, 0.01), _W(100, 0.01)])  # throughput apart
    assert not rule.is_stable([_W(100, 0.01), _W(100, 0.013), _W(100, 0.01)])  # latency apart
    assert rule.is_stable([_W(0, None)] * 3)  # every request failed: steadily
    assert not rule.done([_W(100, 0.01), _W(200, 0.01), _W(100, 0.01)])
    assert rule.done([_W(100 * i, 0.01) for i in range(1, 6)])  # max_trials reached
    with pytest.raises(PipelinesError, match="fraction"):
        StabilityRule(tolerance=10)
    with pytest.raises(PipelinesError, match="--max-trials"):
        StabilityRule(max_trials=2)


# ---------------------------------------------------------------- Triton statistics


def _stats(name, count, ns, *, fail=0, executions=None, version="1", as_strings=False):
    conv = str if as_strings else int  # gRPC statistics turned into JSON carry int64 as strings
    pair = lambda c, n: {"count": conv(c), "ns": conv(n)}  # noqa: E731
    return {
        "name": name,
        "version": version,
        "inference_count": conv(count),
        "execution_count": conv(count if executions is None else executions),
        "inference_stats": {
            "success": pair(count, ns),
            "fail": pair(fail, 0),
            "queue": pair(count, ns // 10),
            "compute_input": pair(count, ns // 20),
            "compute_infer": pair(count, ns // 2),
            "compute_output": pair(count, ns // 20),
        },
    }


@pytest.mark.parametrize("as_strings", [False, True])
def test_breakdown_is_the_delta_between_snapshots_per_request(as_strings):
    before = parse_statistics({"model_stats": [
        _stats("p_ensemble", 10, 10_000_000, as_strings=as_strings),
        _stats("p__a", 10, 4_000_000, as_strings=as_strings),
        _stats("p__idle", 5, 1_000_000, as_strings=as_strings),
    ]})
    after = parse_statistics({"model_stats": [
        _stats("p_ensemble", 30, 50_000_000, fail=3, as_strings=as_strings),
        _stats("p__a", 30, 24_000_000, executions=15, as_strings=as_strings),
        _stats("p__idle", 5, 1_000_000, as_strings=as_strings),
        _stats("p__new", 4, 400_000, as_strings=as_strings),
    ]})
    rows = breakdown(before, after, first=["p_ensemble"])
    assert [r.model for r in rows] == ["p_ensemble", "p__a", "p__new"]  # the idle model is left out
    top, a, new = rows
    assert (top.requests, top.failures, top.total_us) == (20, 3, 2000.0)
    assert (a.requests, a.executions, a.inferences) == (20, 5, 20)
    assert a.total_us == pytest.approx(1000.0)
    assert a.queue_us == pytest.approx((2_400_000 - 400_000) / 20 / 1000)
    assert a.compute_infer_us == pytest.approx((12_000_000 - 2_000_000) / 20 / 1000)
    assert new.requests == 4 and new.total_us == pytest.approx(100.0)


# ---------------------------------------------------------------- the load generator


def test_load_generator_keeps_exactly_n_requests_in_flight_and_counts_every_error():
    concurrency = 3
    state = {"in_flight": 0, "peak": 0}
    all_in = anyio.Event()

    async def infer(request):
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        if state["in_flight"] == concurrency:
            all_in.set()
        try:
            await all_in.wait()  # a barrier: passes only once N requests are in flight together
            await anyio.sleep(0.001)
            if request["i"] == 2:
                raise ValueError("sample 2 is refused")
        finally:
            state["in_flight"] -= 1

    samples = [{"i": i} for i in range(4)]
    plan = LoadPlan(concurrency=concurrency, duration=0.15, warmup=0.05, rule=StabilityRule(max_trials=3))

    async def main():
        with anyio.fail_after(10):
            return await run_load(infer, samples, plan)

    load = anyio.run(main)
    m = load.measured
    assert state["peak"] == concurrency
    assert len(load.windows) == 3 and load.used == 3
    assert m.successes > 0 and m.errors > 0
    assert m.errors_by_sample == (0, 0, m.errors, 0)
    assert m.errors == m.completed_by_sample[2]
    assert m.completed == sum(m.completed_by_sample)
    assert dict(m.error_messages) == {"ValueError: sample 2 is refused": m.errors}
    # round-robin: every sample is sent about as often as the others
    assert max(m.completed_by_sample) - min(m.completed_by_sample) <= 2 * concurrency


def test_windows_of_n_requests_hold_exactly_n_answers_and_snapshots_bracket_them():
    async def infer(request):
        await anyio.sleep(0)

    ticks = iter(range(100))

    async def boundary():
        return next(ticks)

    plan = LoadPlan(concurrency=4, duration=None, requests=25, warmup=0.02, rule=StabilityRule(max_trials=4))
    load = anyio.run(lambda: run_load(infer, [{}], plan, on_boundary=boundary))
    assert [w.completed for w in load.windows] == [25] * len(load.windows)
    assert load.boundaries == tuple(range(len(load.windows) + 1))
    assert load.bracket == (load.boundaries[-4], load.boundaries[-1])


def test_a_hung_request_is_an_error_after_the_timeout_not_a_hang():
    async def infer(request):
        if request["hang"]:
            await anyio.sleep(30)

    plan = LoadPlan(concurrency=2, duration=0.2, warmup=0, timeout=0.05, rule=StabilityRule(windows=1, max_trials=2))
    load = anyio.run(lambda: run_load(infer, [{"hang": False}, {"hang": True}], plan))
    assert load.measured.errors >= 1
    assert all(text.startswith("TimeoutError") for text in load.measured.error_messages)


def test_requests_that_fail_before_awaiting_are_counted_without_starving_the_load_generator():
    async def infer(request):
        raise ValueError("refused at once")  # no await: a client that knows its answer already

    plan = LoadPlan(concurrency=2, duration=0.1, warmup=0.02, rule=StabilityRule(windows=1, max_trials=2))

    async def main():
        with anyio.fail_after(10):
            return await run_load(infer, [{}], plan)

    load = anyio.run(main)
    assert load.measured.successes == 0 and load.measured.errors > 0
    assert dict(load.measured.error_messages) == {"ValueError: refused at once": load.measured.errors}


def test_a_server_that_died_ends_the_load_with_its_error():
    from pipelines.errors import ServerDiedError

    calls = []

    async def infer(request):
        calls.append(1)
        if len(calls) > 5:
            raise ServerDiedError("the Triton server died while in use")
        await anyio.sleep(0.001)

    plan = LoadPlan(concurrency=3, duration=5, warmup=0, rule=StabilityRule(windows=1, max_trials=2))

    async def main():
        with anyio.fail_after(10):
            return await run_load(infer, [{}], plan)

    with pytest.raises(ServerDiedError, match="died while in use"):
        anyio.run(main)
    # a count, not a time: no request was sent once the death was seen, but those already in flight
    assert len(calls) <= 6 + plan.concurrency - 1


@pytest.mark.parametrize("options, message", [
    ({"concurrency": 0}, "concurrency must be >= 1"),
    ({"concurrency": 1, "duration": 1.0, "requests": 10}, "give exactly one"),
    ({"concurrency": 1, "duration": -1.0}, "duration must be > 0"),
])
def test_bad_load_plans_are_explained(options, message):
    with pytest.raises(PipelinesError, match=message):
        LoadPlan(**options)


def test_concurrency_levels_parse_like_perf_analyzer():
    assert parse_levels("1,2,4") == (1, 2, 4)
    assert parse_levels("1:16") == (1, 2, 4, 8, 16)
    with pytest.raises(Exception, match="integers >= 1"):
        parse_levels("0,2")


# ---------------------------------------------------------------- the verdict


def _measurement(where, form, c, p50_ms, throughput):
    summary = LatencySummary(10, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms)
    return Measurement(
        config=Configuration(where, form), concurrency=c, batch=1, throughput=throughput, latency=summary,
        requests=10, errors=0, error_messages={}, stable=True, windows=3, window_seconds=3.0,
        window_throughputs=(throughput,) * 3, completed_by_sample=(10,), errors_by_sample=(0,),
    )


def test_verdict_names_the_winner_per_load_and_whether_the_prediction_named_it():
    ms = [
        _measurement("local", "ensemble", 1, 10.0, 100.0), _measurement("local", "bls", 1, 20.0, 50.0),
        _measurement("server", "ensemble", 1, 12.0, 80.0), _measurement("server", "bls", 1, 20.0, 50.0),
        _measurement("server", "ensemble", 4, 30.0, 130.0), _measurement("server", "bls", 4, 28.0, 134.0),
    ]
    (ratio,) = compare_ratios(ms)
    assert (ratio.concurrency, ratio.versus) == (1, "bls")
    assert ratio.predicted == pytest.approx(0.5) and ratio.measured == pytest.approx(0.6)
    assert ratio.gap == pytest.approx(0.5 / 0.6 - 1)
    text = verdict(ms, pipeline="p")
    assert "ensemble wins at concurrency 1 (1.60× bls" in text
    assert "concurrency 4 is a tie between bls and ensemble" in text
    assert "predicted" not in text  # no --profile: no prediction to judge
    predictions = [{"form": "ensemble", "concurrency": 1, "p50_ms": 11.0, "throughput": 90.0},
                   {"form": "bls", "concurrency": 1, "p50_ms": 19.0, "throughput": 52.0},
                   {"form": "ensemble", "concurrency": 4, "p50_ms": 25.0, "throughput": 160.0},
                   {"form": "bls", "concurrency": 4, "p50_ms": 40.0, "throughput": 100.0}]
    judged = verdict(ms, pipeline="p", predictions=predictions)
    assert "at concurrency 1 it named ensemble, the server's winner ensemble: right" in judged
    # at 4 the server's two forms are within 5 %: either is the winner
    assert "at concurrency 4 it named ensemble, the server's winner bls/ensemble: right" in judged
    wrong = [dict(p, throughput=200.0) if p["form"] == "bls" and p["concurrency"] == 1 else p for p in predictions]
    assert "at concurrency 1 it named bls, the server's winner ensemble: WRONG" in verdict(
        ms, pipeline="p", predictions=wrong)


def test_verdict_of_one_form_says_its_figures_and_that_there_is_nothing_to_compare():
    ms = [_measurement("local", "ensemble", 1, 10.0, 100.0), _measurement("local", "ensemble", 4, 30.0, 130.0)]
    text = verdict(ms, pipeline="p")
    assert text == ("In the local runtime, for pipeline 'p', only ensemble was measured (100.0 infer/s at "
                    "concurrency 1, 130.0 infer/s at concurrency 4); give --forms two or more forms to compare them.")


def test_verdict_of_windows_too_short_for_one_request_says_so():
    empty = dataclasses.replace(_measurement("local", "ensemble", 1, 10.0, 0.0), requests=0)
    assert "finished within a measurement window" in verdict([empty], pipeline="p")
    failed = dataclasses.replace(_measurement("local", "ensemble", 1, 10.0, 0.0), errors=10)
    assert verdict([failed], pipeline="p") == "10 requests failed (local ensemble); their messages are in results.json."


def test_predicted_rows_are_set_beside_the_servers_measurements_with_each_error():
    ms = [_measurement("server", "ensemble", 1, 10.0, 100.0), _measurement("server", "bls", 4, 20.0, 200.0),
          _measurement("local", "ensemble", 4, 1.0, 1000.0)]
    predicted = [{"form": "bls", "concurrency": 4, "p50_ms": 22.0, "throughput": 180.0, "bottleneck": "x"},
                 {"form": "ensemble", "concurrency": 1, "p50_ms": 9.0, "throughput": 110.0},
                 {"form": "ensemble", "concurrency": 4, "p50_ms": 5.0, "throughput": 900.0}]  # nothing measured there
    table = prediction_table(predicted, ms)
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows == [["ensemble", "1", "9.00", "10.00", "-10.0%", "110.0", "100.0", "+10.0%"],
                    ["bls", "4", "22.00", "20.00", "+10.0%", "180.0", "200.0", "-10.0%"]]
    assert prediction_table([], ms) == ""
    result = BenchmarkResult(pipeline="p", settings={"forms": ["ensemble", "bls"]}, measurements=tuple(ms),
                             comparisons=(), verdict="v", predictions=tuple(predicted))
    assert "predicted from the profile vs measured (server)" in render(result)
    assert result.to_dict()["predictions"] == predicted


def test_a_form_named_twice_is_measured_once():
    assert BenchSettings(forms=("ensemble", "bls", "ensemble")).forms == ("ensemble", "bls")
    from pipelines.bench.command import settings_from
    from pipelines.cli import build_parser

    args = build_parser().parse_args(["bench", "--forms", "ensemble,bls,ensemble"])  # the command line too
    assert settings_from(args).forms == ("ensemble", "bls")


def test_a_bad_profile_or_out_is_refused_before_an_earlier_runs_results_are_touched(tmp_path):
    earlier = tmp_path / "results.json"
    earlier.write_text('{"status": "complete"}\n')
    settings = BenchSettings(concurrency=(1,), server=False, forms=("ensemble",), duration=0.05, warmup=0,
                             max_trials=3)
    with pytest.raises(PipelinesError, match="typo.json: no such file.*pipelines calibrate"):
        dataclasses.replace(settings, profile=str(tmp_path / "typo.json"))
    with pytest.raises(PipelinesError, match="is a file; give a directory"):
        run_benchmark("pipelines.examples.basic:chain", settings, out=earlier, progress=False, echo=False)
    # A run that fails before it measures anything (a hand-made model where the bench writes its own)
    # leaves the earlier results alone, and says what the user can do about it.
    (tmp_path / "model_repository" / "chain_bls").mkdir(parents=True)
    (tmp_path / "model_repository" / "chain_bls" / "config.pbtxt").write_text('name: "chain_bls"\n')
    with pytest.raises(PipelinesError, match="'chain_bls'.*move what is there out of the way, or write to another directory") as info:
        run_benchmark("pipelines.examples.basic:chain", dataclasses.replace(settings, server=True),
                      out=tmp_path, progress=False, echo=False)
    assert "overwrite=True" not in str(info.value)  # the bench has no such option
    assert earlier.read_text() == '{"status": "complete"}\n'


# ---------------------------------------------------------------- one real run


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def fragile(x):
    """Stands for a model that rejects some inputs: a negative first element, deterministically."""
    time.sleep(0.002)
    if (x[:, 0] < 0).any():
        raise ValueError("fragile refuses a negative first element")
    return {"y": x * 2}


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def steady(x):
    time.sleep(0.002)
    return {"y": x + 1}


@step(inputs={"a": VECTOR, "b": VECTOR}, outputs={"y": VECTOR})
def join(a, b):
    return {"y": a + b}


def faulty_diamond() -> Pipeline:
    p = Pipeline("faulty_diamond", inputs={"x": VECTOR}, max_batch_size=4)
    a = p.add(fragile, x=p.input("x"))
    b = p.add(steady, x=p.input("x"))
    p.output("y", p.add(join, a=a["y"], b=b["y"])["y"])
    return p


POISONED = 1  # of the four samples, this one makes `fragile` fail
SAMPLES = [{"x": np.full((1, 8), v, np.float32)} for v in (1.0, -1.0, 2.0, 3.0)]
LABELS = {f"{where} {form}" for where in ("local", "server") for form in FORMS}
LEVELS = (1, 2)
TURNS = 2  # each level measured in two turns of every configuration, pooled
WINDOW_S = 0.2  # short windows: the figures' presence and consistency are checked, not their size


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    echo = io.StringIO()
    settings = BenchSettings(concurrency=LEVELS, duration=WINDOW_S, warmup=0.2, max_trials=3, timeout=5.0, turns=TURNS)
    result = run_benchmark(faulty_diamond(), settings, inputs=SAMPLES, out=out, progress=False, echo=echo)
    return result, out, echo.getvalue()


@pytest.mark.server
def test_every_configuration_is_measured_at_every_level(bench):
    result, _, _ = bench
    assert {(m.config.label, m.concurrency) for m in result.measurements} == {(label, c) for label in LABELS for c in LEVELS}


@pytest.mark.server
def test_every_figure_is_present_and_sane(bench):
    result, _, _ = bench
    for m in result.measurements:
        lat = m.latency
        assert m.throughput > 0, m.config.label
        assert lat.count > 0 and lat.count + m.errors == m.requests
        assert lat.min_ms <= lat.p50_ms <= lat.p90_ms <= lat.p95_ms <= lat.p99_ms <= lat.max_ms
        assert lat.min_ms <= lat.avg_ms <= lat.max_ms
        assert lat.min_ms >= 2.0  # each request runs a 2 ms step at least
        assert m.windows == 3 * TURNS and m.window_seconds >= 3 * TURNS * WINDOW_S
        assert m.throughput == pytest.approx(lat.count / m.window_seconds)


@pytest.mark.server
def test_counted_errors_equal_the_injected_ones(bench):
    result, _, _ = bench
    for m in result.measurements:
        injected = m.completed_by_sample[POISONED]  # requests that carried the refused sample
        assert injected > 0, m.config.label
        assert m.errors == injected, m.config.label
        assert m.errors_by_sample == tuple(injected if i == POISONED else 0 for i in range(len(SAMPLES)))
        assert sum(m.error_messages.values()) == m.errors
        assert all("fragile" in text for text in m.error_messages), m.error_messages
        # One sample in four is refused, and samples go round-robin.
        assert abs(m.errors - m.requests / 4) <= 2 * m.concurrency * m.windows


@pytest.mark.server
def test_the_server_breakdown_covers_every_composing_model(bench):
    result, out, _ = bench
    models = {d.name for d in (out / "model_repository").iterdir() if d.is_dir()}
    steps = {m for m in models if m.startswith("faulty_diamond__")}
    assert len(steps) == 3
    # The ensemble also calls its own helper models (e.g. the gate that answers a branch's error).
    helpers = {m for m in models if m.startswith("faulty_diamond_ensemble__")}
    for m in (m for m in result.measurements if m.config.where == "server"):
        rows = {t.model: t for t in m.breakdown}
        assert m.breakdown[0].model == m.config.model
        own = helpers if m.config.form == "ensemble" else set()
        called = set() if form_of(m.config.form).in_process else steps  # fused runs its Python steps itself
        assert called | own | {m.config.model} == set(rows), m.config.label
        for t in m.breakdown:
            assert t.requests > 0
            assert min(t.queue_us, t.compute_input_us, t.compute_infer_us, t.compute_output_us) >= 0
            assert t.total_us > 0
        # Every request reaches `fragile` first, in every form: Triton's count, summed over the turns,
        # matches the client's, give or take the requests in flight at each turn's two snapshots.
        first = rows.get("faulty_diamond__fragile", rows[m.config.model])
        reached = first.requests + first.failures
        assert abs(reached - m.requests) <= 2 * m.concurrency * TURNS, (m.config.label, reached, m.requests)


@pytest.mark.server
def test_local_measurements_carry_the_runtime_cost_report(bench):
    result, _, _ = bench
    for m in (m for m in result.measurements if m.config.where == "local"):
        report = m.local_report
        assert report["mode"] == m.config.form
        assert report["requests"] >= m.requests - m.errors  # the report covers every measured window
        assert {"copies", "copy_bytes", "parallelism", "steps"} <= set(report)
    for m in (m for m in result.measurements if m.config.where == "server"):
        assert m.local_report is None


@pytest.mark.server
def test_results_json_plots_table_and_verdict(bench):
    result, out, printed = bench
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["usable_cpus"] >= 1
    assert data["versions"]["tritonserver"] and data["versions"]["tritonclient"]
    assert data["settings"]["concurrency"] == list(LEVELS) and data["settings"]["duration"] == WINDOW_S
    assert len(data["measurements"]) == len(LABELS) * len(LEVELS)
    assert {r["concurrency"] for r in data["prediction_vs_measurement"]} == set(LEVELS)
    assert data["verdict"] == result.verdict
    for name in ("throughput.png", "latency_p95.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    for label in LABELS:
        assert label in printed
    assert "ensemble/BLS p50 latency ratio: in the local runtime (in-process, no server costs) vs on the server" in printed
    assert "On the Triton server" in result.verdict
    assert "requests failed" in result.verdict


def test_the_command_line_runs_a_local_benchmark(tmp_path, capsys):
    from pipelines.cli import main

    code = main([
        "bench", "pipelines.examples.basic:chain", "--no-server", "--concurrency", "1,2", "--duration", "0.1",
        "--warmup", "0", "--max-trials", "3", "--out", str(tmp_path), "--quiet",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "local bls-sync" in printed and "local fused" in printed and "verdict:" in printed
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["pipeline"] == "pipelines.examples.basic:chain"
    assert len(data["measurements"]) == len(FORMS) * 2  # every form of the table, at two loads


def test_the_local_benchmark_runs_steps_in_processes_when_asked(tmp_path, monkeypatch):
    from pipelines.bench.local_target import LocalTarget
    from pipelines.cli import main

    isolations: set[str] = set()
    infer = LocalTarget.infer

    async def recording(self, inputs):
        isolations.add(self.runtime.isolation)
        return await infer(self, inputs)

    monkeypatch.setattr(LocalTarget, "infer", recording)
    code = main([
        "bench", "pipelines.examples.basic:chain", "--no-server", "--concurrency", "2", "--duration", "0.1",
        "--warmup", "0", "--max-trials", "3", "--forms", "ensemble,bls", "--isolation", "process",
        "--out", str(tmp_path), "--quiet",
    ])
    assert code == 0 and isolations == {"process"}
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["isolation"] == "process"
    assert all(m["errors"] == 0 for m in data["measurements"]), data["measurements"]


def test_turns_go_round_every_form_and_pool_each_forms_windows(monkeypatch):
    from pipelines.bench.local_target import LocalTarget

    seen: list[str] = []
    infer = LocalTarget.infer

    async def recording(self, inputs):
        if not seen or seen[-1] != self.runtime.mode:
            seen.append(self.runtime.mode)
        return await infer(self, inputs)

    monkeypatch.setattr(LocalTarget, "infer", recording)
    settings = BenchSettings(concurrency=(1,), server=False, forms=("ensemble", "bls"), duration=0.05, warmup=0.05,
                             max_trials=3, turns=3)
    result = run_benchmark("pipelines.examples.basic:chain", settings, out=None, progress=False, echo=False)
    assert seen == ["ensemble", "bls"] * 3  # each turn measures every form, one after the other
    for m in result.measurements:
        assert m.windows == 3 * 3 and m.window_seconds >= 9 * 0.05
        assert m.requests == sum(m.completed_by_sample) > 0
        # The cost report starts after the first turn's warm-up and covers every turn's windows.
        assert m.requests <= m.local_report["requests"] <= m.requests + 3 * m.concurrency
    with pytest.raises(PipelinesError, match="--turns must be an integer >= 1; got 0"):
        BenchSettings(turns=0)


# ---------------------------------------------------------------- results are never lost


def test_a_level_that_fails_part_way_keeps_the_measurements_it_finished(tmp_path, monkeypatch):
    from pipelines.bench.local_target import LocalTarget

    reset = LocalTarget.reset

    def failing(self):
        if self.runtime.mode == "bls":
            raise RuntimeError("the bls runtime broke")
        reset(self)

    monkeypatch.setattr(LocalTarget, "reset", failing)
    settings = BenchSettings(concurrency=(1,), server=False, forms=("ensemble", "bls"), duration=0.05, warmup=0,
                             max_trials=3)
    # the error itself, not the load generator's task group that carried it
    with pytest.raises(RuntimeError, match="the bls runtime broke") as caught:
        run_benchmark("pipelines.examples.basic:chain", settings, out=tmp_path, progress=False, echo=False)
    kept = caught.value.benchmark_result.measurements
    assert [(m.config.label, m.concurrency) for m in kept] == [("local ensemble", 1)]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["status"] == "failed: RuntimeError: the bls runtime broke" and len(data["measurements"]) == 1


def test_results_are_written_and_plots_only_noted_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError, as when absent
    echo = io.StringIO()
    settings = BenchSettings(concurrency=(1, 2), server=False, forms=("ensemble",), duration=0.05, warmup=0,
                             max_trials=3)
    result = run_benchmark("pipelines.examples.basic:chain", settings, out=tmp_path, progress=False, echo=echo)
    printed = echo.getvalue()
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["status"] == "complete" and len(data["measurements"]) == 2
    assert data["notes"] == ["no plots: matplotlib is not installed (pip install 'pipelines[plot]')"]
    assert data["files"] == [str(tmp_path / "results.json")]
    assert not list(tmp_path.glob("*.png"))
    assert "verdict:" in printed and "\nnote: no plots: matplotlib is not installed (pip install 'pipelines[plot]')" in printed
    assert printed.count("note:") == 1
    assert result.notes == tuple(data["notes"])


def _sigint(argv, disposition):
    """``argv`` (``python -m module ...`` or ``python -c code ...``) whose Python starts with Ctrl-C
    as a terminal gives it (``SIG_DFL``), or ignored, as a job started in the background (``&``,
    nohup) inherits it, whatever the tests' own shell gave them. Set in the child's Python, not by
    ``preexec_fn``: a fork of this process, which may hold gRPC's threads and descriptors, can
    hand the child a broken gRPC (tests/test_endpoint_hostile.py)."""
    # Python turns an inherited SIG_DFL into its KeyboardInterrupt handler at start-up; set in the
    # child's Python, that handler is what SIG_DFL stands for.
    handler = "SIG_IGN" if disposition == signal.SIG_IGN else "default_int_handler"
    setting = f"import signal; signal.signal(signal.SIGINT, signal.{handler})"
    python, flag, what, *rest = argv
    if flag == "-c":
        return [python, "-c", f"{setting}\n{what}", *rest]
    assert flag == "-m"
    run = f"{setting}; import runpy, sys; sys.argv[0] = {what!r}; runpy.run_module({what!r}, run_name='__main__', alter_sys=True)"
    return [python, "-c", run, *rest]


# A server bench of eight short levels, to be stopped part-way.
_EIGHT_LEVELS = [sys.executable, "-m", "pipelines", "bench", "pipelines.examples.basic:chain", "--server", "--no-local",
                 "--forms", "ensemble", "--concurrency", "1,2,3,4,5,6,7,8", "--duration", "0.3", "--warmup", "0",
                 "--max-trials", "3", "--quiet"]


def _leftover_checks():
    try:
        from .server_fixtures import leftovers, wait_for_no_leftovers
    except ImportError:
        from server_fixtures import leftovers, wait_for_no_leftovers
    return leftovers, wait_for_no_leftovers


@pytest.mark.server
@pytest.mark.parametrize(("sig", "ctrl_c"), [(signal.SIGINT, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                                             (signal.SIGTERM, signal.SIG_IGN)],
                         ids=["SIGINT", "SIGTERM", "SIGTERM-in-the-background"])
def test_an_interrupted_bench_keeps_finished_levels_and_leaves_no_server(tmp_path, sig, ctrl_c):
    leftovers, wait_for_no_leftovers = _leftover_checks()
    out = tmp_path / "bench"
    results = out / "results.json"
    cmd = _EIGHT_LEVELS + ["--out", str(out)]
    proc = subprocess.Popen(_sigint(cmd, ctrl_c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not results.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert results.exists(), proc.communicate(timeout=30)
        assert leftovers(str(out)), "the embedded server should be running mid-benchmark"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    data = json.loads(results.read_text())
    assert data["status"] == "interrupted"
    levels = [m["concurrency"] for m in data["measurements"]]
    assert levels and levels == sorted(levels) and levels[0] == 1 and len(levels) < 8
    assert all(m["requests"] > 0 for m in data["measurements"])
    assert "interrupted" in stderr and "finished measurements kept" in stderr
    assert "server ensemble" in stdout  # the finished levels are printed too
    assert wait_for_no_leftovers(str(out)) == []


@pytest.mark.server
def test_a_server_killed_mid_bench_ends_the_run_with_why_and_keeps_the_finished_levels(tmp_path):
    """The client knows at once that its server is gone (it fails before sending anything): the
    load generator must neither spin on those instant failures nor measure them as a level."""
    leftovers, wait_for_no_leftovers = _leftover_checks()
    out = tmp_path / "bench"
    results = out / "results.json"
    cmd = _EIGHT_LEVELS + ["--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and (
            not results.exists() or not json.loads(results.read_text() or "{}").get("measurements")
        ):
            time.sleep(0.05)
        servers = [line for line in leftovers(str(out)) if line.startswith("process") and "tritonserver " in line]
        assert servers, proc.communicate(timeout=30)
        os.kill(int(servers[0].split()[1].rstrip(":")), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, stderr
    data = json.loads(results.read_text())
    assert data["status"].startswith("failed: ServerDiedError: the Triton server for "), data["status"]
    assert "killed by SIGKILL" in data["status"]
    levels = [m["concurrency"] for m in data["measurements"]]
    assert levels and levels[0] == 1 and len(levels) < 8
    assert all(m["errors"] == 0 for m in data["measurements"])  # nothing measured against a dead server
    assert wait_for_no_leftovers(str(out)) == []


JUPYTER_LIKE = """
import asyncio, sys
from pipelines.bench import BenchSettings, run_benchmark

async def cell():  # a notebook cell: run_benchmark called while this thread's loop runs
    settings = BenchSettings(concurrency=tuple(range(1, 41)), server=False, forms=("ensemble",),
                             duration=0.1, warmup=0, max_trials=3)
    try:
        run_benchmark("pipelines.examples.basic:chain", settings, out=sys.argv[1], progress=False, echo=False)
    except KeyboardInterrupt as exc:
        print("kept", len(exc.benchmark_result.measurements), flush=True)
        raise

asyncio.new_event_loop().run_until_complete(cell())  # no asyncio.Runner: Ctrl-C raises in this thread
"""


def test_ctrl_c_in_a_running_event_loop_stops_the_worker_and_keeps_the_levels(tmp_path):
    results = tmp_path / "results.json"
    proc = subprocess.Popen(_sigint([sys.executable, "-c", JUPYTER_LIKE, str(tmp_path)], signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not results.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)  # 40 levels would take much longer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in stderr
    data = json.loads(results.read_text())
    assert data["status"] == "interrupted"
    assert 1 <= len(data["measurements"]) < 40
    assert stdout.strip() == f"kept {len(data['measurements'])}"


def test_an_interrupted_rerun_sets_an_earlier_complete_run_aside_and_a_complete_one_replaces_it(tmp_path):
    settings = BenchSettings(concurrency=(1,), server=False, forms=("ensemble",), duration=0.05, warmup=0,
                             max_trials=3)
    run_benchmark("pipelines.examples.basic:chain", settings, out=tmp_path, progress=False, echo=False)
    earlier = {name: (tmp_path / name).read_bytes() for name in ("results.json", "throughput.png", "latency_p95.png")}
    assert json.loads(earlier["results.json"])["status"] == "complete"
    proc = subprocess.Popen(_sigint([sys.executable, "-c", JUPYTER_LIKE, str(tmp_path)], signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not (tmp_path / "results.previous.json").exists():
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "interrupted"
    assert "the earlier complete run's results are in" in stderr and "results.previous.json" in stderr
    for name, data in earlier.items():  # whole, and its plots beside it, not beside the partial run
        stem, suffix = name.rsplit(".", 1)
        assert (tmp_path / f"{stem}.previous.{suffix}").read_bytes() == data
        assert not (tmp_path / name).exists() or name == "results.json"
    # Rerun again and interrupted again: the partial run is replaced, the complete one still kept.
    run_benchmark("pipelines.examples.basic:chain", settings, out=tmp_path, progress=False, echo=False)
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "complete"
    assert sorted(f.name for f in tmp_path.iterdir() if "previous" in f.name) == []  # replaced by a complete run


def test_a_complete_run_without_plots_is_set_aside_without_an_older_runs_plots(tmp_path):
    # Run B finished its results but was stopped while plotting; run A's files were set aside by B.
    from pipelines.bench.runner import _set_aside_a_complete_run

    (tmp_path / "results.json").write_text(json.dumps({"status": "complete", "started": "B"}))
    (tmp_path / "results.previous.json").write_text(json.dumps({"status": "complete", "started": "A"}))
    (tmp_path / "throughput.previous.png").write_bytes(b"A's plot")
    _set_aside_a_complete_run(tmp_path)  # run C begins
    assert json.loads((tmp_path / "results.previous.json").read_text())["started"] == "B"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["results.previous.json"]


def test_settings_from_reads_every_field_from_the_cli_options():
    # settings_from reads each BenchSettings field from the option of the same name: every
    # field must have one, and --requests replaces the duration.
    from pipelines.bench.command import settings_from
    from pipelines.bench.settings import BenchSettings
    from pipelines.cli import build_parser

    args = build_parser().parse_args(["bench", "--concurrency", "2,1", "--batch", "3", "--no-local"])
    settings = settings_from(args)
    assert (settings.concurrency, settings.batch, settings.local, settings.duration) == ((1, 2), 3, False, 2.0)
    assert settings.requests is None and settings.size == BenchSettings().size
    by_count = settings_from(build_parser().parse_args(["bench", "--requests", "50"]))
    assert (by_count.requests, by_count.duration) == (50, None)
