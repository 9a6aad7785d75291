"""Server profiles: the fit recovers known costs, a profile round-trips through JSON and
warns when used for another server, the local runtime replays its costs where the server
pays them (checked by its own accounting and by lower bounds on time, never upper ones),
and one small real calibration of the bundled server."""

from __future__ import annotations

import json
import re
import time
import warnings

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.calibration import Cost, Profile, ProfileMismatchWarning, calibrate, fit_costs, load_profile
from pipelines.calibration.fit import crossings, predict_us
from pipelines.calibration.measure import Budget
from pipelines.calibration.probes import BLS_KINDS, CHAINS, KINDS, SIZES, Probe, probe_plan, probe_repository
from pipelines.calibration.profile import BOUNDARIES
from pipelines.cli import main as cli_main
from pipelines.errors import ArgumentError, PipelinesError
from pipelines.runtime.local import LocalRuntime, run_many

MIB = 1 << 20
TRUE = {
    "request": Cost(300.0, 8000.0),
    "ensemble_step": Cost(60.0, 400.0),
    "bls_call": Cost(500.0, 900.0),
    "bls_sync_call": Cost(350.0, 700.0),
    "stub": Cost(150.0, 1200.0),
}


def _synthetic(noise: float = 0.0, seed: int = 0, stub: bool = True):
    rows = []
    for p in probe_plan():
        rng = np.random.default_rng((seed, KINDS.index(p.kind), p.steps, p.size))  # a probe's noise is its own
        latency = predict_us(TRUE, p.kind, p.steps, p.size) * (1 + noise * rng.uniform(-1, 1))
        stub_us = TRUE["stub"].us(2 * p.size) * (1 + noise * rng.uniform(-1, 1)) if stub else None
        rows.append((p.row_kind, p.steps, p.size, latency, stub_us))
    return rows


@pytest.mark.parametrize("stub", [True, False], ids=["stub-from-statistics", "all-four-fitted"])
def test_the_fit_recovers_known_costs_exactly(stub):
    costs, points = fit_costs(_synthetic(stub=stub))
    for name, cost in TRUE.items():
        assert costs[name].fixed_us == pytest.approx(cost.fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(cost.us_per_mib, rel=1e-6), name
    # every plotted point lies on its boundary's line when the data has no noise
    assert {p.boundary for p in points} == set(BOUNDARIES)
    for p in points:
        assert p.cost_us == pytest.approx(costs[p.boundary].us(p.nbytes), rel=1e-6, abs=1e-3), p


def test_the_fit_stays_close_under_noise_and_never_goes_negative():
    # ±2 % on latencies that a 4 MiB request dominates moves the costs read off differences
    # between probes by up to 16 % (the worst of 20 seeds)
    for seed in range(5):
        costs, _ = fit_costs(_synthetic(noise=0.02, seed=seed))
        for name, cost in TRUE.items():
            assert costs[name].us(4 * MIB) == pytest.approx(cost.us(4 * MIB), rel=0.2), (name, seed)
    # a boundary that costs nothing comes out as zero, not as a negative cost
    free = dict(TRUE, ensemble_step=Cost(0.0, 0.0))
    rows = [(p.kind, p.steps, p.size, predict_us(free, p.kind, p.steps, p.size) * (1.03 if i % 2 else 0.97),
             free["stub"].us(2 * p.size)) for i, p in enumerate(probe_plan())]
    fitted, _ = fit_costs(rows)
    assert all(c.fixed_us >= 0 and c.us_per_mib >= 0 for c in fitted.values())


@pytest.mark.parametrize("disturbed", [("ensemble", max(CHAINS), 3.0), ("ensemble", 1, 3.0), ("bls", 2, 0.5)],
                         ids=["longest-chain-3x", "shortest-chain-3x", "a-chain-at-half"])
def test_one_probe_measured_while_the_machine_was_busy_does_not_tilt_its_line(disturbed):
    # as calibrating once measured the 8-step ensemble at 4 MiB: 62.5 ms, where 21.4 the next time
    kind, steps, factor = disturbed
    rows = [(k, n, size, latency * (factor if (k, n, size) == (kind, steps, 4 * MIB) else 1.0), stub)
            for k, n, size, latency, stub in _synthetic(noise=0.02)]
    costs, _ = fit_costs(rows)

    def at_4_mib(cost: Cost) -> float:  # in and out: what the replay pays at that size
        return cost.way_us(4 * MIB, leaving=False) + cost.way_us(4 * MIB, leaving=True)

    for name, cost in TRUE.items():
        assert at_4_mib(costs[name]) == pytest.approx(at_4_mib(cost), rel=0.2), name


def test_a_size_whose_calls_cost_more_than_both_neighbours_is_taken_between_them():
    # as two calibrations of one day put an ensemble step at 4 MiB at 2.9 and 6.5 ms a way (every
    # chain at that size slow but the one-step one), where 1 and 12 MiB gave nothing
    rows = [(k, n, size, latency + (20_000.0 * (n - 1) if (k, size) == ("ensemble", 4 * MIB) else 0.0), stub)
            for k, n, size, latency, stub in _synthetic()]
    costs, _ = fit_costs(rows)
    step = costs["ensemble_step"]
    truth = TRUE["ensemble_step"]
    assert step.way_us(4 * MIB, leaving=False) == pytest.approx(truth.way_us(4 * MIB, leaving=False), rel=0.1)
    # the other sizes, and the other boundaries at 4 MiB, are as they were
    for size in (MIB, 32 * MIB):
        assert step.way_us(size, leaving=True) == pytest.approx(truth.way_us(size, leaving=True), rel=1e-6)
    assert costs["bls_call"].way_us(4 * MIB, leaving=False) == pytest.approx(
        TRUE["bls_call"].way_us(4 * MIB, leaving=False), rel=1e-6)
    # a figure that grows with the bytes, however fast, is no spike
    steep = dict(TRUE, ensemble_step=Cost(60.0, 4000.0))
    rows = [(p.row_kind, p.steps, p.size, predict_us(steep, p.kind, p.steps, p.size), TRUE["stub"].us(2 * p.size))
            for p in probe_plan()]
    fitted, _ = fit_costs(rows)
    assert fitted["ensemble_step"].us_per_mib == pytest.approx(4000.0, rel=1e-6)


def test_a_bls_models_own_statistics_price_its_calls_without_the_requests_noise():
    # the request's HTTP body varies by milliseconds at large sizes: every probe's latency carries
    # its own draw of it, and only what the BLS model held its instance says what its calls cost
    true = dict(TRUE, bls_model=Cost(400.0, 300.0), bls_sync_model=Cost(250.0, 200.0))
    rows = []
    for p in probe_plan():
        rng = np.random.default_rng((7, KINDS.index(p.kind), p.steps, p.size))
        noise = true["request"].us(2 * p.size) * rng.uniform(-0.3, 0.3)
        held = None
        if p.kind in BLS_KINDS:
            held = predict_us(true, p.kind, p.steps, p.size) - true["request"].us(2 * p.size)
        rows.append((p.kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size) + noise,
                     true["stub"].us(2 * p.size), None, held))
    costs, _ = fit_costs(rows)
    for name in ("bls_call", "bls_model", "bls_sync_call", "bls_sync_model"):
        assert costs[name].fixed_us == pytest.approx(true[name].fixed_us, rel=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(true[name].us_per_mib, rel=1e-6), name
    # the same latencies without the BLS models' statistics: the request's noise lands in them
    blind, _ = fit_costs([r[:6] for r in rows])
    assert any(blind[name].us(8 * MIB) != pytest.approx(true[name].us(8 * MIB), rel=0.05)
               for name in ("bls_call", "bls_model", "bls_sync_call", "bls_sync_model"))


def test_crossings_count_the_bls_models_own_stub_and_each_forms_step_stubs():
    assert crossings("bls", 4, 10) == {"request": (1, 20), "bls_model": (1, 20), "bls_call": (4, 20),
                                       "bls_stub": (4, 20)}
    assert crossings("bls-sync", 2, 10) == {"request": (1, 20), "bls_sync_model": (1, 20), "bls_sync_call": (2, 20),
                                            "bls_sync_stub": (2, 20)}
    assert crossings("ensemble", 4, 10) == {"request": (1, 20), "ensemble": (1, 20), "ensemble_step": (4, 20),
                                            "ensemble_stub": (4, 20)}
    assert crossings("step", 1, 10) == {"request": (1, 20), "stub": (1, 20)}


def test_each_forms_step_stubs_are_priced_by_its_own_probes_statistics():
    # the ensemble's stubs cost more than those a BLS model calls (the bundled server, at 4 MiB:
    # 1.63-1.76 ms against 1.27-1.44): each form's own, and its calls what its line leaves beyond them
    true = dict(TRUE, ensemble_stub=Cost(200.0, 1500.0), bls_stub=Cost(120.0, 1000.0),
                bls_sync_stub=Cost(130.0, 1100.0), bls_model=Cost(400.0, 300.0), bls_sync_model=Cost(250.0, 200.0))
    stub_of = {"step": "stub", "ensemble": "ensemble_stub", "bls": "bls_stub", "bls-sync": "bls_sync_stub"}
    rows = [(p.kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size),
             true[stub_of[p.kind]].us(2 * p.size)) for p in probe_plan()]
    costs, _ = fit_costs(rows)
    for name, cost in true.items():
        assert costs[name].fixed_us == pytest.approx(cost.fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(cost.us_per_mib, rel=1e-6), name
    # a profile from before each form's stubs were measured: every form's steps pay its one stub
    older = _profile(**TRUE)
    assert older.costs["ensemble_stub"] == older.costs["bls_stub"] == older.costs["bls_sync_stub"] == TRUE["stub"]


def test_the_replay_charges_the_grown_probes_stubs_and_the_calls_are_read_against_the_chains_own():
    # the chains' stubs, fed by a request of the tensor's size and measured in turns, cost more than
    # the grown probe's, measured back to back between steps that grow and shrink the tensor
    true = dict(TRUE, ensemble_stub=Cost(300.0, 1500.0), bls_stub=Cost(250.0, 1400.0), bls_sync_stub=Cost(250.0, 1400.0))
    warm = {"ensemble": Cost(200.0, 1000.0), "bls": Cost(180.0, 900.0), "bls-sync": Cost(170.0, 950.0)}
    stub_of = {"step": "stub", "ensemble": "ensemble_stub", "bls": "bls_stub", "bls-sync": "bls_sync_stub"}
    rows = [(p.row_kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size),
             (warm[p.kind] if p.grown else true[stub_of[p.kind]]).us(2 * p.size)) for p in probe_plan()]
    assert any(r[0] == "grown bls" for r in rows)
    costs, points = fit_costs(rows)
    for kind, cost in warm.items():
        name = stub_of[kind]
        assert costs[name].fixed_us == pytest.approx(cost.fixed_us, rel=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(cost.us_per_mib, rel=1e-6), name
    # the calls are what the chains' lines leave beyond the chains' own stubs, not beyond the grown ones
    for name in ("ensemble_step", "bls_call", "bls_sync_call", "request"):
        assert costs[name].fixed_us == pytest.approx(true[name].fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(true[name].us_per_mib, rel=1e-6), name
    assert {pt.probe for pt in points if pt.probe.startswith("grown")} == {"grown ensemble", "grown bls",
                                                                           "grown bls-sync"}


def test_a_bls_call_above_the_smallest_size_is_priced_by_the_grown_probe_that_makes_it_warm():
    # the chains carry the tensor in and out of every request and take turns: their slope prices a
    # call cold; the grown probe's BLS model, less what its steps and its own stub held, is its calls
    # made back to back as a user's pipeline makes them (two ways of a few bytes, six of the size)
    true = dict(TRUE, bls_model=Cost(400.0, 300.0), bls_sync_model=Cost(250.0, 200.0))
    warm = {"bls": Cost(300.0, 500.0), "bls-sync": Cost(200.0, 350.0)}
    call = {"bls": "bls_call", "bls-sync": "bls_sync_call"}
    own = {"bls": "bls_model", "bls-sync": "bls_sync_model"}
    smallest = min(p.size for p in probe_plan())
    rows = []
    for p in probe_plan():
        latency = predict_us(true, p.kind, p.steps, p.size)
        held = steps_held = None
        if p.kind in BLS_KINDS:
            held = latency - true["request"].us(2 * p.size)
            if p.grown:
                steps_held = 4 * true["stub"].us(2 * p.size) + 300.0  # grow, the identities, shrink
                held = (true[own[p.kind]].us(2 * smallest) + true[call[p.kind]].us(2 * smallest)
                        + 6 * warm[p.kind].us(2 * p.size) / 2 + steps_held)
        rows.append((p.row_kind, p.steps, p.size, latency, true["stub"].us(2 * p.size), None, held, steps_held))
    costs, _ = fit_costs(rows)
    for kind, name in call.items():
        assert costs[name].way_us(smallest, leaving=False) == pytest.approx(true[name].us(2 * smallest) / 2), name
        for size in sorted({p.size for p in probe_plan()} - {smallest}):
            for leaving in (False, True):
                assert costs[name].way_us(size, leaving=leaving) == pytest.approx(warm[kind].us(2 * size) / 2), (name, size)
    # without the steps' statistics (a profile measured before they were kept) the chains price every size
    cold, _ = fit_costs([r[:7] for r in rows])
    assert cold["bls_call"].us_per_mib == pytest.approx(true["bls_call"].us_per_mib, rel=1e-6)


def _profile(**costs: Cost) -> Profile:
    return Profile(
        costs={**{k: Cost(0.0, 0.0) for k in TRUE}, **costs},
        server_version="2.51.0",
        protocol="http",
        machine={"cpu": "test cpu", "cpu_count": 2},
        date="2026-01-01T00:00:00+00:00",
    )


def test_a_profile_round_trips_through_json(tmp_path):
    costs, points = fit_costs(_synthetic())
    profile = Profile(costs=costs, server_version="2.51.0", protocol="grpc", machine={"cpu": "x", "cpu_count": 2},
                      date="2026-01-01T00:00:00+00:00", url="host:8001", points=points,
                      samples=tuple(_synthetic()), lanes=1.4)
    path = profile.save(tmp_path / "profile.json")
    again = load_profile(path)
    assert again == profile and again.lanes == pytest.approx(1.4)
    assert load_profile(str(path)) == profile and load_profile(profile) is profile
    assert json.loads(path.read_text())["costs"]["stub"]["fixed_us"] == pytest.approx(150.0)
    assert json.loads(path.read_text())["lanes"] == pytest.approx(1.4)
    assert "bls_call" in profile.table() and "2.51.0" in profile.table() and "1.40 lanes" in profile.table()
    # a profile saved before some boundaries were measured loads, with their stand-ins
    data = json.loads(path.read_text())
    for name in ("ensemble", "bls_model", "bls_sync_call", "bls_sync_model"):
        del data["costs"][name]
    older = Profile.from_dict(data)
    assert older.costs["bls_sync_call"] == older.costs["bls_call"] == profile.costs["bls_call"]
    assert older.costs["bls_sync_model"] == older.costs["bls_model"] == profile.costs["stub"]
    assert older.costs["ensemble"] == Cost(0.0, 0.0)


@pytest.mark.parametrize(("machine", "lanes"), [({"cpu_count": 8, "usable_cpus": 3}, 3.0), ({"cpu_count": 2}, 2.0),
                                               ({}, 1.0)], ids=["usable-cpus", "cpu-count", "unknown"])
def test_a_profile_saved_without_lanes_gets_the_cores_of_its_machine(tmp_path, machine, lanes):
    data = _profile().to_dict()
    del data["lanes"]  # as profiles written before lanes were measured
    data["machine"] = machine
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_profile(path).lanes == lanes
    data["lanes"] = 0.5
    path.write_text(json.dumps(data))
    with pytest.raises(PipelinesError, match="lanes is a number >= 1"):
        load_profile(path)


def test_a_file_that_is_not_a_profile_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "protocol": "http"}')
    with pytest.raises(PipelinesError, match="bad.json.*not a server profile"):
        load_profile(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(PipelinesError, match="not a profile"):
        load_profile(bad)
    with pytest.raises(PipelinesError, match="cannot read the profile"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(PipelinesError, match="needs a cost for every boundary"):
        Profile(costs={"request": Cost(1, 1)}, server_version=None, protocol="http", machine={}, date="d")
    # hand-edited figures that no server has: a negative or NaN time, a protocol Triton does not speak
    good = json.loads(_profile().to_json())
    for path, value, said in [(("costs", "request", "fixed_us"), -100000, "finite microseconds >= 0; got -100000"),
                              (("costs", "stub", "us_per_mib"), float("nan"), "finite microseconds >= 0; got nan"),
                              (("protocol",), "carrier-pigeon", "protocol is 'http' or 'grpc'")]:
        edited = json.loads(json.dumps(good))
        *parents, last = path
        holder = edited
        for key in parents:
            holder = holder[key]
        holder[last] = value
        bad.write_text(json.dumps(edited))
        with pytest.raises(PipelinesError, match=f"bad.json.*{re.escape(said)}"):
            load_profile(bad)


def test_a_profile_from_another_server_version_or_protocol_draws_a_warning():
    profile = _profile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile.check(server_version="2.51.0", protocol="http") == []
    with pytest.warns(ProfileMismatchWarning, match=r"measured on Triton 2\.51\.0, the server is Triton 2\.48\.0"):
        profile.check(server_version="2.48.0", protocol="http")
    with pytest.warns(ProfileMismatchWarning, match="measured over http, the requests go over grpc"):
        profile.check(server_version="2.51.0", protocol="grpc")
    with pytest.warns(ProfileMismatchWarning, match="cpu"):
        profile.check(machine={"cpu": "another cpu", "cpu_count": 2})


V = TensorSpec("FP32", [-1])


@step(inputs={"x": V}, outputs={"y": V})
def negate(x):
    return {"y": -x}


def one_step() -> Pipeline:
    p = Pipeline("one_step", inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(negate, x=p.input("x"))["y"])
    return p


X = np.ones((1, 1024), np.float32)  # 4 KiB in, 4 KiB out
COSTS = dict(request=Cost(2000, 100), ensemble_step=Cost(1000, 200), bls_call=Cost(3000, 300),
             bls_sync_call=Cost(2500, 250), stub=Cost(1500, 400), ensemble_stub=Cost(2200, 500),
             bls_stub=Cost(1100, 300), bls_sync_stub=Cost(1300, 350))
HOP = {"ensemble": "ensemble_step", "bls": "bls_call", "bls-sync": "bls_sync_call"}  # each mode's calls
STUB = {"ensemble": "ensemble_stub", "bls": "bls_stub", "bls-sync": "bls_sync_stub"}  # each mode's step stubs


@pytest.mark.parametrize("mode", ["ensemble", "bls", "bls-sync", "fused"])
def test_the_replay_accounts_each_boundary_where_the_server_pays_it(mode):
    profile = _profile(**COSTS)
    nb = X.nbytes
    request = COSTS["request"].us(2 * nb)
    # a fused model runs the step in its own process: no call, and only its own stub
    hop = 0.0 if mode == "fused" else COSTS[HOP[mode]].us(2 * nb)
    # the step's stub, the form's own; in BLS and fused, the top-level model's own stub too
    # (bls_model, bls_sync_model: not in this profile, so "stub" stands in for them)
    paid = ([STUB[mode]] if mode != "fused" else []) + (["stub"] if mode != "ensemble" else [])
    stubs = len(paid)
    half_stub = sum(COSTS[s].fixed_us / 2 + COSTS[s].us_per_mib * nb / MIB for s in paid) / stubs

    async def main():
        async with LocalRuntime(one_step(), mode=mode, profile=profile) as rt:
            return await rt.infer_with_report({"x": X})

    import anyio

    outputs, report = anyio.run(main)
    np.testing.assert_array_equal(outputs["y"], -X)
    server = report.server
    assert server is not None and server.mode == mode
    assert server.overhead_us == pytest.approx(request + hop)
    assert server.compute_input_us == pytest.approx(stubs * half_stub)
    assert server.compute_output_us == pytest.approx(stubs * half_stub)
    total = request + hop + sum(COSTS[s].us(2 * nb) for s in paid)
    # Costs are spent by sleeping, which never ends early; each ledger (the request's, and each held
    # model's, which pays its stubs) may leave < 0.7 ms unpaid.
    assert report.latency_us >= total - 700 * (1 + stubs)
    assert "predicted for the server" in str(report) and "in-process figures" not in str(report)


def test_the_replayed_costs_change_the_latency_by_what_the_profile_says():
    profile = _profile(request=Cost(3000, 0), ensemble_step=Cost(1000, 0), ensemble_stub=Cost(2000, 0))
    requests = [{"x": X}] * 40
    _, plain = run_many(one_step(), requests, mode="ensemble", concurrency=1)
    _, replayed = run_many(one_step(), requests, mode="ensemble", concurrency=1, profile=profile)
    assert "in-process figures, not predictions" in str(plain) and plain.server is None
    said = 3000 + 1000 + 2000
    assert replayed.server.overhead_us + replayed.server.compute_input_us + replayed.server.compute_output_us == (
        pytest.approx(said)
    )
    # the mean latency grew by at least what the profile says (sleep never ends early; rounding < 0.7 ms)
    assert replayed.latency_us - plain.latency_us >= said - 700


def test_a_request_pays_what_it_owes_below_a_millisecond_when_it_leaves():
    # 0.6 ms of request costs in all: less than the event loop's millisecond steps, which
    # would leave it unpaid (or charge 1.15 ms for it); the rest is slept in a thread
    profile = _profile(request=Cost(600, 0))
    requests = [{"x": X}] * 40
    run_many(one_step(), requests, mode="ensemble", concurrency=1)  # warm: a cold first run's mean is no baseline
    _, plain = run_many(one_step(), requests, mode="ensemble", concurrency=1)
    _, replayed = run_many(one_step(), requests, mode="ensemble", concurrency=1, profile=profile)
    assert replayed.server.overhead_us == pytest.approx(600)
    assert replayed.latency_us - plain.latency_us >= 600 - 150


def test_one_slow_hand_over_to_a_thread_does_not_stop_the_requests_paying_what_they_owe():
    # On a loaded machine one hand-over to a worker thread took 20 ms; learning it whole made the
    # hand-over look dearer than any request's remaining debt, and no request slept again.
    import anyio

    from pipelines.runtime.replay import _ThreadSleep

    slow = [0.02]

    def sleep(seconds):
        time.sleep(seconds + (slow.pop() if slow else 0.0))

    async def main():
        settle = _ThreadSleep(sleep)
        await settle(600e-6)  # the slow one
        took = [await settle(600e-6) for _ in range(20)]
        return sorted(took)[len(took) // 2], settle

    took, settle = anyio.run(main)
    assert took >= 600e-6 - 150e-6
    # what it learned is a hand-over's cost again, and a debt of 0.3 ms is always slept
    assert settle.overhead < 2e-3 and not settle.skips(300e-6)


def test_a_stub_cost_holds_the_instance_so_requests_queue_behind_it():
    # one instance, a 40 ms stub cost on the way in and out, and 4 requests at once: each waits for the ones before it
    profile = _profile(stub=Cost(80_000, 0))
    _, report = run_many(one_step(), [{"x": X}] * 4, mode="ensemble", concurrency=4, profile=profile)
    queued = report.step("negate").queue_wait_us * report.step("negate").calls
    assert queued >= (1 + 2 + 3) * 80_000 * 0.9  # 0, 1, 2 and 3 stub costs of waiting
    assert report.server.queue_us >= 6 * 80_000 * 0.9 / 4


def _lanes_profile(lanes: float, by_size: tuple = ()) -> Profile:
    return Profile(costs={**{k: Cost(0.0, 0.0) for k in TRUE}, "request": Cost(40_000, 0)}, server_version="2.51.0",
                   protocol="http", machine={"cpu_count": 2}, date="2026-01-01T00:00:00+00:00", lanes=lanes,
                   lanes_by_size=by_size)


def test_lanes_by_size_round_trip_and_are_read_between_sizes_on_a_log_scale(tmp_path):
    profile = _lanes_profile(1.8, ((MIB, 1.6), (1024, 2.0)))
    assert profile.lanes_by_size == ((1024, 2.0), (MIB, 1.6))  # kept in size order
    assert load_profile(profile.save(tmp_path / "p.json")) == profile
    assert profile.lanes_at(1) == profile.lanes_at(1024) == 2.0  # beyond the sizes: the nearest one's
    assert profile.lanes_at(32 * MIB) == 1.6
    assert profile.lanes_at(32 * 1024) == pytest.approx(1.8)  # halfway between 2**10 and 2**20 bytes
    assert "1.80 lanes (2.00 at 1 KiB, 1.60 at 1 MiB)" in profile.table()
    # a profile without them has its one figure at every size; one saved before they were measured loads
    assert _lanes_profile(1.4).lanes_at(MIB) == 1.4
    data = profile.to_dict()
    del data["lanes_by_size"]
    assert Profile.from_dict(data).lanes_at(MIB) == 1.8
    for bad in (((1024, 0.5),), ((0, 2.0),), ((1024, 2.0), (1024, 1.5))):
        with pytest.raises(PipelinesError, match="lanes_by_size is"):
            _lanes_profile(1.8, bad)


def test_with_one_lane_concurrent_requests_take_turns_for_the_servers_cpu():
    # a request costs 40 ms of boundary (20 in, 20 out); two at once on one lane: one waits for the other
    from time import perf_counter

    began = perf_counter()
    _, one = run_many(one_step(), [{"x": X}] * 2, mode="ensemble", concurrency=2, profile=_lanes_profile(1.0))
    elapsed = perf_counter() - began
    # the first half of one request waits for the first half of the other at least: 20 ms of 80
    assert one.server.overhead_us * 2 >= (2 * 40_000 + 20_000) * 0.9
    assert elapsed >= 2 * 0.040 * 0.95  # the two requests' costs one after another (sleep never ends early)
    # two lanes: neither waits, and the accounting is the profile's cost exactly
    _, two = run_many(one_step(), [{"x": X}] * 2, mode="ensemble", concurrency=2, profile=_lanes_profile(2.0))
    assert two.server.overhead_us == pytest.approx(40_000)
    # 1.5 lanes: two slots, but two requests in them share one and a half cores, so costs stretch
    _, half = run_many(one_step(), [{"x": X}] * 2, mode="ensemble", concurrency=2, profile=_lanes_profile(1.5))
    assert half.server.overhead_us * 2 >= 2 * 40_000 + 20_000 / 3 * 0.9


def test_the_lanes_a_boundary_gets_are_the_profiles_at_the_bytes_it_carries():
    # two lanes for small tensors, one for tensors of 1 MiB and more: X (4 KiB) runs two
    # requests at once; a 1 MiB tensor's requests take turns, as on a server whose copies
    # share the memory bus
    by_size = ((1024, 2.0), (MIB, 1.0))
    _, small = run_many(one_step(), [{"x": X}] * 2, mode="ensemble", concurrency=2, profile=_lanes_profile(2.0, by_size))
    big = np.ones((1, MIB // 4), np.float32)
    _, large = run_many(one_step(), [{"x": big}] * 2, mode="ensemble", concurrency=2,
                        profile=_lanes_profile(2.0, by_size))
    # 4 KiB is 2/10 of the way from 1 KiB to 1 MiB: 1.8 lanes, so the two stretch a little
    assert small.server.overhead_us < 40_000 * 1.2
    assert large.server.overhead_us * 2 >= (2 * 40_000 + 20_000) * 0.9  # one lane: one waits for the other


def test_calibrate_on_a_remote_server_without_probes_writes_them_to_deploy(tmp_path, capsys):
    from pipelines.endpoint import LocalServer
    from pipelines.examples.basic import chain

    probes = tmp_path / "probes"
    with LocalServer(chain, grpc_port=False) as elsewhere:  # a server that answers, without the probe models
        code = cli_main(["calibrate", "--url", elsewhere.http_url, "--out", str(tmp_path / "p.json"),
                         "--probes", str(probes)])
    assert code == 3
    assert "deploy that repository" in capsys.readouterr().out
    written = {d.name for d in probes.iterdir() if d.is_dir() and not d.name.startswith(".")}
    assert set(probe_repository().names) <= written
    assert not (tmp_path / "p.json").exists()


def test_calibrate_says_a_server_it_cannot_reach_and_never_writes_over_a_users_file(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    code = cli_main(["calibrate", "--url", "127.0.0.1:1", "--out", str(tmp_path / "p.json"), "--probes", str(mine)])
    assert code == 2 and "cannot reach the Triton server at http 127.0.0.1:1" in capsys.readouterr().err
    assert mine.read_text() == "my notes\n" and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_calibrate_refuses_an_output_that_is_a_directory_before_measuring_anything(tmp_path, capsys, option):
    args = {"--out": str(tmp_path / "p.json"), "--plot": str(tmp_path / "p.png"), option: str(tmp_path)}
    started = time.monotonic()
    code = cli_main(["calibrate", "--quick", *(x for kv in args.items() for x in kv)])
    assert code == 2 and time.monotonic() - started < 5  # no server was started
    assert f"{option} {str(tmp_path)!r} is a directory; give a file name" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--out", "p.png"], ["--out", "p.json", "--plot", "p.json"]])
def test_calibrate_refuses_a_plot_that_would_be_drawn_over_the_profile(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text("my earlier profile\n")
    started = time.monotonic()
    assert cli_main(["calibrate", "--quick", *args]) == 2 and time.monotonic() - started < 5
    assert "the plot would be drawn over the profile" in capsys.readouterr().err
    assert (tmp_path / "p.json").read_text() == "my earlier profile\n"


def test_a_profile_save_that_fails_leaves_the_earlier_profile_whole(tmp_path):
    import subprocess
    import sys

    path = _profile(stub=Cost(100, 1)).save(tmp_path / "p.json")
    before = path.read_bytes()
    bigger = (
        "import resource, signal, sys; from pipelines.calibration import Profile; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)); "
        "p = Profile.load(sys.argv[1]); Profile(**{**p.__dict__, 'url': 'x' * 5000}).save(sys.argv[1])"
    )
    run = subprocess.run([sys.executable, "-c", bigger, str(path)], capture_output=True, text=True)  # a full disk, in effect
    assert run.returncode != 0 and "File too large" in run.stderr
    assert path.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["p.json"]


def test_a_plot_given_as_a_profile_is_named_as_not_one(tmp_path):
    png = tmp_path / "p.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(PipelinesError, match=r"'.*p\.png' is not a profile \(not text: a plot\?"):
        load_profile(png)


@pytest.mark.server
def test_sigterm_to_calibrate_stops_its_server_and_removes_its_probes_as_ctrl_c_does(tmp_path, monkeypatch):
    import os
    import signal
    import sys
    import tempfile

    calibrate_module = sys.modules["pipelines.calibration.calibrate"]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe repository goes here
    servers = []

    def terminated(*args, **kwargs):  # the signal arrives while the probes are measured
        servers.extend(p for p in os.listdir("/proc") if p.isdigit() and _is_tritonserver(p, serving=tmp_path))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(calibrate_module, "measure_probes", terminated)
    assert cli_main(["calibrate", "--quick", "--quiet", "--out", str(tmp_path / "p.json")]) == 130
    assert servers and not [p for p in servers if _is_tritonserver(p, serving=tmp_path)]
    assert os.listdir(tmp_path) == []  # no probe repository, no profile
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _is_tritonserver(pid: str, *, serving) -> bool:
    """Whether process ``pid`` is a Triton server whose model repository lies under ``serving``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"tritonserver" in argv[0] and any(str(serving).encode() in a for a in argv)


def test_a_pass_that_met_a_slow_spell_of_the_machine_is_left_out_of_that_sizes_figures():
    from pipelines.calibration.measure import measure_probes

    probes = probe_plan(chains=(1, 2), sizes=(1 << 10, 4 << 20))
    big = 4 << 20
    seen: dict[tuple[str, int], int] = {}

    def infer(model, inputs):
        size = inputs["x"].shape[1] if "x" in inputs else int(inputs["n"][0, 0])
        seen[model, size] = seen.get((model, size), 0) + 1
        # the first pass over 4 MiB (a warm-up call and two turns) meets a spell 1.6 times slower
        slow = 1.6 if size == big and seen[model, size] <= 3 else 1.0
        time.sleep(slow * (0.016 if size == big else 0.008))  # long enough that a loaded machine's jitter is <10 %

    samples = measure_probes(infer, probes, Budget(4, 4, 0.0, 1, passes=2))
    for sample in samples:
        if sample.probe.size == big:  # the slow pass left out: the other pass's two turns alone
            assert sample.requests == 2 and sample.latency_us < 16000 * 1.25, sample
        else:  # both passes pooled
            assert sample.requests == 4 and sample.latency_us < 8000 * 1.25, sample


def test_the_grown_probes_of_a_size_take_turns_in_bursts_whose_first_request_is_not_timed():
    # back to back, as a pipeline's requests come, yet side by side with the other forms' grown
    # probes, so that a spell of the machine moves every form's figures alike
    from pipelines.calibration.measure import measure_probes

    probes = [p for p in probe_plan(chains=(1,), sizes=(1 << 20,)) if p.grown]
    calls: list[str] = []

    def infer(model, inputs):
        cold = not calls or calls[-1] != model  # a model called after another one answers late
        calls.append(model)
        time.sleep(0.02 if cold else 0.002)

    samples = measure_probes(infer, probes, Budget(4, 4, 0.0, warmup=0, passes=1))
    models = [p.model for p in probes]
    assert calls == [m for _ in range(2) for m in models for _ in range(3)]  # two turns, bursts of three
    for sample in samples:
        assert sample.requests == 4 and 2000 <= sample.latency_us < 10_000, sample  # never a cold request


def test_a_budget_must_measure_something():
    with pytest.raises(ArgumentError, match="passes >= 1"):
        Budget(passes=0)
    with pytest.raises(ArgumentError, match="min_requests <= max_requests"):
        Budget(5, 4)


@pytest.mark.server
def test_calibrate_the_bundled_server_with_a_tiny_probe_set(tmp_path):
    profile = calibrate(chains=(1, 2), sizes=(1 << 10, 256 << 10), budget=Budget(3, 4, 0.05, 1), progress=False)
    assert profile.server_version and profile.protocol == "http" and profile.machine.get("cpu_count")
    assert 1.0 <= profile.lanes <= profile.machine["cpu_count"]  # measured: a throughput ratio, capped by cores
    # measured on the smallest tensor only here (no size of 1 MiB or more): the mean is that one size's
    assert [n for n, _ in profile.lanes_by_size] == [1 << 10] and profile.lanes_by_size[0][1] == profile.lanes
    # per size: the step, two chains of each kind, then each kind's grown probe, and the gated one
    assert [s[0] for s in profile.samples[:11]] == ["step", *("ensemble",) * 2, *("bls",) * 2, *("bls-sync",) * 2,
                                                    "grown ensemble", "grown bls", "grown bls-sync", "gated ensemble"]
    assert len(profile.samples) == 2 * 11
    assert all(s[3] > 0 for s in profile.samples)
    # stubs are priced by steps whose outputs feed another step, or by the step called alone: an
    # ensemble of one step has none (its one step's output is the answer, copied into the response)
    # (the gated probe has no stub of its own: its figure is its latency, against the grown ensemble's)
    assert all((s[4] is None) == ((s[0] == "ensemble" and s[1] == 1) or s[0] == "gated ensemble")
               for s in profile.samples)
    assert all(s[4] > 0 for s in profile.samples if s[4] is not None)
    # a BLS probe also tells what its BLS model held its instance (more than its steps' stubs)
    assert all((s[6] is not None) == (s[0].removeprefix("grown ") in BLS_KINDS) for s in profile.samples)
    assert all(s[6] > s[1] * s[4] for s in profile.samples if s[6] is not None)
    # and a grown BLS probe what all its step models held (grow, the identities, shrink): less than its hold
    assert all((s[7] is not None) == (s[0] in ("grown bls", "grown bls-sync")) for s in profile.samples)
    assert all(s[1] * s[4] < s[7] < s[6] for s in profile.samples if s[7] is not None)
    assert [p.stub_models for p in (Probe("ensemble", 1, 1024), Probe("ensemble", 2, 1024), Probe("bls", 2, 1024))] == [
        (), ("probe_2__identity",), ("probe_2__identity", "probe_2__id_1")]
    # a grown probe's identity steps all feed another step: each prices a stub, as it would in a BLS model
    assert Probe("ensemble", 2, 1024, grown=True).stub_models == ("probe_grown__identity", "probe_grown__id_1")
    # the replay charges the grown probes' stubs, which the points show as such
    grown_points = [pt for pt in profile.points if pt.probe.startswith("grown ")]
    assert {pt.boundary for pt in grown_points} == {"ensemble_stub", "bls_stub", "bls_sync_stub"}
    at_small = {pt.probe: pt.cost_us for pt in grown_points if pt.nbytes == 2 << 10}
    assert sum(profile.costs["ensemble_stub"].in_us[:1] + profile.costs["ensemble_stub"].out_us[:1]) == (
        pytest.approx(at_small["grown ensemble"], rel=0.5))
    assert all(c.fixed_us >= 0 and c.us_per_mib >= 0 for c in profile.costs.values())
    # a request to a Python model costs something: the fit found it somewhere
    assert profile.costs["request"].fixed_us + profile.costs["stub"].fixed_us > 0
    assert load_profile(profile.save(tmp_path / "p.json")) == profile
    profile.plot(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def _measured(where, form, c, p50_ms, throughput, predicted=False):
    from pipelines.bench.measurement import Configuration, Measurement
    from pipelines.bench.stats import LatencySummary

    return Measurement(
        config=Configuration(where, form), concurrency=c, batch=1, throughput=throughput,
        latency=LatencySummary(10, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms, p50_ms),
        requests=10, errors=0, error_messages={}, stable=True, windows=3, window_seconds=3.0,
        window_throughputs=(throughput,) * 3, completed_by_sample=(10,), errors_by_sample=(0,),
        local_report={"server": {"queue_us": 1.0}} if predicted else None,
    )


def _prediction_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "prediction.py"
    spec = importlib.util.spec_from_file_location("prediction_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_predicted_and_measured_side_by_side_and_the_targets_of_the_check():
    from pipelines.bench.report_tables import prediction_table

    server = {"ensemble": (20.0, 50.0), "bls": (25.0, 40.0), "bls-sync": (40.0, 25.0)}
    good = {"ensemble": (21.0, 48.0), "bls": (26.0, 39.0), "bls-sync": (41.0, 24.0)}
    ms = []
    for c in (1, 4):
        for form in server:
            ms.append(_measured("server", form, c, server[form][0] * c, server[form][1]))
            ms.append(_measured("local", form, c, good[form][0] * c, good[form][1], predicted=True))
    table = prediction_table(ms)
    row = next(line.split() for line in table.splitlines() if line.startswith("ensemble") and line.split()[1] == "1")
    assert row == ["ensemble", "1", "21.00", "20.00", "+5.0%", "48.0", "50.0", "-4.0%"]
    module = _prediction_module()
    checks, winners = module.checks_of("p", [module.figures_of(ms)])
    assert len(checks) == 3 + 2 + 2 and all(c.ok for c in checks)
    assert winners == [["p", "4", "ensemble", "ensemble", "ok"]]
    # a form predicted 30 % slow at concurrency 1 misses its ±20 % target, and moves its ratio too
    ms = [m for m in ms if not (m.config.where == "local" and m.config.form == "bls" and m.concurrency == 1)]
    ms.append(_measured("local", "bls", 1, 32.5, 30.0, predicted=True))
    checks, _ = module.checks_of("p", [module.figures_of(ms)])
    missed = {c.figure for c in checks if not c.ok}
    assert missed == {"bls p50 ms", "ensemble/bls"}


def test_the_check_judges_the_median_of_its_rounds():
    module = _prediction_module()
    key = ("server", "bls", 1)
    rounds = [{key: (20.0, 50.0)}, {key: (31.0, 30.0)}, {key: (21.0, 48.0)}]  # the second round hit a burst
    assert module.median_figures(rounds) == {key: (21.0, 48.0)}
    assert module.median_figures(rounds[:2]) == {key: (25.5, 40.0)}


def test_the_check_forms_each_ratio_within_a_round():
    """The rounds of a full run on `large` at concurrency 1: every round's ensemble/bls ratio is
    within 10 % of the server's, yet the medians of the p50s taken apart set the first round's
    predicted ensemble against the third round's BLS form and miss by 14 %."""
    module = _prediction_module()
    local = [(8.8, 15.6), (8.0, 13.2), (10.0, 15.2)]  # (ensemble, bls) p50 ms
    server = [(9.3, 14.4), (10.6, 16.1), (10.5, 15.6)]
    rounds = []
    for (le, lb), (se, sb) in zip(local, server, strict=True):
        figures = {("local", "ensemble", 1): (le, 1e3 / le), ("local", "bls", 1): (lb, 1e3 / lb),
                   ("server", "ensemble", 1): (se, 1e3 / se), ("server", "bls", 1): (sb, 1e3 / sb)}
        for where, p50 in (("local", lb), ("server", sb)):
            figures[(where, "bls-sync", 1)] = (p50, 1e3 / p50)
        rounds.append(figures)
    medians = module.median_figures(rounds)
    apart = (medians[("local", "ensemble", 1)][0] / medians[("local", "bls", 1)][0]) / (
        medians[("server", "ensemble", 1)][0] / medians[("server", "bls", 1)][0]) - 1
    assert apart < -0.10  # what the check used to judge
    checks, _ = module.checks_of("large", rounds)
    ratio = next(c for c in checks if c.figure == "ensemble/bls")
    assert ratio.predicted == pytest.approx(8.0 / 13.2) and ratio.measured == pytest.approx(10.6 / 16.1)
    assert ratio.ok and ratio.error == pytest.approx(-0.0794, abs=1e-3)
    latency = next(c for c in checks if c.figure == "ensemble p50 ms")
    assert (latency.predicted, latency.measured) == (8.8, 10.5)  # a latency is still its own median


def test_an_ensemble_with_a_gate_model_pays_one_more_step_and_stub():
    from pipelines.examples.basic import add, make_chain

    twice = Pipeline("twice", inputs={"x": V}, max_batch_size=8)  # one step model serving two parallel nodes
    a = twice.add(negate, name="a", x=twice.input("x"))["y"]
    b = twice.add(negate, name="b", x=twice.input("x"))["y"]
    twice.output("y", twice.add(add, a=a, b=b)["y"])
    assert "twice__gate" in twice.compile("ensemble").names  # what the replay mirrors
    profile = _profile(ensemble_step=Cost(200, 0), stub=Cost(1000, 0), ensemble_gate=Cost(700, 300))
    x = {"x": np.ones((1, 16), np.float32)}
    # and the failure tensors its steps carry, once per request: the gate line's fixed cost
    for pipeline, steps, gate in ((twice, 3 + 1, 700), (make_chain(steps=3), 3, 0)):
        _, report = run_many(pipeline, [x] * 3, mode="ensemble", concurrency=1, profile=profile)
        assert report.server.compute_input_us == pytest.approx(steps * 500), pipeline.name
        assert report.server.overhead_us == pytest.approx(steps * 200 + gate), pipeline.name
    # the BLS forms carry no failure tensors and call no gate
    _, report = run_many(twice, [x] * 3, mode="bls", concurrency=1, profile=profile)
    assert report.server.overhead_us == pytest.approx(0.0, abs=1e-6)


def test_a_gated_ensemble_pays_what_the_gated_probe_took_beyond_the_grown_one_and_its_gate():
    # the gated probe is the grown ensemble with one identity model for both identity nodes: its
    # failure tensors and gate model cost the difference, less the gate's step and stub (a few bytes)
    charged = 2 * TRUE["ensemble_step"].us(2 * 1024) + TRUE["stub"].us(2 * 1024)  # every stub priced as "stub"
    rows = []
    for p in probe_plan():
        latency = predict_us(TRUE, p.kind, p.steps, p.size)
        if p.gated:
            latency = predict_us(TRUE, "ensemble", p.steps, p.size) + charged + 900.0
        rows.append((p.row_kind, p.steps, p.size, latency, None if p.gated else TRUE["stub"].us(2 * p.size)))
    assert sum(r[0] == "gated ensemble" for r in rows) == len({p.size for p in probe_plan()})
    costs, points = fit_costs(rows)
    assert costs["ensemble_gate"].fixed_us == pytest.approx(900.0, rel=1e-6)
    assert costs["ensemble_gate"].us_per_mib == pytest.approx(0.0, abs=1e-6)
    assert [pt.cost_us for pt in points if pt.boundary == "ensemble_gate"] == [pytest.approx(900.0)] * len(SIZES)
    # without the gated probe (older profiles), nothing: the gate's step and stub alone
    costs, _ = fit_costs([r for r in rows if r[0] != "gated ensemble"])
    assert costs["ensemble_gate"].fixed_us == 0.0


def test_a_cost_curve_prices_each_way_at_its_sizes_and_between_them(tmp_path):
    curve = Cost(100.0, 500.0, (1 << 10, MIB, 4 * MIB), (10.0, 100.0, 1000.0), (20.0, 300.0, 2000.0))
    assert curve.way_us(MIB, leaving=False) == pytest.approx(100.0)
    assert curve.way_us(MIB, leaving=True) == pytest.approx(300.0)
    # linear between two sizes, the last slope past the largest, the smallest's figure below it
    assert curve.way_us(2.5 * MIB, leaving=True) == pytest.approx(1150.0)
    assert curve.way_us(7 * MIB, leaving=False) == pytest.approx(1000.0 + 300.0 * 3)
    assert curve.way_us(0, leaving=True) == pytest.approx(20.0)
    # without a curve: half the fixed cost, and the cost per byte of the bytes going that way
    assert Cost(100.0, 500.0).way_us(MIB, leaving=True) == pytest.approx(550.0)
    with pytest.raises(PipelinesError, match="one in and one out figure per size"):
        Cost(0.0, 0.0, (1, 2), (1.0,), (1.0, 2.0))
    profile = Profile(costs={**{k: Cost(0.0, 0.0) for k in TRUE}, "request": curve}, server_version="2.51.0",
                      protocol="http", machine={"cpu_count": 2}, date="2026-01-01T00:00:00+00:00")
    assert load_profile(profile.save(tmp_path / "p.json")).costs["request"] == curve


def test_the_fit_keeps_each_sizes_cost_where_costs_per_byte_grow_with_size():
    sizes = (1 << 10, 64 << 10, MIB, 4 * MIB, 16 * MIB)

    def grows(fixed, per_mib, power):  # costs per byte that grow with the size, as HTTP bodies' do
        ways = tuple(fixed / 2 + per_mib * (s / MIB) ** power for s in sizes)
        return Cost(0.0, 0.0, sizes, ways, ways)

    stub = Cost(0.0, 0.0, sizes, tuple(20 + 100 * s / MIB for s in sizes), tuple(300 + 400 * s / MIB for s in sizes))
    # the ensemble's own cost is its answer's copy: all of it on the way out
    answer = Cost(0.0, 0.0, sizes, (0.0,) * len(sizes), tuple(40 + 80 * s / MIB for s in sizes))
    # every boundary's cost is kept per size, the six read off differences between probes as well
    true = {"request": grows(300, 2000, 1.5), "ensemble": answer, "ensemble_step": grows(60, 150, 1.2),
            "bls_call": grows(400, 300, 1.3), "bls_model": grows(700, 200, 1.4), "bls_sync_call": grows(300, 250, 1.2),
            "bls_sync_model": grows(600, 150, 1.3), "stub": stub}
    rows = []
    for p in probe_plan(sizes=sizes):
        s = p.size
        stub_in, stub_out = stub.way_us(s, leaving=False), stub.way_us(s, leaving=True)
        rows.append((p.kind, p.steps, s, predict_us(true, p.kind, p.steps, s), stub_in + stub_out, stub_in))
    fitted, _ = fit_costs(rows)
    for name, cost in true.items():
        for s in (*sizes, 2 * MIB, 8 * MIB):  # at each size, and between two (linear in the bytes)
            for leaving in (False, True):
                assert fitted[name].way_us(s, leaving=leaving) == pytest.approx(
                    cost.way_us(s, leaving=leaving), rel=1e-6, abs=1e-6), (name, s, leaving)
    # the straight lines through them, which the table shows, cannot follow the curves: at 4 MiB
    # they price the request and a BLS model's own stub well off what they cost there
    for name in ("request", "bls_model"):
        line, at_4 = fitted[name].us(8 * MIB), 2 * true[name].way_us(4 * MIB, leaving=False)
        assert abs(line - at_4) > 0.05 * at_4, name
    # one chain length thrown far off by noise moves that size's figures, and none of the others'
    wild = [(k, n, s, lat * (1.4 if (s == 4 * MIB and k == "bls" and n == max(CHAINS)) else 1.0), *rest)
            for k, n, s, lat, *rest in rows]
    refitted, _ = fit_costs(wild)
    assert refitted["bls_call"].way_us(4 * MIB, leaving=True) > 1.5 * true["bls_call"].way_us(4 * MIB, leaving=True)
    for name in true:
        for s in (1 << 10, 64 << 10, MIB, 16 * MIB):
            assert refitted[name].way_us(s, leaving=True) == pytest.approx(fitted[name].way_us(s, leaving=True)), name


def test_a_bls_round_answers_all_its_requests_when_its_last_one_is_done():
    # async execute: the requests of one call run at once, and every response returns with the call
    from time import perf_counter

    import anyio

    from pipelines.runtime.bls_gate import BlsGate

    gate = BlsGate(instances=1, concurrent=True, max_rows=8)
    done: dict[str, float] = {}
    opened: list[bool] = []

    async def request(name: str, seconds: float) -> None:
        async with gate.slot(1) as opens:
            opened.append(opens)
            await anyio.sleep(seconds)
            done[name + " ran"] = perf_counter()
        done[name] = perf_counter()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(request, "fast", 0.0)
            tg.start_soon(request, "slow", 0.15)
            await anyio.sleep(0.01)  # both queued before the instance takes its first round
            tg.start_soon(gate.serve)
            await anyio.sleep(0.3)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert sorted(opened) == [False, True]  # one round, opened by one of them: its fixed costs are paid once
    assert done["fast ran"] < done["slow ran"] - 0.1
    assert done["fast"] >= done["slow ran"]  # answered with the round, not when its own work ended


def test_the_bls_models_own_fixed_cost_is_paid_once_per_round():
    import anyio

    from pipelines.runtime.replay import Replay

    profile = _profile(bls_model=Cost(10_000.0, 1_000.0))
    replay = Replay(profile, "bls")

    async def main():
        opening, joining = replay.begin(), replay.begin()
        await replay.bls_stub(opening, MIB, leaving=False, opens_round=True)
        await replay.bls_stub(joining, MIB, leaving=False, opens_round=False)
        return opening, joining

    opening, joining = anyio.run(main)
    assert opening.input * 1e6 == pytest.approx(5_000 + 1_000)
    assert joining.input * 1e6 == pytest.approx(1_000)


def test_a_stub_pays_its_own_debt_while_its_instance_is_held_not_the_requests():
    # A request's way in (0.6 ms) is too little to sleep for, so it stays owed. Were the stub after it
    # to pay that debt, its instance would be held a whole millisecond where the server's is held for
    # the stub's 0.2 ms, and a concurrency bound by that instance would lose throughput the server keeps.
    import anyio

    from pipelines.runtime.replay import Replay

    replay = Replay(_profile(request=Cost(1200, 0), stub=Cost(400, 0)), "ensemble")
    model = object()

    async def main():
        ledger = replay.begin()
        await replay.request(ledger, 0, leaving=False)
        for _ in range(2):
            await replay.stub(model, 0, leaving=False)
        return ledger

    ledger = anyio.run(main)
    assert ledger.debt == pytest.approx(600e-6)  # still owed by the request, to be paid outside any instance
    assert ledger.input == pytest.approx(400e-6)  # the statistics still tell the request's stubs
    assert ledger.overhead == pytest.approx(600e-6)



STARTS: list[float] = []


@step(inputs={"x": V}, outputs={"y": V})
def stamped(x):
    """Notes when each execution starts (one instance: one after another), and takes 2 ms."""
    from time import perf_counter, sleep

    STARTS.append(perf_counter())
    sleep(0.002)
    return {"y": x}


def test_a_stub_paid_in_the_steps_worker_thread_holds_its_instance_for_what_it_costs_each_time():
    # 0.3 ms in and 0.3 ms out, less than the event loop's millisecond: paid on the loop, one
    # execution would hold the instance a whole millisecond more and the next none more (right
    # on average, but requests meeting at single instances queue on the lumps). Four requests at
    # once run the step in worker threads, which pay each execution's stub as it costs.
    p = Pipeline("one_stamped", inputs={"x": V}, max_batch_size=8)
    p.output("y", p.add(stamped, x=p.input("x"))["y"])
    STARTS.clear()
    # isolation="thread": STARTS is this process's list (the step's own process has a copy)
    _, report = run_many(p, [{"x": X}] * 60, mode="ensemble", concurrency=4, profile=_profile(ensemble_stub=Cost(600, 0)),
                         isolation="thread")
    assert report.server.compute_input_us == pytest.approx(300, rel=0.05)  # 1.8 lanes: nothing stretched
    assert report.server.compute_output_us == pytest.approx(300, rel=0.05)
    # between one execution's start and the next's: its 2 ms, its way out and the next one's way in
    beyond = np.diff(STARTS[10:]) - 0.002
    assert np.percentile(beyond, 10) >= 0.45e-3, np.round(np.sort(beyond) * 1e3, 2)


def test_lanes_are_measured_once_per_size_when_every_size_is_a_large_one():
    # calibrate(sizes=(1 MiB, 4 MiB)) measured the 1 MiB probe twice for its lanes, and the profile
    # refused its own two figures for one size after minutes of measuring
    from pipelines.calibration.calibrate import _lane_probes

    assert [p.size for p in _lane_probes((1, 2), (MIB, 4 * MIB))] == [MIB]
    assert [p.size for p in _lane_probes((1, 2), (1 << 10, MIB, 4 * MIB))] == [1 << 10, MIB]
    assert {p.steps for p in _lane_probes((1, 2), (1 << 10, MIB))} == {2}
