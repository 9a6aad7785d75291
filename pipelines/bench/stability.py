"""When to stop measuring: perf_analyzer's stability rule.

Measurement windows repeat until the last ``windows`` of them agree: each one's
throughput and average latency lie within ``tolerance`` of those windows' mean.
After ``max_trials`` windows without agreement the measurement is reported unstable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import PipelinesError

__all__ = ["StabilityRule", "WindowFigures"]


class WindowFigures(Protocol):
    """What the rule reads from a window."""

    @property
    def throughput(self) -> float: ...

    @property
    def avg_latency(self) -> float | None: ...


def _within(values: Sequence[float], tolerance: float) -> bool:
    mean = sum(values) / len(values)
    if mean == 0:
        return all(v == 0 for v in values)
    return all(abs(v - mean) <= tolerance * mean for v in values)


@dataclass(frozen=True)
class StabilityRule:
    """``tolerance`` 0.1 means every window within ±10% of the mean (perf_analyzer's default)."""

    tolerance: float = 0.1
    windows: int = 3
    max_trials: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.tolerance < 1:
            raise PipelinesError(
                f"stability tolerance must be a fraction in (0, 1), such as 0.1 for ±10%; got {self.tolerance!r}"
            )
        if self.windows < 1:
            raise PipelinesError(f"the stability rule needs at least 1 window; got {self.windows!r}")
        if self.max_trials < self.windows:
            raise PipelinesError(
                f"max_trials ({self.max_trials}) must be at least the {self.windows} windows "
                "the stability rule compares; raise --max-trials"
            )

    def is_stable(self, windows: Sequence[WindowFigures]) -> bool:
        """Whether the last ``self.windows`` windows agree (False while there are fewer)."""
        if len(windows) < self.windows:
            return False
        last = windows[-self.windows:]
        if not _within([w.throughput for w in last], self.tolerance):
            return False
        latencies = [w.avg_latency for w in last]
        if all(lat is None for lat in latencies):  # nothing succeeded: throughput alone decides
            return True
        if any(lat is None for lat in latencies):
            return False
        return _within(latencies, self.tolerance)

    def done(self, windows: Sequence[WindowFigures]) -> bool:
        return self.is_stable(windows) or len(windows) >= self.max_trials
