"""Server profiles: the fit's estimator (medians over rounds, then the solve) recovers known
costs exactly, its intervals are a bootstrap over whole rounds, a profile refuses costs that are
missing or no time and a server it was not measured on, old profiles still load, and one small
real calibration of the bundled server."""

from __future__ import annotations

import json
import math
import re
import time
import warnings

import numpy as np
import pytest

from pipelines.calibration import (
    Cost,
    Profile,
    ProfileMismatchError,
    ProfileMismatchWarning,
    load_profile,
)
from pipelines.calibration.cost import FORM_COSTS
from pipelines.calibration.profile import BOUNDARIES, with_stand_ins
from pipelines.cli import main as cli_main
from pipelines.errors import ArgumentError, PipelinesError
from pipelines.forms import FORMS
from pipelines.profiling.calibrate import calibrate
from pipelines.profiling.fit import estimate, fit_costs, fit_rounds
from pipelines.profiling.measure import Budget, measure_probes, round_request_us
from pipelines.profiling.probes import BLS_KINDS, CHAINS, GROWN_ROW, KINDS, SIZES, Probe, probe_plan, probe_repository

MIB = 1 << 20
TRUE = {
    "request": Cost(300.0, 8000.0),
    "ensemble_step": Cost(60.0, 400.0),
    "bls_call": Cost(500.0, 900.0),
    "bls_sync_call": Cost(350.0, 700.0),
    "stub": Cost(150.0, 1200.0),
}


def predict_us(costs, kind, steps, size):
    """A chained probe's latency by ``costs`` (µs): the sum over the boundaries it crosses, the model
    that pipelines/profiling/fit.py solves (its docstring), each crossing with the tensor in and out."""
    priced = with_stand_ins(costs)
    form = None if kind == "step" else FORMS[kind]
    pays = None if kind == "step" else FORM_COSTS[kind]
    once = ("request", "stub") if pays is None else ("request", pays.own_cost)
    per_step = (() if form is None or pays is None else (pays.in_process_step_cost,) if form.in_process
                else (pays.call_cost, pays.stub_cost))

    def crossing(name):
        return priced[name].way_us(size, leaving=False) + priced[name].way_us(size, leaving=True)

    return sum(map(crossing, once)) + steps * sum(map(crossing, per_step))


def _probe_us(costs, p):
    """A probe's latency by ``costs``: a grown ensemble's request, answer, stub and hand-offs of a few
    bytes priced at the smallest size, its three other stubs and hand-offs of its size."""
    if not (p.grown and p.kind == "ensemble"):
        return predict_us(costs, p.kind, p.steps, p.size)
    priced = with_stand_ins(costs)
    per_step = priced["ensemble_step"].us(2 * p.size) + priced["ensemble_stub"].us(2 * p.size)
    return predict_us(costs, "ensemble", 1, min(SIZES)) + (p.steps + 1) * per_step


def _synthetic(noise: float = 0.0, seed: int = 0, stub: bool = True):
    rows = []
    for p in probe_plan():
        rng = np.random.default_rng((seed, KINDS.index(p.kind), p.steps, p.size))  # a probe's noise is its own
        latency = _probe_us(TRUE, p) * (1 + noise * rng.uniform(-1, 1))
        # a fused probe runs no step model whose statistics would price a stub
        stub_us = TRUE["stub"].us(2 * p.size) * (1 + noise * rng.uniform(-1, 1)) if stub and p.step_models else None
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


def test_what_a_stubs_input_costs_on_its_side_moves_from_its_way_out_to_its_way_in():
    # The grown probes' shrink step reads an input of the size and answers one byte: what its
    # stub's side costs above the smallest size is the input's part, which the identity steps
    # (as much out as in) had put on the way out.
    rows = [(*r, None, None, None, None) for r in _synthetic()]
    base, _ = fit_costs(rows)
    reader = {size: 100.0 + 90.0 * size / MIB for size in SIZES}  # 90 µs a MiB of input

    def with_reader(r):
        return (*r[:8], reader[r[2]]) if r[0].startswith(GROWN_ROW) else r

    moved, _ = fit_costs([with_reader(r) for r in rows])
    for name in ("ensemble_stub", "bls_stub", "bls_sync_stub"):
        for i, size in enumerate(base[name].sizes):
            shift = min(reader[size] - reader[SIZES[0]], base[name].out_us[i])
            assert moved[name].in_us[i] == pytest.approx(base[name].in_us[i] + shift), (name, size)
            assert moved[name].out_us[i] == pytest.approx(base[name].out_us[i] - shift), (name, size)
        assert moved[name].in_us[-1] > base[name].in_us[-1]  # it moved at the largest size
    for name in ("request", "stub", "bls_call", "ensemble"):  # nothing else moves
        assert moved[name].in_us == base[name].in_us and moved[name].out_us == base[name].out_us, name


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
    fitted, _ = fit_costs(rows)  # a negative figure would not pass Cost's own check
    assert fitted["ensemble_step"].us(4 * MIB) == pytest.approx(0.0, abs=10.0)


def _rounds(rows, n_rounds: int, change=None):
    """Per-round rows of ``n_rounds`` rounds, each round's figures the rows' own unless
    ``change(round, row)`` gives that round's (latency, stub) instead."""
    out = []
    for k in range(n_rounds):
        for r in rows:
            latency, stub = change(k, r) if change is not None else (r[3], r[4])
            out.append((r[0], r[1], r[2], k, latency, stub, None, None, None))
    return out


def _at(cost: Cost, size: int) -> float:
    """What a crossing of ``size`` bytes costs in and out, as the profile keeps it at that size."""
    i = cost.sizes.index(size)
    return cost.in_us[i] + cost.out_us[i]


def test_the_estimator_is_each_probes_median_over_the_rounds_so_a_disturbed_round_moves_nothing():
    # as calibrating once measured the 8-step ensemble at 4 MiB at 62.5 ms where 21.4 the next time:
    # now each probe is measured in rounds spread over the calibration, and a spell of the machine
    # lands in a round or two of it, which the median over the rounds does not see
    rows = _synthetic()
    disturbed = {(1, "ensemble", 8, 4 * MIB): 3.0, (3, "bls", 2, 4 * MIB): 0.5, (0, "step", 1, 32 * MIB): 2.0,
                 (4, "grown ensemble", 2, MIB): 4.0}

    def spell(k, r):
        factor = disturbed.get((k, r[0], r[1], r[2]), 1.0)
        return r[3] * factor, (r[4] * factor if r[4] is not None else None)

    per_round = _rounds(rows, 5, spell)
    assert estimate(per_round) == [(*r[:5], None, None, None, None) for r in rows]
    costs, _, _ = fit_rounds(per_round, resamples=50)
    exact, _ = fit_costs(rows)
    for name in BOUNDARIES:
        assert costs[name].in_us == pytest.approx(exact[name].in_us, rel=1e-12, abs=1e-9), name
        assert costs[name].out_us == pytest.approx(exact[name].out_us, rel=1e-12, abs=1e-9), name
    for name, cost in TRUE.items():
        assert costs[name].fixed_us == pytest.approx(cost.fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(cost.us_per_mib, rel=1e-6), name
    # a figure measured in no round stays unmeasured; a probe with no latency at all is refused
    assert estimate([("step", 1, 1024, 0, 500.0, None, None, None, None)]) == [("step", 1, 1024, 500.0, None, None,
                                                                                 None, None, None)]
    with pytest.raises(ArgumentError, match="needs a latency in at least one round"):
        estimate([("step", 1, 1024, 0, None, 20.0, None, None, None)])


def test_the_interval_of_a_cost_is_the_bootstrap_of_its_median_over_the_rounds():
    # Seven rounds in which only the step probe's latency at 1 KiB differs: the request there is
    # that latency less the stub, so its interval is the bootstrap's of a median of seven. Its
    # 2.5 % point is the second smallest (the median of a draw is the smallest with probability
    # P(Bin(7, 1/7) >= 4) = 0.8 %, at most the second with 11 %), and its 97.5 % point the second
    # largest, by symmetry: the order-statistics interval of the median of seven. 500 draws are
    # plenty: the smallest would take the 2.5 % point only in more than 12 of them (4 expected).
    rows = _synthetic()
    stub = TRUE["stub"].us(2 * 1024)
    shifts = [40.0, -25.0, 0.0, 90.0, -60.0, 15.0, 5.0]

    def step_moves(k, r):
        return (r[3] + shifts[k], r[4]) if (r[0], r[2]) == ("step", 1024) else (r[3], r[4])

    costs, _, estimated = fit_rounds(_rounds(rows, 7, step_moves), resamples=500)
    request = costs["request"]
    true_at = TRUE["request"].us(2 * 1024)
    ordered = sorted(shifts)
    assert _at(request, 1024) == pytest.approx(true_at + ordered[3])  # the median round's
    assert request.total_ci[0] == pytest.approx((true_at + ordered[1], true_at + ordered[5]))
    assert request.in_ci[0] == pytest.approx(((true_at + ordered[1]) / 2, (true_at + ordered[5]) / 2))
    assert next(r for r in estimated if r[0] == "step" and r[2] == 1024)[3] == pytest.approx(true_at + stub + ordered[3])
    # the other sizes did not move in any round: their intervals are points
    for i, size in enumerate(sorted(SIZES)[1:], start=1):
        assert request.total_ci[i] == pytest.approx((_at(request, size),) * 2), size
    # the line through the sizes has its interval too, about its own figures
    assert request.fixed_ci[0] <= request.fixed_us <= request.fixed_ci[1]
    assert request.fixed_ci[0] < request.fixed_ci[1]
    # seeded: the same rounds give the same profile
    again, _, _ = fit_rounds(_rounds(rows, 7, step_moves), resamples=500)
    assert again == costs


def test_the_bootstrap_draws_whole_rounds_so_a_spell_that_moves_a_sizes_probes_alike_leaves_its_differences():
    # Each round adds its own delay to every request of 4 MiB (the client's send stalling, say; the
    # grown probes' requests are a few bytes):
    # the request absorbs it, and its interval is wide; an ensemble step is the slope of the
    # ensemble's chains, which the delay shifts alike in every draw of whole rounds, so its
    # interval is a point. Drawn probe by probe, the chains would mix rounds and it would not be.
    rows = _synthetic()
    delays = [0.0, 3000.0, 800.0, 1500.0, 200.0, 2500.0, 100.0]

    def stall(k, r):
        return (r[3] + delays[k], r[4]) if r[2] == 4 * MIB and r[0] in KINDS else (r[3], r[4])

    costs, _, _ = fit_rounds(_rounds(rows, 7, stall), resamples=500)
    i = costs["request"].sizes.index(4 * MIB)
    low, high = costs["request"].total_ci[i]
    assert high - low == pytest.approx(sorted(delays)[5] - sorted(delays)[1])
    for name in ("ensemble_step", "ensemble_stub", "bls_stub"):
        low, high = costs[name].total_ci[i]
        assert high - low == pytest.approx(0.0, abs=1e-6), name
    assert _at(costs["ensemble_step"], 4 * MIB) == pytest.approx(TRUE["ensemble_step"].us(8 * MIB))


def test_without_noise_every_interval_is_its_figure_before_the_clip_at_zero():
    costs, _, _ = fit_rounds(_rounds(_synthetic(), 4), resamples=100)
    # The synthetic gated probe takes no longer than the grown ensemble, so the gate costs less
    # than the step and stub its gate model is already priced by: less than nothing, which the
    # cost clips to 0 and its interval, read before that clip, says.
    gate, smallest = costs.pop("ensemble_gate"), min(SIZES)
    charged = 2 * _at(costs["ensemble_step"], smallest) + _at(costs["ensemble_stub"], smallest)
    assert gate.fixed_us == 0.0 and gate.total_ci == ((-charged, -charged),) * len(gate.sizes)
    for name, cost in costs.items():
        assert cost.fixed_ci == pytest.approx((cost.fixed_us,) * 2, abs=1e-6), name
        assert cost.per_mib_ci == pytest.approx((cost.us_per_mib,) * 2, abs=1e-6), name
        for i in range(len(cost.sizes)):
            assert cost.in_ci[i] == pytest.approx((cost.in_us[i],) * 2, abs=1e-6), name
            assert cost.out_ci[i] == pytest.approx((cost.out_us[i],) * 2, abs=1e-6), name
    with pytest.raises(ArgumentError, match="0 < level < 1"):
        fit_rounds(_rounds(_synthetic(), 2), level=1.0)


def test_the_top_level_models_own_statistics_price_their_lines_without_the_requests_noise():
    # the request's HTTP body stalls 40-60 ms at 4 MiB in some requests and not in others: every
    # probe's latency carries its own draw of it, and only what the BLS model held its instance, or
    # the ensemble's own request time, says what its steps and calls cost
    true = dict(TRUE, bls_model=Cost(400.0, 300.0), bls_sync_model=Cost(250.0, 200.0), ensemble=Cost(80.0, 50.0))
    rows = []
    for p in probe_plan():
        rng = np.random.default_rng((7, KINDS.index(p.kind), p.steps, p.size))
        noise = true["request"].us(2 * p.size) * rng.uniform(-0.3, 0.3)
        held = None
        if p.kind != "step" and not p.grown:
            held = predict_us(true, p.kind, p.steps, p.size) - true["request"].us(2 * p.size)
        rows.append((p.kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size) + noise,
                     true["stub"].us(2 * p.size), None, held))
    costs, _ = fit_costs(rows)
    lines = ("ensemble", "ensemble_step", "bls_call", "bls_model", "bls_sync_call", "bls_sync_model")
    for name in lines:
        assert costs[name].fixed_us == pytest.approx(true[name].fixed_us, rel=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(true[name].us_per_mib, rel=1e-6), name
    # the same latencies without those statistics: the request's noise lands in every line
    blind, _ = fit_costs([r[:6] for r in rows])
    for group in (lines[:2], lines[2:]):
        assert any(blind[name].us(8 * MIB) != pytest.approx(true[name].us(8 * MIB), rel=0.05) for name in group), group


def test_each_forms_step_stubs_are_priced_by_its_own_probes_statistics():
    # the ensemble's stubs cost more than those a BLS model calls (the bundled server, at 4 MiB:
    # 1.63-1.76 ms against 1.27-1.44): each form's own, and its calls what its line leaves beyond them
    true = dict(TRUE, ensemble_stub=Cost(200.0, 1500.0), bls_stub=Cost(120.0, 1000.0),
                bls_sync_stub=Cost(130.0, 1100.0), bls_model=Cost(400.0, 300.0), bls_sync_model=Cost(250.0, 200.0))
    stub_of = {"step": "stub", "ensemble": "ensemble_stub", "bls": "bls_stub", "bls-sync": "bls_sync_stub"}
    rows = [(p.kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size),
             true[stub_of[p.kind]].us(2 * p.size) if p.step_models else None) for p in probe_plan()]
    costs, _ = fit_costs(rows)
    for name, cost in true.items():
        assert costs[name].fixed_us == pytest.approx(cost.fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(cost.us_per_mib, rel=1e-6), name
    # a profile from before each form's stubs were measured: every form's steps pay its one stub
    older = _profile(**TRUE)
    assert older.costs["ensemble_stub"] == older.costs["bls_stub"] == older.costs["bls_sync_stub"] == TRUE["stub"]


def test_the_fused_models_own_costs_are_priced_by_its_own_probes_not_the_bls_models():
    # The fused model's own hold is not the BLS model's (0.34 against 0.65 ms around one identity,
    # timed by hand on the bundled server: docs/design_notes.md, "The fused model's own probes take turns"):
    # its chains price their own line, with no stub per step, and leave the BLS figures be.
    true = dict(TRUE, bls_model=Cost(700.0, 200.0), bls_stub=Cost(120.0, 1000.0),
                fused_model=Cost(280.0, 150.0), fused_step=Cost(40.0, 0.0))
    stub_of = {"step": "stub", "ensemble": "stub", "bls": "bls_stub", "bls-sync": "stub"}
    rows = [(p.kind, p.steps, p.size, predict_us(true, p.kind, p.steps, p.size),
             true[stub_of[p.kind]].us(2 * p.size) if p.step_models else None) for p in probe_plan()]
    assert all(r[4] is None for r in rows if r[0] == "fused")  # its steps run in its process, in no stub
    costs, _ = fit_costs(rows)
    for name in ("fused_model", "fused_step", "bls_model", "bls_stub", "bls_call"):
        assert costs[name].fixed_us == pytest.approx(true[name].fixed_us, rel=1e-6, abs=1e-6), name
        assert costs[name].us_per_mib == pytest.approx(true[name].us_per_mib, rel=1e-6, abs=1e-6), name
    # samples from before the fused probes: the fused model stands in by the BLS model, and does
    # nothing around its steps
    older, _ = fit_costs([r for r in rows if r[0] != "fused"])
    assert older["fused_model"] == older["bls_model"]
    assert older["fused_step"].fixed_us == older["fused_step"].us_per_mib == 0.0
    assert _profile(**TRUE).costs["fused_model"] == _profile(**TRUE).costs["bls_model"]


def test_what_each_request_adds_to_a_fused_round_is_the_slope_of_its_hold_over_its_rows():
    # batch_stats by rows: (executions, µs held); 800 + 60 a row beyond the first, every size weighted
    # by how often it ran (a size seen once moves it little)
    exact = {rows: (count, 800 + 60 * (rows - 1)) for rows, count in ((1, 30), (2, 50), (5, 10), (8, 40))}
    assert round_request_us(exact) == pytest.approx(60.0)
    noisy = {**exact, 3: (1, 5000.0)}
    assert round_request_us(noisy) == pytest.approx(60.0, abs=5.0)  # unweighted, the stray one would set it below 0
    assert round_request_us({1: (100, 800.0)}) == 0.0  # one size: nothing to tell it by
    assert round_request_us({1: (50, 900.0), 4: (50, 800.0)}) == 0.0  # noise below zero: none
    assert round_request_us({}) == 0.0
    # the profile keeps it, and a profile without it (older ones) prices none
    profile = _profile(**TRUE)
    assert profile.round_request_us == 0.0
    kept = Profile.from_dict(dict(profile.to_dict(), round_request_us=60.0))
    assert kept.round_request_us == 60.0 and "round_request): 60 µs" in kept.table()
    with pytest.raises(PipelinesError, match="round_request_us is µs >= 0"):
        Profile.from_dict(dict(profile.to_dict(), round_request_us=float("nan")))


def test_the_profile_keeps_the_grown_probes_stubs_and_the_calls_are_read_against_the_chains_own():
    # the chains' stubs, fed by a request of the tensor's size and measured in turns, cost more than
    # the grown probe's, measured back to back between steps that grow and shrink the tensor
    true = dict(TRUE, ensemble_stub=Cost(300.0, 1500.0), bls_stub=Cost(250.0, 1400.0), bls_sync_stub=Cost(250.0, 1400.0))
    warm = {"ensemble": Cost(200.0, 1000.0), "bls": Cost(180.0, 900.0), "bls-sync": Cost(170.0, 950.0)}
    stub_of = {"step": "stub", "ensemble": "ensemble_stub", "bls": "bls_stub", "bls-sync": "bls_sync_stub"}
    rows = [(p.row_kind, p.steps, p.size, _probe_us(dict(true, ensemble_stub=warm["ensemble"]) if p.grown else true, p),
             (warm[p.kind] if p.grown else true[stub_of[p.kind]]).us(2 * p.size) if p.step_models else None)
            for p in probe_plan()]
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
        latency = _probe_us(true, p)
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


def test_an_ensembles_hand_off_above_the_smallest_size_is_priced_by_the_grown_ensemble():
    # the chains carry the tensor in the request and take turns: their slope less their own stubs
    # prices a hand-off cold; the grown ensemble's latency less its stubs, above the same at the
    # smallest size, is six hand-offs of the size made back to back as a user's pipeline makes them
    warm = Cost(20.0, 700.0)
    smallest = min(SIZES)
    rows = []
    for p in probe_plan():
        costs = TRUE
        if p.grown and p.kind == "ensemble":  # its hand-offs are warm, its small ones the chains'
            costs = dict(TRUE, ensemble_step=Cost(TRUE["ensemble_step"].us(2 * smallest) - warm.us(2 * smallest)
                                                  + warm.fixed_us, warm.us_per_mib))
        rows.append((p.row_kind, p.steps, p.size, _probe_us(costs, p), TRUE["stub"].us(2 * p.size)))
    fitted, _ = fit_costs(rows)
    step = fitted["ensemble_step"]
    assert step.way_us(smallest, leaving=True) == pytest.approx(TRUE["ensemble_step"].us(2 * smallest) / 2)
    for size in sorted(set(SIZES) - {smallest}):
        expected = (TRUE["ensemble_step"].us(2 * smallest) + warm.us(2 * size) - warm.us(2 * smallest)) / 2
        for leaving in (False, True):
            assert step.way_us(size, leaving=leaving) == pytest.approx(expected), size
    # without the grown ensemble (a profile measured before it), the chains price every size
    cold, _ = fit_costs([r for r in rows if r[0] != GROWN_ROW + "ensemble"])
    assert cold["ensemble_step"].us_per_mib == pytest.approx(TRUE["ensemble_step"].us_per_mib, rel=1e-6)


def test_a_gated_ensemble_pays_what_the_gated_probe_took_beyond_the_grown_one_and_its_gate():
    # the gated probe is the grown ensemble with one identity model for both identity nodes: its
    # failure tensors and gate model cost the difference, less the gate's step and stub (a few bytes)
    charged = 2 * TRUE["ensemble_step"].us(2 * 1024) + TRUE["stub"].us(2 * 1024)  # every stub priced as "stub"
    rows = []
    for p in probe_plan():
        latency = _probe_us(TRUE, p)
        if p.gated:
            latency = _probe_us(TRUE, Probe("ensemble", p.steps, p.size, grown=True)) + charged + 900.0
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


class _VirtualServer:
    """A server on a virtual clock: each request costs what ``cost_of(model, size, call)`` says,
    and moves the clock by that much, so the figures a measurement reads are exact."""

    def __init__(self, cost_of):
        self.now = 0.0
        self.calls: list[tuple[str, int]] = []
        self.cost_of = cost_of

    def clock(self) -> float:
        return self.now

    def infer(self, model, inputs):
        size = inputs["x"].shape[1] if "x" in inputs else int(inputs["n"][0, 0])
        self.now += self.cost_of(model, size, len(self.calls))
        self.calls.append((model, size))


def test_every_round_measures_every_probe_of_every_size_so_a_spell_of_the_machine_meets_few_of_its_rounds():
    probes = [p for p in probe_plan(chains=(1, 2), sizes=(1 << 10, 4 << 20)) if not p.grown]
    spell = range(36, 48)  # a slow stretch of the machine across two rounds: these calls take three times as long

    def cost_of(model, size, call):
        return (0.002 if size == 1 << 10 else 0.010) * (3.0 if call in spell else 1.0)

    server = _VirtualServer(cost_of)
    budget = Budget(rounds=5, min_requests=1, max_requests=1, seconds=0.0, warmup=0)
    samples = measure_probes(server.infer, probes, budget, clock=server.clock)
    # round by round, every probe once, the sizes' order turning
    small = [(p.model, p.size) for p in probes if p.size == 1 << 10]
    large = [(p.model, p.size) for p in probes if p.size == 4 << 20]
    assert server.calls == (small + large) + (large + small) + (small + large) + (large + small) + (small + large)
    slowed = 0
    for sample in samples:
        truth = 2000.0 if sample.probe.size == 1 << 10 else 10_000.0
        assert sample.requests == 5 and len(sample.rounds) == 5
        latencies = [figures[0] for figures in sample.rounds]
        assert all(v == pytest.approx(truth) or v == pytest.approx(3 * truth) for v in latencies), sample
        slow = sum(v == pytest.approx(3 * truth) for v in latencies)
        assert slow <= 2, sample  # a spell of one round's length meets a probe in two rounds at most
        assert estimate(sample.round_rows())[0][3] == pytest.approx(truth)  # which the median does not see
        slowed += slow
    assert slowed == len(spell)


def test_the_grown_probes_of_a_size_take_turns_in_bursts_whose_first_request_is_not_timed():
    # back to back, as a pipeline's requests come, yet side by side with the other forms' grown
    # probes, so that a spell of the machine moves every form's figures alike; the statistics are
    # read around the timed requests of a burst whole, as a read between two would part them
    probes = [p for p in probe_plan(chains=(1,), sizes=(1 << 20,)) if p.grown]
    server = _VirtualServer(lambda model, size, call: 0.020 if not server.calls or server.calls[-1][0] != model
                            else 0.002)  # a model called after another one answers late

    def statistics(model):
        server.calls.append(("statistics", 0))
        return {"model_stats": []}

    samples = measure_probes(server.infer, probes, Budget(rounds=2, min_requests=4, max_requests=4, seconds=0.0,
                                                          warmup=0), clock=server.clock, statistics=statistics)
    burst = 1 + 4  # one untimed, four timed
    models = [p.model for p in probes]
    infers = [m for m, _ in server.calls if m != "statistics"]
    assert infers == [m for _ in range(2) for m in models for _ in range(burst)]
    reads = [m for m, _ in server.calls]
    for model in models:  # each burst: untimed, read, four timed with no read between them, read
        assert reads.count(model) == 2 * burst
        first = reads.index(model)
        assert reads[first:first + burst + 2] == [model, "statistics", *[model] * 4, "statistics"]
    for sample in samples:
        assert sample.requests == 8 and [f[0] for f in sample.rounds] == [pytest.approx(2000.0)] * 2, sample


def test_a_budget_must_measure_something():
    with pytest.raises(ArgumentError, match="rounds >= 1"):
        Budget(rounds=0)
    with pytest.raises(ArgumentError, match="min_requests <= max_requests"):
        Budget(min_requests=5, max_requests=4)
    with pytest.raises(TypeError):
        Budget(3, 15, 0.4, 1)  # keyword-only: what the old positional figures meant has changed


def _profile(**costs: Cost) -> Profile:
    return Profile(
        costs={**{k: Cost(0.0, 0.0) for k in TRUE}, **costs},
        server_version="2.51.0",
        protocol="http",
        machine={"cpu": "test cpu", "cpu_count": 2},
        date="2026-01-01T00:00:00+00:00",
    )


def test_a_profile_round_trips_through_json_with_its_intervals_and_rounds(tmp_path):
    per_round = _rounds(_synthetic(), 3, lambda k, r: (r[3] * (1 + 0.01 * k), r[4]))
    costs, points, estimated = fit_rounds(per_round, resamples=50)
    profile = Profile(costs=costs, server_version="2.51.0", protocol="grpc", machine={"cpu": "x", "cpu_count": 2},
                      date="2026-01-01T00:00:00+00:00", url="host:8001", points=points,
                      samples=tuple(estimated), lanes=1.4, rounds=3, round_samples=tuple(per_round))
    path = profile.save(tmp_path / "profile.json")
    again = load_profile(path)
    assert again == profile and again.lanes == pytest.approx(1.4) and again.rounds == 3
    assert load_profile(str(path)) == profile and load_profile(profile) is profile
    written = json.loads(path.read_text())
    assert written["costs"]["stub"]["fixed_us"] == pytest.approx(150.0)
    assert written["costs"]["request"]["total_ci"][0] == list(costs["request"].total_ci[0])
    assert written["rounds"] == 3 and len(written["round_samples"]) == 3 * len(probe_plan())
    table = profile.table()
    assert "bls_call" in table and "2.51.0" in table and "1.40 lanes" in table
    assert "medians over 3 rounds; [low-high]: 95% intervals" in table
    low, high = costs["request"].fixed_ci
    assert f"{costs['request'].fixed_us:.0f} [{low:.0f}-{high:.0f}]" in table
    # the intervals are refitted from the rounds the profile keeps
    assert fit_rounds(again.round_samples, resamples=50)[0] == costs


def test_a_cost_the_fit_clips_to_zero_keeps_its_interval_in_the_table(tmp_path):
    # Issue 43: 'calibrate --quick' showed the ensemble's fixed cost as exactly 0 µs, a negative
    # estimate clipped. The ensemble costs nothing here, and the rounds' noise puts it below zero:
    # the profile uses 0, and its interval, from draws fitted without the clip, reaches below zero.
    def noisy(k, r):
        factor = 1 + 0.02 * ((k * 7 + r[1] * 3 + r[2] % 11) % 5 - 2)
        return r[3] * factor, (r[4] * factor if r[4] is not None else None)

    costs, points, estimated = fit_rounds(_rounds(_synthetic(noise=0.03, seed=1), 5, noisy), resamples=100)
    ensemble = costs["ensemble"]
    i = ensemble.sizes.index(min(SIZES))
    assert ensemble.in_us[i] == ensemble.out_us[i] == 0.0 and ensemble.us_per_mib == 0.0  # clipped
    assert ensemble.total_ci[i][0] < 0 < ensemble.total_ci[i][1]
    low, high = ensemble.fixed_ci
    assert f"{ensemble.fixed_us:.0f}" == "0" and low < 0 < high
    profile = Profile(costs=costs, server_version="2.51.0", protocol="http", machine={"cpu": "x", "cpu_count": 2},
                      date="2026-01-01T00:00:00+00:00", points=points, samples=tuple(estimated), rounds=5)
    table = profile.table()
    row = next(line for line in table.splitlines() if line.startswith("ensemble "))
    # Issue 60: "0 [−5797…+14414]" said less than words do
    assert f"not measurable here (≤ {high:.0f})" in row and "−" not in table
    ms_high = ensemble.total_ci[i][1] / 1e3
    per_size = [line for line in table.splitlines() if line.startswith("ensemble ")][1]
    assert f"not measurable here (≤ {ms_high:.2f})" in per_size
    assert "not measurable here (≤ high): a cost this machine's noise cannot tell from 0" in table
    # a cost the fit did not clip keeps its interval as before; the file keeps the bounds below zero
    request = next(line for line in table.splitlines() if line.startswith("request "))
    assert "not measurable" not in request and "[" in request
    again = load_profile(profile.save(tmp_path / "profile.json"))
    assert again.costs["ensemble"].fixed_ci == (low, high) and again.table() == table


def test_a_profile_written_before_rounds_and_intervals_still_loads(tmp_path):
    # as 'pipelines calibrate' wrote them before: no intervals, rounds or round samples, and (older
    # still) without the boundaries measured later, which their stand-ins price
    old = {
        "format": 1, "server_version": "2.51.0", "protocol": "http", "url": None,
        "machine": {"cpu": "AMD EPYC", "cpu_count": 2}, "date": "2026-01-01T00:00:00+00:00",
        "costs": {
            "request": {"fixed_us": 346.0, "us_per_mib": 1057.0, "sizes": [1024, 1048576],
                        "in_us": [202.1, 951.0], "out_us": [202.1, 951.0]},
            "ensemble_step": {"fixed_us": 0.0, "us_per_mib": 0.0},
            "bls_call": {"fixed_us": 185.0, "us_per_mib": 113.0},
            "stub": {"fixed_us": 243.0, "us_per_mib": 172.0},
        },
        "points": [{"boundary": "stub", "nbytes": 2048, "cost_us": 280.0, "probe": "step x1"}],
        "samples": [["step", 1, 1024, 687.3, 283.5, 16.4, None, None]],
        "lanes": 1.45, "lanes_by_size": [[1024, 1.52]],
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)
    assert profile.rounds == 0 and profile.round_samples == () and profile.costs["request"].total_ci == ()
    assert profile.costs["request"].way_us(1024, leaving=True) == pytest.approx(202.1)
    assert profile.costs["bls_sync_call"] == profile.costs["bls_call"]  # a stand-in
    assert "[" not in profile.table().split("\n", 2)[2] and "medians over" not in profile.table()
    assert profile.save(tmp_path / "again.json") and load_profile(tmp_path / "again.json") == profile


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


def _edited(field: str, value):
    """A good profile's JSON with ``field`` (dotted, ``costs.bls_call.in_us[2]``) set to ``value``,
    or removed where ``value`` is ``...``."""
    data = json.loads(_profile(bls_call=Cost(500.0, 900.0, (1024, MIB, 4 * MIB), (1.0, 2.0, 3.0),
                                             (4.0, 5.0, 6.0))).to_json())
    *parents, last = re.findall(r"[^.\[\]]+", field)
    holder = data
    for key in parents:
        holder = holder[int(key)] if key.isdigit() else holder[key]
    key = int(last) if last.isdigit() else last
    if value is ...:
        del holder[key]
    else:
        holder[key] = value
    return data


@pytest.mark.parametrize(("field", "value", "said"), [
    ("costs.bls_call.in_us[2]", float("nan"), "costs.bls_call.in_us[2] is NaN; every cost is finite µs >= 0"),
    ("costs.bls_call.out_us[0]", -5.0, "costs.bls_call.out_us[0] is -5.0; every cost is finite µs >= 0"),
    ("costs.request.fixed_us", -100000, "costs.request.fixed_us is -100000; every cost is finite µs >= 0"),
    ("costs.stub.us_per_mib", float("inf"), "costs.stub.us_per_mib is inf; every cost is finite µs >= 0"),
    ("costs.stub.fixed_us", None, "costs.stub.fixed_us is null; every cost is finite µs >= 0"),
    ("costs.stub.fixed_us", "12", "costs.stub.fixed_us is '12'; every cost is finite µs >= 0"),
    ("costs.stub.fixed_ci", [None, 1.0], "costs.stub.fixed_ci[0] is null; an interval's bounds are finite µs"),
    ("costs.request", ..., "costs.request is missing; a profile prices every boundary"),
    ("costs.bls_call", ..., "costs.bls_call is missing"),
    ("costs.stub.us_per_mib", ..., "costs.stub.us_per_mib is missing"),
    ("costs.bls_call.in_us", ..., "costs.bls_call: curve needs one in and one out figure per size"),
    ("costs", ..., "not a server profile: costs is missing"),
    ("protocol", ..., "not a server profile: protocol is missing"),
    ("protocol", "carrier-pigeon", "a profile's protocol is 'http' or 'grpc'; got 'carrier-pigeon'"),
], ids=lambda v: v if isinstance(v, str) and v.startswith(("costs", "protocol")) else None)
def test_a_profile_with_a_cost_that_is_missing_negative_or_nan_is_refused_naming_the_field(tmp_path, field, value,
                                                                                           said):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps(_edited(field, value)))
    with pytest.raises(PipelinesError, match=f"profile.json'?: {re.escape(said)}"):
        load_profile(bad)


def test_a_cost_built_in_code_is_refused_as_well_and_a_profile_needs_every_boundary():
    with pytest.raises(PipelinesError, match=r"a cost's in_us\[1\] is NaN; every cost is finite µs >= 0"):
        Cost(0.0, 0.0, (1, 2), (1.0, float("nan")), (1.0, 2.0))
    with pytest.raises(PipelinesError, match=r"a cost's total_ci\[0\]\[0\] is NaN; an interval's bounds are finite µs"):
        Cost(0.0, 0.0, (1,), (1.0,), (1.0,), total_ci=((float("nan"), 2.0),))
    # a bound may be below zero: the interval is the fit's before it clips the cost at 0 (issue 43)
    assert Cost(0.0, 0.0, (1,), (1.0,), (1.0,), total_ci=((-1.0, 2.0),)).total_ci == ((-1.0, 2.0),)
    with pytest.raises(PipelinesError, match="fixed_ci is an interval"):
        Cost(1.0, 0.0, fixed_ci=(2.0, 1.0))
    with pytest.raises(PipelinesError, match="costs.ensemble_step is missing"):
        Profile(costs={"request": Cost(1, 1)}, server_version=None, protocol="http", machine={}, date="d")
    with pytest.raises(PipelinesError, match="costs.requets is no boundary"):
        _profile(requets=Cost(1, 1))


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


def test_a_profile_from_another_server_version_or_protocol_is_refused_unless_the_mismatch_is_allowed():
    profile = _profile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile.require_match(server_version="2.51.0", protocol="http",
                                     machine={"cpu": "test cpu", "cpu_count": 2}) == []
    with pytest.raises(ProfileMismatchError) as refused:
        profile.require_match(server_version="2.48.0", protocol="grpc", machine={"cpu": "another cpu"})
    said = str(refused.value)
    assert "measured on Triton 2.51.0, the server is Triton 2.48.0" in said
    assert "measured over http, the requests go over grpc" in said
    assert "its machine has cpu 'test cpu', this one 'another cpu'" in said
    assert "--allow-mismatch (allow_mismatch=True)" in said and "run 'pipelines calibrate'" in said
    assert len(refused.value.differences) == 3 and isinstance(refused.value, PipelinesError)
    with pytest.warns(ProfileMismatchWarning) as warned:
        found = profile.require_match(server_version="2.48.0", protocol="grpc", allow_mismatch=True)
    assert found == ["it was measured on Triton 2.51.0, the server is Triton 2.48.0",
                     "it was measured over http, the requests go over grpc"]
    assert len(warned) == 1 and all(d in str(warned[0].message) for d in found)
    # what is not known on either side is no mismatch
    assert _profile().require_match(machine={}) == []


def test_check_still_warns_for_its_callers():
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


def test_the_wake_of_a_side_that_waited_round_trips_and_is_checked(tmp_path):
    from dataclasses import replace

    from pipelines.profiling.wake import WAITS_MS, fit_wake

    # measured work times' figures above the work: the first is the probes' own, the rest above it
    over = {ms: [300.0 + 30.0 * ms + d for d in (-5.0, 0.0, 5.0)] for ms in WAITS_MS}
    wake = fit_wake(over)
    assert wake[0] == (500.0, 0.0) and wake[-1] == (20_000.0, pytest.approx(30.0 * 19.5 / 2))  # two hand-offs
    profile = replace(_lanes_profile(1.8), wake=wake)
    assert load_profile(profile.save(tmp_path / "p.json")).wake == wake
    assert "wake): 0 µs after 0.5 ms" in profile.table() and "292 µs after 20 ms" in profile.table()
    data = profile.to_dict()
    del data["wake"]
    assert Profile.from_dict(data).wake == ()  # an older profile prices no wake
    for bad in (((500, -1.0),), ((float("nan"), 2.0),), ((500, 1.0), (500, 2.0)), (("x",),)):
        with pytest.raises(PipelinesError, match="wake"):
            replace(_lanes_profile(1.8), wake=bad)
    # below the probes' own figure, a wake costs nothing
    assert fit_wake({ms: [300.0 - ms] for ms in WAITS_MS})[-1] == (20_000.0, 0.0)


def test_a_sleeping_probes_wake_is_read_against_the_working_probes_own_less_what_it_overslept():
    from pipelines.profiling.wake import SLEEP_MODEL, WAITS_MS, fit_wake, measure_wake

    # a virtual server: a call costs 300 µs beyond its step's work; the sleeping step oversleeps
    # 70 µs and says so, and waking a machine whose cores all idled costs 40 µs more (two hand-offs)
    now = [0.0]

    def infer(model, inputs, say=True):
        ms = float(inputs["ms"][0])
        slept = ms + 0.070 if model == SLEEP_MODEL else ms
        now[0] += (300.0 + (40.0 if model == SLEEP_MODEL else 0.0) + slept * 1e3) / 1e6
        return {"worked": np.array([slept])} if say else None

    over = measure_wake(infer, rounds=2, clock=lambda: now[0])
    assert over["busy"][0.5] == [pytest.approx(300.0)] * 6 and over["idle"][2.0] == [pytest.approx(340.0)] * 6
    assert fit_wake(over["idle"], against=over["busy"]) == tuple((ms * 1e3, pytest.approx(20.0)) for ms in WAITS_MS)
    # read against its own first figure, the wake it pays at every wait is priced nowhere
    assert all(us == pytest.approx(0.0) for _, us in fit_wake(over["idle"]))
    # a probe that does not say how long it slept (written before it did): its oversleep counts
    silent = measure_wake(lambda model, inputs: infer(model, inputs, say=False), rounds=1, clock=lambda: now[0])
    assert silent["idle"][0.5] == [pytest.approx(410.0)] * 3


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


def _no_server(monkeypatch):
    """A refusal comes before anything is measured: starting a server fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("a server was started before the refusal")

    monkeypatch.setattr("pipelines.triton.TritonServer", started)


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_calibrate_refuses_an_output_that_is_a_directory_before_measuring_anything(tmp_path, capsys, option,
                                                                                   monkeypatch):
    _no_server(monkeypatch)
    args = {"--out": str(tmp_path / "p.json"), "--plot": str(tmp_path / "p.png"), option: str(tmp_path)}
    code = cli_main(["calibrate", "--quick", *(x for kv in args.items() for x in kv)])
    assert code == 2
    assert f"{option} {str(tmp_path)!r} is a directory; give a file name" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--out", "p.png"], ["--out", "p.json", "--plot", "p.json"]])
def test_calibrate_refuses_a_plot_that_would_be_drawn_over_the_profile(tmp_path, capsys, monkeypatch, args):
    _no_server(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text("my earlier profile\n")
    assert cli_main(["calibrate", "--quick", *args]) == 2
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

    calibrate_module = sys.modules["pipelines.profiling.calibrate"]
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


@pytest.mark.server
def test_calibrate_the_bundled_server_with_a_tiny_probe_set(tmp_path):
    from pipelines.profiling.wake import WAITS_MS

    rounds = 3
    profile = calibrate(chains=(1, 2), sizes=(1 << 10, 256 << 10), progress=False,
                        budget=Budget(rounds=rounds, max_requests=2, seconds=0.05, lanes_seconds=0.6))
    assert profile.server_version and profile.protocol == "http" and profile.machine.get("cpu_count")
    assert 1.0 <= profile.lanes <= profile.machine["cpu_count"]  # measured: a throughput ratio, capped by cores
    # measured on the smallest tensor only here (no size of 1 MiB or more): the mean is that one size's
    assert [n for n, _ in profile.lanes_by_size] == [1 << 10] and profile.lanes_by_size[0][1] == profile.lanes
    # the wake probe, at each work time: the probes' own first, which every other is measured against
    assert [w for w, _ in profile.wake] == [ms * 1e3 for ms in WAITS_MS] and profile.wake[0][1] == 0.0
    # per size: the step, two chains of each kind, then each kind's grown probe, and the gated one
    assert [s[0] for s in profile.samples[:13]] == [
        "step", *("ensemble",) * 2, *("bls",) * 2, *("bls-sync",) * 2, *("fused",) * 2,
        "grown ensemble", "grown bls", "grown bls-sync", "gated ensemble"]
    assert len(profile.samples) == 2 * 13
    # every probe in every round, and the samples are their medians (the estimator)
    assert profile.rounds == rounds and len(profile.round_samples) == rounds * 2 * 13
    assert {r[3] for r in profile.round_samples} == set(range(rounds))
    assert estimate(profile.round_samples) == list(profile.samples)
    assert all(s[3] > 0 for s in profile.samples)
    # stubs are priced by steps whose outputs feed another step, or by the step called alone: an
    # ensemble of one step has none (its one step's output is the answer, copied into the response)
    # (the gated probe has no stub of its own: its figure is its latency, against the grown ensemble's)
    # (nor the fused chains, whose steps run in the fused model's own process)
    assert all((s[4] is None) == ((s[0] == "ensemble" and s[1] == 1) or s[0] in ("gated ensemble", "fused"))
               for s in profile.samples)
    assert all(s[4] > 0 for s in profile.samples if s[4] is not None)
    # a BLS probe also tells what its BLS model held its instance, an ensemble its own request time
    # (more than its steps' stubs); the step probe has no model around its step
    # (which holds more than its steps' stubs: a timing, left to the benchmarks, since two workers
    # of the suite on two cores can reorder medians taken moments apart)
    assert all((s[6] is None) == (s[0] == "step") for s in profile.samples)
    assert all(s[6] > 0 for s in profile.samples if s[6] is not None)
    # the fused model's own costs are its probes' (intervals of their own), not the BLS model's stood in;
    # and what each request of its rounds adds, from a fused probe driven with requests queued
    assert profile.costs["fused_model"].total_ci != profile.costs["bls_model"].total_ci
    assert math.isfinite(profile.round_request_us) and profile.round_request_us >= 0
    # how steady the machine was: the probes' disagreement over the rounds, and other processes' load beside the
    # server (this process's child, so its work is not counted as theirs)
    assert profile.noise is not None and profile.noise.disagreement is not None
    assert profile.noise.disagreement == profile.window_spread() and profile.noise.other_load is not None
    # and a grown BLS probe what all its step models held (grow, the identities, shrink)
    assert all((s[7] is not None) == (s[0] in ("grown bls", "grown bls-sync")) for s in profile.samples)
    assert all(s[7] > 0 for s in profile.samples if s[7] is not None)
    assert [p.stub_models for p in (Probe("ensemble", 1, 1024), Probe("ensemble", 2, 1024), Probe("bls", 2, 1024))] == [
        (), ("probe_2__identity",), ("probe_2__identity", "probe_2__id_1")]
    # a grown probe's identity steps all feed another step: each prices a stub, as it would in a BLS model
    assert Probe("ensemble", 2, 1024, grown=True).stub_models == ("probe_grown__identity", "probe_grown__id_1")
    # the profile keeps the grown probes' stubs, which the points show as such
    grown_points = [pt for pt in profile.points if pt.probe.startswith("grown ")]
    assert {pt.boundary for pt in grown_points} == {"ensemble_stub", "bls_stub", "bls_sync_stub"}
    at_small = {pt.probe: pt.cost_us for pt in grown_points if pt.nbytes == 2 << 10}
    assert _at(profile.costs["ensemble_stub"], 1 << 10) == pytest.approx(at_small["grown ensemble"])
    # each cost's figures have their intervals, by size, in the profile and its table
    for name, cost in profile.costs.items():
        assert len(cost.in_ci) == len(cost.out_ci) == len(cost.total_ci) == 2, name
        assert cost.fixed_ci is not None and cost.per_mib_ci is not None, name
    assert f"medians over {rounds} rounds" in profile.table()
    # a request to a Python model costs something: the fit found it somewhere
    assert profile.costs["request"].fixed_us + profile.costs["stub"].fixed_us > 0
    assert load_profile(profile.save(tmp_path / "p.json")) == profile
    profile.plot(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_lanes_are_measured_once_per_size_when_every_size_is_a_large_one():
    # calibrate(sizes=(1 MiB, 4 MiB)) measured the 1 MiB probe twice for its lanes, and the profile
    # refused its own two figures for one size after minutes of measuring
    from pipelines.profiling.calibrate import _lane_probes

    assert [p.size for p in _lane_probes((1, 2), (MIB, 4 * MIB))] == [MIB]
    assert [p.size for p in _lane_probes((1, 2), (1 << 10, MIB, 4 * MIB))] == [1 << 10, MIB]
    assert {p.steps for p in _lane_probes((1, 2), (1 << 10, MIB))} == {2}


def test_the_profile_plot_has_a_panel_per_boundary_and_its_title_clear_of_them(tmp_path):
    # Issue 60: an empty panel where the boundaries did not fill the last row, and the figure's
    # title drawn over the first row's panel titles.
    costs, points, estimated = fit_rounds(_rounds(_synthetic(noise=0.03, seed=1), 5), resamples=30)
    profile = Profile(costs=costs, server_version="2.51.0", protocol="http", machine={"cpu": "x", "cpu_count": 2},
                      date="2026-01-01T00:00:00+00:00", points=points, samples=tuple(estimated), rounds=5)
    fig = profile.plot(tmp_path / "profile.png")
    assert (tmp_path / "profile.png").stat().st_size > 0
    assert [ax.get_title() for ax in fig.axes] == list(BOUNDARIES)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure is closed once saved: a canvas to measure on
    fig.draw(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        assert not title.overlaps(ax.title.get_window_extent(renderer)), ax.get_title()
        assert title.y0 >= ax.get_tightbbox(renderer).y1 - 1, ax.get_title()
