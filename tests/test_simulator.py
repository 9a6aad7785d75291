"""The simulator predicts the server's schedule on a virtual clock, so its figures are exact: a
chain of known costs takes their sum, a queue waits what queueing theory says, a batch, an
instance, a core or a GIL is shared exactly as the model says, and the same inputs give the
same figures. Nothing here reads a clock."""

from __future__ import annotations

import math

import pytest
import simpy
from batcher_runs import batches_of

from pipelines.calibration.cost import FORM_COSTS
from pipelines.errors import ArgumentError, PipelinesError
from pipelines.predict.processor_sharing import Cores
from pipelines.predict.simulator import FORMS, simulate
from pipelines.predict.spec import Curve, Load, SimSpec, StepSpec, WayCost

#: The server profile's boundaries (pipelines.calibration.profile.BOUNDARIES).
BOUNDARIES = ("request", "ensemble", "ensemble_step", "bls_call", "bls_model", "bls_sync_call", "bls_sync_model",
              "fused_model", "fused_step",
              "stub", "ensemble_stub", "bls_stub", "bls_sync_stub", "ensemble_gate")


def flat(us: float) -> WayCost:
    return WayCost((0,), (float(us),))


def costs(**priced: tuple[float, float]) -> dict[str, tuple[WayCost, WayCost]]:
    """Every boundary free but those given, as name=(µs in, µs out)."""
    free = {name: (flat(0), flat(0)) for name in BOUNDARIES}
    return free | {name: (flat(way_in), flat(way_out)) for name, (way_in, way_out) in priced.items()}


def step(name: str, wall: float, *, deps: tuple[str, ...] = (), cpu: float | None = None,
         rows_wall: Curve | None = None, **options) -> StepSpec:
    """A step that takes ``wall`` µs a call (``rows_wall``: by rows), on one core unless ``cpu``."""
    wall_us = rows_wall or Curve.flat(wall)
    cpu_us = wall_us if cpu is None else Curve.flat(cpu)
    return StepSpec(name, deps, wall_us, cpu_us, in_bytes=1000.0, out_bytes=1000.0, **options)


def spec(form: str, *steps: StepSpec, cores: float = 8.0, **options) -> SimSpec:
    options.setdefault("costs", costs())
    return SimSpec(form, steps, rows=1, in_bytes=1000.0, out_bytes=1000.0, cores=cores, **options)


def closed(concurrency: int, requests: int = 200, warmup: int = 20) -> Load:
    return Load(concurrency=concurrency, requests=requests, warmup=warmup)


def latencies(result) -> set[float]:
    return {result.p50_us, result.p95_us, result.p99_us, result.mean_us}


# ---------------------------------------------------------------------- a chain sums its costs


def by_bytes(fixed: float) -> WayCost:
    """``fixed`` µs plus 1 µs per 1000 bytes."""
    return WayCost((0, 1000), (fixed, fixed + 1.0))


PRICED = {name: (by_bytes(10 * i + 1), by_bytes(10 * i + 2)) for i, name in enumerate(BOUNDARIES)}


def at(name: str, way: int, nbytes: float) -> float:
    return PRICED[name][way].at(nbytes)


def chain_spec(form: str) -> SimSpec:
    """a -> b -> c at 2 rows a request; c is an external model (no stub)."""
    steps = (
        StepSpec("a", (), Curve.flat(100), Curve.flat(100), in_bytes=1000, out_bytes=2000),
        StepSpec("b", ("a",), Curve((1, 2), (150, 200)), Curve((1, 2), (150, 200)), in_bytes=2000, out_bytes=3000),
        StepSpec("c", ("b",), Curve.flat(300), Curve.flat(0), in_bytes=3000, out_bytes=500, external=True),
    )
    return SimSpec(form, steps, rows=2, in_bytes=1000, out_bytes=500, costs=PRICED, cores=4)


def test_a_chain_alone_takes_the_sum_of_its_costs_in_every_form():
    walls = {"a": 100, "b": 200, "c": 300}  # b at 2 rows
    steps = chain_spec("ensemble").steps
    ins, outs = {s.name: 2 * s.in_bytes for s in steps}, {s.name: 2 * s.out_bytes for s in steps}
    enter, leave = 2000, 1000  # the request's bytes in and out

    def called(call: str, stub: str | None) -> float:
        return sum(at(call, 0, ins[n]) + (at(stub, 0, ins[n]) + at(stub, 1, outs[n]) if stub and n != "c" else 0)
                   + walls[n] + at(call, 1, outs[n]) for n in walls)

    expected = {
        "ensemble": at("request", 0, enter) + at("ensemble", 0, enter) + called("ensemble_step", "ensemble_stub")
        + at("request", 1, leave) + at("ensemble", 1, leave),
        "bls": at("request", 0, enter) + at("bls_model", 0, enter) + called("bls_call", "bls_stub")
        + at("bls_model", 1, leave) + at("request", 1, leave),
        "bls-sync": at("request", 0, enter) + at("bls_sync_model", 0, enter)
        + called("bls_sync_call", "bls_sync_stub") + at("bls_sync_model", 1, leave) + at("request", 1, leave),
        # in process: no calls and no stubs, but for the external step; the fused model's own work
        # around each Python step, which passes no bytes
        "fused": at("request", 0, enter) + at("fused_model", 0, enter) + walls["a"] + walls["b"]
        + 2 * (at("fused_step", 0, 0) + at("fused_step", 1, 0))
        + at("bls_call", 0, ins["c"]) + walls["c"] + at("bls_call", 1, outs["c"])
        + at("fused_model", 1, leave) + at("request", 1, leave),
    }
    for form in FORMS:
        result = simulate(chain_spec(form), closed(1))
        assert latencies(result) == {expected[form]}, form
        assert result.throughput == pytest.approx(1e6 / expected[form], rel=1e-12), form


# ---------------------------------------------------------------------- queues


def test_an_open_loop_into_one_server_waits_as_md1_says():
    # M/D/1: Poisson arrivals at λ, service D: the mean wait is λD²/(2(1-λD)).
    rate, service = 600.0, 1000.0
    rho = rate / 1e6 * service
    wait = rho * service / (2 * (1 - rho))  # 750 µs
    result = simulate(spec("ensemble", step("s", service)),
                      Load(rate=rate, requests=50_000, warmup=1_000, seed=7))
    assert result.mean_us - service == pytest.approx(wait, rel=0.03)  # 758 µs with this seed
    assert result.throughput == pytest.approx(rate, rel=0.01)
    assert result.utilisation["s"] == pytest.approx(rho, rel=0.01)


def test_an_open_loop_beyond_the_capacity_is_answered_at_the_capacity():
    result = simulate(spec("ensemble", step("s", 1000)), Load(rate=5000.0, seed=1))
    assert result.throughput == pytest.approx(1000.0, rel=1e-12)
    assert result.bottleneck == "s"
    assert result.p99_us > result.p50_us > 100_000  # its queue grows while it is measured


def test_two_instances_double_the_throughput_of_a_saturated_step():
    one = simulate(spec("ensemble", step("s", 1000)), closed(8))
    two = simulate(spec("ensemble", step("s", 1000, instances=2)), closed(8))
    assert one.throughput == pytest.approx(1000.0, rel=1e-12)
    assert two.throughput == pytest.approx(2000.0, rel=1e-12)
    assert latencies(one) == {8000.0} and latencies(two) == {4000.0}  # 8 clients queue on 1, or 2, instances
    assert one.utilisation["s"] == pytest.approx(1.0) and two.utilisation["s"] == pytest.approx(1.0)


# ---------------------------------------------------------------------- the dynamic batcher


def batching(wall: float | Curve = 1000.0, **options) -> StepSpec:
    curve = wall if isinstance(wall, Curve) else None
    return step("s", 0 if curve else wall, rows_wall=curve, max_batch_size=4, dynamic_batching=True, **options)


def test_a_saturated_batcher_sends_full_batches():
    # 8 clients, batches of 4 at most: one batch runs while the next 4 wait.
    result = simulate(spec("ensemble", batching(max_queue_delay_us=10_000)), closed(8))
    assert result.throughput == pytest.approx(4000.0, rel=1e-12)
    assert latencies(result) == {2000.0}
    # a batch's cost by its rows: 4 rows take 1600 µs
    grows = simulate(spec("ensemble", batching(Curve((1, 4), (1000, 1600)))), closed(8))
    assert grows.throughput == pytest.approx(4 / 1600 * 1e6, rel=1e-12)


def test_a_batch_below_the_max_waits_out_the_queue_delay():
    # 3 clients, batches of 4: the batch of 3 waits 500 µs for a fourth that never comes.
    waits = simulate(spec("ensemble", batching(max_queue_delay_us=500)), closed(3))
    assert latencies(waits) == {1500.0}
    assert waits.throughput == pytest.approx(3 / 1500 * 1e6, rel=1e-12)
    at_once = simulate(spec("ensemble", batching(max_queue_delay_us=0)), closed(3))
    assert latencies(at_once) == {1000.0}
    assert at_once.throughput == pytest.approx(3000.0, rel=1e-12)


def test_a_preferred_batch_size_goes_without_waiting():
    preferred = simulate(spec("ensemble", batching(max_queue_delay_us=10_000, preferred_batch_sizes=(2,))), closed(2))
    assert latencies(preferred) == {1000.0}
    waits = simulate(spec("ensemble", batching(max_queue_delay_us=10_000)), closed(2))
    assert latencies(waits) == {11_000.0}


def test_a_request_that_arrives_while_a_batch_waits_for_the_instance_waits_for_the_next_one():
    # As Triton's batcher thread: b's batch is formed at 1100 (its delay out) and waits for the
    # instance; c arrives at 1200, but one row of the four it lacks does not wake the thread,
    # so the instance takes b alone at 1500, and c goes in a batch of its own.
    batches, answered = batches_of({"a": 0, "b": 600, "c": 1200})
    assert batches == [["a"], ["b"], ["c"]]
    assert answered == {"a": 1500, "b": 2500, "c": 3500}
    # Rows that make up what the waiting batch lacks wake the thread, and join it.
    batches, answered = batches_of({"a": 0, "b": 600, "c": 1200, "d": 1200, "e": 1200, "f": 1200})
    assert batches == [["a"], ["b", "c", "d", "e"], ["f"]]
    assert answered["f"] == 3500


def test_a_batcher_asleep_on_an_empty_queue_looks_again_after_500_ms():
    # a runs 0.1-1.6 s; b's batch is formed at 0.45 s, and the thread sleeps on its empty queue.
    # c (0.9 s) does not wake it, but its 500 ms wait runs out at 0.95 s: c joins b's batch.
    batches, _ = batches_of({"a": 0, "b": 350_000, "c": 900_000}, execution=1_500_000, delay=100_000)
    assert batches == [["a"], ["b", "c"]]
    # Before it runs out (the instance free at 0.8 s), c waits for a batch of its own.
    batches, _ = batches_of({"a": 0, "b": 350_000, "c": 600_000}, execution=700_000, delay=100_000)
    assert batches == [["a"], ["b"], ["c"]]


# ---------------------------------------------------------------------- the cores


def test_processor_sharing_stretches_cpu_work_beyond_the_cores():
    four = step("s", 1000, instances=4)
    assert latencies(simulate(spec("ensemble", four, cores=4), closed(4))) == {1000.0}
    crowded = simulate(spec("ensemble", four, cores=2), closed(4))
    assert latencies(crowded) == {2000.0}  # 4 one-core jobs on 2 cores take twice as long
    assert crowded.cpu_utilisation == pytest.approx(1.0, rel=1e-12)
    assert crowded.bottleneck == "cpu"
    # cpu below wall: the step waits (on a GPU, say) most of its time, and 4 fit on one core
    waiting = step("s", 1000, cpu=250, instances=4)
    assert latencies(simulate(spec("ensemble", waiting, cores=1), closed(4))) == {1000.0}
    # cpu above wall: two threads; alone on one core it takes twice its wall time
    threads = step("s", 1000, cpu=2000)
    assert latencies(simulate(spec("ensemble", threads, cores=1), closed(1))) == {2000.0}
    assert latencies(simulate(spec("ensemble", threads, cores=2), closed(1))) == {1000.0}


def ends_on(cores: float, *jobs: tuple[float, float]) -> list[float]:
    """When each ``(span, cap)`` job, all started at 0, ends on ``cores`` cores."""
    env = simpy.Environment()
    shared = Cores(env, cores)
    ends: dict[int, float] = {}
    for i, (span, cap) in enumerate(jobs):
        shared.run(span, cap).callbacks.append(lambda _, i=i: ends.__setitem__(i, env.now))
    env.run()
    return [ends[i] for i in range(len(jobs))]


def test_only_the_cpu_time_of_a_job_below_a_core_is_stretched():
    # A step that sleeps 990 µs of its 1000 beside two one-core jobs on one core: only its 10 µs
    # of CPU stretch, by the f at which the three use the core: 2/f + 0.01/(0.99 + 0.01 f) = 1.
    f = (-0.96 + math.sqrt(0.96**2 + 4 * 0.01 * 1.98)) / (2 * 0.01)
    asleep, one, two = ends_on(1, (1000, 0.01), (1000, 1.0), (1000, 1.0))
    assert asleep == pytest.approx(1000 * (0.99 + 0.01 * f), rel=1e-9)  # 1010 µs, not 2010
    assert one == two == pytest.approx(2010.0, rel=1e-9)  # the core never idles: 2010 CPU µs
    # Half asleep beside a one-core job: 1/f + 0.5/(0.5 + 0.5 f) = 1 gives the golden ratio.
    golden = (1 + math.sqrt(5)) / 2
    half, whole = ends_on(1, (1000, 0.5), (1000, 1.0))
    assert half == pytest.approx(500 * (1 + golden), rel=1e-9)
    assert whole == pytest.approx(1500.0, rel=1e-9)
    # Room for both: each at its cap, as long as alone.
    assert ends_on(1, (1000, 0.5), (1000, 0.5)) == [pytest.approx(1000.0, rel=1e-12)] * 2


def test_work_that_waits_on_memory_shares_the_memory_bus():
    # Two copies side by side on two cores each get half the bus: twice as long.
    copies = step("s", 1000, instances=2, memory=1.0)
    assert latencies(simulate(spec("ensemble", copies, cores=2), closed(1))) == {1000.0}  # alone
    assert latencies(simulate(spec("ensemble", copies, cores=2), closed(2))) == {2000.0}
    # Work in the cache beside work in the cache: as long as alone.
    cached = step("s", 1000, instances=2)
    assert latencies(simulate(spec("ensemble", cached, cores=2), closed(2))) == {1000.0}
    # Half of it waits on memory, beside the same: 1 + 0.5 × 0.5 as long.
    half = step("s", 1000, instances=2, memory=0.5)
    assert all(v == pytest.approx(1250.0, rel=1e-9) for v in latencies(simulate(spec("ensemble", half, cores=2), closed(2))))
    # Work that waits on memory but takes little of it (its traffic 0: a cache a neighbour's
    # stream evicts) beside a copy: each job is slowed by the others' traffic, the copy by none
    # and the other by the copy's; the mix's mean factor, 1 + (1 × 1 + 1 × 0) / 2, for both.
    sensitive = step("a", 1000, memory=1.0, traffic=0.0)
    copy = step("b", 1000, memory=1.0)
    assert all(v == pytest.approx(1500.0, rel=1e-9)
               for v in latencies(simulate(spec("ensemble", sensitive, copy, cores=2), closed(1))))
    # On one core they never run at once, so only the cores are shared.
    assert latencies(simulate(spec("ensemble", copies, cores=1), closed(2))) == {2000.0}
    # Four copies on two cores: each runs beside one other at a time, at half the bus, and
    # half the time: four times as long.
    four = step("s", 1000, instances=4, memory=1.0)
    assert all(v == pytest.approx(4000.0, rel=1e-9) for v in latencies(simulate(spec("ensemble", four, cores=2), closed(4))))


def test_a_boundarys_cost_per_byte_is_a_copy_that_shares_the_memory_bus():
    # Two requests at once cross a boundary of 1 µs per 1000 bytes, 1000 µs in all: a copy each,
    # side by side on two cores, twice as long; a fixed cost of the same size is not slowed.
    copy = costs() | {"ensemble_stub": (WayCost((0, 1_000_000), (0.0, 1000.0)), flat(0))}
    fixed = costs(ensemble_stub=(1000.0, 0.0))
    stepped = StepSpec("s", (), Curve.flat(0.0), Curve.flat(0.0), in_bytes=1_000_000.0, out_bytes=0.0, instances=2)
    big = SimSpec("ensemble", (stepped,), rows=1, in_bytes=1_000_000.0, out_bytes=0.0, cores=2, costs=copy)
    assert latencies(simulate(big, closed(2))) == {2000.0}
    flat_cost = SimSpec("ensemble", (stepped,), rows=1, in_bytes=1_000_000.0, out_bytes=0.0, cores=2, costs=fixed)
    assert latencies(simulate(flat_cost, closed(2))) == {1000.0}


# ---------------------------------------------------------------------- BLS rounds, sync and async


def test_a_bls_request_done_early_leaves_with_its_round():
    # One round of 2 requests; their step has one instance, so A is done at 1000 and B at 2000:
    # both answers leave at 2000, when the round's execute() returns.
    result = simulate(spec("bls", step("s", 1000), top_max_batch_size=2), closed(2))
    assert latencies(result) == {2000.0}
    assert result.throughput == pytest.approx(1000.0, rel=1e-12)


def test_sync_bls_calls_one_step_and_one_request_after_another_async_side_by_side():
    a, b = step("a", 1000), step("b", 1000)  # independent
    assert latencies(simulate(spec("bls", a, b), closed(1))) == {1000.0}
    assert latencies(simulate(spec("bls-sync", a, b), closed(1))) == {2000.0}
    two = step("s", 1000, instances=2)  # a round of 2 requests, room for both
    assert latencies(simulate(spec("bls", two, top_max_batch_size=2), closed(2))) == {1000.0}
    assert latencies(simulate(spec("bls-sync", two, top_max_batch_size=2), closed(2))) == {2000.0}


def test_the_bls_model_pays_its_fixed_cost_once_a_round():
    # bls_model's way in: 100 µs fixed + 1 µs per 1000 bytes; each request brings 1000 bytes.
    priced = costs() | {"bls_model": (WayCost((0, 1000), (100, 101)), flat(0))}
    result = simulate(spec("bls", step("s", 1000, instances=2), top_max_batch_size=2, costs=priced), closed(2))
    assert latencies(result) == {100 + 1 + 1 + 1000.0}


@pytest.mark.parametrize("form", ["bls", "bls-sync", "fused"])
def test_a_rounds_answers_pay_the_top_models_fixed_way_out_once(form):
    # The way out: 300 µs fixed + 1 µs per 1000 bytes, each answer 1000 bytes. A round of two
    # requests returns both answers in one list from its execute(), so it pays 300 once and
    # 1 µs each; its answers leave together as the round ends.
    top = FORM_COSTS[form].own_cost
    priced = costs() | {top: (flat(0), WayCost((0, 1000), (300, 301)))}
    s = step("s", 1000, instances=2, max_batch_size=2)  # fused: the round runs as one batch of 2 rows
    result = simulate(spec(form, s, top_max_batch_size=2, costs=priced), closed(2))
    steps = 2000.0 if form == "bls-sync" else 1000.0  # sync: one request's call after the other's
    assert latencies(result) == {steps + 300 + 1 + 1}
    alone = simulate(spec(form, s, top_max_batch_size=2, costs=priced), closed(1))
    assert latencies(alone) == {1000 + 300 + 1.0}



def test_each_request_of_a_fused_round_beyond_the_first_pays_its_own():
    # round_request_us 200: a round of two pays it once (for the second), a round of one not at all;
    # a BLS round pays none (it was measured on the fused model, and priced there only).
    s = step("s", 1000, instances=2, max_batch_size=2)
    assert latencies(simulate(spec("fused", s, top_max_batch_size=2, round_request_us=200), closed(2))) == {1200.0}
    assert latencies(simulate(spec("fused", s, top_max_batch_size=2, round_request_us=200), closed(1))) == {1000.0}
    assert latencies(simulate(spec("bls", s, top_max_batch_size=2, round_request_us=200), closed(2))) == {1000.0}
    with pytest.raises(PipelinesError, match="round_request_us is µs >= 0"):
        simulate(spec("fused", s, round_request_us=-1.0), closed(1))


def test_a_bls_instance_has_at_most_its_call_threads_calls_in_flight():
    # A round of 8 requests, each calling a step of 8 instances: room for every call but for the
    # stub's 6 threads (async_exec() waits for each answer in one), so 2 calls wait for the first 6.
    def round_of_8(threads: int, form: str = "bls", **options) -> set[float]:
        s = step("s", 1000, instances=8, **options)
        return latencies(simulate(spec(form, s, top_max_batch_size=8, call_threads=threads), closed(8)))

    assert round_of_8(0) == {1000.0}  # no limit
    assert round_of_8(8) == {1000.0}
    assert round_of_8(6) == {2000.0}
    assert round_of_8(6, "bls-sync") == {8000.0}  # a sync call waits in the loop's own thread
    assert round_of_8(6, "fused", external=True) == {2000.0}  # a fused model's external steps' calls too


def test_a_rounds_requests_send_their_calls_request_by_request():
    # Two requests, each with two independent steps a and b (one instance each), and 2 call
    # threads: the first request's a and b take both, as the BLS model's tasks send them (each all
    # it can before the next), and the round ends at 2000. Sent step by step instead (both a's
    # first), the b's would wait behind the a's, queued at a's one instance, until 3000.
    a, b = step("a", 1000), step("b", 1000)
    assert latencies(simulate(spec("bls", a, b, top_max_batch_size=2, call_threads=2), closed(2))) == {2000.0}


# ---------------------------------------------------------------------- fused


def test_fused_steps_overlap_but_for_the_share_that_holds_the_gil():
    def fused(gil_share: float) -> set[float]:
        a, b = step("a", 1000, gil_share=gil_share), step("b", 1000, gil_share=gil_share)  # independent
        return latencies(simulate(spec("fused", a, b), closed(1)))

    assert fused(1.0) == {2000.0}
    assert fused(0.0) == {1000.0}
    assert fused(0.5) == {1500.0}  # b takes the GIL when a lets it go, halfway


def test_each_fused_instance_has_its_own_gil():
    a, b = step("a", 1000), step("b", 1000)
    assert latencies(simulate(spec("fused", a, b, top_instances=2), closed(2))) == {2000.0}
    one = simulate(spec("fused", a, b, top_instances=1), closed(2))
    assert latencies(one) == {4000.0}
    assert one.bottleneck == "fused"


def test_a_fused_round_runs_its_requests_as_one_batch():
    flat_batch = Curve((1, 4), (1000, 1000))  # the same cost for 1 to 4 rows
    joined = simulate(spec("fused", step("s", 0, rows_wall=flat_batch, max_batch_size=4), top_max_batch_size=4),
                      closed(4))
    assert latencies(joined) == {1000.0}
    # a step that does not batch: the 4 requests run side by side, and the step's instance in the
    # fused instance takes one call at a time, holding the GIL or not
    for gil_share in (1.0, 0.0):
        alone = simulate(spec("fused", step("s", 1000, gil_share=gil_share), top_max_batch_size=4), closed(4))
        assert latencies(alone) == {4000.0}


def test_side_by_side_fused_requests_of_a_chain_take_turns_on_the_event_loop():
    # A chain a -> b whose steps do not batch: a round of 2 requests runs side by side, and each
    # step, the only one ready in its request, runs on the event loop's thread (fused_model.py),
    # holding up the other request: 4 steps one after another, though neither holds the GIL.
    a, b = step("a", 1000, gil_share=0.0), step("b", 1000, gil_share=0.0, deps=("a",))
    assert latencies(simulate(spec("fused", a, b, top_max_batch_size=2), closed(2))) == {4000.0}


def test_fused_steps_that_run_together_take_the_step_pool():
    # Three independent steps, none holding the GIL: with a pool of 3 they all run at once; with
    # a pool of 2 (step_threads) the third waits for a thread.
    three = [step(name, 1000, gil_share=0.0) for name in "abc"]
    assert latencies(simulate(spec("fused", *three, step_threads=3), closed(1))) == {1000.0}
    assert latencies(simulate(spec("fused", *three, step_threads=2), closed(1))) == {2000.0}


def test_the_fused_models_work_around_each_step_holds_its_gil_and_passes_no_bytes():
    # fused_step: 50 µs in, 50 out at no bytes, 1 µs more per 1000 bytes, which the steps' 1000
    # bytes do not pay (references in one process). Two steps that hold no GIL overlap, but for that
    # work: b takes the GIL for its 100 µs once a is done with it.
    priced = costs() | {"fused_step": (by_bytes(50), by_bytes(50))}
    two = [step(name, 1000, gil_share=0.0) for name in "ab"]
    assert latencies(simulate(spec("fused", *two, step_threads=2, costs=priced), closed(1))) == {1200.0}
    chained = [step("a", 1000, gil_share=0.0), step("b", 1000, deps=("a",), gil_share=0.0)]
    assert latencies(simulate(spec("fused", *chained, costs=priced), closed(1))) == {2200.0}
    # an external step is a BLS call: it pays none of it
    assert latencies(simulate(spec("fused", step("x", 1000, external=True), costs=priced), closed(1))) == {1000.0}


def test_nodes_of_one_model_share_its_instances():
    # Two independent nodes of one step compile to one model: its one instance runs them in turn.
    a, b = step("a", 1000, model="m"), step("b", 1000, model="m")
    for form in ("ensemble", "bls"):
        shared = simulate(spec(form, a, b), closed(1))
        assert latencies(shared) == {2000.0}, form
        assert shared.utilisation["m"] == pytest.approx(1.0, rel=1e-12), form
        assert "a" not in shared.utilisation and "b" not in shared.utilisation
    assert latencies(simulate(spec("ensemble", step("a", 1000), step("b", 1000)), closed(1))) == {1000.0}
    # in a fused instance the step's one instance takes one call at a time, GIL or not
    free_a, free_b = step("a", 1000, model="m", gil_share=0.0), step("b", 1000, model="m", gil_share=0.0)
    assert latencies(simulate(spec("fused", free_a, free_b), closed(1))) == {2000.0}
    with pytest.raises(PipelinesError, match="share model 'm' but not its options"):
        simulate(spec("ensemble", a, step("b", 1000, model="m", instances=2)), closed(1))


# ---------------------------------------------------------------------- the gate, utilisation, bottleneck


def test_the_gate_has_one_instance_and_can_be_the_bottleneck():
    # The step is an external model (no stub, no CPU) with an instance per client; the gate's
    # stub costs 100 + 200 µs a request, on one instance; its fixed cost holds nothing.
    model = step("m", 100, cpu=0, instances=4, external=True)
    priced = costs(ensemble_stub=(100, 200), ensemble_gate=(50, 0))
    alone = simulate(spec("ensemble", model, gate=True, costs=priced), closed(1))
    assert latencies(alone) == {100 + 300 + 50.0}
    busy = simulate(spec("ensemble", model, gate=True, costs=priced, cores=2), closed(4))
    assert busy.throughput == pytest.approx(1e6 / 300, rel=1e-12)
    assert busy.utilisation["gate"] == pytest.approx(1.0, rel=1e-12)
    assert busy.utilisation["m"] == pytest.approx(100 / (4 * 300), rel=1e-12)
    assert busy.bottleneck == "gate"


def test_utilisation_names_the_busiest_model():
    a, b = step("a", 500), step("b", 2000, deps=("a",))
    result = simulate(spec("ensemble", a, b), closed(4))
    assert result.utilisation == pytest.approx({"a": 0.25, "b": 1.0}, rel=1e-12)
    assert result.throughput == pytest.approx(500.0, rel=1e-12)
    assert result.cpu_utilisation == pytest.approx(1.25 / 8, rel=1e-12)  # 1.25 cores busy of 8
    assert result.bottleneck == "b"
    # the BLS model's instance, held for whole rounds, one request each, is busier still
    bls = simulate(spec("bls", a, b), closed(4))
    assert set(bls.utilisation) == {"a", "b", "bls"}
    assert bls.utilisation["bls"] == pytest.approx(1.0, rel=1e-12)
    assert bls.bottleneck == "bls"


# ---------------------------------------------------------------------- repeatable, and refused


def test_the_same_inputs_give_the_same_figures():
    diamond = (step("a", 300), step("b", 800, deps=("a",), cpu=100, max_batch_size=4, dynamic_batching=True,
                                    max_queue_delay_us=200), step("c", 400, deps=("a",)), step("d", 100, deps=("b", "c")))
    for form in FORMS:
        configuration = spec(form, *diamond, cores=2, top_max_batch_size=4)
        first = simulate(configuration, Load(rate=400.0, requests=500, seed=3))
        assert simulate(configuration, Load(rate=400.0, requests=500, seed=3)) == first, form
        assert simulate(configuration, Load(rate=400.0, requests=500, seed=4)) != first, form  # the seed matters


def test_what_cannot_be_simulated_is_refused_with_the_reason():
    with pytest.raises(ArgumentError, match="no form 'grpc'"):
        simulate(spec("grpc", step("s", 10)), closed(1))
    with pytest.raises(PipelinesError, match="bls_call"):
        simulate(spec("bls", step("s", 10), costs={"request": (flat(0), flat(0)), "bls_model": (flat(0), flat(0)),
                                                   "bls_stub": (flat(0), flat(0))}), closed(1))
    with pytest.raises(PipelinesError, match="topological order"):
        simulate(spec("ensemble", step("a", 10, deps=("b",)), step("b", 10)), closed(1))
    with pytest.raises(PipelinesError, match="max_batch_size > 0"):
        simulate(spec("ensemble", step("s", 10, dynamic_batching=True)), closed(1))
    with pytest.raises(PipelinesError, match="'gate'"):
        simulate(spec("ensemble", step("gate", 10), gate=True), closed(1))
    with pytest.raises(PipelinesError, match="zero"):
        simulate(spec("ensemble", step("s", 0)), closed(1))


# ---------------------------------------------------------------------- the client's one thread


def test_the_clients_one_thread_staggers_requests_so_a_bls_round_gathers_fewer():
    # Two clients, 100 µs of client work each way, a BLS model whose round may take both, and a
    # 1000 µs step with an instance each. With two client threads both requests arrive at once
    # and share one round (1200 µs a round trip). With one, the second arrives 100 µs after the
    # first has opened its round, and waits for a round of its own: half the throughput.
    priced = costs(request=(100.0, 100.0))
    s = step("s", 1000.0, instances=2)
    two = simulate(spec("bls", s, costs=priced, top_max_batch_size=8, client_threads=2), closed(2))
    one = simulate(spec("bls", s, costs=priced, top_max_batch_size=8), closed(2))
    assert latencies(two) == {1200.0}
    assert two.throughput == pytest.approx(2 / 1200 * 1e6, rel=1e-9)
    assert one.throughput == pytest.approx(1e6 / 1000, rel=0.01)


def test_each_tensor_more_than_one_pays_the_stubs_and_the_calls_fixed_cost_again():
    # The probes cross a stub with one tensor: a step taking 3 and giving 2 pays the fixed part
    # twice more on the way in and once more on the way out, in its stub and in a BLS call.
    priced = costs(ensemble_stub=(by_bytes(50).at(0), 0.0), bls_call=(20.0, 30.0))
    one = simulate(spec("ensemble", step("s", 1000.0), costs=priced), closed(1))
    many = simulate(spec("ensemble", step("s", 1000.0, in_tensors=3, out_tensors=2), costs=priced), closed(1))
    assert latencies(one) == {1050.0} and latencies(many) == {1150.0}
    bls = simulate(spec("bls", step("s", 1000.0, in_tensors=3, out_tensors=2), costs=priced), closed(1))
    assert latencies(bls) == {1000.0 + 3 * 20.0 + 2 * 30.0}


# ---------------------------------------------------------------------- waking a side that waited

WAKE = ((0.0, 0.0), (10_000.0, 300.0), (20_000.0, 500.0))


def woken(waited: float) -> float:
    """WAKE's µs after ``waited`` µs: straight between its points, flat past the last."""
    if waited >= 20_000:
        return 500.0
    if waited >= 10_000:
        return 300.0 + (waited - 10_000) * 0.02
    return waited * 0.03


def test_a_side_that_waited_for_another_process_pays_its_wake_while_a_core_idles():
    one = step("a", 10_000, cpu=10_000)
    priced = costs(ensemble_stub=(100, 100), bls_stub=(100, 100), bls_call=(50, 50))
    # the step model's instance waits for its stub, then the client for the server
    stub = 100 + 10_000
    expected = stub + woken(stub) + 100
    expected += woken(expected)
    result = simulate(spec("ensemble", one, costs=priced, wake=WAKE), closed(1))
    assert result.p50_us == result.p99_us == pytest.approx(expected, rel=1e-12)
    # BLS: the step's instance for its stub, the BLS model's stub for its call, the BLS model's
    # instance for its stub (its round), and the client
    called = stub + woken(stub) + 100
    call = 50 + called + woken(called) + 50
    expected = call + woken(call)
    expected += woken(expected)
    result = simulate(spec("bls", one, costs=priced, wake=WAKE), closed(1))
    assert result.p50_us == result.p99_us == pytest.approx(expected, rel=1e-12)


def test_a_busy_machine_pays_little_wake():
    # a two-step chain on one core, each step with instances to spare: the core rarely idles
    # (only where processor sharing ends two executions at once)
    busy = spec("ensemble", step("a", 10_000, instances=8), step("b", 7_000, deps=("a",), instances=8),
                cores=1.0, costs=costs(ensemble_stub=(100, 100)))
    woke = SimSpec(**{**busy.__dict__, "wake": WAKE})

    def lost(concurrency: int) -> float:
        return 1 - simulate(woke, closed(concurrency)).throughput / simulate(busy, closed(concurrency)).throughput

    assert lost(1) > 0.05  # alone, every hand-off wakes an idle core: three a request
    assert lost(8) < lost(1) / 4
