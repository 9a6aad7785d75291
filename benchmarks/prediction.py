"""How well the simulation predicts the Triton server: predicted against measured, side by side.

Calibrates the bundled server (or reads --profile), then for each pipeline predicts every
form (ensemble, bls, bls-sync, fused) at concurrency 1, 4 and 16 by simulation
(``pipelines.predict``), and measures the same forms at the same levels on the bundled
server, in one run. It prints the errors against the targets of issue 41:

- concurrency 1: every form's p50 latency within ±10 % of the server's;
- concurrency 4 and 16: every form's throughput within ±15 %;
- at every level, the predicted winner (throughput) is the measured one (forms measured
  within 5 % of the best are a tie: either is the winner);
- speed: yolov5's four forms at 1, 4 and 16 predicted in <= 2 s once its step profiles
  exist; ``advise`` over >= 200 configurations in <= 30 s.

And the targets of issue 59 for each figure's range (p50 at 1, throughput at 4 and 16):

- coverage: the server's figure lies inside the predicted range for >= 90 % of figures;
- width: the median half-width of the ranges is <= 15 % of the figure, and none is over 35 %;
- winners: a winner the prediction names (its range clears the others') is the measured one
  (within 5 %); a "no clear winner" is right only where the forms it names as tying measured
  within 10 % of each other, the measured best among them. Counted as named right, named
  wrong (target: none), tied right and tied wrong.

Each range is a 90 % interval, its sources in quadrature (pipelines/predict/ranges.py); the
median of each source over the figures is printed and recorded, to show which one sets the width.

The load average of the machine at the start and the end of the run is recorded with the
results (benchmarks/results/prediction.json), and so is each noise record.

Beside each figure it shows how far the server's own measurement windows strayed from the
figure they pool to (a run measures each level in 2 turns of windows): a prediction off by
less than that is off by no more than the server is from itself within one measurement. It
is shown, not counted: a target is met or missed on the pooled figure alone.

``--repeat`` measures every pipeline a second time once the first pass is done, and scores
the first pass as if it were a prediction of the second: how many of the same targets the
server meets against itself minutes later, the floor under what any prediction can meet. The
prediction is scored against the second pass too, and against both pooled.

Exits 1 when a target is missed, so it runs as a check::

    .venv/bin/python benchmarks/prediction.py --profile profile.json --out prediction-results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

# prediction_tables.py, beside this file (on sys.path when run as a script): the tables written into the docs
from prediction_tables import LEVELS, MEASURES, RESULTS, write_table

from pipelines.bench import BenchSettings, run_benchmark
from pipelines.calibration import load_profile
from pipelines.commands.loading import load_pipeline_and_module
from pipelines.commands.machine import machine_info
from pipelines.forms import FORMS
from pipelines.measured_prediction import advise, predict
from pipelines.profiling.calibrate import calibrate
from pipelines.profiling.pipeline_costs import sample_inputs
from pipelines.tables import format_table

# boundaries.py is the benchmark's own fixture, beside this file (on sys.path when run as a script).
PIPELINES = {
    "diamond": "pipelines.examples.basic:diamond",
    "chain10": "boundaries:chain10",
    "yolov5": "pipelines.examples.yolov5:pipeline",
    "large": "boundaries:large",
    "twin": "pipelines.examples.capacity:twin",  # one step at instance_count=2
    "batched": "pipelines.examples.capacity:batched",  # a dynamically batched step
    # untuned.py, beside this file: written for issue 59's targets and not tuned on
    "threaded": "untuned:threaded",  # steps on several threads: BLAS, and a pool of the step's own
    "tensor16": "untuned:tensor16",  # 16 MiB tensors between steps
}
LATENCY_C1 = 0.10
THROUGHPUT = 0.15
TIE = 0.05
PREDICT_S = 2.0
ADVISE_S = 30.0
ADVISE_CONFIGS = 200
COVERAGE = 0.90
MEDIAN_HALF_WIDTH = 0.15
MAX_HALF_WIDTH = 0.35
NO_WINNER_TIE = 0.10
@dataclass(frozen=True)
class Check:
    pipeline: str
    concurrency: int
    figure: str
    predicted: float
    measured: float
    tolerance: float
    # How far the server's windows strayed from ``measured`` (lowest, highest), as fractions of it.
    windows: tuple[float, float] = (0.0, 0.0)
    # The predicted range (low, high); None where the guess has none (a pass of the server).
    bounds: tuple[float, float] | None = None
    # The range's sources, each a standard deviation of the figure's log (PredictionRow.spreads).
    sources: tuple[tuple[str, float], ...] = ()

    @property
    def covered(self) -> bool | None:
        """Whether the measured figure lies inside the predicted range."""
        return None if self.bounds is None else self.bounds[0] <= self.measured <= self.bounds[1]

    @property
    def half_width(self) -> float | None:
        """Half the range's width, as a share of the predicted figure."""
        if self.bounds is None or not self.predicted:
            return None
        return (self.bounds[1] - self.bounds[0]) / 2 / self.predicted

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1 if self.measured else float("nan")

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance

    @property
    def within_windows(self) -> bool:
        """Whether the prediction lies where one of the server's own windows did."""
        return self.windows[0] <= self.error <= self.windows[1]

    def row(self) -> list[str]:
        low, high = self.windows
        bounds = "" if self.bounds is None else f"{self.bounds[0]:.3g}…{self.bounds[1]:.3g}"
        covered = "" if self.covered is None else ("in" if self.covered else "OUT")
        return [self.pipeline, str(self.concurrency), self.figure, f"{self.predicted:.3g}", f"{self.measured:.3g}",
                f"{self.error:+.1%}", f"±{self.tolerance:.0%}", f"{low:+.0%}…{high:+.0%}", "ok" if self.ok else "MISSED",
                bounds, covered]


def window_band(throughputs, pooled: float, *, latency: bool = False) -> tuple[float, float]:
    """How far a measurement's windows strayed from its pooled throughput (lowest, highest), as
    fractions; ``latency``: as the latency of one request in flight, which is its inverse."""
    values = [v for v in throughputs if v > 0]
    if not values or pooled <= 0:
        return 0.0, 0.0
    low, high = min(values) / pooled - 1, max(values) / pooled - 1
    return (1 / (1 + high) - 1, 1 / (1 + low) - 1) if latency else (low, high)


def measured_figures(result) -> dict[tuple[str, int], tuple[float, float, tuple[float, ...]]]:
    """(form, concurrency) -> (p50 ms, infer/s, each window's infer/s) on the server."""
    return {(m.config.form, m.concurrency): (m.latency.p50_ms, m.throughput, tuple(m.window_throughputs))
            for m in result.measurements if m.config.where == "server"}


@dataclass(frozen=True)
class Row:
    form: str
    concurrency: int
    p50_ms: float
    throughput: float


@dataclass(frozen=True)
class Pass:
    """One pass of the server's measurements, in the shape of a prediction (``rows`` and
    ``winner``), so that one pass can be scored against another as a prediction is."""

    measured: dict

    @property
    def rows(self) -> list[Row]:
        return [Row(f, c, p50, throughput) for (f, c), (p50, throughput, _) in self.measured.items()]

    def winner(self, *, concurrency: int) -> str:
        return max((r for r in self.rows if r.concurrency == concurrency), key=lambda r: r.throughput).form

    def tied(self, *, concurrency: int) -> tuple[str, ...]:
        return (self.winner(concurrency=concurrency),)


def checks_of(name: str, predicted, measured) -> tuple[list[Check], list[list[str]]]:
    checks, winners = [], []
    by = {(r.form, r.concurrency): r for r in predicted.rows}
    forms = sorted({f for f, _ in measured}, key=list(FORMS).index)
    for c in LEVELS:
        for f in forms:
            if (f, c) not in measured or (f, c) not in by:
                continue
            p50, throughput, windows = measured[f, c]
            row = by[f, c]
            if c == 1:
                checks.append(Check(name, c, f"{f} p50 ms", row.p50_ms, p50, LATENCY_C1,
                                    window_band(windows, throughput, latency=True), _bounds(row, "p50_ms_range"),
                                    _sources(row, "p50_us")))
            else:
                checks.append(Check(name, c, f"{f} infer/s", row.throughput, throughput, THROUGHPUT,
                                    window_band(windows, throughput), _bounds(row, "throughput_range"),
                                    _sources(row, "throughput")))
        server = {f: measured[f, c][1] for f in forms if (f, c) in measured}
        if server:
            winners.append([name, str(c), *judged(predicted, server, c)])
    return checks, winners


def _bounds(row, name: str) -> tuple[float, float] | None:
    bounds = getattr(row, name, None)
    return None if bounds is None else (float(bounds[0]), float(bounds[1]))


def _sources(row, figure: str) -> tuple[tuple[str, float], ...]:
    spreads = getattr(row, "spreads", None) or {}
    return tuple(sorted((spreads.get(figure) or {}).items()))


def judged(predicted, server: dict[str, float], c: int) -> list[str]:
    """[the predicted verdict, the measured winners, "ok" or "MISSED"]: a named winner is right where it measured
    within TIE of the best; no clear winner is right where the forms it names as tying measured within NO_WINNER_TIE
    of each other, the measured best among them."""
    best = max(server.values())
    measured = sorted(f for f in server if server[f] >= best * (1 - TIE))
    guess = predicted.winner(concurrency=c)
    if guess is not None:
        return [guess, "/".join(measured), "ok" if guess in measured else "MISSED"]
    tied = [f for f in predicted.tied(concurrency=c) if f in server]
    top = max(server[f] for f in tied)
    right = top >= best * (1 - TIE) and all(server[f] >= top * (1 - NO_WINNER_TIE) for f in tied)
    return [f"none ({'/'.join(tied)} tie)", "/".join(measured), "ok" if right else "MISSED"]


def range_targets(checks: list[Check]) -> list[list[str]]:
    """Coverage and width of the ranges over the figures that have one: [target, figure, bound, ok]."""
    ranged = [c for c in checks if c.bounds is not None]
    if not ranged:
        return []
    coverage = sum(bool(c.covered) for c in ranged) / len(ranged)
    widths = [c.half_width for c in ranged]
    median, widest = statistics.median(widths), max(widths)
    return [["coverage: the server's figure inside the range", f"{coverage:.0%} of {len(ranged)}",
             f">= {COVERAGE:.0%}", "ok" if coverage >= COVERAGE else "MISSED"],
            ["median half-width", f"{median:.1%}", f"<= {MEDIAN_HALF_WIDTH:.0%}",
             "ok" if median <= MEDIAN_HALF_WIDTH else "MISSED"],
            ["largest half-width", f"{widest:.1%}", f"<= {MAX_HALF_WIDTH:.0%}",
             "ok" if widest <= MAX_HALF_WIDTH else "MISSED"]]


def winner_counts(winners: list[list[str]]) -> list[list[str]]:
    """The verdicts counted: named right, named wrong (target: none), tied right, tied wrong; [what, count, target,
    ok]. A tie is right where the forms it names measured within NO_WINNER_TIE of each other."""
    named = [w for w in winners if not w[2].startswith("none")]
    tied = [w for w in winners if w[2].startswith("none")]
    wrong = sum(w[-1] != "ok" for w in named)
    tied_wrong = sum(w[-1] != "ok" for w in tied)
    return [["winners named and right", str(len(named) - wrong), "", ""],
            ["winners named and wrong", str(wrong), "0", "ok" if wrong == 0 else "MISSED"],
            [f"no clear winner, measured within {NO_WINNER_TIE:.0%} (right)", str(len(tied) - tied_wrong), "", ""],
            ["no clear winner, measured further apart (wrong)", str(tied_wrong), "0",
             "ok" if tied_wrong == 0 else "MISSED"]]


def source_medians(checks: list[Check]) -> dict[str, float]:
    """Each source of the ranges, its median standard deviation over the figures that have it."""
    by: dict[str, list[float]] = {}
    for c in checks:
        for name, value in c.sources:
            by.setdefault(name, []).append(value)
    return {name: round(statistics.median(values), 4) for name, values in sorted(by.items())}


def fitted_model(checks: list[Check], level: float = COVERAGE) -> dict[str, float | None]:
    """The least ``model`` source (pipelines.predict.ranges.MODEL_SPREAD) for a figure alone (concurrency 1) and in a
    queue that, beside the run's other sources as recorded, would have held ``level`` of its figures of that kind: what
    this run supports, to set the constants from a quiet run (None: no such figures, or none up to 30 %)."""
    from pipelines.predict.ranges import Z

    out: dict[str, float | None] = {}
    for kind, chosen in (("alone", [c for c in checks if c.concurrency == 1]),
                         ("queued", [c for c in checks if c.concurrency != 1])):
        chosen = [c for c in chosen if c.sources and c.measured > 0 and c.predicted > 0]
        out[kind] = None
        for step in range(121):
            model = step * 0.0025
            held = sum(abs(math.log(c.predicted / c.measured)) <= Z * math.sqrt(
                model ** 2 + sum(v * v for k, v in c.sources if k != "model")) for c in chosen)
            if chosen and held >= level * len(chosen):
                out[kind] = model
                break
    return out


def plot(checks: list[Check], path: Path, *, guess: str = "predicted by the simulation",
         truth: str = "measured on the server") -> None:
    """Predicted against measured, one point per figure (p50 at concurrency 1, throughput at 4
    and 16), on log axes, with the targets' bands around the diagonal (``guess`` and ``truth``
    name the axes: the server's second pass against its first, for ``--repeat``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:  # the plot is a nicety; prediction.json has the figures
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, kind, tolerance in ((axes[0], "p50 ms", LATENCY_C1), (axes[1], "infer/s", THROUGHPUT)):
        chosen = [c for c in checks if c.figure.endswith(kind)]
        if not chosen:
            continue
        for form, marker in zip(FORMS, "os^D", strict=False):
            mine = [c for c in chosen if c.figure.startswith(form + " ")]
            ax.scatter([c.measured for c in mine], [c.predicted for c in mine], marker=marker, label=form, alpha=0.8)
        low = min(min(c.measured, c.predicted) for c in chosen) * 0.8
        high = max(max(c.measured, c.predicted) for c in chosen) * 1.2
        line = [low, high]
        ax.plot(line, line, color="black", linewidth=0.8)
        ax.fill_between(line, [v * (1 - tolerance) for v in line], [v * (1 + tolerance) for v in line],
                        color="grey", alpha=0.15, label=f"±{tolerance:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # the decades' labels only: the minor ones overlap
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(f"{truth} ({kind})")
        ax.set_ylabel(f"{guess} ({kind})")
        ax.set_title("p50 at concurrency 1" if kind == "p50 ms" else "throughput at concurrency 4 and 16")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def met(checks: list[Check], winners: list[list[str]]) -> tuple[int, int]:
    """(met, of) over figures and winners."""
    return sum(c.ok for c in checks) + sum(w[-1] == "ok" for w in winners), len(checks) + len(winners)


def pooled(first: dict, second: dict) -> dict:
    """Two passes' figures as one measurement twice as long: the mean p50 and throughput of each."""
    return {key: ((first[key][0] + second[key][0]) / 2, (first[key][1] + second[key][1]) / 2,
                  first[key][2] + second[key][2]) for key in first.keys() & second.keys()}


def score_repeat(names, predictions, firsts, results, measure, out: Path) -> dict:
    """Measures each pipeline again and scores the first pass against the second (the server
    against itself) and the prediction against the second pass; ``measure(name, out)`` measures one pipeline."""
    scores = {"server_against_itself": [0, 0], "prediction_against_second": [0, 0], "prediction_against_both": [0, 0]}
    rows, itself_checks = [], []
    for name in names:
        second = measure(name, out / name / "repeat")
        itself = checks_of(name, Pass(firsts[name]), second)
        against = checks_of(name, predictions[name], second)
        both = checks_of(name, predictions[name], pooled(firsts[name], second))
        for key, (checks, winners) in (("server_against_itself", itself), ("prediction_against_second", against),
                                       ("prediction_against_both", both)):
            got, of = met(checks, winners)
            scores[key][0] += got
            scores[key][1] += of
        itself_checks += itself[0]
        rows += [c.row() for c in itself[0]] + [[*w[:2], "winner", w[2], w[3], "", "", "", w[4]] for w in itself[1]]
        results[name]["measured_again"] = {f"{f} {c}": list(v) for (f, c), v in sorted(second.items())}
    print(format_table(["pipeline", "conc", "figure", "first pass", "second pass", "error", "target",
                        "windows", "", "range", ""], [r + [""] * (11 - len(r)) for r in rows]))
    plot(itself_checks, out / "server_against_itself.png", guess="the server's first pass",
         truth="the server's second pass")
    for key, (got, of) in scores.items():
        print(f"{key.replace('_', ' ')}: {got} of {of} figures and winners")
    return scores


def perf_analyzer_settings(settings: BenchSettings, commands: list[str], failed: dict) -> dict:
    """How perf_analyzer measured, for the results: its version, its stopping rule, a command it ran, what failed."""
    from perf_analyzer_tool import TRITONCLIENT, WINDOWS

    return {"version": f"tritonclient {TRITONCLIENT}",
            "rule": f"a fixed {WINDOWS} windows of {settings.duration:g} s a turn, as the bench's (-s 1000 -r {WINDOWS}), "
                    f"{settings.turns} turn{'s' if settings.turns > 1 else ''}, {settings.warmup:g} s of warm-up",
            "protocol": settings.protocol, "command": commands[0] if commands else None, "failed": failed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="use this profile instead of calibrating first")
    parser.add_argument("--quick", action="store_true", help="a quick calibration and short windows")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"some of {','.join(PIPELINES)}")
    parser.add_argument("--out", default="prediction-results", help="where results go (default: prediction-results)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement window (default 2)")
    parser.add_argument("--turns", type=int, default=None,
                        help="turns of windows per level (default: 1 with --quick, else 2)")
    parser.add_argument("--repeat", action="store_true",
                        help="measure every pipeline again after the first pass, and score the server against itself")
    parser.add_argument("--step-costs", choices=["local", "server"], default="local",
                        help="where the steps' costs come from: the step profiles timed here (default), or each "
                        "step's own model on the bundled server (issue 59's 'from where the steps run')")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--table", action="store_true",
                        help=f"only write docs/prediction_accuracy.md's latest tables from {RESULTS.name} (with "
                        "--measure perf_analyzer: from its own results)")
    parser.add_argument("--measure", choices=list(MEASURES), default="bench",
                        help="what measures the server: pipelines bench's load generator (default), or perf_analyzer "
                        "(the same windows, levels, requests and protocol; results into "
                        f"{MEASURES['perf_analyzer'][0].name} and tables of their own)")
    args = parser.parse_args(argv)
    results_path, _ = MEASURES[args.measure]
    if args.table:
        if not results_path.exists():
            print(f"no {results_path} yet: run benchmarks/prediction.py --measure {args.measure} first", file=sys.stderr)
            return 1
        write_table(json.loads(results_path.read_text(encoding="utf-8")))
        return 0
    tool = None
    if args.measure == "perf_analyzer":
        # perf_analyzer_tool.py, beside this file (on sys.path when run as a script)
        from perf_analyzer_tool import Unavailable, install_perf_analyzer

        try:
            tool = install_perf_analyzer()
        except Unavailable as why:
            print(f"skipped: perf_analyzer is not available here: {why}", file=sys.stderr)
            return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    load_began = os.getloadavg()  # the machine is shared: how busy it was is part of the figures
    if args.profile:
        profile_path = Path(args.profile)
        load_profile(profile_path)
    else:
        from pipelines.profiling.calibrate_command import QUICK

        profile = calibrate(progress=not args.quiet, **(QUICK if args.quick else {}))
        profile_path = out / "profile.json"
        profile.save(profile_path)
    profile = load_profile(profile_path)
    print(profile.table())
    checks: list[Check] = []
    winners: list[list[str]] = []
    speeds: list[list[str]] = []
    results = {}
    predictions, firsts = {}, {}
    settings = BenchSettings(concurrency=LEVELS, local=False, forms=tuple(FORMS), duration=args.duration,
                             warmup=1.0 if args.quick else 2.0, max_trials=3,
                             turns=args.turns or (1 if args.quick else 2))
    failed: dict[str, dict[str, str]] = {}  # perf_analyzer's measurements that could not be made, and why
    commands: list[str] = []

    def measure(name: str, where: Path) -> dict:
        """(form, concurrency) -> (p50 ms, infer/s, each window's infer/s), by the bench or perf_analyzer."""
        if tool is None:
            return measured_figures(run_benchmark(PIPELINES[name], settings, out=where, progress=not args.quiet,
                                                  echo=False))
        from perf_analyzer_tool import measure_forms

        where.mkdir(parents=True, exist_ok=True)
        got = measure_forms(PIPELINES[name], tool, where, levels=LEVELS, window_s=settings.duration,
                            warmup_s=settings.warmup, turns=settings.turns, protocol=settings.protocol,
                            progress=not args.quiet)
        if got["failed"]:
            failed[str(where.relative_to(out))] = got["failed"]
        if not commands:  # one is enough to show the settings: the others differ in model and level
            commands.extend(got["commands"][:1])
        return got["figures"]

    for name in args.pipelines.split(","):
        pipeline_began = time.perf_counter()
        pipeline, module = load_pipeline_and_module(PIPELINES[name])
        inputs = sample_inputs(pipeline, module)
        started = time.perf_counter()
        predicted = predict(pipeline, profile_path, concurrency=LEVELS, inputs=inputs, step_costs=args.step_costs)
        first = time.perf_counter() - started
        started = time.perf_counter()
        predicted = predict(pipeline, profile_path, concurrency=LEVELS, inputs=inputs, step_costs=args.step_costs)
        again = time.perf_counter() - started
        print(predicted)
        if name == "yolov5":
            speeds.append(["yolov5: 4 forms x 3 levels predicted (step profiles cached)", f"{again:.2f} s",
                           f"<= {PREDICT_S:g} s", "ok" if again <= PREDICT_S else "MISSED"])
        predictions[name] = predicted
        measured = firsts[name] = measure(name, out / name)
        c, w = checks_of(name, predicted, measured)
        checks += c
        winners += w
        results[name] = {"predicted": predicted.as_dicts(), "predict_s": [round(first, 3), round(again, 3)],
                         "levels": predicted.level_records(), "noise": predicted.noise_record(),
                         "measured": {f"{f} {c}": list(v) for (f, c), v in sorted(measured.items())},
                         "seconds": round(time.perf_counter() - pipeline_began)}
    if "yolov5" in args.pipelines.split(","):
        pipeline, module = load_pipeline_and_module(PIPELINES["yolov5"])
        started = time.perf_counter()
        advice = advise(pipeline, profile_path, concurrency=8, module=module, budget=300)
        took = time.perf_counter() - started
        ok = took <= ADVISE_S and advice.simulated >= ADVISE_CONFIGS
        speeds.append([f"yolov5: advise over {advice.simulated} configurations", f"{took:.1f} s",
                       f"<= {ADVISE_S:g} s, >= {ADVISE_CONFIGS}", "ok" if ok else "MISSED"])
    repeat = {}
    if args.repeat:
        repeat = score_repeat(args.pipelines.split(","), predictions, firsts, results, measure, out)
    print(format_table(["pipeline", "conc", "figure", "predicted", "measured", "error", "target",
                        "server's windows", "", "range", ""], [c.row() for c in checks]))
    print()
    print(format_table(["pipeline", "conc", "predicted winner", "measured winner", ""], winners))
    print()
    ranges = range_targets(checks)
    print(format_table(["range target", "figure", "target", ""], ranges))
    print()
    counts = winner_counts(winners)
    print(format_table(["winners", "levels", "target", ""], counts))
    print()
    sources = source_medians(checks)
    print("the ranges' sources, median standard deviation over the figures: "
          + ", ".join(f"{k} {v:.1%}" for k, v in sources.items()))
    fitted = fitted_model(checks)
    print("the least model source this run supports (90 % held): "
          + ", ".join(f"{k} {'-' if v is None else f'{v:.1%}'}" for k, v in fitted.items()))
    print()
    print(format_table(["speed", "took", "target", ""], speeds))
    missed = [c for c in checks if not c.ok] + [w for w in winners if w[-1] != "ok"] + \
        [s for s in speeds if s[-1] != "ok"] + [r for r in ranges if r[-1] != "ok"]
    total = len(checks) + len(winners) + len(speeds) + len(ranges)
    summary = {
        "date": datetime.now(timezone.utc).date().isoformat(),
        "machine": {k: machine_info().get(k) for k in ("cpu", "cpu_count", "usable_cpus")},
        "settings": {"quick": args.quick, "pipelines": args.pipelines.split(","), "step_costs": args.step_costs,
                     "duration": args.duration, "turns": settings.turns, "measure": args.measure,
                     **({"perf_analyzer": perf_analyzer_settings(settings, commands, failed)} if tool else {})},
        "profile": str(profile_path),
        "profile_noise": None if profile.noise is None else profile.noise.to_dict(),
        "load_average": {"began": list(load_began), "ended": list(os.getloadavg())},
        "ranges": ranges,
        "checks": [dict(zip(("pipeline", "conc", "figure", "predicted", "measured", "error", "target", "windows",
                             "ok", "range", "covered"), c.row(), strict=True)) for c in checks],
        "winners": winners,
        "winner_counts": counts,
        "range_sources": sources,
        "fitted_model": fitted,
        "speeds": speeds,
        "results": results,
        "missed": len(missed),
        "missed_within_windows": sum(c.within_windows for c in checks if not c.ok),
        "repeat": repeat,
        "seconds": round(time.perf_counter() - began),
    }
    text = json.dumps(summary, indent=2) + "\n"
    (out / results_path.name).write_text(text, encoding="utf-8")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(text, encoding="utf-8")
    write_table(summary)
    plot(checks, out / ("predicted_vs_measured.png" if tool is None else "predicted_vs_perf_analyzer.png"),
         truth="measured on the server" + ("" if tool is None else " by perf_analyzer"))
    print(f"\n{total - len(missed)} of {total} targets met in {time.perf_counter() - began:.0f} s; "
          f"wrote {out / results_path.name} and {results_path}")
    figures_missed = [c for c in checks if not c.ok]
    if figures_missed:
        inside = sum(c.within_windows for c in figures_missed)
        print(f"{inside} of the {len(figures_missed)} figures missed lie within the server's own windows' spread")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
