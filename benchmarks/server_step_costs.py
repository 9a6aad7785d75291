"""Step costs timed here against step costs timed on the server: each pipeline's ensemble and fused
forms predicted both ways, and measured on the bundled server, side by side in one run (issue 59,
"Step costs from where the steps run").

The calibration is the one kept for the bundled server (``pipelines.profiling.kept_calibration``: made once,
quick, where none is kept). Each form runs its default configuration; it is measured with the
benchmark's load generator for ``--duration`` seconds at each concurrency.

    .venv/bin/python benchmarks/server_step_costs.py [--out benchmarks/results/server_step_costs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from pipelines.bench.verify_advice import measure_configurations
from pipelines.commands.loading import load_pipeline_and_module
from pipelines.commands.machine import machine_info
from pipelines.commands.sample_inputs import sample_requests
from pipelines.measured_prediction import predictor as measured_predictor
from pipelines.predict.spec import Load
from pipelines.profiling.kept_calibration import kept_calibration
from pipelines.tables import format_table

PIPELINES = ("pipelines.examples.yolov5:pipeline", "pipelines.examples.basic:diamond")
FORMS = ("ensemble", "fused")
LEVELS = (1, 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "server_step_costs.json"))
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args(argv)
    profile = kept_calibration(note=lambda text: print(text, file=sys.stderr)).path
    rows = []
    for target in PIPELINES:
        pipeline, module = load_pipeline_and_module(target)
        predicted = {}
        for costs in ("local", "server"):
            predictor = measured_predictor(pipeline, profile, module=module, step_costs=costs)
            for form in FORMS:
                for c in LEVELS:
                    row = predictor.row(predictor.default(form), Load(concurrency=c, requests=500, warmup=50))
                    predicted[costs, form, c] = (row.throughput, row.p50_ms)
        samples = sample_requests(pipeline, module=module)
        for c in LEVELS:
            load = os.getloadavg()[0]
            entries = [(form, predictor.default(form), 0.0, 0.0) for form in FORMS]
            for measured in measure_configurations(pipeline, entries, samples, concurrency=c, duration=args.duration):
                rows.append({
                    "pipeline": pipeline.name, "form": measured.label, "concurrency": c,
                    "load_average": round(load, 2),
                    "measured": {"throughput": round(measured.measured_throughput, 1),
                                 "p50_ms": round(measured.measured_p50_ms, 2)},
                    **{costs: {"throughput": round(predicted[costs, measured.label, c][0], 1),
                               "p50_ms": round(predicted[costs, measured.label, c][1], 2)}
                       for costs in ("local", "server")}})

    def error(row: dict, costs: str, figure: str) -> str:
        return f"{row[costs][figure] / row['measured'][figure] - 1:+.0%}"

    print(format_table(
        ["pipeline", "form", "c", "measured infer/s", "local", "server", "measured p50", "local", "server"],
        [[r["pipeline"], r["form"], str(r["concurrency"]), f"{r['measured']['throughput']:.1f}",
          error(r, "local", "throughput"), error(r, "server", "throughput"), f"{r['measured']['p50_ms']:.2f}",
          error(r, "local", "p50_ms"), error(r, "server", "p50_ms")] for r in rows]))
    machine = machine_info()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "profile": str(profile),
              "machine": {k: machine.get(k) for k in ("cpu", "cpu_count", "usable_cpus")}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
