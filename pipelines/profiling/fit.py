"""Fitting boundary costs to probe latencies, one tensor size at a time.

At one tensor size, a probe's latency is a sum over the boundaries it crosses:

- a step model called directly: ``request + stub``;
- an ensemble of ``n`` steps: ``request + ensemble + n * (ensemble_step + ensemble_stub)``;
- an async BLS model calling ``n`` steps: ``request + bls_model + n * (bls_call + bls_stub)``;
- a sync BLS model: the same with ``bls_sync_model`` and ``bls_sync_call``;
- a fused model running ``n`` steps in its process: ``request + fused_model + n * fused_step``.

Each size is fitted on its own (costs per byte grow with it): each form's stubs by Triton's
statistics of its own probes, the request by the step probe, the rest by a line over chain lengths.
:func:`fit_rounds` fits each probe's median over the rounds and bootstraps whole rounds. Why, with
the measurements: docs/calibration_internals.md ("Rounds, turns and bursts", "The fit").
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from statistics import median

import numpy as np

from ..calibration.cost import FORM_COSTS
from ..calibration.profile import BOUNDARIES, MIB, STAND_INS, Cost, Point
from ..errors import ArgumentError
from ..forms import FORMS
from .probes import BLS_KINDS, GATED_ROW, GROWN_ROW, GROWN_STEPS, HELD_KINDS, KINDS

__all__ = ["estimate", "fit_costs", "fit_rounds"]

# What each chained probe kind (a form) pays once per request, and per step (a call, or the fused model's own work).
_KINDS_OF = {kind: (FORM_COSTS[kind].own_cost, FORM_COSTS[kind].in_process_step_cost or FORM_COSTS[kind].call_cost)
             for kind in KINDS if kind in FORMS}
# The stub of each kind's steps, priced from that kind's own probes (none in the fused model's process).
_STUB_OF = {kind: FORM_COSTS[kind].stub_cost for kind in _KINDS_OF if not FORMS[kind].in_process}
# The kind of probe whose line (over chain lengths) prices each boundary: "slope" or "intercept"
# (in the kinds' order: a boundary's stand-in is priced before it).
_FROM_LINE = {name: (kind, part) for kind, (once, per_step) in _KINDS_OF.items()
              for name, part in ((per_step, "slope"), (once, "intercept"))}

Row = tuple  # (kind, steps, size, latency_us[, stub_us[, stub_in_us[, model_us[, steps_us]]]])
At = dict[int, dict[str, tuple[float, float]]]  # by size, every boundary's (way in, way out) µs


def _clipped(us: float, clip: bool) -> float:
    """A cost below zero as zero, where ``clip`` (bootstrap draws are not: an interval says how far)."""
    return max(0.0, us) if clip else us


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Intercept and slope of latency over chain length (least squares through the medians per
    length, every length kept: a robust line would answer noise twice), or None with fewer than two."""
    by_steps: dict[int, list[float]] = defaultdict(list)
    for steps, latency in points:
        by_steps[steps].append(latency)
    if len(by_steps) < 2:
        return None
    n = sorted(by_steps)
    slope, intercept = np.polyfit(n, [median(by_steps[k]) for k in n], 1)
    return float(intercept), float(slope)


def _at_size(rows: Sequence[Row], *, clip: bool) -> dict[str, tuple[float, float]]:
    """Every boundary's (way in, way out) cost in µs at one tensor size (below zero where the
    fit puts it there, unless ``clip``)."""
    latency = defaultdict(list)
    for kind, steps, _, lat, *_ in rows:
        latency[kind].append((steps, lat))
    stub_rows = [r for r in rows if r[4] is not None and r[4] > 0]
    lines = {kind: _line(latency[kind]) for kind in _KINDS_OF}
    step = median(lat for _, lat in latency["step"]) if latency["step"] else None
    if stub_rows:
        # the step probe is the request and its one stub: its own statistics price that stub
        stub_pair = _stubs(stub_rows, "step") or _stubs(stub_rows)
        stub = sum(stub_pair)
        request = step - stub if step is not None else (lines["ensemble"] or (0.0, 0.0))[0]
        for kind in ("ensemble", *HELD_KINDS):
            # the top-level model's own hold over chain lengths: its latency's line without the request's noise
            held = _line([(r[1], r[6]) for r in rows if r[0] == kind and r[6] is not None])
            if held is not None:
                lines[kind] = (held[0] + request, held[1])  # less the request below: the hold's own
    else:  # no statistics: the ensemble's intercept is the request, the step probe's rest the stub
        request = (lines["ensemble"] or (0.0, 0.0))[0]
        stub = _clipped(step - request, clip) if step is not None else 0.0
        stub_pair = (stub / 2, stub / 2)
    # Each form's steps priced by its own probes' statistics (an ensemble's stubs cost more than a BLS model's); what
    # its line leaves per step beyond them is its call (docs/calibration_internals.md).
    stub_of = {kind: (_stubs(stub_rows, kind) or stub_pair) if kind in _STUB_OF else (0.0, 0.0) for kind in _KINDS_OF}
    costs = {"request": _clipped(request, clip), "stub": stub}
    for name, (kind, part) in _FROM_LINE.items():
        line = lines[kind]
        if line is None and not latency[kind] and name in STAND_INS:  # a kind not probed (older samples)
            stand_in = STAND_INS[name]
            costs[name] = costs[stand_in] if stand_in else 0.0
            continue
        kind_stub = sum(stub_of[kind])
        if line is None:  # one chain length: the whole rest is per step, nothing per request
            one = latency[kind]
            per_step = median((lat - request) / s - kind_stub for s, lat in one) if one else 0.0
            line = (request, per_step + kind_stub)
        intercept, slope = line
        costs[name] = slope - kind_stub if part == "slope" else intercept - request
    if not stub_rows:  # without statistics, a BLS model's own stub is taken as one stub, the ensemble's as nothing
        costs["bls_model"] = costs["bls_sync_model"] = stub
        costs["ensemble"] = 0.0
    pairs = {name: (_clipped(us, clip) / 2, _clipped(us, clip) / 2) for name, us in costs.items()}
    # The ensemble's: mostly its answer's copy out of its last step (probes.Probe.stub_models), paid on the way out.
    pairs["ensemble"] = (0.0, _clipped(costs["ensemble"], clip))
    pairs["stub"] = stub_pair
    pairs["ensemble_gate"] = (0.0, 0.0)  # read off the gated probe across sizes: _gate_from_gated
    # A step's stub in a pipeline is the grown probe's, fed warm as a user's steps pass intermediates (2.0-2.6 ms at
    # 4 MiB where the chains' cost 2.8-3.4); the chains' own (stub_of) stay what their lines were read against.
    for kind, name in _STUB_OF.items():
        pairs[name] = _stubs(stub_rows, GROWN_ROW + kind) or stub_of[kind]
    return pairs


def _reads_from_grown(at: At, by_size: dict[int, list[Row]]) -> None:
    """Moves to each form's step stub's (``*_stub``) way in the part of its way out that its input's size sets: what the
    grown probe's ``shrink`` (an input of the size, an answer of a byte) costs above the smallest size, so that a step
    that takes much and gives little pays it (docs/calibration_internals.md, "The fit")."""
    smallest = min(by_size)
    for kind, name in _STUB_OF.items():
        reads = {size: [r[8] for r in rows if r[0] == GROWN_ROW + kind and r[8] is not None]
                 for size, rows in by_size.items()}
        if not reads[smallest]:
            continue
        base = median(reads[smallest])
        for size, read in reads.items():
            if size != smallest and read:
                way_in, way_out = at[size][name]
                moved = min(max(0.0, median(read) - base), max(0.0, way_out))
                at[size][name] = (way_in + moved, way_out - moved)


# A grown probe's ways: two of a few bytes (grow's request, shrink's answer); every other carries the intermediate.
_GROWN_WAYS = 2 * GROWN_STEPS + 2


def _calls_from_grown(at: At, by_size: dict[int, list[Row]], *, clip: bool) -> None:
    """Each BLS kind's call cost at each size above the smallest, where its grown probe gave its BLS model's hold and
    its step models' (``model_us``, ``steps_us``): the hold less theirs and less its own stub, its two small ways and
    own stub priced at the smallest size. The chains' slope prices calls cold, and too low at large sizes
    (docs/calibration_internals.md, "The fit")."""
    smallest = min(at)
    for kind in BLS_KINDS:
        own, call = FORM_COSTS[kind].own_cost, FORM_COSTS[kind].call_cost
        small_way = sum(at[smallest][call]) / 2
        own_small = sum(at[smallest][own])
        for size, rows in by_size.items():
            grown = [r for r in rows if r[0] == GROWN_ROW + kind and r[6] is not None and r[7] is not None]
            if size == smallest or not grown:
                continue
            calls = median(r[6] - r[7] for r in grown) - own_small
            way = _clipped((calls - 2 * small_way) / _GROWN_WAYS, clip)
            at[size][call] = (way, way)


def _grown_ensemble_left(at: At, by_size: dict[int, list[Row]], size: int) -> float | None:
    """What the grown ensemble took at ``size`` beyond its four stubs (grow's and shrink's with one way of
    a few bytes, the identities' with both of the size), or None where it was not measured: its
    request and answer of a few bytes, and its steps' hand-offs, two of a few bytes and six of the size."""
    latency = [r[3] for r in by_size[size] if r[0] == GROWN_ROW + "ensemble"]
    if not latency:
        return None
    small = sum(at[min(at)]["ensemble_stub"])
    return median(latency) - small - (GROWN_STEPS + 1) * sum(at[size]["ensemble_stub"])


def _steps_from_grown(at: At, by_size: dict[int, list[Row]], *, clip: bool) -> None:
    """The ensemble's hand-off of a step's tensors (``ensemble_step``) above the smallest size, where the grown ensemble
    was measured: the smallest size's, plus a sixth (six of its hand-offs carry the size) of what it took beyond its
    stubs above that at the smallest (docs/calibration_internals.md, "The fit")."""
    smallest = min(at)
    base = _grown_ensemble_left(at, by_size, smallest)
    if base is None:
        return
    small_way = sum(at[smallest]["ensemble_step"]) / 2
    for size in at:
        left = _grown_ensemble_left(at, by_size, size) if size != smallest else None
        if left is not None:
            way = _clipped(small_way + (left - base) / _GROWN_WAYS, clip)
            at[size]["ensemble_step"] = (way, way)


def _gate_from_gated(at: At, by_size: dict[int, list[Row]], *, clip: bool) -> None:
    """What a gated ensemble pays beyond an ungated one, where both grown probes were measured: the
    gated probe's latency less the grown ensemble's, less what the profile prices its gate model by (a
    step and a stub at the smallest size): docs/calibration_internals.md, "The probes"."""
    smallest = min(at)
    charged = sum(at[smallest]["ensemble_step"]) * 2 + sum(at[smallest]["ensemble_stub"])
    for size, rows in by_size.items():
        gated = [r[3] for r in rows if r[0] == GATED_ROW]
        plain = [r[3] for r in rows if r[0] == GROWN_ROW + "ensemble"]
        if gated and plain:
            extra = _clipped(median(gated) - median(plain) - charged, clip)
            at[size]["ensemble_gate"] = (extra / 2, extra / 2)


def _stubs(rows: Sequence[Row], kind: str | None = None) -> tuple[float, float] | None:
    """A stub's (way in, way out) µs from ``kind``'s own rows (None: all of them), or None where there
    are none: the medians of their statistics (compute input on the way in)."""
    own = [r for r in rows if kind is None or r[0] == kind]
    if not own:
        return None
    stub_in = median(float(r[5]) if r[5] is not None else r[4] / 2 for r in own)
    stub = median(float(r[4]) for r in own)
    return min(stub_in, stub), max(0.0, stub - stub_in)  # at least the way in, where noise put the total below it


def _summary_line(sizes: Sequence[int], totals: Sequence[float], *, clip: bool) -> tuple[float, float]:
    """Fixed µs and µs per MiB of the straight line through (in + out bytes, µs), weighted least squares with relative
    errors; with ``clip``, neither below zero (the more negative is zero, and the other is fitted again)."""
    x = np.array([2 * s / MIB for s in sizes])
    y = np.array(totals, float)
    if len(x) == 1:
        return float(y[0]), 0.0
    weights = 1.0 / np.maximum(y, max(1.0, 1e-3 * float(y.max())))
    a = np.stack([np.ones_like(x), x], 1)
    free = [0, 1]  # the columns still fitted
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free] * weights[:, None], y * weights, rcond=None)
        coef = np.zeros(2)
        coef[free] = solution
        if not clip or solution.min() >= 0:
            break
        free.pop(int(np.argmin(solution)))
    return float(coef[0]), float(coef[1])


def fit_costs(samples: Sequence[Row]) -> tuple[dict[str, Cost], tuple[Point, ...]]:
    """Fit every boundary's cost to ``(kind, steps, size, latency_us[, stub_us[, stub_in_us[, model_us[,
    steps_us[, reader_us]]]]])`` samples (:data:`RoundRow` says what each figure is). Returns the costs
    and the points to plot."""
    rows = _checked(samples)
    sizes, figures = _fit(rows, clip=True)
    costs: dict[str, Cost] = {}
    points: list[Point] = []
    for name, (fixed, per_mib, ins, outs, totals) in figures.items():
        points += [Point(name, 2 * s, t, "fitted at this size") for s, t in zip(sizes, totals, strict=True)]
        costs[name] = Cost(fixed, per_mib, sizes, ins, outs)
    for kind, steps, size, _, stub_us, *_ in rows:
        if stub_us is not None and stub_us > 0:
            grown = kind.startswith(GROWN_ROW)
            name = _STUB_OF.get(kind.removeprefix(GROWN_ROW), "stub")
            points.append(Point(name, 2 * size, float(stub_us), kind if grown else f"{kind} x{steps}"))
    return costs, tuple(points)


def _checked(samples: Sequence[Row]) -> list[Row]:
    """The samples as fit rows, every figure there (None where not measured), every latency > 0."""
    if not samples:
        raise ArgumentError("no samples to fit: give at least one (kind, steps, size, latency_us) row per size")
    rows = [(str(r[0]), int(r[1]), int(r[2]), float(r[3]), *(tuple(r[4:9]) + (None,) * 5)[:5]) for r in samples]
    if not all(r[3] > 0 for r in rows):
        raise ArgumentError("every latency must be positive (microseconds > 0); a sample of 0 or less was given")
    return rows


#: A boundary's fixed µs and µs per MiB, then its in, out and in + out µs by size.
Figures = tuple[float, float, tuple[float, ...], tuple[float, ...], tuple[float, ...]]


def _fit(rows: Sequence[Row], *, clip: bool) -> tuple[tuple[int, ...], dict[str, Figures]]:
    """The sizes, and every boundary's figures at them: each size fitted on its own, then the line
    through them. Without ``clip`` (a bootstrap draw), a figure below zero stays there."""
    by_size: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        by_size[r[2]].append(r)
    sizes = tuple(sorted(by_size))
    at = {s: _at_size(by_size[s], clip=clip) for s in sizes}
    _calls_from_grown(at, by_size, clip=clip)
    _steps_from_grown(at, by_size, clip=clip)
    _gate_from_gated(at, by_size, clip=clip)
    _reads_from_grown(at, by_size)
    figures = {}
    for name in BOUNDARIES:
        ins, outs = zip(*(at[s][name] for s in sizes), strict=True)
        totals = tuple(i + o for i, o in zip(ins, outs, strict=True))
        figures[name] = (*_summary_line(sizes, totals, clip=clip), ins, outs, totals)
    return sizes, figures


#: A probe's figures in one round: (kind, steps, size, round, latency_us, stub_us, stub_in_us, model_us, steps_us,
#: reader_us), the last five None where not measured: Triton's statistics of one execution of a probe's step and its
#: way in, what a BLS probe's model held its instance (an ensemble probe: its own request time), what a grown BLS
#: probe's step models held theirs, and a grown probe's ``shrink`` on its stub's side (see measure.Sample).
RoundRow = tuple


def _by_probe(rows: Sequence[RoundRow]) -> tuple[list[tuple[str, int, int]], np.ndarray]:
    """The probes in the order first seen, and their figures as an array [probe, round, 6] (NaN
    where a figure was not measured, or a probe missed a round)."""
    keys = [(str(r[0]), int(r[1]), int(r[2])) for r in rows]
    probes = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    rounds = {k: i for i, k in enumerate(dict.fromkeys(r[3] for r in rows))}
    figures = np.full((len(probes), len(rounds), 6), np.nan)
    for key, r in zip(keys, rows, strict=True):
        figures[probes[key], rounds[r[3]]] = np.array((tuple(r[4:10]) + (None,) * 6)[:6], float)  # None: NaN
    return list(probes), figures


def _medians(figures: np.ndarray) -> np.ndarray:
    """The median over the rounds (axis -2) of each figure, NaN where a figure has none."""
    with warnings.catch_warnings():  # a figure never measured (a chain's BLS hold) is all NaN: it stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(figures, axis=-2)


def _rows_of(probes: Sequence[tuple[str, int, int]], medians: np.ndarray) -> list[Row]:
    """Fit rows from each probe's medians: a latency of at least 1 µs, no time below zero; none
    for a probe without a latency (a draw of only rounds it missed)."""
    rows = []
    for (kind, steps, size), m in zip(probes, medians, strict=True):
        if np.isnan(m[0]):
            continue
        rest = [None if np.isnan(v) else max(0.0, float(v)) for v in m[1:]]
        rows.append((kind, steps, size, max(1.0, float(m[0])), *rest))
    return rows


def estimate(rows: Sequence[RoundRow]) -> list[Row]:
    """The estimator: each probe's median over the rounds of each of its figures, as one
    ``(kind, steps, size, latency_us, stub_us, stub_in_us, model_us, steps_us, reader_us)`` row for
    :func:`fit_costs` (a latency of at least 1 µs; no time below zero)."""
    if not rows:
        raise ArgumentError("no rounds to fit: give (kind, steps, size, round, latency_us, ...) rows")
    probes, figures = _by_probe(rows)
    if np.isnan(figures[..., 0]).all(axis=1).any():
        raise ArgumentError("every probe needs a latency in at least one round")
    return _rows_of(probes, _medians(figures))


def fit_rounds(rows: Sequence[RoundRow], *, resamples: int = 1000, level: float = 0.95, seed: int = 0
               ) -> tuple[dict[str, Cost], tuple[Point, ...], list[Row]]:
    """Every boundary's cost from per-round figures (:func:`fit_costs` of :func:`estimate`), with its ``*_ci``
    intervals: the middle ``level`` of ``resamples`` draws of whole rounds with replacement, estimated and fitted again.
    Returns the costs, the points to plot, and the estimator's rows (one per probe)."""
    if not 0 < level < 1 or resamples < 1:
        raise ArgumentError(f"an interval needs 0 < level < 1 and resamples >= 1; got level={level}, "
                            f"resamples={resamples}")
    estimated = estimate(rows)
    costs, points = fit_costs(estimated)
    probes, figures = _by_probe(rows)
    n_rounds = figures.shape[1]
    draws = np.random.default_rng(seed).integers(0, n_rounds, size=(resamples, n_rounds))
    drawn = _medians(figures[:, draws, :])  # [probe, draw, figure]
    names = list(costs)
    # Unclipped: a cost's interval reaches below zero where the data do (see _clipped).
    fits = [_fit(_checked(_rows_of(probes, drawn[:, b, :])), clip=False)[1] for b in range(resamples)]
    lines = np.array([[fitted[name][:2] for name in names] for fitted in fits])  # [draw][boundary][fixed, per MiB]
    ways = np.array([[fitted[name][2:] for name in names] for fitted in fits])  # [draw][boundary][in, out, total][size]
    tails = [(1 - level) / 2, 1 - (1 - level) / 2]
    line_lo, line_hi = np.quantile(lines, tails, axis=0).tolist()  # [boundary][fixed, per MiB]
    way_lo, way_hi = np.quantile(ways, tails, axis=0).tolist()  # [boundary][in, out, total][size]
    with_ci = {}
    for j, name in enumerate(names):
        ins, outs, totals = (tuple(zip(lo, hi, strict=True)) for lo, hi in zip(way_lo[j], way_hi[j], strict=True))
        with_ci[name] = replace(costs[name], fixed_ci=(line_lo[j][0], line_hi[j][0]),
                                per_mib_ci=(line_lo[j][1], line_hi[j][1]), in_ci=ins, out_ci=outs, total_ci=totals)
    return with_ci, points, estimated
