"""The verdict does not crown a winner whose margin is inside the instability of its windows."""

from __future__ import annotations

from pipelines.bench.latency import LatencySummary
from pipelines.bench.measurement import Configuration, Measurement
from pipelines.bench.verdict import verdict


def _measured(form: str, c: int, windows: tuple[float, ...], *, stable: bool) -> Measurement:
    throughput = sum(windows) / len(windows)
    summary = LatencySummary(10, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0)
    return Measurement(
        config=Configuration("server", form), concurrency=c, batch=1, throughput=throughput, latency=summary,
        requests=10, errors=0, error_messages={}, stable=stable, windows=len(windows), window_seconds=3.0,
        window_throughputs=windows, completed_by_sample=(10,), errors_by_sample=(0,),
    )


def test_a_margin_inside_unsettled_windows_is_no_clear_winner_and_says_how_to_get_one():
    ms = [_measured("fused", 1, (100.0, 140.0, 120.0), stable=False),
          _measured("ensemble", 1, (105.0, 108.0, 104.0), stable=True)]
    text = verdict(ms, pipeline="p")
    assert "no clear winner at concurrency 1" in text
    assert "fused leads ensemble by 14%, but their windows varied by up to 33%" in text
    assert "--turns 3" in text and "wins" not in text.split("did not stabilise")[0]


def test_a_margin_beyond_the_instability_still_names_the_winner():
    ms = [_measured("fused", 4, (200.0, 210.0, 190.0), stable=False),
          _measured("ensemble", 4, (100.0, 101.0, 99.0), stable=True)]
    assert "fused wins at concurrency 4 (2.00× ensemble in throughput)" in verdict(ms, pipeline="p")


def test_one_verdict_per_level_the_prediction_is_not_scored_where_the_server_has_no_clear_winner():
    # Issue 60: "no clear winner at concurrency 1 and 4", then "at concurrency 1 ... fused: right".
    ms = [_measured("fused", 1, (100.0, 140.0, 120.0), stable=False),
          _measured("ensemble", 1, (105.0, 108.0, 104.0), stable=True),
          _measured("fused", 4, (200.0, 210.0, 190.0), stable=True),
          _measured("ensemble", 4, (100.0, 101.0, 99.0), stable=True)]
    predictions = [{"form": "fused", "concurrency": c, "throughput": 150.0} for c in (1, 4)]
    predictions += [{"form": "ensemble", "concurrency": c, "throughput": 100.0} for c in (1, 4)]
    text = verdict(ms, pipeline="p", predictions=predictions)
    assert "no clear winner at concurrency 1 " in text
    assert "at concurrency 1 it named fused, where the server has no clear winner (not scored)" in text
    assert "at concurrency 1 it named fused, the server's winner" not in text
    assert "fused wins at concurrency 4" in text
    assert "at concurrency 4 it named fused, the server's winner fused: right" in text


def test_a_prediction_is_scored_against_the_tie_the_bench_states():
    ms = [_measured("fused", 2, (103.0, 103.0, 103.0), stable=True),
          _measured("ensemble", 2, (100.0, 100.0, 100.0), stable=True),
          _measured("bls", 2, (60.0, 60.0, 60.0), stable=True)]
    tie = [{"form": f, "concurrency": 2, "throughput": t} for f, t in (("ensemble", 90.0), ("fused", 80.0), ("bls", 70.0))]
    text = verdict(ms, pipeline="p", predictions=tie)
    assert "concurrency 2 is a tie between ensemble and fused" in text
    assert "at concurrency 2 it named ensemble, the server's winner ensemble/fused: right" in text
    wrong = [dict(r, throughput=200.0) if r["form"] == "bls" else r for r in tie]
    assert "it named bls, the server's winner ensemble/fused: WRONG" in verdict(ms, pipeline="p", predictions=wrong)
