"""What the cores can do: no simulated configuration answers faster than the server's cores over the CPU time one
request costs, and a step that runs several threads (CPU time above its wall time) takes its CPU time of the cores.
Exact, on virtual time."""

from __future__ import annotations

import pytest
from test_simulator import PRICED, chain_spec, closed, costs, spec, step

from pipelines.predict.simulator import FORMS, core_ceiling, cpu_per_request, simulate
from pipelines.predict.spec import Curve, SimSpec, StepSpec


def threaded(form: str, *, instances: int, cores: float = 2.0) -> SimSpec:
    """prepare (100 µs) -> heavy (1000 µs of wall, 2000 µs of CPU: two threads) and light (300 µs) -> join (50 µs)."""
    steps = (step("prepare", 100, instances=instances),
             step("heavy", 1000, cpu=2000, deps=("prepare",), instances=instances),
             step("light", 300, deps=("prepare",), instances=instances),
             step("join", 50, deps=("heavy", "light"), instances=instances))
    return spec(form, *steps, cores=cores, costs=PRICED, top_instances=instances)


def batching(form: str, *, instances: int) -> SimSpec:
    """One step of 400 µs for one row, 1000 µs for 8, batching up to 8 rows with a 100 µs delay."""
    curve = Curve((1, 8), (400.0, 1000.0))
    heavy = StepSpec("batched", (), curve, curve, in_bytes=1000.0, out_bytes=1000.0, instances=instances,
                     max_batch_size=8, dynamic_batching=True, max_queue_delay_us=100.0)
    return SimSpec(form, (heavy,), rows=1, in_bytes=1000.0, out_bytes=1000.0, costs=PRICED, cores=2.0,
                   top_instances=instances, top_max_batch_size=8)


PIPELINES = {"threaded": threaded, "batching": batching,
             "chain": lambda form, instances: chain_spec(form)}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("form", FORMS)
def test_no_configuration_answers_faster_than_the_cores_can(name, form):
    for instances in (1, 2, 4):
        configured = PIPELINES[name](form, instances=instances)
        ceiling = core_ceiling(configured)
        for concurrency in (1, 4, 16):
            requests = 200
            result = simulate(configured, closed(concurrency, requests=requests))
            # Up to `concurrency` requests answered in the window began before it, their CPU time spent before it.
            assert result.throughput <= ceiling * requests / (requests - concurrency), (instances, concurrency)
            assert result.cpu_utilisation <= 1.0 + 1e-9


def test_a_request_costs_at_least_its_request_boundary_and_the_cheapest_row_of_each_step_it_always_runs():
    configured = batching("ensemble", instances=1)
    # 1000 µs for 8 rows: 125 µs a row at best; the request's boundary is 1 + 1 µs a KB in and 2 + 1 out
    assert cpu_per_request(configured) == pytest.approx(2.0 + 3.0 + 125.0)
    gated = SimSpec("bls", (step("always", 100), step("sometimes", 900, deps=("always",), when=("A",))), rows=1,
                    in_bytes=0.0, out_bytes=0.0, costs=costs(), cores=2.0, when_rates={"A": 0.5})
    assert cpu_per_request(gated) == pytest.approx(100.0)  # a `when` block's step may not run at all


def test_a_step_that_runs_two_threads_takes_its_cpu_time_of_the_cores():
    # Two instances of a step of 1000 µs of wall and 2000 µs of CPU, on two cores, free boundaries: each execution
    # wants both cores, so two at once take twice their wall time. Priced by its wall time alone, it would answer
    # 2000 requests/s; by its CPU time, 1000.
    two_threads = spec("ensemble", step("heavy", 1000, cpu=2000, instances=2), cores=2.0)
    result = simulate(two_threads, closed(2))
    assert result.throughput == pytest.approx(1000.0)
    assert result.p50_us == pytest.approx(2000.0)
    assert core_ceiling(two_threads) == pytest.approx(1000.0)
    # alone, it takes its wall time
    assert simulate(two_threads, closed(1)).p50_us == pytest.approx(1000.0)


@pytest.mark.parametrize("form", FORMS)
def test_a_multi_threaded_step_reaches_the_ceiling_once_it_saturates_the_cores(form):
    # heavy's 2000 µs of CPU dominate: with enough instances and clients the cores are the bottleneck
    configured = spec(form, step("heavy", 1000, cpu=2000, instances=4), cores=2.0, top_instances=4)
    result = simulate(configured, closed(16))
    assert result.throughput == pytest.approx(core_ceiling(configured), rel=0.02)
    assert result.bottleneck == "cpu"
