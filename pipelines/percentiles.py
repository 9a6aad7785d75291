"""The one percentile definition of the package: the cost report and the benchmark both use it.

numpy's ``percentile`` with ``method="nearest"``: the observation at index
``round(p/100 * (n-1))`` of the sorted values. perf_analyzer picks
``latencies[int(p/100 * (n-1) + 0.5)]`` (inference_profiler.cc), the same index
except at an exact tie (``p/100 * (n-1)`` ending in .5), where numpy rounds to the
even index and perf_analyzer up: one neighbouring observation apart. Either way a
percentile is a latency that was really observed, and p50 <= p90 <= p99.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import ArgumentError

__all__ = ["PERCENTILE_METHOD", "percentiles"]

PERCENTILE_METHOD = "nearest"


def percentiles(values: Sequence[float] | np.ndarray, ps: Sequence[float]) -> tuple[float, ...]:
    """The ``ps`` percentiles (0..100) of ``values``; ``values`` must not be empty."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ArgumentError("percentiles of no values: give at least one value")
    return tuple(float(v) for v in np.percentile(values, list(ps), method=PERCENTILE_METHOD))
