"""Triton's statistics API read into counters, and the per-model time breakdown they give.

Triton's statistics are cumulative counters; a breakdown is the difference of two
snapshots taken around a measurement, divided per request, so it covers exactly the
requests of that measurement, for every model the server ran (composing models too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = [
    "BatchCounters",
    "ModelCounters",
    "ModelTimes",
    "breakdown",
    "breakdown_over",
    "held_by_batch",
    "parse_batch_statistics",
    "parse_statistics",
    "process_cpu_ns",
]


# The duration counters of inference_stats, in the order a request meets them.
_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class ModelCounters:
    """One model's cumulative counters from one statistics snapshot (durations in ns)."""

    model: str
    version: str
    inference_count: int
    execution_count: int
    success_count: int
    success_ns: int
    fail_count: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.version

    def since(self, before: ModelCounters | None) -> ModelCounters:
        """What the counters grew by since ``before`` (all of them where the model had not run yet)."""
        if before is None:
            return self
        return replace(self, **{n: getattr(self, n) - getattr(before, n) for n in _COUNTED})

    def plus(self, other: ModelCounters) -> ModelCounters:
        """Two stretches' growth as one."""
        return replace(self, **{n: getattr(self, n) + getattr(other, n) for n in _COUNTED})


# The cumulative counters: every field but the model's name and version.
_COUNTED = tuple(f.name for f in fields(ModelCounters) if f.name not in ("model", "version"))


def _int(value: Any) -> int:
    # gRPC statistics turned into JSON carry 64-bit counters as strings.
    return int(value or 0)


def _pair(stats: Mapping[str, Any], name: str) -> tuple[int, int]:
    entry = stats.get(name) or {}
    return _int(entry.get("count")), _int(entry.get("ns"))


def parse_statistics(statistics: Mapping[str, Any]) -> dict[tuple[str, str], ModelCounters]:
    """Read a ``/v2/models/stats`` answer (HTTP JSON, or gRPC as JSON) into counters per (model, version)."""
    out: dict[tuple[str, str], ModelCounters] = {}
    for entry in statistics.get("model_stats", ()) or ():
        stats = entry.get("inference_stats") or {}
        success_count, success_ns = _pair(stats, "success")
        fail_count, _ = _pair(stats, "fail")
        counters = ModelCounters(
            model=str(entry.get("name", "")),
            version=str(entry.get("version", "")),
            inference_count=_int(entry.get("inference_count")),
            execution_count=_int(entry.get("execution_count")),
            success_count=success_count,
            success_ns=success_ns,
            fail_count=fail_count,
            queue_ns=_pair(stats, "queue")[1],
            compute_input_ns=_pair(stats, "compute_input")[1],
            compute_infer_ns=_pair(stats, "compute_infer")[1],
            compute_output_ns=_pair(stats, "compute_output")[1],
        )
        out[counters.key] = counters
    return out


@dataclass(frozen=True)
class ModelTimes:
    """Where one model's time went during a measurement: averages per request, in microseconds.

    ``requests`` counts successful requests, ``inferences`` the batch items they
    carried, and ``executions`` the model runs (fewer than requests when the
    dynamic batcher merged them). ``total_us`` is Triton's own request time.
    """

    model: str
    version: str
    requests: int
    failures: int
    inferences: int
    executions: int
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    total_us: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _times(grown: ModelCounters) -> ModelTimes | None:
    """A model's times from what its counters grew by, or ``None`` where it served no request."""
    requests, failures = grown.success_count, grown.fail_count
    if requests <= 0 and failures <= 0:
        return None
    # Triton counts queue and compute time over successful requests only.
    per = max(requests, 1) * 1000.0
    return ModelTimes(
        model=grown.model,
        version=grown.version,
        requests=requests,
        failures=failures,
        inferences=grown.inference_count,
        executions=grown.execution_count,
        queue_us=grown.queue_ns / per,
        compute_input_us=grown.compute_input_ns / per,
        compute_infer_us=grown.compute_infer_ns / per,
        compute_output_us=grown.compute_output_ns / per,
        total_us=grown.success_ns / per,
    )


def breakdown(
    before: Mapping[tuple[str, str], ModelCounters],
    after: Mapping[tuple[str, str], ModelCounters],
    *,
    first: Sequence[str] = (),
) -> list[ModelTimes]:
    """Per-model times between two snapshots, for every model that served a request in between.

    Models named in ``first`` (the measured top-level model) lead; the rest
    follow by name, so a table reads top-down from the model the client called.
    """
    rows = [t for key, counters in after.items() if (t := _times(counters.since(before.get(key)))) is not None]
    order = {name: i for i, name in enumerate(first)}
    rows.sort(key=lambda t: (order.get(t.model, len(order)), t.model, t.version))
    return rows


def breakdown_over(
    brackets: Sequence[tuple[Mapping[tuple[str, str], ModelCounters], Mapping[tuple[str, str], ModelCounters]]],
    *,
    first: Sequence[str] = (),
    leave_out: Sequence[str] = (),
) -> list[ModelTimes]:
    """Like :func:`breakdown`, over several ``(before, after)`` pairs at once: a measurement taken
    in turns, with other models' load between them, counts only what happened inside each pair.
    ``leave_out`` names top-level models measured in other turns: a request of theirs that was
    still in flight when this turn began is theirs, not this one's (their helper models too,
    ``<model>__...``)."""
    summed: dict[tuple[str, str], ModelCounters] = {}
    others = tuple(leave_out)
    for before, after in brackets:
        for key, counters in after.items():
            if key[0] in others or key[0].startswith(tuple(f"{m}__" for m in others)):
                continue
            grown = counters.since(before.get(key))
            summed[key] = summed[key].plus(grown) if key in summed else grown
    return breakdown({}, summed, first=first)


@dataclass(frozen=True)
class BatchCounters:
    """One model's cumulative counters at one batch size (``batch_stats``): its executions of that
    many rows, and the ns they spent in compute input, infer and output."""

    model: str
    version: str
    batch_size: int
    executions: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int

    @property
    def held_ns(self) -> int:
        """What its executions held their instances: compute input + infer + output."""
        return self.compute_input_ns + self.compute_infer_ns + self.compute_output_ns


def parse_batch_statistics(statistics: Mapping[str, Any]) -> dict[tuple[str, str, int], BatchCounters]:
    """Read the ``batch_stats`` of a ``/v2/models/stats`` answer into counters per (model, version, batch size)."""
    out: dict[tuple[str, str, int], BatchCounters] = {}
    for entry in statistics.get("model_stats", ()) or ():
        model, version = str(entry.get("name", "")), str(entry.get("version", ""))
        for batch in entry.get("batch_stats", ()) or ():
            size = _int(batch.get("batch_size"))
            out[model, version, size] = BatchCounters(
                model, version, size, _pair(batch, "compute_infer")[0], _pair(batch, "compute_input")[1],
                _pair(batch, "compute_infer")[1], _pair(batch, "compute_output")[1])
    return out


def held_by_batch(before: Mapping[str, Any], after: Mapping[str, Any], model: str) -> dict[int, tuple[int, float]]:
    """``{batch size: (executions, mean µs one held its instance)}`` of ``model`` between two statistics
    answers (every version summed), for each batch size it ran at in between."""
    was, now = parse_batch_statistics(before), parse_batch_statistics(after)
    grown: dict[int, list[int]] = {}
    for key, counters in now.items():
        if key[0] != model:
            continue
        old = was.get(key)
        executions = counters.executions - (old.executions if old else 0)
        held = counters.held_ns - (old.held_ns if old else 0)
        if executions > 0:
            total = grown.setdefault(key[2], [0, 0])
            total[0] += executions
            total[1] += held
    return {size: (n, ns / n / 1e3) for size, (n, ns) in sorted(grown.items())}


def process_cpu_ns(pid: int) -> int | None:
    """The CPU time a process has used, all its threads together (ns), or None where it cannot be read.

    The scheduler's own count (``/proc/<pid>/task/*/schedstat``, in ns) where the kernel keeps it:
    ``/proc/<pid>/stat`` counts in clock ticks (10 ms), too coarse for a step's few milliseconds.
    A thread that ended in between is not counted; a stub's pools (onnxruntime's, BLAS') live on.
    """
    total, found = 0, False
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
                    found = True
    if found:
        return total
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return None
