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

Fits are weighted to minimise relative errors, so 1 KiB probes (a fraction of
a millisecond) count as much as 32 MiB ones (hundreds). A cost cannot be
negative: a coefficient the fit puts below zero is fixed at zero and the
others are fitted again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .profile import BOUNDARIES, MIB, Cost, Point

__all__ = ["crossings", "fit_costs", "predict_us"]

_NAMES = tuple(BOUNDARIES)
# Which probe shows each boundary best: its points on the plot come from these probes.
_SHOWN_BY = {"request": "step", "ensemble_step": "ensemble", "bls_call": "bls"}

Row = tuple  # (kind, steps, size, latency_us[, stub_us])


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
    raise ValueError(f"unknown probe kind {kind!r}")


def predict_us(costs: dict[str, Cost], kind: str, steps: int, size: int) -> float:
    """A probe's latency according to ``costs`` (µs)."""
    return sum(times * costs[name].us(nbytes) for name, (times, nbytes) in crossings(kind, steps, size).items())


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, relative residuals (rows weighted by 1/y)."""
    weights = 1.0 / np.maximum(np.abs(y), 1e-9)
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


def _row(kind: str, steps: int, size: int, names: Sequence[str]) -> np.ndarray:
    row = np.zeros(2 * len(names))
    for name, (times, nbytes) in crossings(kind, steps, size).items():
        if name in names:
            i = names.index(name)
            row[2 * i] = times
            row[2 * i + 1] = times * nbytes / MIB
    return row


def fit_costs(samples: Sequence[Row]) -> tuple[dict[str, Cost], tuple[Point, ...]]:
    """Fit every boundary's cost to ``(kind, steps, size, latency_us[, stub_us])`` samples.

    Returns the costs and the points to plot: per sample, the cost of the
    boundary that sample shows best once the fitted costs of the others are
    taken away (and the stub's own measured cost, where there is one).
    """
    if not samples:
        raise ValueError("no samples to fit")
    rows = [(str(r[0]), int(r[1]), int(r[2]), float(r[3]), r[4] if len(r) > 4 else None) for r in samples]
    if not all(r[3] > 0 for r in rows):
        raise ValueError("latencies must be positive")
    costs: dict[str, Cost] = {}
    points: list[Point] = []
    stub_rows = [r for r in rows if r[4] is not None and r[4] > 0]
    names: tuple[str, ...] = _NAMES
    if stub_rows:
        a = np.array([[1.0, 2 * r[2] / MIB] for r in stub_rows])
        fixed, per_mib = _nonnegative_lstsq(a, np.array([float(r[4]) for r in stub_rows]))
        costs["stub"] = Cost(float(fixed), float(per_mib))
        points += [Point("stub", 2 * r[2], float(r[4]), f"{r[0]} x{r[1]}") for r in stub_rows]
        names = tuple(n for n in _NAMES if n != "stub")
    known = dict(costs)

    def rest(kind: str, steps: int, size: int) -> float:  # the part of a latency priced already
        return sum(t * known[b].us(nb) for b, (t, nb) in crossings(kind, steps, size).items() if b in known)

    a = np.array([_row(k, n, s, names) for k, n, s, _, _ in rows])
    y = np.array([lat - rest(k, n, s) for k, n, s, lat, _ in rows])
    coef = _nonnegative_lstsq(a, y)
    costs.update({name: Cost(float(coef[2 * i]), float(coef[2 * i + 1])) for i, name in enumerate(names)})
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
