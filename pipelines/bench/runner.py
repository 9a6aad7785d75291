"""``run_benchmark``: one pipeline measured every way, side by side, in one run.

The local runtime in each mode and the Triton server (embedded, or remote with
``url``) on each top-level model are all opened first, then measured one after
another at each concurrency level. With a server profile, the server's predicted
figures enter the report in one place (:func:`_prediction_rows`), beside the
measured ones. ``results.json`` is rewritten after every level, so a run that is interrupted (Ctrl-C, SIGTERM, a server that dies) keeps
every level it finished; then the tables and the verdict are printed, and the
plots are drawn last, only if matplotlib is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, ExitStack
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import anyio

from ..commands.loading import load_pipeline_and_module
from ..commands.output_paths import output_dir
from ..commands.progress import Progress
from ..compile import compile_pipeline
from ..core.graph import Graph
from ..core.plan import ensemble_refusal
from ..core.planning import plan_of, refuse_streaming_form
from ..errors import NotCompilableError, PipelinesError, sole_exception
from ..forms import FormLeftOutWarning
from ..freed_memory import keep_freed_memory_here
from ..triton.statistics import breakdown_over
from .inputs import sample_requests
from .loadgen import LoadResult, run_load
from .local_target import local_target
from .measurement import FORMS, Configuration, Measurement
from .plots import PLOT_EXTRA, PLOT_FILES, plot_results
from .report_tables import render
from .results import BenchmarkResult, machine_info, now, package_versions
from .server_target import ServerTarget, StreamingServerTarget, check_streaming_settings, model_name
from .settings import DEFAULT_PIPELINE, BenchSettings
from .verdict import compare_ratios, verdict

__all__ = ["DEFAULT_PIPELINE", "BenchSettings", "render", "run_benchmark"]

RESULTS_FILE = "results.json"


def run_benchmark(
    target: Graph | str = DEFAULT_PIPELINE,
    settings: BenchSettings | None = None,
    *,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    out: str | os.PathLike[str] | None = "bench-results",
    progress: bool = True,
    echo: bool | TextIO = True,
) -> BenchmarkResult:
    """Benchmark ``target`` (a Pipeline or ``"MODULE:ATTR"``) as ensemble, bls and bls-sync.

    ``settings`` (default: ``BenchSettings()``) says where and how to measure.
    Requests are ``inputs`` if given, else the pipeline module's
    ``sample_inputs(batch)``, else random tensors. With ``out``, writes
    ``results.json`` there after every concurrency level, the model repository it
    served, and ``throughput.png`` and ``latency_p95.png`` when matplotlib is
    installed. The tables and the verdict go to ``echo`` (True: stdout; False:
    nowhere; or a stream); the progress bar to stderr.

    Interrupted (KeyboardInterrupt) or failing part-way, it writes the levels it
    finished to ``results.json`` (``status`` says why it stopped), stops the
    server it started, and raises again; the exception's ``benchmark_result``
    holds the same partial result.
    """
    settings = BenchSettings() if settings is None else settings
    if not isinstance(settings, BenchSettings):
        raise PipelinesError(f"run_benchmark takes a BenchSettings as settings; got {type(settings).__name__}")
    pipeline, module, spec = _resolve(target)
    check_streaming_settings(pipeline, settings)
    left_out = _ensemble_left_out(pipeline, settings)
    if left_out:
        settings = replace(settings, forms=tuple(f for f in settings.forms if f != "ensemble"))
        print(left_out, file=sys.stderr, flush=True)
    # One memory behaviour for every measurement of this process, local or the server's
    # client side, as calibration had (see pipelines.freed_memory).
    keep_freed_memory_here()
    samples = sample_requests(pipeline, module=module, inputs=inputs, batch=settings.batch, size=settings.size)
    bar = Progress(enabled=progress)
    out_dir = output_dir(out, "the results directory (out)") if out is not None else None
    # Before anything is measured: a bad profile is refused before it replaces an earlier run's results.json.
    predictions = tuple(_prediction_rows(settings, pipeline, samples))
    stream = sys.stdout if echo is True else echo or None
    started = now()
    measurements: list[Measurement] = []
    versions: dict[str, str | None] = {}
    server_notes: list[str] = []  # what the server measured is not the deployed model (a stand-in)
    if pipeline.streaming and settings.on_server and settings.protocol != "grpc":
        server_notes.append("the server's streams were measured over gRPC (ModelStreamInfer), whatever --protocol says")

    def result(status: str, files: Sequence[str] = (), notes: Sequence[str] = ()) -> BenchmarkResult:
        ordered = sorted(measurements, key=_order)
        notes = [*([left_out] if left_out else []), *server_notes, *notes]
        return BenchmarkResult(
            pipeline=spec or pipeline.name,
            settings={**settings.to_dict(), "samples": len(samples), "out": None if out is None else str(out)},
            measurements=tuple(ordered),
            comparisons=tuple(compare_ratios(ordered)),
            verdict=verdict(ordered, pipeline=pipeline.name, predictions=predictions) if ordered else "nothing was measured",
            machine=machine_info(),
            versions=package_versions(versions),
            started=started,
            finished=now(),
            files=tuple(files),
            status=status,
            notes=tuple(notes),
            predictions=predictions,
        )

    results_path = out_dir / RESULTS_FILE if out_dir is not None else None
    writing = False  # whether this run has written results.json (an earlier complete run set aside first)

    def save(status: str, files: Sequence[str] = (), notes: Sequence[str] = ()) -> BenchmarkResult:
        nonlocal writing
        r = result(status, [*files, *([str(results_path)] if results_path else [])], notes)
        if out_dir is not None and results_path is not None:
            if not writing:
                _set_aside_a_complete_run(out_dir)
                writing = True
            r.write(results_path)
        return r

    def level_done(concurrency: int, last: bool) -> None:
        save("complete" if last else f"running: levels up to concurrency {concurrency} done")

    try:
        with ExitStack() as stack:
            connect = None
            if settings.on_server:
                connect = _server(pipeline, settings, bar, out_dir, stack, versions, server_notes)
            _run_async(_measure, pipeline, samples, settings, bar, connect, measurements, level_done)
    except BaseException as raised:
        exc = sole_exception(raised)  # a step's error, not the task group that carried it
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed: {type(exc).__name__}: {exc}"
        # Nothing measured: an earlier run's results.json is worth more than a record of this failure.
        kept_earlier = not measurements and results_path is not None and results_path.exists()
        partial = result(why) if kept_earlier else save(why)
        # Said even with the progress bar off: the reader must know the figures are partial.
        print(
            f"{why}; {len(measurements)} finished measurements kept"
            + (f" in {results_path}" if results_path is not None and not kept_earlier else "")
            + (f" ({results_path}, an earlier run's, was left as it was)" if kept_earlier else "")
            + (f"; the earlier complete run's results are in {kept[0]}" if (kept := _previous(out_dir)) else ""),
            file=sys.stderr,
            flush=True,
        )
        if stream is not None and measurements:
            stream.write(render(partial))
            stream.flush()
        exc.benchmark_result = partial  # for a caller without `out`: what was finished is not lost
        if exc is raised:
            raise
        raise exc from None  # its own traceback still shows where it was raised

    # The figures are safe on disk before anything optional (plots) can fail.
    final = save("complete")
    if stream is not None:
        stream.write(render(final, files=False))
        stream.flush()
    files: list[str] = []
    notes: list[str] = []
    if out_dir is not None:
        try:
            files = [str(p) for p in plot_results(final.measurements, out_dir, title=f"pipeline {pipeline.name!r}")]
        except ImportError:
            notes.append(f"no plots: matplotlib is not installed (pip install 'pipelines[{PLOT_EXTRA}]')")
        except Exception as exc:  # a plot is a view of results.json, never a reason to lose it
            notes.append(f"no plots: {type(exc).__name__}: {exc}")
        final = save("complete", files, notes)
    if out_dir is not None:  # an earlier complete run set aside, now or by an interrupted rerun: replaced
        for earlier in _previous(out_dir):
            earlier.unlink(missing_ok=True)
    if stream is not None:
        stream.write(render(final, tables=False))
        stream.flush()
    return final


# ---------------------------------------------------------------------------- internal


def _prediction_rows(
    settings: BenchSettings, pipeline: Graph, requests: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The one place where a prediction of the server enters the benchmark's report.

    Rows of ``form``, ``concurrency``, ``p50_ms`` and ``throughput`` (as
    ``p.predict(profile, ...).rows`` gives them) for ``settings.profile`` at
    ``settings.concurrency`` over ``settings.forms``, predicted from ``requests`` (the
    samples the benchmark sends); :func:`~pipelines.bench.report_tables.prediction_table`
    sets them beside the server's measurements, with the error of each figure. Called
    before anything is measured, so that a profile it refuses leaves earlier results alone.

    The steps are profiled on the first sample (kept beside a profile file), the server's
    schedule simulated (:mod:`pipelines.predict`); a profile from another machine is refused
    unless ``settings.allow_mismatch``.
    """
    if settings.profile is None:
        return []
    from ..measured_prediction import predict

    prediction = predict(pipeline, settings.profile, concurrency=settings.concurrency, forms=settings.forms,
                         inputs=requests[0], allow_mismatch=settings.allow_mismatch)
    return prediction.as_dicts()



def _set_aside_a_complete_run(out_dir: Path) -> None:
    """Before a run writes its first level: an earlier *complete* run's ``results.json`` and
    plots become ``results.previous.json`` and ``*.previous.png``, so that an interrupted rerun
    into the same directory does not lose them (nor leave its plots beside other figures).
    A complete rerun deletes them."""
    try:
        earlier = json.loads((out_dir / RESULTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(earlier, dict) or earlier.get("status") != "complete":
        return  # an interrupted run's levels: this rerun of it replaces them
    # One run's files as a unit: an older run's plots must not stay beside these results
    # (a run stopped while plotting has results but no plots).
    for older in _previous(out_dir):
        older.unlink()
    for name, aside in zip((RESULTS_FILE, *PLOT_FILES), _previous(out_dir, existing=False), strict=True):
        if (out_dir / name).is_file():
            os.replace(out_dir / name, aside)


def _previous(out_dir: Path | None, *, existing: bool = True) -> list[Path]:
    """The names an earlier complete run's files are set aside under (those there, with ``existing``)."""
    if out_dir is None:
        return []
    names = [out_dir / f"{Path(n).stem}.previous{Path(n).suffix}" for n in (RESULTS_FILE, *PLOT_FILES)]
    return [p for p in names if p.is_file()] if existing else names


def _order(m: Measurement) -> tuple[int, int, int]:
    where = 0 if m.config.where == "local" else 1
    return where, FORMS.index(m.config.form), m.concurrency


def _resolve(target: Graph | str) -> tuple[Graph, ModuleType | None, str | None]:
    """The pipeline, the module it came from (for ``sample_inputs``), and its ``MODULE:ATTR``."""
    if isinstance(target, Graph):
        return target, sys.modules.get(getattr(target, "__module__", "") or ""), None
    if not isinstance(target, str):
        raise PipelinesError(f"benchmark a Pipeline or 'MODULE:ATTR'; got {type(target).__name__}")
    pipeline, module = load_pipeline_and_module(target)
    return pipeline, module, target


def _run_async(fn: Callable[..., Any], *args: Any) -> Any:
    """``anyio.run``, from a worker thread when this thread already runs a loop (Jupyter).

    There, Ctrl-C reaches this thread, not the worker: it cancels the worker's run,
    waits for it to close what it opened, and raises here.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # outside the `except`: errors of the run are not chained to "no running event loop"
        return anyio.run(fn, *args)
    handle: dict[str, Any] = {}

    async def cancellable() -> Any:
        with anyio.CancelScope() as scope:
            handle["cancel"] = (asyncio.get_running_loop(), scope.cancel)
            return await fn(*args)
        raise KeyboardInterrupt  # only reached when the scope was cancelled from outside

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(anyio.run, cancellable)
        try:
            return future.result()
        except KeyboardInterrupt:
            if "cancel" in handle:
                loop, cancel = handle["cancel"]
                # The run may have ended just now and closed its loop: then there is nothing to cancel, and
                # the Ctrl-C must still be what this call raises.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(cancel)
            future.exception()  # wait until it has unwound
            raise


def _finish(bar: Progress, label: str, m: Measurement) -> None:
    lat, st = m.latency, m.stream
    figures = (
        f"{m.throughput:,.1f} infer/s, p50 {lat.p50_ms:.2f} ms, p95 {lat.p95_ms:.2f} ms"
        if lat.count else "no successful request"
    )
    if st is not None and st.ttft.count:
        figures = (f"{st.requests_per_s:,.1f} req/s, {st.responses_per_s:,.1f} resp/s, first response p50 "
                   f"{st.ttft.p50_ms:.2f} ms" + (f", between p50 {st.itl.p50_ms:.2f} ms" if st.itl.count else ""))
    errors = f", {m.errors} errors" if m.errors else ""
    stable = "" if m.stable else f", NOT stable after {m.windows} windows"
    bar.finish(label, figures + errors + stable)


async def _measure(
    pipeline: Graph,
    samples: list[dict[str, Any]],
    settings: BenchSettings,
    bar: Progress,
    connect: tuple[Callable[[], Any], str | None] | None,
    measurements: list[Measurement],
    level_done: Callable[[int, bool], None],
) -> None:
    """Measure every configuration at each level in turn, into ``measurements``.

    Every target is opened first and the levels are the outer loop, so the forms
    compared at one level are measured minutes apart at most: on a shared machine
    the load of other processes drifts, and this keeps the drift out of the ratios.
    With ``settings.turns`` > 1 each level goes round the targets that many times
    (a warm-up in the first turn only) and pools each target's turns, so a drift of
    seconds moves every target alike too. ``level_done`` is called after each level
    (it saves what is finished).
    """
    async with AsyncExitStack() as stack:
        targets: list[tuple[Configuration, Any]] = []
        if settings.local:
            for form in settings.forms:
                runtime = local_target(pipeline, form, server_copies=settings.server_copies, isolation=settings.isolation)
                targets.append((Configuration("local", form), await stack.enter_async_context(runtime)))
        if connect is not None:
            make_client, grpc_url = connect
            client = await stack.enter_async_context(make_client())
            for form in settings.forms:
                config = Configuration("server", form, model_name(pipeline.name, form))
                if pipeline.streaming and grpc_url is not None:
                    streamed = StreamingServerTarget(grpc_url, client, config.model, pipeline.inputs, timeout=settings.timeout)
                    stack.push_async_callback(streamed.close)
                    targets.append((config, streamed))
                    continue
                targets.append((config, ServerTarget(client, client, config.model, timeout=settings.timeout)))
        for i, c in enumerate(settings.concurrency):
            plan = settings.plan(c)
            loads: list[list[LoadResult]] = [[] for _ in targets]
            # At each window's edge: the server's statistics, or (once) the local cost report's reset.
            boundaries = [t.snapshot if isinstance(t, ServerTarget) else _reset_once(t) for _, t in targets]
            for turn in range(settings.turns):
                # Later turns need no warm-up: the models are warm, and the local cost report
                # (reset once, after the first warm-up) then covers exactly the measured windows.
                turn_plan = plan if turn == 0 else replace(plan, warmup=0.0)
                for k, (config, target) in enumerate(targets):
                    label = _label(config, c, turn, settings.turns)
                    loads[k].append(await run_load(target.infer, samples, turn_plan, on_boundary=boundaries[k],
                                                   progress=bar, label=label))
                    if turn == settings.turns - 1:  # kept at once: an interrupted level keeps what it finished
                        m = _measurement(config, target, loads[k], settings.batch,
                                         [cfg.model for cfg, _ in targets if cfg.model and cfg.model != config.model])
                        _finish(bar, f"{config.label} c={c}", m)
                        measurements.append(m)
            level_done(c, i == len(settings.concurrency) - 1)


def _label(config: Configuration, concurrency: int, turn: int, turns: int) -> str:
    label = f"{config.label} c={concurrency}"
    return f"{label} (turn {turn + 1}/{turns})" if turns > 1 else label


def _measurement(config: Configuration, target: Any, loads: Sequence[LoadResult], batch: int,
                 others: Sequence[str] = ()) -> Measurement:
    """One target's turns at one level, pooled into one measurement (the server's statistics summed;
    ``others``: the top-level models of the other server targets, whose late requests are theirs)."""
    load = LoadResult.pooled(loads)
    streaming = bool(getattr(target, "streaming", False))
    if isinstance(target, ServerTarget):
        brackets = [b for one in loads if (b := one.bracket) is not None]
        times = breakdown_over(brackets, first=[config.model] if config.model else [], leave_out=others)
        return Measurement.from_load(config, load, batch=batch, breakdown=tuple(times), streaming=streaming)
    return Measurement.from_load(config, load, batch=batch, local_report=target.report(), streaming=streaming)


def _reset_once(target: Any) -> Callable[[], Any]:
    """The local cost report starts afresh once the first warm-up is over, and only then."""
    called = False

    async def once() -> None:
        nonlocal called
        if not called:
            called = True
            target.reset()

    return once


def _server(
    pipeline: Graph,
    settings: BenchSettings,
    bar: Progress,
    out_dir: Path | None,
    stack: ExitStack,
    versions: dict[str, str | None],
    notes: list[str],
) -> tuple[Callable[[], Any], str | None]:
    """Start the embedded server (or reach the remote one); return how to make its async client,
    and its gRPC address (None for a remote one over HTTP), where streams are measured.
    ``notes`` gets a line for each model the embedded server serves through a stand-in."""
    from ..triton import AsyncTritonClient

    if settings.url is not None:
        url = settings.url
        bar.note(f"measuring the Triton server at {url} ({settings.protocol})")
        versions["tritonserver"] = _version_at(url, settings.protocol, 10)  # one it cannot reach fails now, not last
        return (lambda: AsyncTritonClient(url, settings.protocol, compression=settings.compression),
                url if settings.protocol == "grpc" else None)
    server = _start_server(pipeline, out_dir, stack, bar)
    for stand_in in server.stand_ins.values():
        # Said once, in the report's notes; the server's start has already said it in short.
        notes.append(f"server figures measured with a STAND-IN for {stand_in.model!r}: {stand_in.label}; "
                     "measure a full Triton with --url HOST:PORT for that model's own")
    versions["tritonserver"] = _server_version(server.http_url, "http")
    # fails fast if it dies
    return lambda: server.async_client(settings.protocol, compression=settings.compression), server.grpc_url


def _ensemble_left_out(pipeline: Graph, settings: BenchSettings) -> str | None:
    """Why the ensemble is not measured (a pipeline with ``when`` blocks, a stream read whole),
    or None where it is."""
    if "ensemble" not in settings.forms:
        return None
    why = ensemble_refusal(plan_of(pipeline, warn=False)) if pipeline.conditional else None
    try:
        refuse_streaming_form(pipeline, "ensemble")
    except NotCompilableError as exc:
        why = why or exc.message
    if why is None:
        return None
    if settings.forms == ("ensemble",):
        raise NotCompilableError(f"{why}: benchmark --forms bls,fused", pipeline=pipeline.name)
    return f"ensemble left out: {why}"


def write_bench_repository(pipeline: Graph, out_dir: Path | None, stack: ExitStack) -> Path:
    """Write the pipeline's three forms for the server: into ``out_dir/model_repository`` beside
    whatever else is there (only this pipeline's own models are replaced), or a temporary directory."""
    if out_dir is not None:
        repo_dir = out_dir / "model_repository"
    else:
        repo_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-bench-"))) / "repo"
    from ..compile.repository import write_models

    # The bench offers no way to replace what is not its own: the refusal says so.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormLeftOutWarning)  # run_benchmark has said so already
        repository = compile_pipeline(pipeline.validate(), "all")
    return write_models(repository, repo_dir, overwrite_hint=None)


def _start_server(pipeline: Graph, out_dir: Path | None, stack: ExitStack, bar: Progress):
    from ..compile import repository_pipelines
    from ..triton import TritonServer

    repo_dir = write_bench_repository(pipeline, out_dir, stack)
    bar.note(f"starting the embedded Triton server on {repo_dir}")
    # A run that met a crash measured two servers: it ends there, with why, and is not started again.
    server = stack.enter_context(TritonServer(repo_dir, restart_on_crash=False))
    # Models of the user's beside the bench's may fail to load; its own must not.
    server.require(repository_pipelines(repo_dir).get(pipeline.name, []))
    bar.note(f"Triton server ready at {server.http_url} (http), {server.grpc_url} (grpc)")
    return server


def _version_at(url: str, protocol: str, timeout: float) -> str | None:
    """Triton's version from its metadata, over either protocol; ``ServerError`` if it cannot be reached."""
    from ..triton import TritonClient

    with TritonClient(url, protocol, timeout=timeout) as client:
        return client.metadata().get("version")


def _server_version(url: str, protocol: str) -> str | None:
    """:func:`_version_at`, or None if the server will not say."""
    try:
        return _version_at(url, protocol, 5)
    except PipelinesError:  # the version is a nicety of results.json, never a reason to stop
        return None
