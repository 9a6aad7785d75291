"""Every predicted figure with its range: what the calibration's intervals, the steps' spread and the machine's noise
allow. A winner is named only where its range clears the others', and a busy machine is said so and widens every
range. The steps' costs are given here, so every figure is the simulation's, exact on virtual time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, external_model, step
from pipelines.bench.results import machine_info
from pipelines.calibration.noise import (
    MAX_WIDENING,
    MachineNoise,
    measurement_spread,
    round_disagreement,
    share_spread,
)
from pipelines.calibration.profile import BOUNDARIES, Cost, Profile
from pipelines.cli import main
from pipelines.errors import ArgumentError, PipelinesError
from pipelines.examples.basic import make_diamond
from pipelines.measured_prediction import advise, predict
from pipelines.predict.prediction import Prediction, PredictionRow
from pipelines.predict.ranges import (
    MODEL_SPREAD,
    SIMULATION_SPREAD,
    Spread,
    Z,
    shift_spread,
    step_spread,
    ways,
)
from pipelines.profiling.noise_watch import NoiseWatch, _tree_ticks

#: The diamond's steps priced as given: nothing measured here, so nothing of this machine's load enters.
GIVEN = {"branch_0": 2000.0, "branch_1": 2000.0, "join_0": 100.0}


def profile(us: float = 40.0, *, ci: tuple[float, float] = (1.0, 1.0), noise: MachineNoise | None = None) -> Profile:
    """Every boundary ``us`` each way, its interval ``ci`` times that."""
    interval = ((us * ci[0], us * ci[1]),) * 2
    return Profile(
        costs={b: Cost(2 * us, 0.0, (1, 1 << 20), (us, us), (us, us), in_ci=interval, out_ci=interval,
                       total_ci=((2 * us * ci[0], 2 * us * ci[1]),) * 2) for b in BOUNDARIES},
        server_version="2.51.0", protocol="http", machine=machine_info(), date="2026-11-29", lanes=2.0, noise=noise)


QUIET = MachineNoise(other_load=0.0, steal=0.0, disagreement=0.0, cores=2.0, seconds=60.0)
BUSY = MachineNoise(other_load=1.0, steal=0.0, disagreement=0.04, cores=2.0, seconds=60.0)


def diamond_predicted(server: Profile, concurrency=(1, 4)) -> Prediction:
    return predict(make_diamond(ms=1.0), server, concurrency=concurrency, forms=("ensemble", "bls", "fused"),
                   costs=GIVEN, cache=False)


def expected(point: float, parts: dict[str, float]) -> tuple[float, float]:
    """A 90 % interval by hand: the sources in quadrature, Z of them either way in the log."""
    sigma = math.sqrt(sum(v * v for v in parts.values()))
    return point * math.exp(-1.6448536 * sigma), point * math.exp(1.6448536 * sigma)


def test_each_range_holds_its_figure_and_is_its_sources_in_quadrature():
    result = diamond_predicted(profile(ci=(0.5, 2.0), noise=QUIET))
    for r in result.rows:
        for figure, bounds in ((r.p50_ms, r.p50_ms_range), (r.p95_ms, r.p95_ms_range),
                               (r.throughput, r.throughput_range)):
            low, high = bounds
            assert low < figure < high, (r.form, r.concurrency)
        # the calibration's intervals move the figures, so they are a source of every range
        assert r.spreads["throughput"]["boundaries"] > 0
    # Intervals of no width, a quiet machine and costs given: what is left is the simulation's own error and the closed
    # loop's precision (the boundaries' source simulated on a shorter loop, which settles into the same schedule here).
    exact = diamond_predicted(profile(ci=(1.0, 1.0), noise=QUIET))
    for r in exact.rows:
        alone = MODEL_SPREAD["alone" if r.concurrency == 1 else "queued"]
        parts = {"model": alone, "simulation": SIMULATION_SPREAD}
        assert r.spreads["p50_us"] == pytest.approx({**parts, "boundaries": 0.0, "measurement": 0.0, "load": 0.0,
                                                     "steal": 0.0})
        assert r.p50_ms_range == pytest.approx(expected(r.p50_ms, parts))
        assert r.throughput_range[0] == pytest.approx(expected(r.throughput, parts)[0])
        # a p95 is a tail: priced as a queue's figure at every load
        assert r.p95_ms_range == pytest.approx(expected(r.p95_ms, {**parts, "model": MODEL_SPREAD["queued"]}))


def test_known_spreads_in_quadrature_give_the_known_width():
    three_four = Spread({"a": 0.03, "b": 0.04})
    assert three_four.total == pytest.approx(0.05)
    low, high = three_four.around(200.0)
    assert low < 200.0 < high
    assert (low, high) == pytest.approx((200.0 * math.exp(-Z * 0.05), 200.0 * math.exp(Z * 0.05)))
    assert Z == pytest.approx(1.6448536)  # a two-sided 90 % interval
    assert three_four.half_width() == pytest.approx((high - low) / 2 / 200.0)
    # no source: the figure itself
    assert Spread({}).around(3.0) == (3.0, 3.0)
    # the machine's sources: a window's disagreement as the standard error of three windows of 2 s pooled
    # (1.056 standard deviations of a 0.5 s window), a share of the cores uniform over +-that share
    assert measurement_spread(0.1056) == pytest.approx(0.1 * math.sqrt(0.5 / 6.0))
    assert share_spread(0.3) == pytest.approx(0.3 / math.sqrt(3))
    assert share_spread(2.0) == pytest.approx(MAX_WIDENING / math.sqrt(3))  # at most +-50 %
    assert measurement_spread(None) == share_spread(None) == 0.0
    # a step's rounds: half the range of three, 0.79 of it the standard error of their median
    assert step_spread(0.1) == pytest.approx(0.0791, abs=1e-4)
    assert shift_spread(100.0, 110.0) == pytest.approx(math.log(1.1))
    assert shift_spread(100.0, 90.0) == pytest.approx(-math.log(0.9))


def test_a_boundary_one_standard_error_up_is_its_interval_over_the_intervals_z():
    cost = profile(ci=(0.5, 2.0)).costs["request"]  # 40 us each way, its 95 % interval 20 to 80
    way_in, _ = ways(cost, 1.0, 0.95)
    assert way_in.us[0] == pytest.approx(40.0 + 40.0 / 1.959964)
    down, _ = ways(cost, -1.0, 0.95)
    assert down.us[0] == pytest.approx(40.0 - 20.0 / 1.959964)
    assert ways(cost)[0].us[0] == 40.0


def test_a_busy_noise_record_widens_every_range_and_every_table_says_so():
    quiet = diamond_predicted(profile(ci=(0.8, 1.25), noise=QUIET))
    busy = diamond_predicted(profile(ci=(0.8, 1.25), noise=BUSY))
    assert BUSY.busy and not QUIET.busy  # other processes took half the cores
    machine = {"measurement": measurement_spread(0.04), "load": share_spread(0.5), "steal": 0.0}
    for q, b in zip(quiet.rows, busy.rows, strict=True):
        assert (b.p50_ms, b.throughput) == (q.p50_ms, q.throughput)  # the figures are the same simulation's
        assert b.spreads["p50_us"] == pytest.approx({**q.spreads["p50_us"], **machine})
        assert b.p50_ms_range == pytest.approx(expected(b.p50_ms, b.spreads["p50_us"]))
        assert b.p50_ms_range[0] < q.p50_ms_range[0] and b.p50_ms_range[1] > q.p50_ms_range[1]
        assert b.throughput_range[0] == pytest.approx(expected(b.throughput, b.spreads["throughput"])[0])
        assert b.throughput_range[1] >= q.throughput_range[1]
    wide = BUSY.widening(machine)
    assert wide == pytest.approx(math.expm1(Z * math.hypot(*machine.values())))
    line = "the machine the profile was calibrated on was busy: load 1.0 from other processes (of 2 cores)"
    assert any(n.startswith(line) and f"ranges widened to -{wide / (1 + wide):.0%}…+{wide:.0%} of each figure" in n
               for n in busy.notes)
    assert line in str(busy) and line in busy._repr_html_()
    assert not any("busy" in n for n in quiet.notes)
    # and which source widens them: other processes' load, +61 % alone; nothing on the quiet machine
    assert "the ranges are widest from load (+61% alone: other processes' load)" in busy.notes
    assert not any(n.startswith("the ranges are widest") for n in quiet.notes)
    record = busy.noise_record()
    assert record["busy"] is True and quiet.noise_record()["busy"] is False
    assert record["spreads"] == pytest.approx(machine) and record["widening"] == pytest.approx(wide)


def test_the_throughput_range_never_passes_what_the_cores_can_do():
    # a busy noise record: the high end still stops at the cores over a request's least CPU time
    result = diamond_predicted(profile(ci=(1.0, 1.0), noise=BUSY), concurrency=(16,))
    ensemble = next(r for r in result.rows if r.form == "ensemble")
    assert ensemble.utilisation["cpu"] == pytest.approx(1.0)  # its two branches keep both cores busy at 16
    assert ensemble.throughput_range[0] == pytest.approx(expected(ensemble.throughput,
                                                                  ensemble.spreads["throughput"])[0])
    # two cores over the least a request costs: its steps' 4.1 ms and its request boundary's 40 us each way
    assert ensemble.throughput_range[1] == pytest.approx(2e6 / (2000 + 2000 + 100 + 2 * 40))
    assert ensemble.throughput_range[1] < expected(ensemble.throughput, ensemble.spreads["throughput"])[1]


def test_a_winner_is_not_named_where_ranges_made_of_its_sources_overlap():
    def ranged(form: str, point: float, sigma: float) -> PredictionRow:
        low, high = Spread({"model": sigma}).around(point)
        return PredictionRow(form, 4, None, 10.0, 12.0, 13.0, point, "cpu", {}, "", (9.0, 11.0), (11.0, 13.0),
                             (low, high))

    # 20 % apart: 5 % either way clears (a 90 % interval is +-8.6 %), 10 % does not (+-18 %)
    assert Prediction("p", (ranged("fused", 120.0, 0.05), ranged("ensemble", 100.0, 0.05))).winner(concurrency=4) \
        == "fused"
    tie = Prediction("p", (ranged("fused", 120.0, 0.10), ranged("ensemble", 100.0, 0.10)))
    assert tie.winner(concurrency=4) is None and tie.tied(concurrency=4) == ("fused", "ensemble")


def row(form: str, throughput: tuple[float, float, float], concurrency: int = 4) -> PredictionRow:
    low, point, high = throughput
    return PredictionRow(form, concurrency, None, 10.0, 12.0, 13.0, point, "cpu", {}, "", (9.0, 11.0),
                         (11.0, 13.0), (low, high))


def test_a_winner_is_named_only_where_its_range_clears_the_runner_ups():
    clear = Prediction("p", (row("fused", (110, 120, 130)), row("ensemble", (90, 100, 109)), row("bls", (40, 50, 60))))
    assert clear.winner(concurrency=4) == "fused" and clear.tied(concurrency=4) == ("fused",)
    assert clear.verdicts() == ["winner at concurrency 4: fused"]
    overlap = Prediction("p", (row("ensemble", (95, 100, 111)), row("fused", (110, 120, 130)),
                               row("bls", (40, 50, 60))))
    assert overlap.leader(concurrency=4) == "fused"  # the highest figure, but not a winner
    assert overlap.winner(concurrency=4) is None
    assert overlap.tied(concurrency=4) == ("fused", "ensemble")
    assert overlap.verdicts() == ["no clear winner at concurrency 4: fused, ensemble tie"]
    assert "no clear winner at concurrency 4: fused, ensemble tie" in str(overlap)
    assert overlap.level_records() == [{"concurrency": 4, "rate": None, "winner": None,
                                            "tied": ["fused", "ensemble"]}]


def test_predict_json_carries_the_ranges_and_each_loads_winner(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(ci=(0.9, 1.1), noise=QUIET).save(path)
    code = main(["predict", "pipelines.examples.basic:diamond", "--profile", str(path), "--concurrency", "1,4",
                 "--forms", "ensemble,bls", "--cost", "branch_0=2000", "--cost", "branch_1=2000",
                 "--cost", "join_0=100", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["form"], r["concurrency"]) for r in rows] == [("ensemble", 1), ("ensemble", 4), ("bls", 1), ("bls", 4)]
    for r in rows:
        for name, figure in (("p50_ms_range", "p50_ms"), ("p95_ms_range", "p95_ms"), ("throughput_range", "throughput")):
            low, high = r[name]
            assert low <= r[figure] <= high
    for level in (1, 4):  # one verdict per load, the same on each of its rows
        at = [r for r in rows if r["concurrency"] == level]
        assert len({(r["winner"], tuple(r["tied"])) for r in at}) == 1
        assert at[0]["winner"] in (None, "ensemble", "bls") and at[0]["tied"]
        assert (at[0]["winner"] is None) == (len(at[0]["tied"]) > 1)


def test_advise_under_a_bound_ranks_by_what_each_surely_reaches_and_says_when_its_top_picks_tie():
    advice = advise(make_diamond(ms=1.0), profile(ci=(0.8, 1.25), noise=BUSY), concurrency=4, p95_ms=500.0,
                    costs=GIVEN, cache=False, forms=("ensemble", "fused"), budget=40)
    shown = advice.top(5)
    assert all(c.row.throughput_range is not None for c in shown)
    # +-50 % of noise: the top picks overlap, and the advice says so
    assert len(advice.tied()) > 1
    assert "no clear pick: #1, #2" in advice.text()
    assert "was busy" in advice.text()


def test_a_profile_keeps_its_noise_record_and_an_older_one_reads_as_unknown(tmp_path):
    path = tmp_path / "p.json"
    profile(noise=BUSY).save(path)
    assert Profile.load(path).noise == BUSY
    data = json.loads(path.read_text())
    del data["noise"]
    path.write_text(json.dumps(data))
    older = Profile.load(path)
    assert older.noise is None
    result = diamond_predicted(older)
    assert any("no noise record" in n and "unknown" in n for n in result.notes)
    data["noise"] = {"other_load": -1.0}
    path.write_text(json.dumps(data))
    with pytest.raises(PipelinesError, match="noise record's other_load is a finite number >= 0"):
        Profile.load(path)


def test_the_calibrations_rounds_say_how_far_the_server_moved_from_window_to_window():
    rows = [("ensemble", 1, 1024, k, lat) for k, lat in enumerate((100.0, 110.0, 90.0))]
    rows += [("bls", 1, 1024, k, lat) for k, lat in enumerate((200.0, 200.0, 240.0))]
    # half the range over the median: 10 % and 10 %
    assert round_disagreement(rows) == pytest.approx(0.1)
    assert round_disagreement(rows[:1]) is None


def test_the_watch_counts_no_load_of_its_own_process():
    watch = NoiseWatch()
    total = sum(float(i) for i in range(3_000_000))  # this process's own work, on one core
    noise = watch.stop()
    assert total > 0 and noise.seconds > 0
    if noise.other_load is not None:  # Linux: what other processes used, never this one's work
        assert noise.other_load < noise.cores


# ---------------------------------------------------------------------- a `when` share counted through steps

ROW = TensorSpec("FP32", [4])
FLAG = TensorSpec("BOOL", [1])


@step(inputs={"x": ROW}, outputs={"score": ROW})
def scored(x):
    return {"score": x * 2}


@step(inputs={"score": ROW}, outputs={"confident": FLAG})
def decide(score):
    return {"confident": score[:, :1] > 1.0}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def refine(x):
    return {"y": x + 1}


def refined(first=scored) -> Pipeline:
    p = Pipeline("refined", inputs={"x": ROW}, max_batch_size=8)
    s = p.add(first, name="score", x=p.input("x"))
    d = p.add(decide, score=s["score"])
    with p.when(~d["confident"]):
        r = p.add(refine, x=p.input("x"))
    p.output("y", r["y"], otherwise=0.0)
    return p


def test_a_when_share_computed_by_other_steps_is_counted_by_running_them_on_the_samples():
    x = np.zeros((8, 4), np.float32)
    x[:6, 0] = 1.0  # score 2 > 1 on 6 rows of 8: confident; the refiner runs on the other 2
    result = refined().predict(profile(noise=QUIET), concurrency=(1,), forms=("bls",), inputs={"x": x},
                               costs={"score": 100.0, "decide": 100.0, "refine": 5000.0}, cache=False)
    assert any("decide.confident is true on 75% of the rows of the request given (8 rows, through score, decide)"
               in n for n in result.notes)
    always = refined().predict(profile(noise=QUIET), concurrency=(1,), forms=("bls",), inputs={"x": x},
                               costs={"score": 100.0, "decide": 100.0, "refine": 5000.0}, cache=False,
                               when_rates={"decide.confident": 0.0})
    # the refiner runs on a quarter of the rows, so some requests skip it: more of them answered than where it always runs
    assert result.rows[0].throughput > 1.05 * always.rows[0].throughput


def test_a_when_share_that_cannot_be_counted_here_is_refused_naming_the_flag_to_give():
    opaque = external_model("score", inputs={"x": ROW}, outputs={"score": ROW}, backend="onnxruntime")
    with pytest.raises(ArgumentError, match=r"decide\.confident holds cannot be counted .* step 'score' is an external "
                                            r"model with no Python stand-in\. Give it: --when-rate decide\.confident"
                                            r"=SHARE"):
        refined(opaque).predict(profile(noise=QUIET), concurrency=(1,), forms=("bls",),
                                costs={"score": 100.0, "decide": 100.0, "refine": 5000.0}, cache=False)
    given = refined(opaque).predict(profile(noise=QUIET), concurrency=(1,), forms=("bls",),
                                    costs={"score": 100.0, "decide": 100.0, "refine": 5000.0}, cache=False,
                                    when_rates={"decide.confident": 0.5})
    assert given.rows


def test_a_noise_record_is_busy_by_its_thresholds_and_widens_by_what_it_saw_in_quadrature():
    assert not MachineNoise(other_load=0.4, steal=0.01, disagreement=0.05, cores=2.0).busy
    assert MachineNoise(other_load=0.5, cores=2.0).busy  # a quarter of the cores
    assert MachineNoise(steal=0.06).busy and MachineNoise(disagreement=0.1).busy
    seen = MachineNoise(other_load=0.2, disagreement=0.18, cores=2.0)
    assert seen.spreads() == pytest.approx({"measurement": measurement_spread(0.18), "load": share_spread(0.1),
                                            "steal": 0.0})
    assert seen.widening() == pytest.approx(math.expm1(Z * math.hypot(measurement_spread(0.18), share_spread(0.1))))
    # other processes on three of four cores count as half the machine, no more
    assert MachineNoise(other_load=3.1, cores=4.0).widening() == pytest.approx(
        math.expm1(Z * MAX_WIDENING / math.sqrt(3)))
    assert MachineNoise().widening() == 0.0 and not MachineNoise().known and MachineNoise().line() == ""
    wide = MachineNoise(other_load=3.1, disagreement=0.18, cores=4.0).widening()
    assert MachineNoise(other_load=3.1, disagreement=0.18, cores=4.0).line() == (
        "the machine was busy: load 3.1 from other processes (of 4 cores), repeated measurements disagreed by 18%; "
        f"ranges widened to -{wide / (1 + wide):.0%}…+{wide:.0%} of each figure to match")
    worst = MachineNoise(other_load=0.2, disagreement=0.3, cores=2.0).combined(MachineNoise(other_load=1.0, cores=2.0))
    assert (worst.other_load, worst.disagreement) == (1.0, 0.3)


def test_the_watch_counts_a_child_process_as_its_own_not_as_another_s():
    before = _tree_ticks()
    if before is None:
        pytest.skip("no /proc here")
    # a child that works 0.3 s of CPU, as the bundled server's stubs do for the calibration
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(5)"])
    try:
        deadline = time.monotonic() + 20
        while _tree_ticks() - before < 25 and time.monotonic() < deadline:  # 10 ms ticks: 0.25 s of it at least
            time.sleep(0.05)
        assert _tree_ticks() - before >= 25
    finally:
        child.kill()
        child.wait()
