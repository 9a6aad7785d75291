"""Is ``advise``'s top pick the best configuration a real server measures?

For each pipeline, at concurrency 8: ``advise`` ranks the configurations by simulation;
then a sweep of at least 12 configurations (advise's top 3, each form's default, and
variations of instance counts and batching around them) is measured on the bundled Triton
server, side by side in one run. Targets of issue 41:

- diamond and yolov5: the measured throughput of advise's top pick is within 10 % of the
  best measured configuration of the sweep;
- ``capacity:fixed`` (a slow step that costs the same per call whatever the batch size):
  advise's top pick measures >= 3x the throughput of the default configuration.

Exits 1 when a target is missed::

    .venv/bin/python benchmarks/advise_sweep.py --profile profile.json --out advise-results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from pipelines.bench.inputs import sample_requests
from pipelines.bench.verify_advice import measure_configurations, verified_table
from pipelines.commands.loading import load_pipeline_and_module
from pipelines.measured_prediction import advise
from pipelines.predict.configuration import Configuration

PIPELINES = {
    "diamond": "pipelines.examples.basic:diamond",
    "yolov5": "pipelines.examples.yolov5:pipeline",
    "fixed": "pipelines.examples.capacity:fixed",
}
CONCURRENCY = 8
WITHIN = 0.10
BEATS = 3.0
SWEEP = 12


def sweep_of(advice) -> list[tuple[str, Configuration, float, float]]:
    """Advise's top 3, each form's default, then variations (instances, batching, the top-level
    model's instances) of the defaults, until there are at least ``SWEEP`` distinct ones."""
    entries: dict[tuple, tuple[str, Configuration, float, float]] = {}

    def key(c: Configuration) -> tuple:
        return (c.form, c.top_instances, tuple(sorted(c.models.items())))

    def add(label: str, configuration: Configuration, row=None) -> None:
        if key(configuration) not in entries:
            tput = row.throughput if row is not None else float("nan")
            p95 = row.p95_ms if row is not None else float("nan")
            entries[key(configuration)] = (label, configuration, tput, p95)

    for i, c in enumerate(advice.top(3), 1):
        add(f"advise #{i} {c.configuration.label(advice.defaults[c.configuration.form].configuration)}",
            c.configuration, c.row)
    for name, c in advice.defaults.items():
        add(f"default {name}", c.configuration, c.row)
    predicted = {key(c.configuration): c.row for c in advice.ranked}
    variations = []
    for name, base in advice.defaults.items():
        b = base.configuration
        if name != "ensemble":
            variations.append((f"{name} x2", replace(b, top_instances=2)))
        for model, choice in b.models.items():
            short = model.split("__", 1)[-1]
            variations.append((f"{name} {short}:i2", replace(b, models={**b.models,
                                                                         model: replace(choice, instance_count=2)})))
            if choice.max_batch_size > 0 and name != "fused":
                variations.append((f"{name} {short}:batch@500us", replace(b, models={
                    **b.models, model: replace(choice, dynamic_batching=True, max_queue_delay_us=500)})))
    for label, configuration in variations:
        if len(entries) >= SWEEP + 2:
            break
        add(label, configuration, predicted.get(key(configuration)))
    return list(entries.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="a profile from 'pipelines calibrate'")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"some of {','.join(PIPELINES)}")
    parser.add_argument("--out", default="advise-results")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per configuration")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    verdicts, summary = [], {}
    for name in args.pipelines.split(","):
        pipeline, module = load_pipeline_and_module(PIPELINES[name])
        started = time.perf_counter()
        advice = advise(pipeline, args.profile, concurrency=CONCURRENCY, module=module)
        took = time.perf_counter() - started
        print(advice)
        print(f"({advice.simulated} configurations simulated in {took:.1f} s)")
        entries = sweep_of(advice) if name != "fixed" else [
            ("advise #1 " + advice.best.configuration.label(), advice.best.configuration, advice.best.row.throughput,
             advice.best.row.p95_ms),
            *[(f"default {f}", c.configuration, c.row.throughput, c.row.p95_ms) for f, c in advice.defaults.items()],
        ]
        samples = sample_requests(pipeline, module=module)
        rows = measure_configurations(pipeline, entries, samples, concurrency=CONCURRENCY, duration=args.duration,
                                      note=lambda t: print(t, file=sys.stderr))
        print(f"\n{name} at concurrency {CONCURRENCY}: {len(rows)} configurations measured")
        print(verified_table(rows))
        top = rows[0].measured_throughput
        if name == "fixed":
            default = rows[1 + list(advice.defaults).index(advice.best.configuration.form)].measured_throughput
            ratio = top / default if default else float("inf")
            ok = ratio >= BEATS
            verdicts.append(f"{name}: advise's pick measured {top:.1f} infer/s, the default of its form "
                            f"{default:.1f}: {ratio:.1f}x (target >= {BEATS:g}x) {'ok' if ok else 'MISSED'}")
        else:
            best = max(r.measured_throughput for r in rows)
            ok = len(rows) >= SWEEP and top >= best * (1 - WITHIN)
            verdicts.append(f"{name}: advise's pick measured {top:.1f} infer/s, the best of {len(rows)} "
                            f"{best:.1f} ({top / best - 1:+.1%}; target within -{WITHIN:.0%}) "
                            f"{'ok' if ok else 'MISSED'}")
        summary[name] = {
            "simulated": advice.simulated, "advise_s": round(took, 2),
            "rows": [{"label": r.label, "predicted": r.predicted_throughput, "measured": r.measured_throughput,
                      "predicted_p95_ms": r.predicted_p95_ms, "measured_p95_ms": r.measured_p95_ms,
                      "errors": r.errors} for r in rows],
        }
    print()
    print("\n".join(verdicts))
    missed = [v for v in verdicts if v.endswith("MISSED")]
    summary["verdicts"] = verdicts
    summary["seconds"] = round(time.perf_counter() - began)
    (out / "advise_sweep.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
