"""How steady the machine was while a calibration or a prediction worked: the CPU that other processes used, the
time the hypervisor stole, and repeated measurements that disagreed. A busy machine's figures are still used, but
said to be, and a prediction's ranges widen to match (docs/prediction.md, "How a range is made"): each of what it saw
is a standard deviation of the figure a user measures (:meth:`MachineNoise.spreads`), beside the others in quadrature.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from statistics import NormalDist
from typing import Any

from ..errors import PipelinesError

__all__ = ["BUSY", "LEVEL", "MAX_WIDENING", "Z", "MachineNoise", "measurement_spread",
           "round_disagreement", "share_spread"]

#: What makes a machine busy: other processes using this share of its cores, the hypervisor stealing this share of
#: its CPU time, or repeated measurements of one thing disagreeing by this much (half their range over their median).
BUSY = {"load_share": 0.25, "steal": 0.05, "disagreement": 0.10}
#: The most one share of the machine (other processes' cores, stolen time, a window's disagreement) counts for: beyond
#: it a range says nothing a table could use.
MAX_WIDENING = 0.5
#: The share of measured figures a prediction's range should hold: each is a two-sided 90 % interval, Z standard
#: deviations either way.
LEVEL = 0.90
Z = NormalDist().inv_cdf(0.5 + LEVEL / 2)
#: The calibration's lanes windows last half of ``Budget.lanes_seconds`` (1 s in a full and a quick calibration). Its
#: disagreement is, for each probe, the larger of two half-ranges of three windows (at concurrency 1 and under load),
#: the median over the probes: for normal windows, 1.056 standard deviations of one window.
CALIBRATION_WINDOW_S = 0.5
WINDOW_SD_PER_DISAGREEMENT = 1 / 1.056
#: The figure a user measures: the last three windows of two seconds, pooled (``pipelines bench``'s defaults and its
#: stability rule's, as perf_analyzer's).
USER_WINDOWS, USER_WINDOW_S = 3, 2.0


def measurement_spread(disagreement: float | None) -> float:
    """The standard error of a figure pooled over :data:`USER_WINDOWS` windows of :data:`USER_WINDOW_S` s, from the
    calibration's window-to-window ``disagreement``: one window's standard deviation over the square root of how many
    calibration windows the user's measurement lasts (noise that changes faster than a window averages out; what
    drifts slower is the load's, below, and the model's)."""
    if not disagreement:
        return 0.0
    window_sd = min(disagreement, MAX_WIDENING) * WINDOW_SD_PER_DISAGREEMENT
    return window_sd * math.sqrt(CALIBRATION_WINDOW_S / (USER_WINDOWS * USER_WINDOW_S))


def share_spread(share: float | None) -> float:
    """The standard deviation of a share of the machine that one side of a comparison may have had and the other
    not (other processes' cores, stolen time): uniform over ``±share``, ``share`` at most :data:`MAX_WIDENING`."""
    return min(share or 0.0, MAX_WIDENING) / math.sqrt(3.0)


@dataclass(frozen=True)
class MachineNoise:
    """What one calibration or prediction saw of the machine while it worked; ``None``: not measured.

    ``other_load``: the cores' worth of CPU that other processes used on average (the machine's CPU time, from
    ``/proc/stat``, less this process's and its children's). ``steal``: the share of CPU time the hypervisor took.
    ``disagreement``: how far repeated measurements of one thing disagreed, half their range over their median (the
    median over what was repeated: the server's throughput over the calibration's lanes windows, a prediction's
    steps over their rounds).
    ``cores``: the machine's; ``seconds``: how long it watched.
    """

    other_load: float | None = None
    steal: float | None = None
    disagreement: float | None = None
    cores: float | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PipelinesError(f"a noise record's {f.name} is a finite number >= 0 (or null: not measured); "
                                     f"got {value!r}")
            object.__setattr__(self, f.name, float(value))

    @property
    def known(self) -> bool:
        return any(v is not None for v in (self.other_load, self.steal, self.disagreement))

    @property
    def load_share(self) -> float | None:
        """The share of the machine's cores that other processes used."""
        if self.other_load is None:
            return None
        return self.other_load / self.cores if self.cores else self.other_load

    def _seen(self) -> dict[str, float]:
        return {k: v for k, v in (("load_share", self.load_share), ("steal", self.steal),
                                  ("disagreement", self.disagreement)) if v is not None}

    @property
    def busy(self) -> bool:
        """Whether any of what it saw passes :data:`BUSY`."""
        return any(v >= BUSY[k] for k, v in self._seen().items())

    def spreads(self) -> dict[str, float]:
        """What it saw as standard deviations of the figure a user measures (0 where not measured): ``measurement``
        from the windows' disagreement (:func:`measurement_spread`), ``load`` and ``steal`` from their shares
        (:func:`share_spread`)."""
        return {"measurement": measurement_spread(self.disagreement), "load": share_spread(self.load_share),
                "steal": share_spread(self.steal)}

    def widening(self, spreads: Mapping[str, float] | None = None) -> float:
        """The share by which its noise alone may move a figure up, at :data:`LEVEL`: its :meth:`spreads` (or
        ``spreads``) in quadrature, ``Z`` of them."""
        parts = self.spreads() if spreads is None else spreads
        return math.expm1(Z * math.sqrt(sum(v * v for v in parts.values())))

    def describe(self) -> str:
        """What it saw, in words: ``load 1.3 from other processes, 4 % steal, probes disagreed by 18 %``."""
        parts = []
        if self.other_load is not None:
            parts.append(f"load {self.other_load:.1f} from other processes"
                         + (f" (of {self.cores:g} cores)" if self.cores else ""))
        if self.steal is not None and self.steal >= 0.005:
            parts.append(f"{self.steal:.0%} of CPU time stolen")
        if self.disagreement is not None:
            parts.append(f"repeated measurements disagreed by {self.disagreement:.0%}")
        return ", ".join(parts) or "nothing measured"

    def line(self, what: str = "the machine", widening: float | None = None) -> str:
        """One line for a busy machine (empty for a quiet one): what it saw, and how far its noise alone puts a
        range's ends from its figure (``widening``, default its own :meth:`widening`: the high end's share; the low
        end is the figure over the same factor)."""
        if not self.busy:
            return ""
        wide = self.widening() if widening is None else widening
        return (f"{what} was busy: {self.describe()}; ranges widened to -{wide / (1 + wide):.0%}…+{wide:.0%} of each "
                "figure to match")

    def combined(self, other: MachineNoise | None) -> MachineNoise:
        """The noisier of the two, figure by figure (a prediction's own watch and its profile's)."""
        if other is None:
            return self

        def worst(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        if (self.load_share or 0.0) >= (other.load_share or 0.0):
            load, cores = self.other_load, self.cores
        else:
            load, cores = other.other_load, other.cores
        return MachineNoise(load if load is not None else worst(self.other_load, other.other_load),
                            worst(self.steal, other.steal), worst(self.disagreement, other.disagreement),
                            cores if cores is not None else worst(self.cores, other.cores),
                            self.seconds + other.seconds)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MachineNoise | None:
        """The record a profile holds, or ``None`` (an older profile: unknown)."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise PipelinesError(f"a profile's noise is an object (other_load, steal, disagreement, cores, seconds) "
                                 f"or null; got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise PipelinesError(f"a profile's noise has no field {unknown[0]!r}; its fields are "
                                 f"{', '.join(f.name for f in fields(cls))}")
        return cls(**data)


def round_disagreement(rows: Iterable[tuple]) -> float | None:
    """The calibration's probes' disagreement over their rounds: for each probe, half the range of its latencies
    over their median; the median over the probes. ``rows``: a profile's ``round_samples`` (kind, steps, bytes,
    round, latency µs, ...). ``None`` with fewer than two rounds of any probe."""
    by_probe: dict[tuple, list[float]] = {}
    for row in rows:
        if len(row) > 4 and row[4] is not None and row[4] > 0:
            by_probe.setdefault(tuple(row[:3]), []).append(float(row[4]))
    spreads = [(max(v) - min(v)) / 2 / statistics.median(v) for v in by_probe.values() if len(v) > 1]
    return statistics.median(spreads) if spreads else None
