"""``pipelines predict`` and ``pipelines advise``: the command lines of
:func:`~pipelines.measured_prediction.predict` and :func:`~pipelines.measured_prediction.advise` (the pipeline
measured here, then simulated). Each ``add_*_arguments(parser)`` fills its sub-command's parser and each
``*_main(args)`` runs it and returns the exit status."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ..commands.input_files import parse_forms, parse_levels
from ..compile import compile_pipeline
from ..errors import PipelinesError
from ..forms import FORMS

__all__ = ["add_advise_arguments", "add_predict_arguments", "advise_main", "predict_main"]


def _positive(kind: type, what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
        return value

    return parse


def _named_number(text: str, fits: Callable[[float], bool], what: str) -> tuple[str, float]:
    """``NAME=NUMBER`` from the command line, the number checked by ``fits``; else ``what`` it should be."""
    name, sep, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")  # fits nothing
    if not sep or not name or not fits(number):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return name, number


def _cost(text: str) -> tuple[str, float]:
    return _named_number(text, lambda us: us >= 0, "STEP=MICROSECONDS (a step's cost per call, e.g. detector=2500)")


def _share(text: str) -> tuple[str, float]:
    return _named_number(text, lambda share: 0.0 <= share <= 1.0,
                         "TENSOR=SHARE (the share of rows where a `when` condition tensor is true, 0..1, "
                         "e.g. is_blank.blank=0.3)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", metavar="MODULE:ATTR")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="the server profile that 'pipelines calibrate' wrote; the step profiles are kept "
                        "beside it (PROFILE.steps.json). Default: the calibration kept for this server (the "
                        "bundled one, or --url), its Triton version and protocol on this machine, made now "
                        "(as 'pipelines calibrate --quick') where none is kept yet")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                        help="a sample input from a .npy file (repeat for each input; default: the pipeline "
                        "module's own sample_inputs()/make_sample(), else random tensors)")
    parser.add_argument("--forms", type=parse_forms, default=None, metavar="FORM,...",
                        help=f"the forms to consider (default: all of {','.join(FORMS)})")
    parser.add_argument("--cost", type=_cost, action="append", default=[], metavar="STEP=US",
                        help="a step's cost per call in µs, instead of measuring it here (an external model "
                        "with no stand-in, or one that runs on other hardware); repeat for each")
    parser.add_argument("--when-rate", type=_share, action="append", default=[], metavar="TENSOR=SHARE",
                        help="the share of rows where a `when` block's condition tensor is true (NODE.TENSOR, a "
                        "pipeline input, or NODE for a node with one; default: counted over the sample requests); "
                        "repeat for each")
    parser.add_argument("--cores", type=_positive(float, "a number of cores > 0"), default=None, metavar="N",
                        help="the server's cores (default: those of the machine the profile was measured on)")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="use a profile measured on another machine, Triton version or protocol (warns, "
                        "naming each difference)")
    parser.add_argument("--step-costs", choices=["auto", "server", "local"], default="auto",
                        help="where each step's cost comes from: 'server' times each step's own model on the "
                        "bundled Triton server (or --url), 'local' the step profiles timed here; 'auto' (default) "
                        "the server at --url where one is given, else local. A server that cannot serve the "
                        "steps is named, and the local step profiles are used instead")
    parser.add_argument("--json", action="store_true",
                        help="print JSON instead of a table (predict: a list of rows, each with its ranges and its "
                        "load's winner, a form or null, and the forms that tie; the notes go to stderr; advise: "
                        "the ranked rows)")


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--concurrency", type=parse_levels, default=None, metavar="1,4,16",
                        help="clients in a closed loop, as perf_analyzer (also LOW:HIGH for powers of two; "
                        "default 1,4,16 unless --rate is given)")
    parser.add_argument("--rate", type=_positive(float, "requests/s > 0"), action="append", default=None,
                        metavar="R", help="an open-loop load of R requests/s (Poisson arrivals); repeatable. "
                        "Given alone, replaces the default concurrencies")
    parser.add_argument("--url", metavar="HOST:PORT", default=None,
                        help="a Triton server serving the pipeline's step models (its ensemble or bls "
                        "repository): each step's cost is timed there (--step-costs)")


def add_advise_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_positive(int, "an int >= 1"), default=None, metavar="N",
                      help="clients in a closed loop (default 8)")
    load.add_argument("--rate", type=_positive(float, "requests/s > 0"), default=None, metavar="R",
                      help="an open-loop load of R requests/s")
    parser.add_argument("--p95-ms", type=_positive(float, "milliseconds > 0"), default=None, metavar="X",
                        help="rank by throughput among configurations whose p95 is at most X ms "
                        "(default: rank by p95); configurations within 5%% of the best are ties, and the "
                        "one that changes least from its form's default comes first")
    parser.add_argument("--top", type=_positive(int, "an int >= 1"), default=5, metavar="K",
                        help="how many configurations to print (default 5)")
    parser.add_argument("--budget", type=_positive(int, "an int >= 1"), default=300, metavar="N",
                        help="at most this many configurations simulated (default 300)")
    parser.add_argument("--verify", action="store_true",
                        help="compile the top 3 and the default, measure them on the bundled Triton server "
                        "(or --url), and print predicted against measured")
    parser.add_argument("--url", metavar="HOST:PORT", default=None,
                        help="the Triton server where each step's cost is timed (--step-costs; it must serve the "
                        "pipeline's step models) and, with --verify, where the configurations are measured instead "
                        "of on the bundled one; those must be served there too (<pipeline>_v0, _v1, ...), as "
                        "--verify-repository writes them")
    parser.add_argument("--verify-repository", metavar="DIR", default=None,
                        help="with --verify: write the configurations measured into DIR (and keep it), e.g. the "
                        "repository that the server at --url loads")
    parser.add_argument("--duration", type=_positive(float, "seconds > 0"), default=3.0, metavar="S",
                        help="with --verify: seconds measured per configuration (default 3)")
    parser.add_argument("--write", metavar="DIR", default=None,
                        help="write the winner's model repository into DIR (its other models are left as they are)")


def _load(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any] | None]:
    from ..commands.input_files import parse_inputs
    from ..commands.loading import load_pipeline_and_module

    pipeline, module = load_pipeline_and_module(args.pipeline)
    inputs = parse_inputs(args.input, pipeline) if args.input else None
    return pipeline, module, inputs


def _profile(args: argparse.Namespace) -> str:
    """``--profile``, or the calibration kept for the server (made now where there is none), said on stderr."""
    if args.profile is not None:
        return args.profile
    from ..profiling.kept_calibration import kept_calibration

    kept = kept_calibration(args.url, note=lambda text: print(text, file=sys.stderr))
    print(kept.describe(), file=sys.stderr)
    return str(kept.path)


def predict_main(args: argparse.Namespace) -> int:
    from ..commands.progress import Progress, counted_stages
    from ..measured_prediction import predict

    pipeline, module, inputs = _load(args)
    concurrency = args.concurrency if args.concurrency is not None else ((1, 4, 16) if args.rate is None else ())
    result = predict(pipeline, _profile(args), concurrency=concurrency, forms=args.forms, rate=args.rate,
                     inputs=inputs, module=module, costs=dict(args.cost) or None, cores=args.cores,
                     allow_mismatch=args.allow_mismatch, when_rates=dict(args.when_rate) or None,
                     step_costs=args.step_costs, url=args.url,
                     progress=counted_stages(Progress(), "profiling steps", "steps"))  # a line each, in a log
    # The table ends with one verdict per load: a winner only where its range clears the others'.
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        for line in (*result.verdicts(), *result.notes):  # the rows are data; what was seen goes beside them
            print(line, file=sys.stderr)
    else:
        print(result)
    return 0


def advise_main(args: argparse.Namespace) -> int:
    from ..commands.progress import Progress, counted_stages
    from ..commands.sample_inputs import sample_requests
    from ..measured_prediction import advise

    if args.verify_repository and not args.verify:
        raise PipelinesError("--verify-repository is where --verify writes what it measures; add --verify, or drop it")
    pipeline, module, inputs = _load(args)
    advice = advise(pipeline, _profile(args), concurrency=args.concurrency, rate=args.rate, p95_ms=args.p95_ms,
                    forms=args.forms, cores=args.cores, inputs=inputs, module=module, costs=dict(args.cost) or None,
                    allow_mismatch=args.allow_mismatch, budget=args.budget, when_rates=dict(args.when_rate) or None,
                    step_costs=args.step_costs, url=args.url,
                    progress=counted_stages(bar := Progress(), "advise: simulating", "configurations"))
    bar.finish("advise: simulated", f"{advice.simulated} configurations")
    if args.json:
        print(json.dumps(advice.as_dicts(args.top), indent=2))
    else:
        print(advice.text(args.top))
    if args.verify:
        from ..bench.verify_advice import measure_configurations, verified_table

        if advice.load.concurrency is None:
            raise PipelinesError("--verify measures at a concurrency (perf_analyzer's closed loop); give "
                                 "--concurrency N instead of --rate")
        default = max(advice.defaults.values(), key=lambda c: c.row.throughput)
        entries = [(f"#{i} {c.configuration.label(advice.defaults[c.configuration.form].configuration)}",
                    c.configuration, c.row.throughput, c.row.p95_ms) for i, c in enumerate(advice.top(3), 1)]
        entries.append((f"default {default.configuration.form}", default.configuration, default.row.throughput,
                        default.row.p95_ms))
        samples = [inputs] if inputs else sample_requests(pipeline, module=module)
        rows = measure_configurations(pipeline, entries, samples, concurrency=advice.load.concurrency, url=args.url,
                                      duration=args.duration, repository=args.verify_repository,
                                      note=bar.note)
        print("\npredicted against measured at concurrency", advice.load.concurrency)
        print(verified_table(rows))
    if args.write:
        from ..compile.repository import write_models
        from ..predict.configuration import configured

        best = advice.best.configuration
        repo = compile_pipeline(configured(pipeline, best).validate(), best.form, **best.compile_options())
        path = write_models(repo, args.write, overwrite_hint="removing the models first")
        print(f"wrote the winner ({best.label()}) to {path}: {', '.join(sorted(repo.models))}")
    return 0
