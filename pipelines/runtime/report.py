"""The cost report of the local runtime: where the time and the bytes go.

A :class:`Report` covers one request or many: per step the queue wait, compute
and scheduling overhead, the copies between devices, the critical path and the
parallelism achieved. :func:`compare` sets two reports (ensemble against BLS)
side by side with ratios.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import NotFoundError
from ..percentiles import percentiles
from ..tables import format_table

__all__ = ["Comparison", "CostRecorder", "Report", "StepCost", "compare"]


@dataclass(frozen=True)
class StepCost:
    """One step's costs, as a mean per execution for one request (microseconds).

    ``calls`` counts executions on behalf of requests; ``batches`` counts the
    calls of the step's function (fewer when dynamic batching merged requests).
    """

    step: str
    calls: int
    batches: int
    queue_wait_us: float
    compute_us: float
    overhead_us: float

    @property
    def mean_batch(self) -> float:
        """Requests served per call of the step's function."""
        return self.calls / self.batches if self.batches else 0.0


@dataclass(frozen=True)
class Report:
    """Costs of one request, or aggregated over many (``requests`` says which).

    Times are means per successful request, in microseconds. ``parallelism`` is
    the sum of step compute divided by the wall time; ``latency_over_critical_path``
    near 1 means independent steps overlapped as well as the graph allows.
    ``copies`` and ``copy_bytes`` are totals over the ``requests`` (divide for
    one request's share). These are measured in this process, not predictions of a
    server (``p.predict(profile, ...)`` gives those). ``in_processes`` names the steps
    whose instances ran in processes of their own (``isolation="process"``).
    """

    pipeline: str
    mode: str
    requests: int
    errors: int
    latency_us: float
    latency_p50_us: float
    latency_p99_us: float
    throughput_rps: float
    steps: tuple[StepCost, ...]
    copies: int
    copy_bytes: int
    critical_path: tuple[str, ...]
    critical_path_us: float
    parallelism: float
    in_processes: tuple[str, ...] = ()

    @property
    def latency_over_critical_path(self) -> float:
        return self.latency_us / self.critical_path_us if self.critical_path_us else math.nan

    @property
    def step_time_us(self) -> float:
        """Compute summed over all steps, per request."""
        return sum(s.compute_us for s in self.steps)

    @property
    def overhead_us(self) -> float:
        """Scheduling overhead summed over all steps, per request."""
        return sum(s.overhead_us for s in self.steps)

    def step(self, name: str) -> StepCost:
        for s in self.steps:
            if s.step == name:
                return s
        raise NotFoundError(
            f"report of pipeline {self.pipeline!r} has no step {name!r}; it has {[s.step for s in self.steps]}"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["critical_path"] = list(self.critical_path)
        data["in_processes"] = list(self.in_processes)
        data["latency_over_critical_path"] = _finite(self.latency_over_critical_path)
        data["steps"] = [dict(asdict(s), mean_batch=s.mean_batch) for s in self.steps]
        return {k: _finite(v) for k, v in data.items()}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def __str__(self) -> str:
        head = (
            f"pipeline {self.pipeline!r}, mode {self.mode!r}: {self.requests} request(s), {self.errors} error(s)\n"
            f"latency {_us(self.latency_us)} (p50 {_us(self.latency_p50_us)}, p99 {_us(self.latency_p99_us)}), "
            f"throughput {self.throughput_rps:.1f} req/s\n"
            f"critical path {_us(self.critical_path_us)} via {' -> '.join(self.critical_path) or '-'}; "
            f"latency / critical path {self.latency_over_critical_path:.2f}; parallelism {self.parallelism:.2f}\n"
            f"copies between devices: {self.copies} ({_bytes(self.copy_bytes)})\n"
        )
        if self.in_processes:
            head += f"steps in processes of their own: {', '.join(self.in_processes)}\n"
        rows = [
            (s.step, str(s.calls), f"{s.mean_batch:.1f}", _us(s.queue_wait_us), _us(s.compute_us), _us(s.overhead_us))
            for s in self.steps
        ]
        rows.append(
            (
                "total",
                "",
                "",
                _us(sum(s.queue_wait_us for s in self.steps)),
                _us(self.step_time_us),
                _us(self.overhead_us),
            )
        )
        return head + _table(("step", "calls", "batch", "queue wait", "compute", "overhead"), rows)


@dataclass(frozen=True)
class Comparison:
    """Two reports side by side; ``ratio`` is b / a for each figure."""

    a: Report
    b: Report
    rows: tuple[tuple[str, float, float], ...] = field(default=())

    def ratio(self, figure: str) -> float:
        for name, x, y in self.rows:
            if name == figure:
                return y / x if x else math.nan
        raise NotFoundError(f"no figure {figure!r}; figures are {[r[0] for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.mode,
            "b": self.b.mode,
            "figures": {
                name: {"a": _finite(x), "b": _finite(y), "ratio": _finite(y / x if x else math.nan)}
                for name, x, y in self.rows
            },
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def __str__(self) -> str:
        out = []
        for name, x, y in self.rows:
            ratio = y / x if x else math.nan
            fmt = _bytes if "bytes" in name else (_us if name.endswith("_us") else (lambda v: f"{v:.2f}"))
            # the value carries its own unit (µs, ms, s), so the name does not: no "latency_us 24.18 ms"
            shown = name.removesuffix("_us")
            out.append((shown, fmt(x), fmt(y), "–" if math.isnan(ratio) else f"{ratio:.2f}"))
        title = f"pipeline {self.a.pipeline!r}: {self.a.mode} (a) against {self.b.mode} (b)\n"
        return title + _table(("figure", self.a.mode, self.b.mode, "b / a"), out)


def compare(report_a: Report, report_b: Report) -> Comparison:
    """Set two reports side by side (e.g. ensemble against BLS), with ratios b / a."""
    rows: list[tuple[str, float, float]] = []
    for figure in (
        "latency_us",
        "latency_p99_us",
        "throughput_rps",
        "critical_path_us",
        "parallelism",
        "latency_over_critical_path",
        "step_time_us",
        "overhead_us",
        "copies",
        "copy_bytes",
    ):
        rows.append((figure, float(getattr(report_a, figure)), float(getattr(report_b, figure))))
    names = [s.step for s in report_a.steps]
    others = {s.step: s for s in report_b.steps}
    for name in names:
        if name in others:
            sa, sb = report_a.step(name), others[name]
            rows.append((f"{name}.queue_wait_us", sa.queue_wait_us, sb.queue_wait_us))
            rows.append((f"{name}.compute_us", sa.compute_us, sb.compute_us))
            rows.append((f"{name}.overhead_us", sa.overhead_us, sb.overhead_us))
    return Comparison(report_a, report_b, tuple(rows))


class CostRecorder:
    """Running sums behind :class:`Report`; memory stays flat however many requests it sees.

    ``trace`` entries are ``(step, queue_wait_s, compute_s, overhead_s, batch)``
    where ``batch`` is how many requests shared that call of the step.
    """

    #: Latencies kept for percentiles, in a buffer allocated once so a soak does not grow.
    WINDOW = 65_536

    def __init__(
        self,
        *,
        pipeline: str,
        mode: str,
        steps: Sequence[str],
        critical_path: Callable[[Mapping[str, float]], tuple[list[str], float]],
    ) -> None:
        self._pipeline = pipeline
        self._mode = mode
        self._steps = list(steps)
        self._critical_path = critical_path
        self.reset()

    def reset(self) -> None:
        self._requests = 0
        self._errors = 0
        self._latency = 0.0
        self._latencies = np.zeros(self.WINDOW)
        self._sums = {s: [0, 0.0, 0.0, 0.0, 0.0] for s in self._steps}  # calls, batches, queue, compute, overhead
        self._copies = 0
        self._copy_bytes = 0
        self._first: float | None = None
        self._last = 0.0

    def error(self) -> None:
        self._errors += 1

    def record(
        self,
        trace: Iterable[tuple[str, float, float, float, int]],
        *,
        start: float,
        end: float,
        copies: int,
        copy_bytes: int,
    ) -> None:
        self._requests += 1
        self._latency += end - start
        self._latencies[(self._requests - 1) % self.WINDOW] = end - start
        self._first = start if self._first is None else min(self._first, start)
        self._last = max(self._last, end)
        self._copies += copies
        self._copy_bytes += copy_bytes
        sums = self._sums
        for name, queue, compute, overhead, batch in trace:
            row = sums[name]
            row[0] += 1
            row[1] += 1.0 / batch
            row[2] += queue
            row[3] += compute
            row[4] += overhead

    def report(self) -> Report:
        n = self._requests
        per = 1e6 / n if n else 0.0
        steps = tuple(
            StepCost(
                step=name,
                calls=int(row[0]),
                batches=round(row[1]),
                queue_wait_us=row[2] / row[0] * 1e6 if row[0] else 0.0,
                compute_us=row[3] / row[0] * 1e6 if row[0] else 0.0,
                overhead_us=row[4] * per,
            )
            for name, row in self._sums.items()
        )
        compute_per_request = {name: row[3] * per for name, row in self._sums.items()}
        path, path_us = self._critical_path(compute_per_request) if n else ([], 0.0)
        latency_us = self._latency * per
        p50, p99 = percentiles(self._latencies[: min(n, self.WINDOW)], (50, 99)) if n else (0.0, 0.0)
        span = self._last - (self._first or 0.0)
        return Report(
            pipeline=self._pipeline,
            mode=self._mode,
            requests=n,
            errors=self._errors,
            latency_us=latency_us,
            latency_p50_us=p50 * 1e6,
            latency_p99_us=p99 * 1e6,
            throughput_rps=n / span if n and span > 0 else 0.0,
            steps=steps,
            copies=self._copies,
            copy_bytes=self._copy_bytes,
            critical_path=tuple(path),
            critical_path_us=float(path_us),
            parallelism=sum(compute_per_request.values()) / latency_us if latency_us else 0.0,
        )


def _finite(value: Any) -> Any:
    # JSON has no NaN; an undefined ratio is written as null
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _us(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.2f} ms"
    return f"{value:.1f} µs"


def _bytes(value: float) -> str:
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return format_table(header, rows) + "\n"
