"""The ``pipelines`` command: compile, run, graph, serve and bench a pipeline
named as ``MODULE:ATTR`` (a module path or a ``.py`` file, and the attribute
holding a :class:`~pipelines.Pipeline`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ..commands.input_files import parse_forms, parse_inputs
from ..commands.interrupts import sigterm_as_interrupt
from ..commands.loading import load_pipeline
from ..commands.output_paths import output_dir
from ..compile import compile_pipeline
from ..drawing.diagram_text import to_dot, to_mermaid
from ..errors import PipelinesError
from ..forms import FORMS, TARGETS

__all__ = ["load_pipeline", "main"]

_EPILOG = """\
examples:
  pipelines graph pipelines.examples.yolov5:pipeline
  pipelines compile pipelines.examples.yolov5:pipeline --target both --out model_repository
  pipelines remove model_repository yolov5
  pipelines serve model_repository
  pipelines serve --local pipelines.examples.yolov5:pipeline --http-port 8000
  pipelines run pipelines.examples.basic:diamond --mode bls --input x=x.npy
  pipelines bench pipelines.examples.basic:diamond --server --concurrency 1,4,16
  pipelines calibrate --out profile.json
  pipelines predict pipelines.examples.yolov5:pipeline --profile profile.json
  pipelines advise pipelines.examples.yolov5:pipeline --profile profile.json --concurrency 8

MODULE:ATTR names a pipeline: an importable module (pkg.mod) or a file
(path/to/file.py), then the attribute that holds the Pipeline, or a function
that takes no arguments and returns one.
"""


def _cmd_graph(args: argparse.Namespace) -> int:
    p = load_pipeline(args.pipeline)
    if args.format == "mermaid":
        print(to_mermaid(p), end="")
    elif args.format == "dot":
        print(to_dot(p), end="")
    else:
        print(repr(p))
        for i, group in enumerate(p.parallel_groups()):
            print(f"  stage {i}: " + ", ".join(group))
        path, _ = p.critical_path()
        print("  critical path: " + " -> ".join(path))
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from ..compile import repository_pipelines
    from ..compile.repository import write_models
    from ..triton.stand_ins import stand_in_for

    p = load_pipeline(args.pipeline)
    repo = compile_pipeline(p.validate(), args.target, bls_instance_count=args.bls_instance_count,
                            fused_instance_count=args.fused_instance_count)
    had = repository_pipelines(args.out).get(p.name, []) if os.path.isdir(args.out) else []
    with sigterm_as_interrupt():  # a killed write discards its staging directory, as on Ctrl-C
        path = write_models(repo, args.out, overwrite=args.overwrite, overwrite_hint="--overwrite")
    print(f"wrote {len(repo.models)} models of pipeline {p.name!r} to {path}:")
    stand_ins = {name: runtime for name, model in repo.models.items() if (runtime := stand_in_for(model.config))}
    for name in sorted(repo.models):
        print(f"  {name}" + (f"  (backend {stand_ins[name]}: on the bundled server, a Python stand-in)"
                             if name in stand_ins else ""))
    removed = sorted(set(had) - set(repository_pipelines(path).get(p.name, [])))
    if removed:
        print(f"removed {len(removed)} models the pipeline no longer has:")
        for name in removed:
            print(f"  {name}")
    print(f"the server's Python needs: {path / 'requirements.txt'} (pip install -r)")
    if stand_ins:
        print(f"{', '.join(map(repr, sorted(stand_ins)))}: written for a full Triton, which runs "
              f"{' and '.join(sorted(set(stand_ins.values())))} itself; the bundled server (pipelines serve, bench) "
              "has only the Python backend and serves a labelled Python stand-in in its place "
              "(pip install 'pipelines[onnx]'); measure the real one with `pipelines bench --url HOST:8000`")
    return 0


def _cmd_remove(args: argparse.Namespace) -> int:
    from ..compile import remove_pipelines

    with sigterm_as_interrupt():
        names = remove_pipelines(args.repository, args.pipelines)
    print(f"removed {len(names)} models of {', '.join(map(repr, args.pipelines))} from {args.repository}:")
    for name in names:
        print(f"  {name}")
    links = _links_to_models_of(args.repository, args.pipelines)
    if links:
        print(f"left {len(links)} symbolically linked model folder{'s' if len(links) > 1 else ''} of "
              f"{', '.join(map(repr, args.pipelines))} in {args.repository}: a link is never removed, nor what it "
              "points to (remove the link by hand if the model should go):")
        for name, target in links:
            print(f"  {name} -> {target}")
    return 0


def _links_to_models_of(repository: str, pipelines: Sequence[str]) -> list[tuple[str, str]]:
    """The symbolic links in ``repository`` that stand for a model of one of ``pipelines``: (name, target).

    A link's folder is the pipeline's when the model marker it holds names the pipeline, or
    (a folder with no marker) when the link is named as the pipeline's models are.
    """
    import json

    from ..compile.repository_disk import MARKER_FILE

    found = []
    for entry in sorted(os.scandir(repository), key=lambda e: e.name):
        if not entry.is_symlink():
            continue
        try:
            with open(os.path.join(entry.path, MARKER_FILE), encoding="utf-8") as file:
                marker = json.load(file)
            owner = marker.get("pipeline") if isinstance(marker, dict) else None
        except (OSError, ValueError):
            owner = None
        ours = owner in pipelines if owner is not None else any(entry.name.startswith(f"{p}_") for p in pipelines)
        if ours:
            found.append((entry.name, os.readlink(entry.path)))
    return found


def _cmd_run(args: argparse.Namespace) -> int:
    import anyio
    import numpy as np

    from ..runtime.local import LocalRuntime

    p = load_pipeline(args.pipeline)
    inputs = parse_inputs(args.input, p)
    out_dir = output_dir(args.out, "--out") if args.out else None

    async def go():
        async with LocalRuntime(p, mode=args.mode) as rt:
            out = await rt.infer(inputs)
            return out, rt.report()

    def show(outputs: dict, suffix: str = "") -> None:
        for name, value in outputs.items():
            arr = np.asarray(value)
            print(f"{name}: {arr.dtype} {list(arr.shape)}")
            if out_dir is not None:
                np.save(out_dir / f"{name}{suffix}.npy", arr)
            elif arr.size <= 64:
                print(f"  {arr.tolist()}")

    if p.streaming:  # each response as it comes, numbered; with --out, NAME_<i>.npy
        from ..runtime.local import stream_pipeline

        count = 0
        for count, response in enumerate(stream_pipeline(p, inputs, mode=args.mode), start=1):
            print(f"response {count}:", flush=True)
            show(response, f"_{count}")
        print(f"{count} response(s)")
        if args.report:
            print("--report: not kept for a streaming pipeline's responses yet")
        return 0
    outputs, report = anyio.run(go)
    show(outputs)
    if args.report:
        print(report)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.local:
        return _cmd_serve_local(args)
    if args.modes is not None:
        raise PipelinesError("--modes: for --local only; a model repository serves the models compiled into it "
                             "(pipelines compile --target picks them): drop it, or serve the pipeline with --local")
    if args.http_max_input_size is not None:
        raise PipelinesError("--http-max-input-size: for --local only; the bundled tritonserver (2.51) has no such "
                             "option (Triton added it in a later release) and takes requests of any size: drop it, "
                             "or serve the pipeline with --local")
    from ..triton import serve_main
    from ..triton.arguments import PythonBackendSettings

    shm = PythonBackendSettings(shm_default_byte_size=args.shm_default_byte_size,
                                shm_growth_byte_size=args.shm_growth_byte_size)
    return serve_main(args.repository, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                      python_env=args.python_env, python_backend=shm) or 0


def _cmd_serve_local(args: argparse.Namespace) -> int:
    from ..endpoint import serve_local

    given = [flag for flag, value in (("--python-env", args.python_env),
                                      ("--shm-default-byte-size", args.shm_default_byte_size),
                                      ("--shm-growth-byte-size", args.shm_growth_byte_size)) if value is not None]
    if given:
        raise PipelinesError(f"{', '.join(given)}: for a model repository on the bundled Triton server (the "
                             "environment and shared memory of its Python stubs); --local serves the pipeline "
                             f"from this process, with no stubs: drop {'it' if len(given) == 1 else 'them'}, "
                             "or serve a compiled DIR without --local")
    p = load_pipeline(args.repository)
    options: dict[str, Any] = {} if args.modes is None else {"modes": args.modes}
    if args.http_max_input_size is not None:
        options["http_max_input_size"] = args.http_max_input_size
    return serve_local(p, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, **options)


def _whole_number(low: int, high: int | None, expected: str) -> Any:
    """An argparse ``type``: an int from ``low`` to ``high`` (None: no bound), else "expected ..."."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
        return value

    return parse


_positive_int = _whole_number(1, None, "a positive number of bytes, e.g. 4194304 for 4 MiB")
_port = _whole_number(0, 65535, "a TCP port from 0 to 65535 (0: a free one)")


class _Formatter(argparse.HelpFormatter):
    """Wraps a command's description to the terminal; keeps its examples (the epilog) line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _examples(*commands: str) -> dict[str, Any]:
    """A subcommand's epilog: commands that run as written (from the project's directory)."""
    return {"epilog": "examples:\n" + "\n".join(f"  pipelines {c}" for c in commands), "formatter_class": _Formatter}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipelines",
        description="Declare Triton pipeline steps once; compile them to an ensemble, BLS models and a "
        "fused model, run them locally, and measure the forms against each other.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser("graph", help="print the pipeline's graph", description="Print the pipeline's DAG: its stages "
                       "(steps that can run in parallel), critical path, or a Mermaid/DOT diagram.",
                       **_examples("graph pipelines.examples.basic:diamond --format text",
                                   "graph pipelines.examples.yolov5:pipeline --format dot | dot -Tpng > yolov5.png"))
    g.add_argument("pipeline", metavar="MODULE:ATTR")
    g.add_argument("--format", choices=["text", "mermaid", "dot"], default="mermaid",
                   help="mermaid renders in GitHub and Jupyter; dot feeds Graphviz (default: mermaid)")
    g.set_defaults(func=_cmd_graph)

    c = sub.add_parser("compile", help="write a pipeline's models into a Triton model repository",
                       description="Compile the pipeline and write its models into a Triton model repository. "
                       "'both' writes <name>_ensemble, <name>_bls and <name>_bls_sync side by side. Only this "
                       "pipeline's models are replaced; other models in DIR are left as they are. The server's "
                       "Python needs DIR/requirements.txt (see the README's deployment section).",
                       **_examples("compile pipelines.examples.yolov5:pipeline --target both --out model_repository",
                                   "compile pipelines.examples.basic:diamond --target all --out model_repository",
                                   "compile path/to/my_pipeline.py:pipeline --target ensemble --out model_repository"))
    c.add_argument("pipeline", metavar="MODULE:ATTR")
    c.add_argument("--target", choices=list(TARGETS), default="both",
                   help="one form, or forms side by side: 'both' (ensemble, bls, bls-sync), 'all' (every form)")
    c.add_argument("--out", required=True, metavar="DIR", help="the model repository directory to write into")
    c.add_argument("--bls-instance-count", type=int, default=1, metavar="N", help="instances of the BLS models (default 1)")
    c.add_argument("--fused-instance-count", type=int, default=1, metavar="N",
                   help="instances of the fused model, each with an instance of every Python step (default 1)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace models of the same name that this pipeline does not own, or write into a "
                   "directory that is not a model repository (its other files stay)")
    c.set_defaults(func=_cmd_compile)

    rm = sub.add_parser("remove", help="remove a pipeline's models from a model repository",
                        description="Remove every model that the named pipelines own from DIR; other models "
                        "are left as they are.",
                        **_examples("remove model_repository yolov5", "remove model_repository diamond chain"))
    rm.add_argument("repository", metavar="DIR")
    rm.add_argument("pipelines", metavar="PIPELINE", nargs="+")
    rm.set_defaults(func=_cmd_remove)

    r = sub.add_parser("run", help="run the pipeline once in the local runtime",
                       description="Run the pipeline once, without a server, with the semantics of one Triton form.",
                       **_examples("run pipelines.examples.basic:diamond --mode bls --input x=x.npy --report",
                                   "run pipelines.examples.yolov5:pipeline --mode fused --input images=image.npy "
                                   "--out outputs"))
    r.add_argument("pipeline", metavar="MODULE:ATTR")
    r.add_argument("--mode", choices=list(FORMS), default="ensemble")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="an input tensor from a .npy file (repeat for each input)")
    r.add_argument("--out", metavar="DIR", help="save each output as DIR/NAME.npy")
    r.add_argument("--report", action="store_true", help="print the cost report (per-step time, copies)")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("serve", help="serve a model repository on the embedded Triton server, or a pipeline locally",
                       description="Start the bundled tritonserver (from nvidia-pytriton) on DIR; Ctrl-C stops it. "
                       "With --local, serve the pipeline MODULE:ATTR from the local runtime over Triton's own "
                       "protocol (HTTP and gRPC), one model per form named as compiled (<name>_ensemble, <name>_bls, "
                       "<name>_bls_sync, ...), so tritonclient code runs unchanged against it; no server binary needed. "
                       "Ctrl-C or SIGTERM stops it.",
                       **_examples("serve model_repository --http-port 8000",
                                   "serve --local pipelines.examples.yolov5:pipeline --http-port 8000",
                                   "serve --local mypipe.py:pipeline --modes bls,fused"))
    s.add_argument("repository", metavar="DIR | MODULE:ATTR",
                   help="the model repository to serve, or with --local the pipeline")
    s.add_argument("--local", action="store_true",
                   help="serve the pipeline MODULE:ATTR from the local runtime (KServe v2 over HTTP and gRPC)")
    s.add_argument("--modes", type=parse_forms, metavar=",".join(FORMS), default=None,
                   help="--local only: the modes to serve, one model each (default: every mode the pipeline can "
                   "run; a pipeline with `when` blocks leaves the ensemble out and says so)")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    s.add_argument("--http-port", type=_port, default=None, help="default: a free port")
    s.add_argument("--grpc-port", type=_port, default=None, help="default: a free port")
    s.add_argument("--http-max-input-size", type=_positive_int, metavar="BYTES", default=None,
                   help="--local only: the largest HTTP request body to accept, as Triton's option of that name "
                   "(default: Triton's, 67108864 = 64 MiB); a larger request is refused with a 400 naming both sizes")
    s.add_argument("--python-env", metavar="VENV", default=None,
                   help="DIR only: the virtual (or conda) environment the Python models run in, with numpy<2 and "
                   "what `pipelines compile` wrote to DIR/requirements.txt (default: this one)")
    s.add_argument("--shm-default-byte-size", type=_positive_int, metavar="BYTES", default=None,
                   help="DIR only: each Python stub's shared memory to start with (Triton's default: 1 MiB); "
                   "a request whose tensors do not fit grows it, and it never shrinks")
    s.add_argument("--shm-growth-byte-size", type=_positive_int, metavar="BYTES", default=None,
                   help="DIR only: the step it grows by (Triton's default: 1 MiB); larger means fewer, larger "
                   "increments for requests with large tensors")
    s.set_defaults(func=_cmd_serve)

    _delegate(sub, "bench", "benchmark every form (ensemble, BLS, fused) locally and on a server",
              "Measure the pipeline in every form (ensemble, bls, bls-sync, fused; --forms picks some), in the "
              "local runtime and on a real Triton server, side by side: throughput, latency percentiles, "
              "per-model breakdown, plots and a verdict.",
              ["bench pipelines.examples.basic:diamond --concurrency 1,4,16 --duration 2 --out bench-diamond",
               "bench --forms ensemble,fused --concurrency 1:16 --out bench-yolov5",
               "bench pipelines.examples.basic:diamond --profile profile.json --no-server",
               "bench pipelines.examples.basic:diamond --url HOST:8000 --concurrency 1,4"],
              "pipelines.bench.command")

    _delegate(sub, "calibrate", "measure a Triton server's costs into a profile",
              "Run generated probe models on a Triton server (the bundled one by default) and fit a fixed cost "
              "plus a cost per byte for each boundary a request crosses, with a confidence interval for each; "
              "'pipelines predict' and 'pipelines advise' simulate that server from it (p.predict(profile), "
              "bench --profile).",
              ["calibrate --out profile.json", "calibrate --quick --out profile.json",
               "calibrate --url HOST:8001 --protocol grpc --out remote-grpc.json"],
              "pipelines.profiling.calibrate_command")

    _delegate(sub, "predict", "predict each form's latency and throughput on a profiled server",
              "Simulate the pipeline's forms on the server that a profile measured: the server's schedule "
              "(instances, dynamic batching, the ensemble scheduler, BLS rounds, the cores) on a virtual clock, "
              "with each step's cost measured here on the pipeline's own tensors. No server runs; a prediction "
              "takes seconds. Rows: form, load, p50/p95/p99, throughput and the bottleneck (the busiest model, "
              "or the cores).",
              ["predict pipelines.examples.yolov5:pipeline --profile profile.json",
               "predict pipelines.examples.basic:diamond --profile profile.json --concurrency 1,4,16 --json",
               "predict pipelines.examples.basic:diamond --profile profile.json --rate 200"],
              "pipelines.cli.predict_commands", "add_predict_arguments", "predict_main")

    _delegate(sub, "advise", "search forms, instance counts and batching for the fastest configuration",
              "Simulate hundreds of configurations (form, each step's instance_count, dynamic batching and its "
              "queue delay, the BLS or fused model's instances) and rank them by predicted throughput under a "
              "p95 bound (or by p95). Prints the top K with the exact options to set; --verify measures the "
              "top 3 and the default on a real server, --write writes the winner's repository.",
              ["advise pipelines.examples.yolov5:pipeline --profile profile.json --concurrency 8",
               "advise pipelines.examples.basic:diamond --profile profile.json --p95-ms 20 --top 3 --verify",
               "advise pipelines.examples.basic:diamond --profile profile.json --write model_repository"],
              "pipelines.cli.predict_commands", "add_advise_arguments", "advise_main")
    return parser


def _delegate(
    sub: Any, name: str, summary: str, description: str, examples: Sequence[str], module: str,
    add: str = "add_arguments", run: str = "main",
) -> None:
    """The subcommand ``name`` (``summary`` in the command list, ``description`` and ``examples``
    in its own --help), whose ``add_arguments(parser)`` and ``main(args)`` (or ``add`` and
    ``run``) live in ``module``.

    Imported when the parser is built, so importing ``pipelines.cli`` does not import the
    benchmark or the calibration.
    """
    parser = sub.add_parser(name, help=summary, description=description, **_examples(*examples))
    command = importlib.import_module(module)
    getattr(command, add)(parser)
    parser.set_defaults(func=getattr(command, run))


def _format_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> str:
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            # A command's warnings read as its errors do: one line each, not the library's source line.
            warnings.formatwarning = _format_warning
            return int(args.func(args) or 0)
    except PipelinesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
