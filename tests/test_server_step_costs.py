"""Step costs taken from the server (pipelines/profiling/server_steps.py): a short run of the pipeline's own step
models on the bundled Triton server feeds a prediction; a model that fails to load there leaves the local step
profiles in place, named."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
import time

import numpy as np
import pytest
from test_predict import flat_profile
from toy_steps import V, add, inc

from pipelines import Pipeline, step
from pipelines.errors import ArgumentError
from pipelines.measured_prediction import predictor as measured_predictor
from pipelines.predict.spec import Load
from pipelines.profiling.server_steps import STEP_COSTS
from pipelines.triton.statistics import held_by_batch, parse_batch_statistics, process_cpu_ns

X = {"x": np.arange(2048, dtype=np.float32).reshape(1, -1)}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    flat_profile().save(path)
    return path


@step(inputs={"x": V}, outputs={"y": V})
def churn(x):
    """A millisecond or so of work, where inc and add take microseconds."""
    for _ in range(40):
        np.sort(x, axis=-1)
    return {"y": x * 2}


def here_warm(profile) -> float:
    """A local profile's first figure as the fused form reads it: warm where it was timed so."""
    return (profile.warm_wall_us or profile.wall_us)[0]


def toy(name: str = "toy3", last=add) -> Pipeline:
    """Two branches and a join: three step models, each batching up to 4 rows."""
    p = Pipeline(name, inputs={"x": V}, max_batch_size=4)
    a = p.add(inc, x=p.input("x"))
    b = p.add(churn, x=p.input("x"))
    p.output("z", p.add(last, a=a["y"], b=b["y"])["y"])
    return p


@step(inputs={"a": V, "b": V}, outputs={"y": V})
class LicensedAdd:
    """Adds here; on the server (in a Python backend stub) its initialize() fails, as a step whose licence or
    model file is only on the developer's machine would."""

    def initialize(self, config):
        if "triton_python_backend_utils" in sys.modules:
            raise RuntimeError("no licence for add on this server")

    def execute(self, a, b):
        return {"y": a + b}


@pytest.mark.server
def test_step_costs_come_from_the_servers_statistics_by_batch_size(profile_path, tmp_path):
    cache = tmp_path / "steps.json"
    predictor = measured_predictor(toy(), profile_path, inputs=X, cache=cache, step_costs="server")
    for node in ("inc", "churn", "add"):
        server, local = predictor.steps[node], predictor.local_steps[node]
        assert server.source == "server" and local.source == "measured"
        assert server.rows == local.rows == (1, 2, 4)
        assert all(us > 0 for us in server.wall_us) and all(us >= 0 for us in server.cpu_us)
        assert server.wall_us != local.wall_us
    # the step's own work, its stub's (its twin's) taken off: the churning step costs what it costs here, within
    # what a shared machine allows, and far more than the steps that add
    churned, here = predictor.steps["churn"], predictor.local_steps["churn"]
    assert 0.3 < churned.wall_us[0] / here.wall_us[0] < 5 and 0.3 < churned.cpu_us[0] / here.cpu_us[0] < 5
    assert churned.wall_us[0] > 5 * max(predictor.steps["inc"].wall_us[0], predictor.steps["add"].wall_us[0])
    notes = "\n".join(predictor.notes)
    assert "step costs from the bundled Triton server" in notes
    for node in ("inc", "churn", "add"):
        assert f"{node} (server statistics (model toy3__{node}, " in notes
    assert "requests of 1 and 4 rows)" in notes  # the first batch size and the largest, the rest along the local curve
    # the fused form: the fused model's own timings of its steps, where they ran in its process
    assert "the fused form's step costs from the fused model's own timings of its steps: inc (server statistics " \
        "(model toy3, " in notes
    in_fused = predictor.fused_steps["churn"]
    assert in_fused.source == "server" and in_fused.rows == (1, 2, 4)
    assert 0.3 < in_fused.wall_us[0] / here_warm(predictor.local_steps["churn"]) < 5
    ensemble = predictor.spec(predictor.default("ensemble"))
    fused = predictor.spec(predictor.default("fused"))
    assert ensemble.steps[0].wall_us.us == predictor.steps[ensemble.steps[0].name].wall_us
    assert fused.steps[0].wall_us.us == predictor.fused_steps[fused.steps[0].name].wall_us
    row = predictor.row(predictor.default("ensemble"), Load(concurrency=2, requests=100, warmup=10))
    assert row.throughput > 0 and row.p50_ms > 0
    # kept with the model and the requests it was timed by; a second prediction reads them (no server: the same
    # figures, where a second run would read the machine's noise)
    entries = json.loads(cache.read_text())["profiles"]
    kept = [e["extra"] for e in entries.values() if e.get("source") == "server" and not e["extra"].get("fused")]
    assert sorted(e["model"] for e in kept) == ["toy3__add", "toy3__churn", "toy3__inc"]
    assert all(e["cpu"] and e["twin"] and e["sizes"] == [1, 4] for e in kept)  # stubs' CPU read, twins taken off
    assert sum(1 for e in entries.values() if e.get("extra", {}).get("fused")) == 3
    again = measured_predictor(toy(), profile_path, inputs=X, cache=cache, step_costs="server")
    assert {n: p.wall_us for n, p in again.steps.items()} == {n: p.wall_us for n, p in predictor.steps.items()}
    assert again.fused_steps == predictor.fused_steps


@pytest.mark.server
def test_a_model_that_fails_to_load_leaves_the_local_profiles_named(profile_path):
    predictor = measured_predictor(toy("toy3licensed", LicensedAdd), profile_path, inputs=X, cache=False,
                          step_costs="server")
    assert all(p.source == "measured" for p in predictor.steps.values())
    assert predictor.fused_steps == predictor.local_steps
    fallback = [n for n in predictor.notes if "failed to load" in n]
    assert len(fallback) == 1
    assert "cannot serve model 'toy3licensed__LicensedAdd' of pipeline 'toy3licensed'" in fallback[0]
    assert "no licence for add on this server" in fallback[0]
    assert "the local step profiles are used instead" in fallback[0]
    assert not any(n.startswith("step costs from") for n in predictor.notes)  # that one line says it all


def test_without_a_server_asked_for_the_local_profiles_stay_and_bad_choices_are_refused(profile_path, tmp_path):
    cache = tmp_path / "steps.json"
    predictor = measured_predictor(toy(), profile_path, inputs=X, cache=cache)  # "auto" with no url: as before
    assert all(p.source == "measured" for p in predictor.steps.values())
    assert predictor.steps == predictor.local_steps == predictor.fused_steps
    assert not any("step costs" in n for n in predictor.notes)
    with pytest.raises(ArgumentError, match="step_costs is one of auto, server, local"):
        measured_predictor(toy(), profile_path, inputs=X, cache=cache, step_costs="remote")
    assert STEP_COSTS == ("auto", "server", "local")


def test_a_server_that_cannot_be_reached_leaves_the_local_profiles_named(profile_path):
    predictor = measured_predictor(toy(), profile_path, inputs=X, cache=False, url="127.0.0.1:9")
    assert all(p.source == "measured" for p in predictor.steps.values())
    assert any("the server at 127.0.0.1:9 cannot be reached" in n and "local step profiles are used instead" in n
               for n in predictor.notes)


def test_batch_statistics_give_each_batch_sizes_hold_between_two_answers():
    def answer(executions: int, ns: int) -> dict:
        return {"model_stats": [{"name": "m", "version": "1", "batch_stats": [
            {"batch_size": 4, "compute_input": {"count": executions, "ns": ns // 10},
             "compute_infer": {"count": executions, "ns": ns}, "compute_output": {"count": executions, "ns": 0}},
        ]}]}

    assert parse_batch_statistics(answer(2, 1000))["m", "1", 4].held_ns == 1100
    assert held_by_batch(answer(2, 1000), answer(5, 4000), "m") == {4: (3, (4400 - 1100) / 3 / 1e3)}
    assert held_by_batch(answer(2, 1000), answer(2, 1000), "m") == {}


def test_a_processes_cpu_time_counts_its_threads():
    before = process_cpu_ns(os.getpid())
    spun, done = threading.Event(), threading.Event()

    def spin():  # as a stub's thread pool: it lives on after its work
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait()

    thread = threading.Thread(target=spin)
    thread.start()
    spun.wait()
    try:
        assert process_cpu_ns(os.getpid()) - before >= 40_000_000
    finally:
        done.set()
        thread.join()
    assert process_cpu_ns(2 ** 22 + 12345) is None


def test_a_calibration_kept_for_the_server_is_reused_and_feeds_the_command(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main
    from pipelines.profiling.kept_calibration import calibration_key, kept_calibration

    version = "nvidia-pytriton " + importlib.metadata.version("nvidia-pytriton")
    kept = tmp_path / f"{calibration_key(None, 'http', version)}.json"
    flat_profile().save(kept)
    found = kept_calibration(store=tmp_path)  # the bundled server: known by its wheel, none started
    assert found.reused and found.path == kept
    assert "reused the calibration of" in found.describe()
    # another protocol or server is another calibration
    assert calibration_key(None, "grpc", version) != kept.stem != calibration_key("host:8000", "http", version)
    monkeypatch.setenv("PIPELINES_CALIBRATIONS", str(tmp_path))
    assert main(["predict", "pipelines.examples.basic:diamond", "--concurrency", "1", "--forms", "ensemble",
                 "--json"]) == 0
    out = capsys.readouterr()
    assert f"reused the calibration of {flat_profile().date}" in out.err and str(kept) in out.err
    assert json.loads(out.out)
    assert kept.with_suffix(".steps.json").exists()  # the steps' costs kept beside it, for every pipeline


@pytest.mark.server
@pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")  # this file's steps
def test_a_server_at_a_url_that_serves_the_step_models_times_them_there(profile_path, tmp_path):
    from pipelines.triton import TritonServer

    pipeline = toy("toy3url")
    pipeline.compile("ensemble").write(tmp_path / "repo")
    with TritonServer(tmp_path / "repo") as server:
        version = server.client().metadata()["version"]
        predictor = measured_predictor(pipeline, profile_path, inputs=X, cache=False, url=server.http_url)
    assert all(predictor.steps[n].source == "server" for n in ("inc", "churn", "add"))
    notes = "\n".join(predictor.notes)
    assert f"step costs from the Triton {version} server at {server.http_url} over http" in notes
    # no twins there, and its stubs are not this machine's to read: the profile's stub taken off, CPU as timed here
    assert "churn (server statistics (model toy3url__churn, " in notes and "CPU as timed here" in notes
    churned, here = predictor.steps["churn"], predictor.local_steps["churn"]
    assert churned.cpu_us[0] / churned.wall_us[0] == pytest.approx(here.cpu_us[0] / here.wall_us[0])
    assert predictor.fused_steps == predictor.local_steps  # its fused model is not asked to time its steps
    assert "the fused form keeps the local step profiles of inc, churn, add" in notes
