"""How long a new user waits for a predicted table on the bundled server (issue 59, "Faster to an
answer"): from nothing (no calibration kept, no step costs kept) to yolov5's table of every form at
concurrency 1, 4 and 16 with ranges, with each step's cost taken on the server; then a second pipeline
on the same server (the calibration reused); then the first again (everything kept).

Each run is ``pipelines predict MODULE:ATTR --step-costs server --json`` in a fresh process, with
``$PIPELINES_CALIBRATIONS`` on an empty directory at the start. The machine's load average is
recorded beside each: on a shared machine the figures are as slow as its neighbours make them.

    .venv/bin/python benchmarks/time_to_answer.py [--out benchmarks/results/time_to_answer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

from pipelines.commands.machine import machine_info

RUNS = (
    ("from nothing", "pipelines.examples.yolov5:pipeline", 120.0),
    ("a second pipeline, same server", "pipelines.examples.basic:diamond", 45.0),
    ("the first again, everything kept", "pipelines.examples.yolov5:pipeline", None),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "time_to_answer.json"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipelines-time-to-answer-") as store:
        env = {**os.environ, "PIPELINES_CALIBRATIONS": store}
        for label, pipeline, target in RUNS:
            load_before = os.getloadavg()[0]
            began = perf_counter()
            done = subprocess.run([sys.executable, "-m", "pipelines", "predict", pipeline, "--step-costs", "server",
                                   "--json"], env=env, capture_output=True, text=True, check=False)
            seconds = perf_counter() - began
            said = [line for line in done.stderr.splitlines() if line.startswith(("reused", "calibrated", "no cal"))]
            rows.append({"run": label, "pipeline": pipeline, "seconds": round(seconds, 1), "target_s": target,
                         "met": None if target is None else seconds <= target, "exit": done.returncode,
                         "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "said": said})
            print(f"{label:34s} {pipeline:40s} {seconds:7.1f} s  (target {target or '-'}, load "
                  f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}) exit {done.returncode}")
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
    machine = machine_info()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {k: machine.get(k) for k in ("cpu", "cpu_count", "usable_cpus")}, "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
