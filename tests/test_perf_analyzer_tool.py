"""``benchmarks/perf_analyzer_tool.py``: perf_analyzer's output read into the figures that
``benchmarks/prediction.py --measure perf_analyzer`` scores, and (where perf_analyzer can be installed)
a pipeline's every form measured by it on the bundled server, as the bench measures them.

The text below is perf_analyzer 2.51's own, from a run against the diamond's bls form at concurrency 4.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import perf_analyzer_tool as pat  # noqa: E402

CSV = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
    "4,41.8551,222,2012,39507,29,52221,276,0,91967,110130,117558,157372\n"
)
STDOUT = """\
Request concurrency: 4
  Pass [1] throughput: 39.8204 infer/sec. Avg latency: 97887 usec (std 18656 usec).
  Pass [2] throughput: 43.304 infer/sec. Avg latency: 90544 usec (std 2711 usec).
  Pass [3] throughput: 42.4485 infer/sec. Avg latency: 94662 usec (std 10144 usec).
  Client:
    Request count: 151
    Throughput: 41.8551 infer/sec
    p50 latency: 91967 usec
"""


def test_the_csv_gives_p50_in_ms_and_infer_per_s():
    assert pat.parse_csv(CSV) == pytest.approx((91.967, 41.8551))


@pytest.mark.parametrize("text", ["", CSV.splitlines()[0] + "\n", "Concurrency,Throughput\n4,41.8\n"])
def test_a_csv_without_the_figures_is_refused_with_what_it_held(text):
    with pytest.raises(ValueError, match="perf_analyzer's CSV"):
        pat.parse_csv(text)


def test_each_windows_throughput_is_read_in_order_and_they_merge_to_the_reported_one():
    windows = pat.parse_windows(STDOUT)
    assert windows == (39.8204, 43.304, 42.4485)
    # perf_analyzer reports its last 3 windows merged: the band prediction.py shows is around that figure
    assert sum(windows) / len(windows) == pytest.approx(pat.parse_csv(CSV)[1], rel=1e-4)
    assert pat.parse_windows("Request concurrency: 4\n  Client: \n") == ()


def test_the_command_is_a_fixed_number_of_windows_at_one_level():
    command = pat.perf_analyzer_command("diamond_bls", "localhost:8000", 16, 2.0, 3, "d.json", "pa.csv")
    assert command[command.index("--concurrency-range") + 1] == "16:16"
    assert command[command.index("-p") + 1] == "2000"
    # -s 1000: no window is refused, so perf_analyzer stops at -r windows (its rule compares the last 3)
    assert command[command.index("-s") + 1] == "1000" and command[command.index("-r") + 1] == "3"
    assert command[command.index("-i") + 1] == "http"


def test_input_data_is_the_requests_without_their_batch_axis(tmp_path):
    samples = [{"x": np.arange(6, dtype=np.float32).reshape(1, 6) + i} for i in range(2)]
    data = json.loads(pat.input_data(samples, tmp_path / "d.json").read_text())["data"]
    assert [d["x"]["shape"] for d in data] == [[6], [6]]
    assert np.frombuffer(base64.b64decode(data[1]["x"]["b64"]), np.float32).tolist() == [1, 2, 3, 4, 5, 6]
    unbatched = json.loads(pat.input_data(samples, tmp_path / "u.json", batched=False).read_text())["data"]
    assert unbatched[0]["x"]["shape"] == [1, 6]


def test_a_run_measured_by_perf_analyzer_says_so_and_names_its_own_results():
    import prediction_tables as prediction

    summary = {"date": "2026-11-29", "machine": {"cpu": "AMD EPYC", "cpu_count": 2},
               "settings": {"pipelines": ["diamond"], "measure": "perf_analyzer",
                            "perf_analyzer": {"version": "tritonclient 2.51.0", "rule": "a fixed 3 windows"}},
               "load_average": {"began": [1.0], "ended": [2.0]},
               "checks": [{"pipeline": "diamond", "conc": "1", "figure": "bls p50 ms", "predicted": "10",
                           "range": "8…12", "measured": "13", "error": "-23%", "covered": "OUT"}]}
    text = prediction.latest_tables(summary)
    assert "measured by perf_analyzer (tritonclient 2.51.0, a fixed 3 windows)" in text
    assert "`benchmarks/results/prediction_perf_analyzer.json`" in text
    assert "| diamond | 0 of 1 | 20% | 20% |" in text
    assert "perf_analyzer" not in prediction.latest_tables({**summary, "settings": {"pipelines": ["diamond"]}})


@pytest.mark.server
def test_every_form_of_the_diamond_is_measured_by_perf_analyzer_in_fixed_windows(tmp_path):
    try:
        pa = pat.install_perf_analyzer()
    except pat.Unavailable as why:
        pytest.skip(f"perf_analyzer is not available here: {why}")
    got = pat.measure_forms("pipelines.examples.basic:diamond", pa, tmp_path, levels=(2,), window_s=0.3,
                            warmup_s=0.0, turns=2, progress=False)
    assert got["failed"] == {}
    assert sorted(got["figures"]) == sorted((f, 2) for f in ("ensemble", "bls", "bls-sync", "fused"))
    for p50_ms, throughput, windows in got["figures"].values():
        assert p50_ms > 0 and throughput > 0
        assert len(windows) == 2 * pat.WINDOWS  # two turns of three windows each, pooled
    assert len(got["commands"]) == 8 and all("--concurrency-range 2:2" in c for c in got["commands"])
