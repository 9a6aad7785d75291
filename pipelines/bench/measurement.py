"""What is measured: a configuration (where the pipeline runs, in which form) and its
figures at one concurrency, the rows of the benchmark's table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PipelinesError
from ..forms import form_names
from ..triton.statistics import ModelTimes
from .latency import LatencySummary
from .loadgen import LoadResult
from .streams import StreamSummary, stream_figures

__all__ = ["FORMS", "Configuration", "Measurement"]

#: Every form a pipeline compiles to (the table in pipelines.forms), as the local runtime names its modes.
FORMS = form_names()


@dataclass(frozen=True)
class Configuration:
    """One way to run the pipeline: ``where`` is ``"local"`` or ``"server"``, ``form`` one of :data:`FORMS`.

    ``model`` is the Triton model the server configuration calls.
    """

    where: str
    form: str
    model: str | None = None

    def __post_init__(self) -> None:
        if self.where not in ("local", "server"):
            raise PipelinesError(f"a configuration runs 'local' or on the 'server'; got {self.where!r}")
        if self.form not in FORMS:
            raise PipelinesError(f"form must be one of {list(FORMS)}; got {self.form!r}")

    @property
    def label(self) -> str:
        return f"{self.where} {self.form}"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "where": self.where, "form": self.form, "model": self.model}


@dataclass(frozen=True)
class Measurement:
    """The figures of one configuration at one concurrency.

    ``throughput`` is successful requests per second (``batch`` items each);
    ``errors`` counts failed requests in the measured windows, never dropped.
    ``breakdown`` is the server's per-model time, ``local_report`` the local
    runtime's cost report; each is empty where it does not apply. ``stream`` holds a
    streaming pipeline's figures (time to first response, between responses, responses per
    second); ``None`` for a pipeline that answers once, whose results stay as they were.
    """

    config: Configuration
    concurrency: int
    batch: int
    throughput: float
    latency: LatencySummary
    requests: int
    errors: int
    error_messages: Mapping[str, int]
    stable: bool
    windows: int
    window_seconds: float
    window_throughputs: tuple[float, ...]
    completed_by_sample: tuple[int, ...]
    errors_by_sample: tuple[int, ...]
    breakdown: tuple[ModelTimes, ...] = ()
    local_report: Mapping[str, Any] | None = None
    stream: StreamSummary | None = None

    @classmethod
    def from_load(
        cls,
        config: Configuration,
        load: LoadResult,
        *,
        batch: int,
        breakdown: tuple[ModelTimes, ...] = (),
        local_report: Mapping[str, Any] | None = None,
        streaming: bool = False,
    ) -> Measurement:
        measured = load.measured
        return cls(
            config=config,
            concurrency=load.concurrency,
            batch=batch,
            throughput=measured.throughput,
            latency=LatencySummary.of(measured.latencies),
            requests=measured.completed,
            errors=measured.errors,
            error_messages=dict(measured.error_messages),
            stable=load.stable,
            windows=len(load.windows),
            window_seconds=measured.seconds,
            window_throughputs=tuple(w.throughput for w in load.windows),
            completed_by_sample=measured.completed_by_sample,
            errors_by_sample=measured.errors_by_sample,
            breakdown=tuple(breakdown),
            local_report=local_report,
            stream=stream_figures(measured.streams, measured.seconds) if streaming else None,
        )

    def to_dict(self) -> dict[str, Any]:
        data = {
            "config": self.config.to_dict(),
            "concurrency": self.concurrency,
            "batch": self.batch,
            "throughput_infer_per_s": self.throughput,
            "throughput_items_per_s": self.throughput * self.batch,
            "latency": self.latency.to_dict(),
            "requests": self.requests,
            "errors": self.errors,
            "error_messages": dict(self.error_messages),
            "stable": self.stable,
            "windows": self.windows,
            "measured_seconds": self.window_seconds,
            "window_throughputs": list(self.window_throughputs),
            "completed_by_sample": list(self.completed_by_sample),
            "errors_by_sample": list(self.errors_by_sample),
            "breakdown": [t.to_dict() for t in self.breakdown],
            "local_report": None if self.local_report is None else dict(self.local_report),
        }
        if self.stream is not None:  # a plain pipeline's results keep the keys they always had
            data["stream"] = self.stream.to_dict()
        return data
