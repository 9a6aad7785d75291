"""``pipelines bench MODULE:ATTR``: the command line of :func:`run_benchmark`.

``add_arguments`` fills the ``bench`` sub-command's parser; ``main`` runs it and
returns the exit status. ``benchmarks/ensemble_vs_bls.py`` uses both as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from ..commands.input_files import parse_forms, parse_inputs, parse_levels
from ..commands.interrupts import sigterm_as_interrupt
from ..commands.loading import load_pipeline_and_module
from ..errors import PipelinesError
from ..runtime.step_process import ISOLATIONS
from ..triton.async_client import COMPRESSIONS
from .inputs import given_requests
from .measurement import FORMS
from .runner import run_benchmark
from .settings import DEFAULT_PIPELINE, BenchSettings

__all__ = ["add_arguments", "main", "parse_levels", "run", "settings_from"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pipelines bench`` (and of ``benchmarks/ensemble_vs_bls.py``)."""
    parser.add_argument("pipeline", metavar="MODULE:ATTR", nargs="?", default=DEFAULT_PIPELINE,
                        help=f"the pipeline to measure (default: {DEFAULT_PIPELINE})")
    parser.add_argument("--concurrency", type=parse_levels, default=(1, 2, 4, 8, 16), metavar="1,2,4,8,16",
                        help="requests kept in flight, one measurement per level (also LOW:HIGH for powers of two)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", action=argparse.BooleanOptionalAction, default=None,
                       help="measure on the embedded Triton server (the default unless --url is given)")
    where.add_argument("--url", metavar="HOST:PORT",
                       help="measure a remote Triton server where the repository compiled with "
                       "'--target all' is already deployed")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--local", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the local runtime (default: on)")
    parser.add_argument("--server-copies", action=argparse.BooleanOptionalAction, default=True,
                        help="let the local runtime copy tensors where a Triton server moves them between "
                        "processes (one copy per step boundary in an ensemble, two in BLS), so that it "
                        "moves the bytes a server moves (default: on)")
    parser.add_argument("--forms", type=parse_forms, default=FORMS, metavar=",".join(FORMS),
                        help="which forms to measure (default: every form)")
    parser.add_argument("--batch", type=int, default=1, help="batch size of each request (default: 1)")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--duration", type=float, default=2.0, metavar="SECONDS",
                        help="length of one measurement window (default: 2)")
    window.add_argument("--requests", type=int, metavar="N", help="measurement windows of N answers instead")
    parser.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS",
                        help="load sent and not measured before the windows (default: 1)")
    parser.add_argument("--stability", type=float, default=0.1, metavar="FRACTION",
                        help="windows agree when within this fraction of their mean (default: 0.1, ±10%%)")
    parser.add_argument("--max-trials", type=int, default=10, metavar="N",
                        help="windows measured at most before a measurement is called unstable (default: 10)")
    parser.add_argument("--turns", type=int, default=1, metavar="N",
                        help="measure each concurrency level in N turns, every form in turn, and pool each "
                        "form's turns: on a machine whose speed drifts (a shared VM), the drift then moves "
                        "every form alike and the ratios between forms hold still (default: 1)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a request not answered in this time counts as an error (default: 60)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                        help="send your own request: one .npy per pipeline input (repeat the flag), batch dimension "
                        "included, as 'pipelines run' takes them; or PROMPTS.txt (NAME=PROMPTS.txt), one request per "
                        "line, the line as the pipeline's text (BYTES) input; without it the requests come from the "
                        "pipeline module's sample_inputs(batch) function if it has one, else random tensors")
    parser.add_argument("--size", type=int, default=16,
                        help="size of variable (-1) dims in generated inputs (default: 16)")
    parser.add_argument("--out", metavar="DIR", default="bench-results",
                        help="where results.json, the PNG plots and the model repository go (default: bench-results)")
    parser.add_argument("--profile", metavar="FILE",
                        help="a server profile from 'pipelines calibrate': the report sets the server's predicted "
                        "figures beside the measured ones (the local runtime executes and predicts nothing; "
                        "'pipelines predict' predicts without measuring)")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="with --profile: use a profile measured on another machine, Triton version or "
                        "protocol (warns, naming each difference)")
    parser.add_argument("--isolation", choices=ISOLATIONS, default="thread",
                        help="where the local runtime runs each step instance: in this process's threads, or in "
                        "a forked process of its own, as Triton runs each Python model instance in a stub "
                        "('process' keeps steps from waiting for each other's GIL; default: thread)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default=None,
                        help="compress the server's requests and responses with this algorithm, to measure "
                        "what compression costs (default: none, as tritonclient's blocking client and "
                        "perf_analyzer send them)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The :class:`BenchSettings` that parsed ``args`` describe (checked: bad values raise PipelinesError)."""
    # Each option is stored under its field's name (add_arguments keeps them in step);
    # --requests replaces the duration.
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchSettings)}
    if args.requests is not None:
        values["duration"] = None
    return BenchSettings(**values)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed ``args`` describe; 0 when it ran (errors are in its report).

    SIGTERM stops it as Ctrl-C does: the finished levels stay in results.json and
    the embedded server is stopped.
    """
    settings = settings_from(args)
    inputs = _given_inputs(args.pipeline, args.input, settings)
    with sigterm_as_interrupt():
        run_benchmark(args.pipeline, settings, inputs=inputs, out=args.out, progress=not args.quiet)
    return 0


def _given_inputs(spec: str, pairs: Sequence[str], settings: BenchSettings) -> dict | list[dict] | None:
    """The request(s) that ``--input NAME=FILE.npy`` and ``PROMPTS.txt`` flags make, checked against
    the pipeline's inputs."""
    if not pairs:
        return None
    if settings.batch != 1:
        raise PipelinesError("--batch does not apply with --input: the files' arrays are sent as they are, "
                             "their first axis being the batch; drop --batch")
    pipeline, _ = load_pipeline_and_module(spec)
    inputs = given_requests(pipeline, pairs, parse_inputs)
    given = inputs[0] if isinstance(inputs, list) else inputs
    unknown = sorted(set(given) - set(pipeline.inputs))
    missing = sorted(set(pipeline.inputs) - set(given))
    if unknown or missing:
        raise PipelinesError(
            f"pipeline {pipeline.name!r} takes inputs {sorted(pipeline.inputs)}; --input "
            + (f"names {unknown}, which it does not take" if unknown else "")
            + ("; and " if unknown and missing else "")
            + (f"misses {missing}: give one --input NAME=FILE.npy for each" if missing else ""),
            pipeline=pipeline.name,
        )
    return inputs


def run(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/ensemble_vs_bls.py`` and ``python -m pipelines.bench``: parse ``argv`` and run."""
    parser = argparse.ArgumentParser(
        prog="ensemble_vs_bls",
        description=f"Benchmark a pipeline in every form ({', '.join(FORMS)}), locally and on a Triton server.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except PipelinesError as exc:
        parser.exit(2, f"error: {exc}\n")
    except KeyboardInterrupt:
        return 130
