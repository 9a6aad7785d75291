"""Each predicted figure's range: a 90 % interval for the figure that the server will measure.

A range is ``point × exp(±Z σ)``, where ``σ`` is the standard deviation of ``log(measured / predicted)``, and
independent sources of error add in quadrature (docs/prediction.md, "How a range is made"):

- ``model``: the simulation's own error, from the benchmark's residuals (:data:`MODEL_SPREAD`);
- ``simulation``: the closed loop's own precision (:data:`SIMULATION_SPREAD`);
- ``steps``: the steps' costs, each the median of three rounds, taken one standard error up and simulated;
- ``boundaries``: the calibration's costs, each taken one standard error up (its bootstrap interval) and simulated;
- ``measurement``: the server's own window-to-window spread, as the standard error of a figure pooled over
  three windows of two seconds (what ``pipelines bench`` and perf_analyzer report);
- ``load`` and ``steal``: other processes' share of the cores and the hypervisor's share of CPU time, which may
  be there when one side is measured and gone when the other is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from ..calibration.noise import LEVEL, MAX_WIDENING, MachineNoise, Z, measurement_spread, share_spread
from .spec import WayCost

__all__ = ["LEVEL", "MODEL_SPREAD", "SIMULATION_SPREAD", "Z", "Spread", "machine_spread", "shift_spread",
           "step_spread", "ways", "wide_sources", "widening"]

#: The simulation's own error, a standard deviation of log(predicted / measured), for a figure of one request alone
#: (concurrency 1) and of a queue (throughput under load, every p95): the least that, beside the other sources as they
#: are computed here, holds 90 % of the last benchmark run's figures before this method (four pipelines, step costs
#: from the server, git show 1165ba7:benchmarks/results/prediction.json; its costs' sources re-derived from its
#: recorded ranges): 44 of 48, where none holds 43 and the
#: residuals' own robust standard deviations (3.6 %, 7.0 %) hold 44 with ranges a quarter wider. Its misses are
#: errors of another kind (yolov5 at 16: the server slower than at 4), which no Gaussian term covers at a usable
#: width. ``benchmarks/prediction.py`` prints the least terms each run supports.
MODEL_SPREAD = {"alone": 0.02, "queued": 0.04}
#: The closed loop's own precision: 500 requests give the figures of 8000 within 0.8 % (throughput) and 1.4 % (p50).
SIMULATION_SPREAD = 0.01
#: A step's cost is the median of its three rounds; its spread is half their range over their median. For normal
#: rounds the median of three has a standard deviation of 0.669 σ, and half the range of three averages 0.846 σ.
STEP_SE_PER_HALF_RANGE = 0.669 / 0.846


def step_spread(spread: float | None) -> float:
    """The standard error of a step's cost, relative, from its rounds' spread (:data:`STEP_SE_PER_HALF_RANGE`)."""
    return min((spread or 0.0) * STEP_SE_PER_HALF_RANGE, MAX_WIDENING)


def shift_spread(point: float, shifted: float) -> float:
    """How far one source moved a figure: ``|log(shifted / point)|`` where it was taken one standard error up."""
    if point <= 0 or shifted <= 0 or not math.isfinite(point) or not math.isfinite(shifted):
        return 0.0
    return abs(math.log(shifted / point))


def machine_spread(noise: MachineNoise | None, disagreement: float | None) -> dict[str, float]:
    """The machine's sources (the same for every figure): ``measurement`` from the server's window-to-window
    ``disagreement`` (the calibration's), ``load`` and ``steal`` from the noise record ``noise``."""
    return {"measurement": measurement_spread(disagreement),
            "load": share_spread(noise.load_share if noise is not None else None),
            "steal": share_spread(noise.steal if noise is not None else None)}


@dataclass(frozen=True)
class Spread:
    """One figure's sources of error, each a standard deviation of ``log(measured / predicted)``, independent."""

    parts: Mapping[str, float]

    @property
    def total(self) -> float:
        """The sources in quadrature."""
        return math.sqrt(sum(v * v for v in self.parts.values()))

    def around(self, point: float) -> tuple[float, float]:
        """The :data:`LEVEL` interval around ``point``: it always holds it."""
        wide = math.exp(Z * self.total)
        return point / wide, point * wide

    def half_width(self) -> float:
        """Half the interval's width over its figure."""
        return math.sinh(Z * self.total)


def widening(parts: Mapping[str, float]) -> float:
    """What ``parts`` alone widen a figure by, either way: the high end's share over the figure."""
    return math.expm1(Z * Spread(parts).total)


#: What each source is, in the line that names the sources that widen a prediction's ranges most.
SOURCES = {"model": "the simulation's own error", "simulation": "the closed loop's precision",
           "steps": "the steps' costs: their rounds disagreed", "boundaries": "the calibration's intervals",
           "measurement": "the server's window-to-window spread", "load": "other processes' load",
           "steal": "stolen CPU time"}
#: A source is named where it alone puts a range's high end this far above its figure (at the median over the rows).
WIDE = 0.15


def wide_sources(rows: Sequence[Mapping[str, Mapping[str, float]] | None]) -> str:
    """One line naming the sources that widen the ranges most (each alone beyond :data:`WIDE`, at its median over
    the rows' figures), widest first; "" where none does. ``rows``: each row's ``spreads``."""
    by: dict[str, list[float]] = {}
    for spreads in rows:
        for parts in (spreads or {}).values():
            for name, value in parts.items():
                by.setdefault(name, []).append(value)
    medians = {name: sorted(v)[len(v) // 2] for name, v in by.items()}
    wide = sorted(((math.expm1(Z * v), name) for name, v in medians.items() if math.expm1(Z * v) > WIDE),
                  reverse=True)
    if not wide:
        return ""
    return "the ranges are widest from " + ", ".join(f"{name} (+{w:.0%} alone: {SOURCES.get(name, name)})"
                                                     for w, name in wide)


# ------------------------------------------------------------------ the calibration's costs one error up


def ways(cost: Any, shift: float = 0.0, level: float = 0.95) -> tuple[WayCost, WayCost]:
    """A profile boundary as the simulator reads it: the measured curve each way, or, for an old profile with only a
    line, half its fixed cost each way plus its cost per byte. ``shift``: each figure that many standard errors up
    (down where negative), from its bootstrap interval at ``level`` (a profile's ``ci_level``), where it has one."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    if cost.sizes:
        ins, outs = tuple(cost.in_us), tuple(cost.out_us)
        if shift and cost.in_ci and cost.out_ci:
            ins, outs = _shifted(ins, cost.in_ci, shift / z), _shifted(outs, cost.out_ci, shift / z)
        return WayCost(tuple(cost.sizes), ins), WayCost(tuple(cost.sizes), outs)
    fixed, per_mib = cost.fixed_us, cost.us_per_mib
    if shift and cost.fixed_ci and cost.per_mib_ci:
        fixed, per_mib = _shifted((fixed, per_mib), (cost.fixed_ci, cost.per_mib_ci), shift / z)
    line = WayCost((0, 1 << 20), (fixed / 2, fixed / 2 + per_mib))
    return line, line


def _shifted(figures: Sequence[float], intervals: Sequence[tuple[float, float]], share: float) -> tuple[float, ...]:
    """Each figure moved ``share`` of the way to its interval's high end (``share`` > 0) or low end, never below
    zero (a bootstrap's interval need not hold the fit's clipped figure: then it moves no way)."""
    if share < 0:
        return tuple(max(0.0, f + share * max(0.0, f - lo)) for f, (lo, _) in zip(figures, intervals, strict=True))
    return tuple(f + share * max(0.0, hi - f) for f, (_, hi) in zip(figures, intervals, strict=True))
