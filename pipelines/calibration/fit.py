"""Fitting boundary costs to probe latencies with numpy's least squares.

Each probe's latency is a sum over the boundaries it crosses: a request
(in and out), ``n`` ensemble steps or ``n`` BLS calls, and the Python stubs
of its steps (plus the BLS model's own stub). Every boundary costs
``fixed + per_byte * bytes``, so latencies are linear in the unknowns.

A stub's cost cannot be told apart from the boundary that feeds it by
end-to-end latency alone (every stub is reached through a request, an
ensemble step or a BLS call), so the stub is priced from Triton's own
statistics of the identity step model (compute input + infer + output per
execution) when the samples carry them; the other three boundaries are then
fitted to what remains of the latencies. Without statistics all four are
fitted together.

Fixed costs come from the small probes (1 to 64 KiB) and costs per byte from
the large ones (1 MiB and up), fitted in turn until they agree, each fit
subtracting what the other explains: under noise a straight line through all
sizes at once is pulled by whichever sizes the weighting favours. Fits
minimise relative errors (a probe's noise grows with its latency), with
numpy's least squares; the stub's own figures take medians. A cost cannot be
negative: a coefficient the fit puts below zero is fixed at zero and the
others are fitted again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ArgumentError
from .profile import BOUNDARIES, MIB, Cost, Point

__all__ = ["crossings", "fit_costs", "predict_us"]

_NAMES = tuple(BOUNDARIES)
# Which probe shows each boundary best: its points on the plot come from these probes.
_SHOWN_BY = {"request": "step", "ensemble_step": "ensemble", "bls_call": "bls"}

Row = tuple  # (kind, steps, size, latency_us[, stub_us])
#: Probes this small price the fixed costs; probes this large, the costs per byte.
SMALL = 64 << 10
LARGE = 1 << 20
_ROUNDS = 30


def crossings(kind: str, steps: int, size: int) -> dict[str, tuple[int, int]]:
    """Boundary -> (times crossed, bytes per crossing) for one request of a probe.

    Every crossing carries the tensor in and back out: ``2 * size`` bytes.
    """
    both = 2 * size
    if kind == "step":
        return {"request": (1, both), "stub": (1, both)}
    if kind == "ensemble":
        return {"request": (1, both), "ensemble_step": (steps, both), "stub": (steps, both)}
    if kind == "bls":  # the BLS model's own stub, and one stub per step it calls
        return {"request": (1, both), "bls_call": (steps, both), "stub": (steps + 1, both)}
    raise ArgumentError(f"unknown probe kind {kind!r}; expected one of 'step', 'ensemble', 'bls'")


def predict_us(costs: dict[str, Cost], kind: str, steps: int, size: int) -> float:
    """A probe's latency according to ``costs`` (µs)."""
    return sum(times * costs[name].us(nbytes) for name, (times, nbytes) in crossings(kind, steps, size).items())


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0 (numpy's lstsq, refitted without
    the most negative coefficient until none is left)."""
    free = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    coef = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free] * weights[:, None], y * weights, rcond=None)
        coef[:] = 0.0
        coef[free] = solution
        if solution.min() >= 0:
            break
        free.pop(int(np.argmin(solution)))  # the most negative cost is zero; fit the rest again
    return coef


def _counts(rows: Sequence[Row], names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per row: times each boundary is crossed, and MiB crossing it in all."""
    times = np.zeros((len(rows), len(names)))
    mib = np.zeros((len(rows), len(names)))
    for r, (kind, steps, size, *_) in enumerate(rows):
        for name, (t, nbytes) in crossings(kind, steps, size).items():
            if name in names:
                i = names.index(name)
                times[r, i] = t
                mib[r, i] = t * nbytes / MIB
    return times, mib


def _fit_lines(rows: Sequence[Row], y: np.ndarray, names: Sequence[str]) -> dict[str, Cost]:
    """Fixed costs from the small probes, costs per byte from the large ones, in turn until
    they agree: each fit subtracts what the other explains. Relative errors, so a probe's
    noise counts in proportion to its latency."""
    times, mib = _counts(rows, names)
    sizes = np.array([r[2] for r in rows])
    small, large = sizes <= SMALL, sizes >= LARGE
    if not small.any() or not large.any():  # no split possible: one fit of both
        coef = _nonnegative_lstsq(np.hstack([times, mib]), y, 1.0 / y)
        return {n: Cost(float(coef[i]), float(coef[len(names) + i])) for i, n in enumerate(names)}
    fixed = np.zeros(len(names))
    per_mib = np.zeros(len(names))
    scale = y.copy()  # what each row's noise is in proportion to: its latency, then the fit's own prediction
    for _ in range(_ROUNDS):
        fixed = _nonnegative_lstsq(times[small], y[small] - mib[small] @ per_mib, 1.0 / y[small])
        per_mib = _nonnegative_lstsq(mib[large], y[large] - times[large] @ fixed, 1.0 / scale[large])
        # weighting by the measured latency would favour the probes that happened to run fast
        scale = np.maximum(times @ fixed + mib @ per_mib, 0.1 * y)
    return {n: Cost(float(fixed[i]), float(per_mib[i])) for i, n in enumerate(names)}


def _fit_stub(rows: Sequence[Row]) -> Cost:
    """The stub's line through its own figures: medians, fixed from small probes, per byte from large."""
    sizes = np.array([2 * r[2] / MIB for r in rows])
    cost = np.array([float(r[4]) for r in rows])
    small, large = sizes <= 2 * SMALL / MIB, sizes >= 2 * LARGE / MIB
    if not small.any() or not large.any():
        fixed, per_mib = _nonnegative_lstsq(np.stack([np.ones_like(sizes), sizes], 1), cost, 1.0 / cost)
        return Cost(float(fixed), float(per_mib))
    fixed = per_mib = 0.0
    for _ in range(_ROUNDS):
        fixed = max(0.0, float(np.median(cost[small] - per_mib * sizes[small])))
        per_mib = max(0.0, float(np.median((cost[large] - fixed) / sizes[large])))
    return Cost(fixed, per_mib)


def fit_costs(samples: Sequence[Row]) -> tuple[dict[str, Cost], tuple[Point, ...]]:
    """Fit every boundary's cost to ``(kind, steps, size, latency_us[, stub_us])`` samples.

    Returns the costs and the points to plot: per sample, the cost of the
    boundary that sample shows best once the fitted costs of the others are
    taken away (and the stub's own measured cost, where there is one).
    """
    if not samples:
        raise ArgumentError("no samples to fit: give at least one (kind, steps, size, latency_us) row per boundary")
    rows = [(str(r[0]), int(r[1]), int(r[2]), float(r[3]), r[4] if len(r) > 4 else None) for r in samples]
    if not all(r[3] > 0 for r in rows):
        raise ArgumentError("every latency must be positive (microseconds > 0); a sample of 0 or less was given")
    costs: dict[str, Cost] = {}
    points: list[Point] = []
    stub_rows = [r for r in rows if r[4] is not None and r[4] > 0]
    names: tuple[str, ...] = _NAMES
    if stub_rows:
        costs["stub"] = _fit_stub(stub_rows)
        points += [Point("stub", 2 * r[2], float(r[4]), f"{r[0]} x{r[1]}") for r in stub_rows]
        names = tuple(n for n in _NAMES if n != "stub")
    known = dict(costs)

    def rest(kind: str, steps: int, size: int) -> float:  # the part of a latency priced already
        return sum(t * known[b].us(nb) for b, (t, nb) in crossings(kind, steps, size).items() if b in known)

    y = np.array([lat - rest(k, n, s) for k, n, s, lat, _ in rows])
    keep = y > 0  # a probe faster than its stubs alone says nothing about the other boundaries
    costs.update(_fit_lines([r for r, k in zip(rows, keep, strict=True) if k], y[keep], names))
    shown = dict(_SHOWN_BY) if stub_rows else {**_SHOWN_BY, "request": "ensemble", "stub": "step"}
    for kind, steps, size, latency, _ in rows:
        parts = crossings(kind, steps, size)
        for name, shown_by in shown.items():
            if shown_by != kind or name not in parts:
                continue
            others = sum(t * costs[b].us(nb) for b, (t, nb) in parts.items() if b != name)
            times, nbytes = parts[name]
            points.append(Point(name, nbytes, (latency - others) / times, f"{kind} x{steps}"))
    return {name: costs[name] for name in _NAMES}, tuple(points)
