"""The benchmark's report as text, the way perf_analyzer users read it: one row per
configuration and concurrency, the server's per-model time breakdown, the local
cost report, the prediction against the measurement, and the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..tables import format_table
from .measurement import Measurement
from .results import BenchmarkResult
from .verdict import RatioComparison

__all__ = [
    "breakdown_table",
    "local_table",
    "prediction_table",
    "ratio_table",
    "render",
    "results_table",
    "stream_table",
]


def render(result: BenchmarkResult, *, tables: bool = True, files: bool = True) -> str:
    """The terminal report: the tables and the verdict, then notes and the files written."""
    parts = []
    if tables:
        s = result.settings
        window = f"{s['requests']} requests" if s.get("requests") else f"{s.get('duration')} s"
        parts += [
            f"\npipeline {result.pipeline}: {', '.join(s.get('forms') or ())}, batch {s.get('batch')}, "
            f"windows of {window}, stability ±{s.get('stability', 0):.0%}"
            + (f", server requests and responses compressed with {s['compression']} (--compression)"
               if s.get("compression") else "") + "\n",
            stream_table(result.measurements) if _streams(result.measurements) else results_table(result.measurements),
        ]
        if _streams(result.measurements):
            parts += ["(ms; first: time to first response, between: time between one request's consecutive responses, "
                      "stream: the whole request; req/s and resp/s over the measured windows)"]
        server = [m for m in result.measurements if m.breakdown]
        if server:
            parts += ["\nserver time per request by model (µs, Triton statistics API, delta over the measured "
                      "windows;\nan ensemble's queue/in/infer/out are the sums of its composing models', as Triton "
                      "reports them)", breakdown_table(server)]
        local = [m for m in result.measurements if m.local_report]
        if local:
            parts += ["\nlocal runtime cost report (per request, measured in this process)", local_table(local)]
        side = prediction_table(result.predictions, result.measurements)
        if side:
            parts += ["\npredicted from the profile vs measured (server), per form and concurrency", side]
        if result.comparisons:
            parts += ["\nensemble/BLS p50 latency ratio: in the local runtime (in-process, no server costs) vs on the server",
                      ratio_table(result.comparisons)]
        parts += ["\nverdict: " + result.verdict]
        if result.status != "complete":
            parts += [f"\nstatus: {result.status} (these are the measurements it finished; its last level may lack some)"]
    if files:
        parts += [f"\nnote: {note}" for note in result.notes]
        if result.files:
            parts += [f"\nwrote {', '.join(result.files)}"]
    return "\n".join(parts) + "\n" if parts else ""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _streams(measurements: Sequence[Measurement]) -> bool:
    return any(m.stream is not None for m in measurements)


def _row(m: Measurement, *figures: str) -> list[str]:
    """A measurement's row: its configuration and concurrency, ``figures``, its errors and whether
    it was stable (the columns of :func:`_headers`)."""
    return [m.config.label, str(m.concurrency), *figures, str(m.errors), "yes" if m.stable else "NO"]


def _headers(*figures: str) -> list[str]:
    return ["configuration", "conc", *figures, "errors", "stable"]


def stream_table(measurements: Sequence[Measurement]) -> str:
    """A streaming pipeline's figures: requests and responses per second, time to first response
    (p50, p95, p99), time between responses (p50, p99) and the whole stream's p50, in ms."""
    headers = _headers("req/s", "resp/s", "first p50", "p95", "p99", "between p50", "p99", "stream p50")
    rows = [
        _row(m, f"{st.requests_per_s:.1f}", f"{st.responses_per_s:.1f}",
             _ms(st.ttft.p50_ms), _ms(st.ttft.p95_ms), _ms(st.ttft.p99_ms),
             _ms(st.itl.p50_ms), _ms(st.itl.p99_ms), _ms(m.latency.p50_ms))
        for m in measurements
        if (st := m.stream) is not None
    ]
    return format_table(headers, rows)


def results_table(measurements: Sequence[Measurement]) -> str:
    headers = _headers("infer/s", "avg ms", "p50", "p90", "p95", "p99")
    rows = [
        _row(m, f"{m.throughput:.1f}", _ms(m.latency.avg_ms), _ms(m.latency.p50_ms), _ms(m.latency.p90_ms),
             _ms(m.latency.p95_ms), _ms(m.latency.p99_ms))
        for m in measurements
    ]
    return format_table(headers, rows)


def breakdown_table(measurements: Sequence[Measurement]) -> str:
    """Per-model server time per request (µs) for every server measurement."""
    headers = ["configuration", "conc", "model", "requests", "execs", "queue", "in", "infer", "out", "total"]
    rows = []
    for m in measurements:
        for t in m.breakdown:
            rows.append([
                m.config.label,
                str(m.concurrency),
                t.model,
                str(t.requests),
                str(t.executions),
                f"{t.queue_us:.0f}",
                f"{t.compute_input_us:.0f}",
                f"{t.compute_infer_us:.0f}",
                f"{t.compute_output_us:.0f}",
                f"{t.total_us:.0f}",
            ])
    return format_table(headers, rows) if rows else ""


def ratio_table(comparisons: Sequence[RatioComparison]) -> str:
    headers = ["ensemble / ...", "conc", "predicted (local)", "measured (server)", "gap"]
    rows = [
        [r.versus, str(r.concurrency), f"{r.predicted:.3f}", f"{r.measured:.3f}", f"{r.gap:+.1%}"]
        for r in comparisons
    ]
    return format_table(headers, rows) if rows else ""


def local_table(measurements: Sequence[Measurement]) -> str:
    """The local runtime's cost report per measurement: copies, bytes, parallelism, overhead."""
    headers = ["configuration", "conc", "copies", "bytes copied", "parallelism", "latency/critical", "overhead µs"]
    rows = []
    for m in measurements:
        r = m.local_report or {}
        n = max(int(r.get("requests") or 0), 1)
        overhead = sum(float(s.get("overhead_us") or 0.0) for s in r.get("steps") or ())
        ratio = r.get("latency_over_critical_path")
        rows.append([
            m.config.label,
            str(m.concurrency),
            f"{(r.get('copies') or 0) / n:.1f}",
            f"{(r.get('copy_bytes') or 0) / n:,.0f}",
            f"{float(r.get('parallelism') or 0.0):.2f}",
            "-" if ratio is None else f"{float(ratio):.2f}",
            f"{overhead:.0f}",
        ])
    return format_table(headers, rows) if rows else ""


def prediction_table(predictions: Sequence[Mapping[str, Any]], measurements: Sequence[Measurement]) -> str:
    """The server's predicted p50 and throughput (rows of ``form``, ``concurrency``, ``p50_ms``,
    ``throughput``) against the server's measured ones, with the error of each; a prediction
    with no server measurement at its form and concurrency has no row."""
    server = {(m.config.form, m.concurrency): m for m in measurements if m.config.where == "server"}
    headers = ["form", "conc", "predicted p50", "measured p50", "error", "predicted infer/s", "measured infer/s",
               "error"]
    rows = []
    for row in sorted(predictions, key=lambda r: (int(r["concurrency"]), str(r["form"]))):
        form, c = str(row["form"]), int(row["concurrency"])
        measured = server.get((form, c))
        if measured is None:
            continue
        p, s = row.get("p50_ms"), measured.latency.p50_ms
        t = row.get("throughput")
        rows.append([form, str(c), _ms(p), _ms(s), _error(p, s), "-" if t is None else f"{float(t):.1f}",
                     f"{measured.throughput:.1f}", _error(t, measured.throughput)])
    return format_table(headers, rows) if rows else ""


def _error(predicted: float | None, measured: float | None) -> str:
    if not predicted or not measured:
        return "-"
    return f"{predicted / measured - 1:+.1%}"
