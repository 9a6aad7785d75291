"""Client-side latency summaries of a measurement, with percentiles as :mod:`pipelines.percentiles` defines them.

The server's own per-model times come from its statistics (:mod:`pipelines.triton.statistics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..percentiles import percentiles

__all__ = ["LatencySummary"]

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class LatencySummary:
    """Client-side latency of the successful requests of a measurement, in milliseconds.

    Every figure is ``None`` when no request succeeded.
    """

    count: int
    avg_ms: float | None
    min_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, seconds: Sequence[float] | np.ndarray) -> LatencySummary:
        values = np.sort(np.asarray(seconds, dtype=np.float64)) * 1000.0
        if values.size == 0:
            return cls(0, None, None, None, None, None, None, None)
        p50, p90, p95, p99 = percentiles(values, PERCENTILES)
        return cls(
            count=int(values.size),
            avg_ms=float(values.mean()),
            min_ms=float(values[0]),
            p50_ms=p50,
            p90_ms=p90,
            p95_ms=p95,
            p99_ms=p99,
            max_ms=float(values[-1]),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
