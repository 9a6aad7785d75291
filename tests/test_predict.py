"""``p.predict``, ``p.advise`` and their command lines: the simulation put to a pipeline.

The simulator itself is tested exactly on virtual time (tests/test_simulator.py); here the
whole path runs: the step profiles are measured for real, the configurations compile, and
one ``advise --verify`` measures on the bundled Triton server.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipelines import DynamicBatching, Pipeline, TensorSpec, external_model, step
from pipelines.bench.results import machine_info
from pipelines.calibration.profile import BOUNDARIES, Cost, Profile
from pipelines.cli import main
from pipelines.errors import PipelinesError
from pipelines.examples import capacity
from pipelines.examples.basic import make_diamond
from pipelines.measured_prediction import advise, predict
from pipelines.predict import Configuration, ModelChoice, configured, default_configuration
from pipelines.predict.advise import TIE


def flat_profile(us: float = 40.0, *, lanes: float = 2.0) -> Profile:
    """A server whose every boundary costs ``us`` each way, whatever the bytes."""
    return Profile(
        costs={b: Cost(2 * us, 0.0, (1, 1 << 20), (us, us), (us, us)) for b in BOUNDARIES},
        server_version="2.51.0", protocol="http", machine=machine_info(), date="2026-11-26", lanes=lanes,
    )


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    flat_profile().save(path)
    return path


def test_predict_gives_a_row_per_form_and_load_and_names_the_winner(profile_path):
    diamond = make_diamond(ms=20.0)
    result = diamond.predict(profile_path, concurrency=(1, 4))
    assert {(r.form, r.concurrency) for r in result.rows} == {
        (f, c) for f in ("ensemble", "bls", "bls-sync", "fused") for c in (1, 4)
    }
    by = {(r.form, r.concurrency): r for r in result.rows}
    # The two 20 ms branches overlap in the ensemble and one after another in the sync BLS form.
    assert by["bls-sync", 1].p50_ms > 1.6 * by["ensemble", 1].p50_ms
    assert 20.0 < by["ensemble", 1].p50_ms < 30.0
    for row in result.rows:
        assert row.p50_ms <= row.p95_ms <= row.p99_ms
        assert row.throughput > 0 and row.bottleneck
    text = str(result)
    assert result.leader(concurrency=1) != "bls-sync"
    assert len(result.verdicts()) == 2 and all(v in text for v in result.verdicts())
    assert "bls-sync" in text and "p95 ms" in text
    assert "<table>" in result._repr_html_()
    keys = set(result.as_dicts()[0])
    assert {"form", "concurrency", "p50_ms", "p95_ms", "p99_ms", "throughput", "bottleneck"} <= keys


def test_the_same_prediction_twice_gives_the_same_figures(profile_path, tmp_path):
    diamond = make_diamond(ms=5.0)
    # The step profiles are cached beside the profile: the second prediction reads them.
    first = predict(diamond, profile_path, concurrency=(4,), forms=["ensemble"])
    second = predict(diamond, profile_path, concurrency=(4,), forms=["ensemble"])
    # The figures are the simulation's; their ranges also widen with how busy this machine is as it predicts.
    unranged = {"p50_ms_range": None, "p95_ms_range": None, "throughput_range": None, "spreads": None}
    assert [replace(r, **unranged) for r in first.rows] == [replace(r, **unranged) for r in second.rows]


def test_a_rate_is_an_open_loop_load(profile_path):
    result = capacity.twin.predict(profile_path, concurrency=None, forms=["ensemble"], rate=50.0)
    (row,) = result.rows
    assert row.concurrency is None and row.rate == 50.0
    # Below the server's capacity, an open loop's throughput is its rate.
    assert row.throughput == pytest.approx(50.0, rel=0.1)


def test_a_bad_load_is_refused_with_what_was_expected(profile_path):
    with pytest.raises(PipelinesError, match="concurrency is an int >= 1"):
        make_diamond().predict(profile_path, concurrency=(0,))
    with pytest.raises(PipelinesError, match="at least one concurrency or rate"):
        make_diamond().predict(profile_path, concurrency=())


def test_a_profile_with_a_nan_cost_is_refused_naming_the_field(tmp_path):
    data = flat_profile().to_dict()
    data["costs"]["bls_call"]["in_us"] = [data["costs"]["bls_call"]["in_us"][0], float("nan")]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PipelinesError, match="bls_call"):
        make_diamond().predict(path, concurrency=(1,))


def test_a_profile_from_another_machine_is_refused_unless_allowed(tmp_path):
    other = flat_profile()
    data = other.to_dict()
    data["machine"] = {**data["machine"], "cpu": "a CPU of another machine", "cpu_count": 512}
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PipelinesError, match="cpu_count"):
        make_diamond(ms=1.0).predict(path, concurrency=(1,), forms=["ensemble"])
    with pytest.warns(UserWarning, match="cpu_count"):
        result = make_diamond(ms=1.0).predict(path, concurrency=(1,), forms=["ensemble"], allow_mismatch=True)
    assert result.rows


def test_configured_sets_each_models_options_and_still_compiles():
    p = capacity.fixed
    base = default_configuration(p, "bls")
    slow = next(name for name in base.models if name.endswith("__Slow"))
    assert base.models[slow] == ModelChoice(instance_count=1, max_batch_size=8)
    choice = ModelChoice(instance_count=3, max_batch_size=8, dynamic_batching=True, max_queue_delay_us=500)
    config = Configuration("bls", {**base.models, slow: choice}, top_instances=2)
    copy = configured(p, config)
    assert copy.nodes["slow"].step.options.instance_count == 3
    assert copy.nodes["slow"].step.options.dynamic_batching == DynamicBatching((), 500)
    assert copy.nodes["prepare"].step.options == p.nodes["prepare"].step.options
    repo = copy.compile("bls", **config.compile_options())
    text = repo.models["fixed__Slow"].config_text
    assert "count: 3" in text and "max_queue_delay_microseconds: 500" in text
    assert "count: 2" in repo.models["fixed"].config_text
    np.testing.assert_allclose(copy.run(capacity.sample_inputs()[0], mode="bls")["y"],
                               p.run(capacity.sample_inputs()[0], mode="bls")["y"])
    assert config.changes(base) == [
        "Slow: .with_options(instance_count=3, max_batch_size=8, "
        "dynamic_batching=DynamicBatching(max_queue_delay_us=500))",
        'p.compile("bls", bls_instance_count=2)',
    ]


def test_nodes_that_share_a_step_still_share_one_model_once_configured():
    vec = TensorSpec("FP32", [4])

    @step(inputs={"x": vec}, outputs={"y": vec}, share_model=True)
    def twice(x):
        return {"y": x * 2}

    p = Pipeline("shared", inputs={"x": vec}, max_batch_size=4)
    a = p.add(twice, name="first", x=p.input("x"))
    p.output("y", p.add(twice, name="second", x=a["y"])["y"])
    base = default_configuration(p, "ensemble")
    assert list(base.models) == ["shared__twice"]
    config = Configuration("ensemble", {"shared__twice": ModelChoice(instance_count=2, max_batch_size=4)})
    copy = configured(p, config)
    assert copy.nodes["first"].step is copy.nodes["second"].step
    assert [m for m in copy.compile("ensemble").models if m.endswith("twice")] == ["shared__twice"]


def test_nodes_of_one_step_keep_a_model_each_and_their_own_options_once_configured():
    vec = TensorSpec("FP32", [4])

    @step(inputs={"x": vec}, outputs={"y": vec})
    def twice(x):
        return {"y": x * 2}

    p = Pipeline("pernode", inputs={"x": vec}, max_batch_size=4)
    a = p.add(twice, name="first", x=p.input("x"))
    p.output("y", p.add(twice, name="second", x=a["y"])["y"])
    base = default_configuration(p, "ensemble")
    assert list(base.models) == ["pernode__twice", "pernode__second"]
    config = Configuration("ensemble", {"pernode__twice": ModelChoice(instance_count=2, max_batch_size=4),
                                        "pernode__second": ModelChoice(instance_count=3, max_batch_size=4)})
    copy = configured(p, config)
    repo = copy.compile("ensemble")
    assert sorted(m for m in repo.models if m.startswith("pernode__")) == ["pernode__second", "pernode__twice"]
    assert [repo[m].config.instance_group[0].count for m in ("pernode__twice", "pernode__second")] == [2, 3]
    assert default_configuration(copy, "ensemble") == config


def test_advise_finds_batching_or_instances_for_a_step_that_costs_the_same_per_call(profile_path):
    advice = advise(capacity.fixed, profile_path, concurrency=8, forms=["ensemble", "bls"], budget=120)
    best = advice.best
    default = advice.defaults[best.configuration.form]
    assert best.row.throughput >= 3 * default.row.throughput
    slow = best.configuration.models["fixed__Slow"]
    assert slow.dynamic_batching or slow.instance_count > 1
    assert 0 < advice.simulated <= 120
    assert "with_options" in "\n".join(advice.settings(1))
    # Ranked by p95 without a bound: its ties first (below), fewest changes first; the rest in
    # order of p95.
    ties = ties_of(advice.ranked)
    assert advice.ranked[: len(ties)] == tuple(ties)
    p95s = [c.row.p95_ms for c in advice.ranked[len(ties):]]
    assert p95s == sorted(p95s)
    changes = [changed_options(c, advice.defaults) for c in ties]
    assert changes == sorted(changes)


def ties_of(ranked, bound: bool = False) -> list:
    """What the simulation cannot tell apart from the best: those that meet the bound (without
    one: a p95 within TIE of the lowest) and have a throughput within TIE of the highest of them
    (under a bound: its range's lower edge, what it surely reaches)."""
    lowest = min(c.row.p95_ms for c in ranked)
    near = [c for c in ranked if c.meets_bound and (bound or c.row.p95_ms <= lowest * (1 + TIE))]
    if bound:  # ranked by their ranges' lower edges: those simulated with ranges (the leaders)
        near = [c for c in near if c.row.throughput_range is not None]

    def reach(c):
        return c.row.throughput_range[0] if bound and c.row.throughput_range else c.row.throughput

    most = max(reach(c) for c in near)
    return [c for c in ranked if c in near and reach(c) >= most * (1 - TIE)]


def changed_options(candidate, defaults) -> int:
    default = defaults[candidate.configuration.form].configuration
    models = candidate.configuration.models
    return (sum(1 for name, choice in models.items() if default.models[name] != choice)
            + (candidate.configuration.top_instances != default.top_instances))


def test_advise_proposes_the_simplest_of_the_configurations_it_cannot_tell_apart(profile_path):
    # On capacity:fixed many configurations batch the slow step and differ only in steps that
    # are not the bottleneck: the pick changes no option that it does not need.
    advice = advise(capacity.fixed, profile_path, concurrency=8, forms=["ensemble"], budget=120)
    best, ties = advice.best, ties_of(advice.ranked)
    assert best in ties and len(ties) > 1
    assert changed_options(best, advice.defaults) == min(changed_options(c, advice.defaults) for c in ties)
    assert changed_options(best, advice.defaults) < max(changed_options(c, advice.defaults) for c in ties)


def test_advise_under_a_p95_bound_ranks_by_throughput_among_those_that_meet_it(profile_path):
    advice = advise(capacity.fixed, profile_path, concurrency=8, forms=["ensemble"], p95_ms=200.0, budget=60)
    meeting = [c for c in advice.ranked if c.meets_bound]
    assert meeting and all(c.row.p95_ms <= 200.0 for c in meeting)
    assert advice.ranked[: len(meeting)] == tuple(meeting)
    ties = ties_of(advice.ranked, bound=True)
    assert meeting[: len(ties)] == ties  # the ties first, fewest changes first; the rest by what each surely reaches
    # the rest by what each surely reaches: those simulated with ranges (the leaders) by their lower edges, then
    # those only screened, by their figures
    ranged = [c for c in meeting if c.row.throughput_range is not None]
    assert meeting[: len(ranged)] == ranged
    edges = [c.row.throughput_range[0] for c in ranged[len(ties):]]
    screened = [c.row.throughput for c in meeting[len(ranged):]]
    assert edges == sorted(edges, reverse=True) and screened == sorted(screened, reverse=True)


def test_advise_screens_on_a_shorter_loop_and_shows_the_leaders_on_the_full_one(profile_path):

    from pipelines.measured_prediction import predictor as measured_predictor
    from pipelines.predict.advise import CONFIRM, SCREEN, search
    from pipelines.predict.prediction import CLOSED_LOOP
    from pipelines.predict.spec import Load

    predictor = measured_predictor(capacity.fixed, profile_path)
    load = Load(concurrency=8, **CLOSED_LOOP)
    screen = replace(load, **SCREEN)
    simulate, loops = predictor.row, []

    def on(c, loop):
        return simulate(c.configuration, loop, c.configuration.label(), ranges=loop == load)

    def counted(configuration, loop, label=None, *, ranges=True):
        loops.append(loop)
        return simulate(configuration, loop, label, ranges=ranges)

    predictor.row = counted
    advice = search(predictor, load, forms=["ensemble", "fused"], budget=40)
    assert advice.simulated > CONFIRM and advice.load == load
    # every configuration screened once; the full loop run again for the leaders and the defaults (all of
    # them where, confirmed one by one, the leaders keep changing places with those behind them)
    assert loops.count(screen) == advice.simulated
    assert CONFIRM <= loops.count(load) <= advice.simulated and len(loops) == loops.count(screen) + loops.count(load)
    for c in (*advice.ranked[:CONFIRM], *advice.defaults.values()):
        assert c.row == on(c, load), c.configuration.label()
    # a leader that fell behind once confirmed keeps its full figures; the rest, their screen's
    for c in advice.ranked[CONFIRM:]:
        assert c.row in (on(c, screen), on(c, load)), c.configuration.label()


def test_advise_never_proposes_batching_a_step_that_cannot_batch(profile_path):
    p = make_diamond(ms=5.0, max_batch_size=0, name="flat")
    advice = advise(p, profile_path, concurrency=4, budget=80)
    for candidate in advice.ranked:
        for choice in candidate.configuration.models.values():
            assert not choice.dynamic_batching
            assert choice.max_batch_size == 0


def test_predict_command_prints_json_rows(profile_path, capsys):
    code = main(["predict", "pipelines.examples.basic:diamond", "--profile", str(profile_path),
                 "--concurrency", "1,4", "--forms", "ensemble,bls", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["form"], r["concurrency"]) for r in rows] == [("ensemble", 1), ("ensemble", 4), ("bls", 1), ("bls", 4)]
    assert all(math.isfinite(r["p95_ms"]) for r in rows)


def test_predict_command_explains_a_bad_profile(tmp_path, capsys):
    path = tmp_path / "nope.json"
    path.write_text("[1, 2]")
    assert main(["predict", "pipelines.examples.basic:diamond", "--profile", str(path)]) == 2
    assert "not a profile" in capsys.readouterr().err


def test_advise_command_writes_the_winner(profile_path, tmp_path, capsys):
    out = tmp_path / "repo"
    (out / "other_model" / "1").mkdir(parents=True)
    (out / "other_model" / "config.pbtxt").write_text('name: "other_model"\nbackend: "python"\n')
    code = main(["advise", "pipelines.examples.capacity:fixed", "--profile", str(profile_path), "--concurrency", "8",
                 "--forms", "ensemble", "--top", "2", "--budget", "40", "--write", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "#1" in printed and "set:" in printed
    assert (out / "fixed" / "config.pbtxt").exists() and (out / "fixed__Slow" / "config.pbtxt").exists()
    assert (out / "other_model" / "config.pbtxt").read_text().startswith('name: "other_model"')


@pytest.mark.server
def test_advise_verify_measures_the_top_picks_on_the_bundled_server(profile_path, capsys):
    code = main(["advise", "pipelines.examples.capacity:twin", "--profile", str(profile_path), "--concurrency", "4",
                 "--forms", "ensemble", "--budget", "20", "--verify", "--duration", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    table = printed.split("predicted against measured", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith(("#", "default"))]
    assert len(rows) == 4  # the top 3 and the default
    for line in rows:
        measured = float(line.split()[-5])
        assert measured > 0


def test_an_external_model_with_no_stand_in_is_predicted_from_the_cost_given(profile_path):
    vec = TensorSpec("FP32", [16])
    onnx = external_model("scorer", inputs={"x": vec}, outputs={"score": vec}, backend="onnxruntime")

    @step(inputs={"score": vec}, outputs={"y": vec})
    def squash(score):
        return {"y": np.tanh(score)}

    p = Pipeline("scored", inputs={"x": vec}, max_batch_size=4)
    s = p.add(onnx, x=p.input("x"))
    p.output("y", p.add(squash, score=s["score"])["y"])
    with pytest.raises(PipelinesError, match="scorer"):
        p.predict(profile_path, concurrency=(1,), forms=["ensemble"], cache=False)
    result = p.predict(profile_path, concurrency=(1,), forms=["ensemble", "fused"], costs={"scorer": 5000.0},
                       cache=False)
    by = {r.form: r for r in result.rows}
    assert by["ensemble"].p50_ms > 5.0 and by["fused"].p50_ms > 5.0  # the model's 5 ms, through BLS in fused


def test_tensors_between_gpu_steps_are_not_priced_per_byte(profile_path):
    """On the server a GPU step's outputs stay in device memory and cross a stub or a BLS call as
    a CUDA IPC handle; the request's host tensor, and a GPU output that a CPU step takes, are copied."""
    big = TensorSpec("FP32", [1024])

    @step(inputs={"x": big}, outputs={"y": big}, device="gpu")
    def on_gpu(x):
        return {"y": x * 2}

    @step(inputs={"y": big}, outputs={"z": big})
    def on_cpu(y):
        return {"z": y + 1}

    p = Pipeline("gpu_then_cpu", inputs={"x": big}, max_batch_size=4)
    first = p.add(on_gpu, name="first", x=p.input("x"))["y"]
    second = p.add(on_gpu, name="second", x=first)["y"]
    p.output("z", p.add(on_cpu, name="last", y=second)["z"])
    from pipelines.measured_prediction import predictor as measured_predictor

    predictor = measured_predictor(p, profile_path, inputs={"x": np.ones((2, 1024), np.float32)},
                          costs={"first": 100.0, "second": 100.0}, cache=False)
    by = {s.name: s for s in predictor.spec(predictor.default("ensemble")).steps}
    row = 1024 * 4
    assert (by["first"].in_bytes, by["first"].out_bytes) == (row, 0)  # from the request's host tensor
    assert (by["second"].in_bytes, by["second"].out_bytes) == (0, 0)  # GPU to GPU
    assert (by["last"].in_bytes, by["last"].out_bytes) == (row, row)  # copied to the host for a CPU step


def test_the_fused_form_times_a_step_on_what_the_step_before_it_just_wrote(profile_path):
    """A stub reads what another process wrote: its large inputs are timed out of the caches. In
    the fused model a step reads what the step before it just wrote, so it takes its warm timing."""
    row = TensorSpec("FP32", [-1])

    @step(inputs={"x": row}, outputs={"y": row})
    def grow(x):
        return {"y": np.tile(x, (1, 1 << 14))}  # 16 floats -> 1 MiB

    @step(inputs={"y": row}, outputs={"z": row})
    def halve(y):
        return {"z": y * np.float32(0.5)}

    p = Pipeline("warmth", inputs={"x": row}, max_batch_size=1)
    p.output("z", p.add(halve, y=p.add(grow, x=p.input("x"))["y"])["z"])
    from pipelines.measured_prediction import predictor as measured_predictor

    predictor = measured_predictor(p, profile_path, inputs={"x": np.ones((1, 16), np.float32)}, cache=False)
    grown, halved = predictor.steps["grow"], predictor.steps["halve"]
    assert grown.warm_wall_us == () and len(halved.warm_wall_us) == len(halved.rows)  # 64 B in; 1 MiB in
    for form in ("fused", "ensemble"):
        by = {s.name: s for s in predictor.spec(predictor.default(form)).steps}
        assert by["grow"].wall_us.us == grown.wall_us  # the request's input: as a stub reads it
        assert by["halve"].wall_us.us == (halved.warm_wall_us if form == "fused" else halved.wall_us)
