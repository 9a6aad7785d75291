"""Measuring the probes: requests one at a time, the median latency of each probe.

Calibration measures at concurrency 1 on purpose: a fitted cost is what one
boundary costs when nothing else runs, and the local runtime's replay adds
the queueing that concurrency brings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from time import perf_counter
from typing import Any

from .probes import Probe

__all__ = ["Budget", "Sample", "measure_probes"]


@dataclass(frozen=True)
class Sample:
    """One probe's measurement: the median latency over ``requests`` answers (µs), and
    ``stub_us``, what one execution of the identity step model cost inside the server
    (Triton's compute input + infer + output for it, the median over the requests;
    ``None`` without statistics).
    """

    probe: Probe
    latency_us: float
    requests: int
    stub_us: float | None = None

    @property
    def row(self) -> tuple[str, int, int, float, float | None]:
        return self.probe.kind, self.probe.steps, self.probe.size, self.latency_us, self.stub_us


@dataclass(frozen=True)
class Budget:
    """How long each probe is measured: at least ``min_requests``, at most ``max_requests``
    answers, and no longer than ``seconds`` once ``min_requests`` are in."""

    min_requests: int = 4
    max_requests: int = 30
    seconds: float = 0.8
    warmup: int = 1


def measure_probes(
    infer: Callable[[str, dict[str, Any]], Any],
    probes: Sequence[Probe],
    budget: Budget | None = None,
    progress: Callable[[int, int, Probe], None] | None = None,
    statistics: Callable[[str], Any] | None = None,
) -> list[Sample]:
    """Time ``infer(model, inputs)`` on each probe; ``progress(done, total, probe)`` after each.

    ``statistics(model)`` (Triton's statistics API answer), when given, is read
    around each timed request for the stub's own cost (the median per execution).
    """
    budget = budget or Budget()
    samples = []
    for i, probe in enumerate(probes):
        inputs = probe.inputs()
        for _ in range(budget.warmup):  # the first calls of a stub allocate its shared memory
            infer(probe.model, inputs)
        times: list[float] = []
        stubs: list[float] = []
        before = statistics("") if statistics is not None else None
        began = perf_counter()
        while len(times) < budget.max_requests and (
            len(times) < budget.min_requests or perf_counter() - began < budget.seconds
        ):
            t = perf_counter()
            infer(probe.model, inputs)
            times.append(perf_counter() - t)
            if statistics is not None:
                # read after every request, so the stub's figure is a median as the latency is
                after = statistics("")  # every model: the probe's step models in one answer
                stub_us = _stub_us(before, after, probe.step_models)
                if stub_us is not None:
                    stubs.append(stub_us)
                before = after
        stub = median(stubs) if stubs else None
        samples.append(Sample(probe, median(times) * 1e6, len(times), stub))
        if progress is not None:
            progress(i + 1, len(probes), probe)
    return samples


def _stub_us(before: Any, after: Any, models: Sequence[str]) -> float | None:
    """Mean time of one execution of the ``models`` between two statistics answers (µs), or None."""
    from ..bench.stats import breakdown, parse_statistics

    rows = [t for t in breakdown(parse_statistics(before), parse_statistics(after)) if t.model in models]
    executions = sum(t.requests for t in rows)
    if not rows or executions <= 0:
        return None
    return sum((t.compute_input_us + t.compute_infer_us + t.compute_output_us) * t.requests for t in rows) / executions
