"""Measuring apart from predicting (issue 62): ``measure_pipeline`` (profiling/) measures a pipeline into one
``PipelineCosts``, written as JSON; the simulation (predict/) reads it back and measures nothing, and gives the
prediction that ``p.predict`` gives, which measures first. The steps' costs are given, so the figures are the
simulation's, exact on virtual time."""

from __future__ import annotations

import json

import pytest

from pipelines.calibration.profile import BOUNDARIES, Cost, Profile
from pipelines.commands.machine import machine_info
from pipelines.errors import ArgumentError
from pipelines.examples.basic import make_diamond
from pipelines.predict import (
    PipelineCosts,
    Predictor,
    advice_load,
    checked_profile,
    loads,
    predicted_forms,
    search,
)
from pipelines.profiling.pipeline_costs import measure_pipeline

GIVEN = {"branch_0": 2000.0, "branch_1": 2000.0, "join_0": 100.0}


def flat_profile(us: float = 40.0) -> Profile:
    return Profile(costs={b: Cost(2 * us, 0.0, (1, 1 << 20), (us, us), (us, us)) for b in BOUNDARIES},
                   server_version="2.51.0", protocol="http", machine=machine_info(), date="2026-11-29", lanes=2.0)


def test_costs_measured_once_and_read_back_from_json_predict_what_the_pipeline_predicts():
    diamond, server = make_diamond(ms=1.0), flat_profile()
    measured = measure_pipeline(diamond, None, server, costs=GIVEN)
    assert set(measured.steps) == set(GIVEN) and all(p.source == "given" for p in measured.steps.values())
    assert measured.noise.other_load is None  # nothing measured here: this machine's load tells nothing
    read = PipelineCosts.from_json(json.dumps(measured.to_json()))
    assert read == measured

    wanted = loads((1, 4), None)
    simulated = predicted_forms(Predictor(diamond, server, read), wanted, ("ensemble", "fused"))
    direct = diamond.predict(server, concurrency=(1, 4), forms=("ensemble", "fused"), costs=GIVEN, cache=False)
    assert simulated.rows == direct.rows and simulated.notes == direct.notes
    advice = search(Predictor(diamond, server, read), advice_load(concurrency=4), forms=("ensemble",), budget=20)
    assert advice.simulated <= 20 and advice.best.configuration.form == "ensemble"


def test_the_checks_that_need_no_measuring_come_first():
    with pytest.raises(ArgumentError, match="predict needs a Pipeline; got int"):
        checked_profile(3, flat_profile())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="a concurrency or a rate, not both"):
        advice_load(concurrency=4, rate=10.0)
    server, notes = checked_profile(make_diamond(), flat_profile())
    assert server.date == "2026-11-29" and notes == []


def test_malformed_costs_are_refused_naming_what_is_wrong():
    measured = measure_pipeline(make_diamond(), None, flat_profile(), costs=GIVEN)
    data = measured.to_json()
    with pytest.raises(ArgumentError, match="no 'fused_steps'; measure the pipeline again"):
        PipelineCosts.from_json({k: v for k, v in data.items() if k != "fused_steps"})
    with pytest.raises(ArgumentError, match="each live step needs both"):
        PipelineCosts.from_json({**data, "fused_steps": {}})
    with pytest.raises(ArgumentError, match="rows are an int >= 1; got 0"):
        PipelineCosts.from_json({**data, "rows": 0})
    with pytest.raises(ArgumentError, match="malformed"):
        PipelineCosts.from_json({**data, "noise": {"loud": 1.0}})
    with pytest.raises(ArgumentError, match="a JSON object; got list"):
        PipelineCosts.from_json("[]")
