"""``run_benchmark``: one pipeline measured every way, side by side, in one run.

The local runtime in each mode and the Triton server (embedded, or remote with
``url``) on each top-level model are all opened first, then measured one after
another at each concurrency level. Then the tables, ``results.json``, the plots
and the verdict.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import anyio

from ..errors import PipelinesError
from ..graph import Pipeline
from .inputs import sample_requests
from .loadgen import LoadPlan, LoadResult, run_load
from .local import local_target
from .measurement import FORMS, Configuration, Measurement
from .plots import plot_results
from .progress import Progress
from .results import BenchmarkResult, machine_info, now, package_versions
from .stability import StabilityRule
from .stats import breakdown
from .table import breakdown_table, local_table, ratio_table, results_table
from .triton import ServerTarget, model_name
from .verdict import compare_ratios, verdict

__all__ = ["DEFAULT_PIPELINE", "BenchSettings", "render", "run_benchmark"]

DEFAULT_PIPELINE = "pipelines.examples.yolov5:pipeline"
PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class BenchSettings:
    """Every option that shapes a benchmark run; recorded in ``results.json``."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    local: bool = True
    server_copies: bool = True
    server: bool = True
    url: str | None = None
    protocol: str = "http"
    batch: int = 1
    duration: float | None = 2.0
    requests: int | None = None
    warmup: float = 1.0
    stability: float = 0.1
    max_trials: int = 10
    forms: tuple[str, ...] = FORMS
    timeout: float = 60.0

    def __post_init__(self) -> None:
        levels = tuple(sorted({int(c) for c in self.concurrency}))
        if not levels or levels[0] < 1:
            raise PipelinesError(f"concurrency levels must be integers >= 1, such as 1,2,4; got {self.concurrency!r}")
        object.__setattr__(self, "concurrency", levels)
        if self.protocol not in PROTOCOLS:
            raise PipelinesError(f"--protocol must be 'http' or 'grpc'; got {self.protocol!r}")
        forms = tuple(self.forms)
        unknown = [f for f in forms if f not in FORMS]
        if unknown or not forms:
            raise PipelinesError(f"forms must be some of {list(FORMS)}; got {list(forms)}")
        object.__setattr__(self, "forms", forms)
        if self.requests is not None:
            object.__setattr__(self, "duration", None)
        if not (self.local or self.on_server):
            raise PipelinesError(
                "nothing to measure: the local runtime and the server are both off; "
                "drop --no-local, or give --server or --url HOST:PORT"
            )
        self.plan(levels[0])  # window, warm-up and stability options fail here, before any server starts

    @property
    def on_server(self) -> bool:
        return self.server or self.url is not None

    def plan(self, concurrency: int) -> LoadPlan:
        return LoadPlan(
            concurrency=concurrency,
            duration=self.duration,
            requests=self.requests,
            warmup=self.warmup,
            rule=StabilityRule(tolerance=self.stability, max_trials=self.max_trials),
            timeout=self.timeout,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["concurrency"] = list(self.concurrency)
        data["forms"] = list(self.forms)
        return data


def run_benchmark(
    target: Pipeline | str = DEFAULT_PIPELINE,
    *,
    concurrency: Sequence[int] = (1, 2, 4, 8, 16),
    local: bool = True,
    server_copies: bool = True,
    server: bool | None = None,
    url: str | None = None,
    protocol: str = "http",
    batch: int = 1,
    duration: float | None = 2.0,
    requests: int | None = None,
    warmup: float = 1.0,
    stability: float = 0.1,
    max_trials: int = 10,
    forms: Sequence[str] = FORMS,
    timeout: float = 60.0,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    size: int = 16,
    out: str | os.PathLike[str] | None = "bench-results",
    progress: bool = True,
    echo: bool | TextIO = True,
) -> BenchmarkResult:
    """Benchmark ``target`` (a Pipeline or ``"MODULE:ATTR"``) as ensemble, bls and bls-sync.

    ``server`` (default: on unless ``url`` is given) starts the embedded Triton
    server on the compiled repository; ``url`` (``HOST:PORT`` of ``protocol``)
    measures a remote server where the repository compiled with ``"both"`` is
    already deployed. ``server_copies`` makes the local runtime copy tensors where
    a server moves them between processes, so its figures predict the server's
    (see ``LocalRuntime``). Windows last ``duration`` seconds, or ``requests``
    answers. Requests are ``inputs`` if given, else the pipeline module's
    ``sample_inputs(batch)``, else random tensors (variable dims of ``size``).
    With ``out``, writes ``results.json``, ``throughput.png`` and
    ``latency_p95.png`` there (and the model repository it served). The
    tables and the verdict go to ``echo`` (True: stdout; False: nowhere; or a
    stream); the progress bar to stderr.
    """
    if server and url is not None:
        raise PipelinesError(
            f"choose the embedded server (--server) or a remote one (--url {url}), not both"
        )
    settings = BenchSettings(
        concurrency=tuple(concurrency),
        local=local,
        server_copies=server_copies,
        server=url is None if server is None else bool(server),
        url=url,
        protocol=protocol,
        batch=batch,
        duration=duration,
        requests=requests,
        warmup=warmup,
        stability=stability,
        max_trials=max_trials,
        forms=tuple(forms),
        timeout=timeout,
    )
    pipeline, module, spec = _resolve(target)
    samples = sample_requests(pipeline, module=module, inputs=inputs, batch=batch, size=size)
    bar = Progress(enabled=progress)
    out_dir = Path(out) if out is not None else None
    started = now()
    measurements: list[Measurement] = []
    extra_versions: dict[str, str | None] = {}

    with ExitStack() as stack:
        connect = None
        if settings.on_server:
            connect = _server(pipeline, settings, bar, out_dir, stack, extra_versions)
        measurements = _run_async(_measure, pipeline, samples, settings, bar, connect)

    comparisons = compare_ratios(measurements)
    text = verdict(measurements, pipeline=pipeline.name)
    files: list[str] = []
    if out_dir is not None:
        files += [str(p) for p in plot_results(measurements, out_dir, title=f"pipeline {pipeline.name!r}")]
        files.append(str(out_dir / "results.json"))
    result = BenchmarkResult(
        pipeline=spec or pipeline.name,
        settings={**settings.to_dict(), "samples": len(samples), "out": None if out is None else str(out)},
        measurements=tuple(measurements),
        comparisons=tuple(comparisons),
        verdict=text,
        machine=machine_info(),
        versions=package_versions(extra_versions),
        started=started,
        finished=now(),
        files=tuple(files),
    )
    if out_dir is not None:
        result.write(out_dir / "results.json")
    stream = sys.stdout if echo is True else echo or None
    if stream is not None:
        stream.write(render(result))
        stream.flush()
    return result


def render(result: BenchmarkResult) -> str:
    """The terminal report: results table, server breakdown, local costs, prediction, verdict."""
    s = result.settings
    window = f"{s['requests']} requests" if s.get("requests") else f"{s.get('duration')} s"
    parts = [
        f"\npipeline {result.pipeline}: ensemble vs BLS, batch {s.get('batch')}, "
        f"windows of {window}, stability ±{s.get('stability', 0):.0%}\n",
        results_table(result.measurements),
    ]
    server = [m for m in result.measurements if m.breakdown]
    if server:
        parts += ["\nserver time per request by model (µs, Triton statistics API, delta over the measured windows;\n"
                  "an ensemble's queue/in/infer/out are the sums of its composing models', as Triton reports them)",
                  breakdown_table(server)]
    local = [m for m in result.measurements if m.local_report]
    if local:
        parts += ["\nlocal runtime cost report (per request)", local_table(local)]
    if result.comparisons:
        parts += ["\nensemble/BLS p50 latency ratio: predicted by the local runtime vs measured on the server",
                  ratio_table(result.comparisons)]
    parts += ["\nverdict: " + result.verdict]
    if result.files:
        parts += [f"\nwrote {', '.join(result.files)}"]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- internal


def _resolve(target: Pipeline | str) -> tuple[Pipeline, ModuleType | None, str | None]:
    """The pipeline, the module it came from (for ``sample_inputs``), and its ``MODULE:ATTR``."""
    if isinstance(target, Pipeline):
        return target, sys.modules.get(getattr(target, "__module__", "") or ""), None
    if not isinstance(target, str):
        raise PipelinesError(f"benchmark a Pipeline or 'MODULE:ATTR'; got {type(target).__name__}")
    from ..cli import load_pipeline

    pipeline = load_pipeline(target)
    module_name = target.rpartition(":")[0]
    if module_name.endswith(".py") or os.sep in module_name:
        module_name = Path(module_name).stem  # load_pipeline registers a file under its stem
    return pipeline, sys.modules.get(module_name), target


def _run_async(fn: Callable[..., Any], *args: Any) -> Any:
    """``anyio.run``, from a worker thread when this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(fn, *args)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn, *args).result()


def _finish(bar: Progress, label: str, m: Measurement) -> None:
    lat = m.latency
    figures = (
        f"{m.throughput:,.1f} infer/s, p50 {lat.p50_ms:.2f} ms, p95 {lat.p95_ms:.2f} ms"
        if lat.count else "no successful request"
    )
    errors = f", {m.errors} errors" if m.errors else ""
    stable = "" if m.stable else f", NOT stable after {m.windows} windows"
    bar.finish(label, figures + errors + stable)


async def _measure(
    pipeline: Pipeline,
    samples: list[dict[str, Any]],
    settings: BenchSettings,
    bar: Progress,
    connect: Callable[[], Any] | None,
) -> list[Measurement]:
    """Measure every configuration at each level in turn.

    Every target is opened first and the levels are the outer loop, so the forms
    compared at one level are measured minutes apart at most: on a shared machine
    the load of other processes drifts, and this keeps the drift out of the ratios.
    """
    async with AsyncExitStack() as stack:
        targets: list[tuple[Configuration, Any]] = []
        if settings.local:
            for form in settings.forms:
                runtime = local_target(pipeline, form, server_copies=settings.server_copies)
                targets.append((Configuration("local", form), await stack.enter_async_context(runtime)))
        if connect is not None:
            client = await stack.enter_async_context(connect())
            for form in settings.forms:
                config = Configuration("server", form, model_name(pipeline.name, form))
                targets.append((config, ServerTarget(client, client, config.model, timeout=settings.timeout)))
        out = []
        for c in settings.concurrency:
            for config, target in targets:
                out.append(await _measure_one(config, target, samples, settings.plan(c), settings.batch, bar))
    order = {t[0]: i for i, t in enumerate(targets)}
    return sorted(out, key=lambda m: (order[m.config], m.concurrency))


async def _measure_one(
    config: Configuration, target: Any, samples: list[dict[str, Any]], plan: LoadPlan, batch: int, bar: Progress
) -> Measurement:
    label = f"{config.label} c={plan.concurrency}"
    if isinstance(target, ServerTarget):
        load = await run_load(target.infer, samples, plan, on_boundary=target.snapshot, progress=bar, label=label)
        m = Measurement.from_load(config, load, batch=batch, breakdown=tuple(_breakdown(load, config.model)))
    else:
        async def reset() -> None:
            target.reset()

        # The cost report starts afresh once the warm-up is over.
        load = await run_load(target.infer, samples, plan, on_boundary=_first_only(reset), progress=bar, label=label)
        m = Measurement.from_load(config, load, batch=batch, local_report=target.report())
    _finish(bar, label, m)
    return m


def _first_only(fn: Callable[[], Any]) -> Callable[[], Any]:
    called = False

    async def once() -> None:
        nonlocal called
        if not called:
            called = True
            await fn()

    return once


def _server(
    pipeline: Pipeline,
    settings: BenchSettings,
    bar: Progress,
    out_dir: Path | None,
    stack: ExitStack,
    versions: dict[str, str | None],
) -> Callable[[], Any]:
    """Start the embedded server (or reach the remote one); return how to make its async client."""
    from ..triton import AsyncTritonClient

    if settings.url is not None:
        url = settings.url
        bar.note(f"measuring the Triton server at {url} ({settings.protocol})")
        versions["tritonserver"] = _server_version(url, settings.protocol)
        return lambda: AsyncTritonClient(url, settings.protocol)
    server = _start_server(pipeline, out_dir, stack, bar)
    versions["tritonserver"] = _server_version(server.http_url, "http")
    return lambda: server.async_client(settings.protocol)  # fails fast if the server dies


def _breakdown(load: LoadResult, model: str | None):
    bracket = load.bracket
    if bracket is None:
        return []
    return breakdown(*bracket, first=[model] if model else [])


def _start_server(pipeline: Pipeline, out_dir: Path | None, stack: ExitStack, bar: Progress):
    from ..triton import TritonServer

    if out_dir is not None:
        repo_dir = out_dir / "model_repository"
    else:
        repo_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-bench-"))) / "repo"
    pipeline.compile("both").write(repo_dir, overwrite=True)
    bar.note(f"starting the embedded Triton server on {repo_dir}")
    server = stack.enter_context(TritonServer(repo_dir))
    bar.note(f"Triton server ready at {server.http_url} (http), {server.grpc_url} (grpc)")
    return server


def _server_version(url: str, protocol: str) -> str | None:
    """Triton's version from its metadata, over either protocol, or None if it will not say."""
    from ..triton import TritonClient

    try:
        with TritonClient(url, protocol, timeout=5) as client:
            return client.metadata().get("version")
    except PipelinesError:  # the version is a nicety of results.json, never a reason to stop
        return None
