"""A busy machine is noticed, not believed: calibrate with two CPU hogs running, then predict.

Runs ``pipelines calibrate --quick`` while two busy-loop processes hold the cores, checks that it
says the machine was busy, then predicts diamond, yolov5, twin and batched on that profile (step
costs from the bundled server, hogs stopped) and holds every named winner against the winners
that the latest quiet run of ``benchmarks/prediction.py`` measured
(``benchmarks/results/prediction.json``). The target (issue 59): the warning appears, and no
winner is named that the quiet run's measurement contradicts. Exits 1 when either fails.

    .venv/bin/python benchmarks/busy_calibration.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from pipelines.commands.loading import load_pipeline_and_module
from pipelines.commands.machine import machine_info
from pipelines.measured_prediction import predict
from pipelines.profiling.pipeline_costs import sample_inputs

HERE = Path(__file__).resolve().parent
QUIET = HERE / "results" / "prediction.json"
RESULTS = HERE / "results" / "busy_calibration.json"
PIPELINES = {"diamond": "pipelines.examples.basic:diamond", "yolov5": "pipelines.examples.yolov5:pipeline",
             "twin": "pipelines.examples.capacity:twin", "batched": "pipelines.examples.capacity:batched"}
HOGS = 2


def _hog() -> None:
    while True:
        pass


def main() -> int:
    quiet = json.loads(QUIET.read_text(encoding="utf-8"))
    measured = {(w[0], int(w[1])): w[3].split("/") for w in quiet["winners"]}
    with tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "profile.json"
        hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(HOGS)]
        for hog in hogs:
            hog.start()
        try:
            done = subprocess.run([sys.executable, "-m", "pipelines", "calibrate", "--quick", "--out", str(profile)],
                                  capture_output=True, text=True, check=False)
        finally:
            for hog in hogs:
                hog.terminate()
        said = [line for line in (done.stdout + done.stderr).splitlines() if "was busy" in line]
        print(*said or ["no busy warning"], sep="\n")
        levels = []
        for name, ref in PIPELINES.items():
            pipeline, module = load_pipeline_and_module(ref)
            predicted = predict(pipeline, profile, concurrency=(1, 4, 16), inputs=sample_inputs(pipeline, module),
                                step_costs="server")
            for level in predicted.level_records():
                truth = measured.get((name, level["concurrency"]), [])
                wrong = level["winner"] is not None and level["winner"] not in truth
                levels.append({"pipeline": name, "concurrency": level["concurrency"], "winner": level["winner"],
                               "tied": level["tied"], "quiet_measured": truth, "contradicted": wrong})
                print(f"{name:8s} {level['concurrency']:3d}  predicted {level['winner'] or 'no clear winner'}  "
                      f"quiet run measured {'/'.join(truth)}{'  CONTRADICTED' if wrong else ''}")
    named = [lv for lv in levels if lv["winner"] is not None]
    contradicted = [lv for lv in levels if lv["contradicted"]]
    ok = bool(said) and done.returncode == 0 and not contradicted
    result = {"date": datetime.now(timezone.utc).date().isoformat(),
              "machine": {k: machine_info().get(k) for k in ("cpu", "cpu_count", "usable_cpus")},
              "hogs": HOGS, "quiet_run": {"date": quiet.get("date"), "source": QUIET.name},
              "calibrate_exit": done.returncode, "warning": said, "levels": levels,
              "named": len(named), "contradicted": len(contradicted), "met": ok, "load_average": os.getloadavg()}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{len(named)} winners named, {len(contradicted)} contradicted by the quiet run; warning "
          f"{'shown' if said else 'MISSING'}; wrote {RESULTS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
