"""Fitting boundary costs to probe latencies, one tensor size at a time.

At one tensor size, a probe's latency is a sum over the boundaries it crosses:

- a step model called directly: ``request + stub``;
- an ensemble of ``n`` steps: ``request + ensemble + n * (ensemble_step + ensemble_stub)``;
- an async BLS model calling ``n`` steps: ``request + bls_model + n * (bls_call + bls_stub)``;
- a sync BLS model: the same with ``bls_sync_model`` and ``bls_sync_call`` (measured: a sync
  call costs 0.13–0.17 ms less than an async one at 1 KiB, 0.5 ms less at 4 MiB).

The stub is priced from Triton's own statistics of the probe's identity step
models (compute input on the way in; compute infer and output on the way
out), because end-to-end latency cannot tell a
stub from the boundary that feeds it; each form's probes price that form's
stubs (``ensemble_stub``, ``bls_stub``, ``bls_sync_stub``: the ensemble's cost
more; an ensemble's by its steps before the last, whose compute output holds
the copy of the answer, which is the ensemble's own cost, paid on the way out),
and the step probe's its ``stub``. Where a kind's grown probe was measured
(``grown <kind>`` rows: intermediates of the size between a small request and
answer, requests back to back), its stubs are the ones the profile keeps; the
chains' own stubs are what the chains' lines are read against. Then the step probe gives the request,
and a straight line through each kind's latencies over its chain lengths
gives, from its slope, the cost of one more step (ensemble step or BLS call)
and, from its intercept, what the kind pays once per request (the ensemble
scheduler's own work, or the BLS model's own stub). A BLS model's and an
ensemble's line are read from their own statistics where they are given: the time
a BLS model held its instance (compute input + infer + output) holds its own stub
and every call it made, and the ensemble's own request time (from the request
received whole to its answer) every step and hand-off; neither holds the
client's send, whose HTTP body of 4 MiB stalls 40-60 ms in some requests and
not in others. That line plus the request is the latency's line, without the
request's noise. (On this machine's bundled server, at 1 KiB, the latency's
intercept lay within 0.1 ms of the request plus the hold's; an ensemble's
latency less its request time was 0.23-0.28 ms, as the step probe's.) Without statistics the
stub is what the step probe leaves once the ensemble's intercept has priced
the request (the ensemble's and the BLS model's own costs are then taken as
nothing and as one stub).

Fitting each size on its own keeps what a line through every size loses: on
a real server, costs per byte grow with the size (an HTTP body of 16 MiB
costs about twice as much per byte as one of 1 MiB), so the profile keeps each boundary's cost at each
measured size, and what predicts the server interpolates between them. The straight line
through those figures (numpy's least squares, relative errors, no cost below
zero) is what the table and the plot show. A cost the noise puts below zero
is zero.

**The estimator, and its interval** (:func:`fit_rounds`). The calibration measures
every probe in several rounds (:func:`pipelines.calibration.measure.measure_probes`).
Each probe's figures are their median over the rounds, and the solve above runs
once on those medians. The median is where the robustness lives, and the only place:
a round that met a slow spell of the machine is one of several, and it moves no median.
So the solve can stay linear least squares. It is exact on the model, and it weighs every chain
length alike. Theil–Sen over four lengths, or a rule that leaves one out, would
answer the same noise a second time, with a breakdown of its own and less
efficiency. Each cost's interval is a percentile bootstrap over the rounds: whole rounds are drawn with
replacement (every probe of a round together, since a spell moves them alike), the
medians and the solve are redone on each draw, and the interval holds the middle
``level`` of the draws' figures. It is seeded, so one set of rounds always gives the
same profile. The draws are fitted without clipping at zero: a cost the fit clips to 0 keeps
an interval that reaches below zero, which says that the data cannot tell it from nothing and
how far it may be from it, where draws clipped at zero would give it an interval of about
[0-0], as if it were known to cost nothing.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence
from statistics import median

import numpy as np

from ..errors import ArgumentError
from ..forms import FORMS
from .probes import BLS_KINDS, GATED_ROW, GROWN_ROW, GROWN_STEPS, KINDS
from .profile import BOUNDARIES, MIB, STAND_INS, Cost, Point, with_stand_ins

__all__ = ["crossings", "estimate", "fit_costs", "fit_rounds", "predict_us"]

_NAMES = tuple(BOUNDARIES)
# What each chained probe kind (a form) pays once per request, and per step.
_KINDS_OF = {kind: (FORMS[kind].own_cost, FORMS[kind].call_cost) for kind in KINDS if kind in FORMS}
# The stub of each kind's steps, priced from that kind's own probes.
_STUB_OF = {kind: FORMS[kind].stub_cost for kind in _KINDS_OF}
# The kind of probe whose line (over chain lengths) prices each boundary: "slope" or "intercept"
# (in the kinds' order: a boundary's stand-in is priced before it).
_FROM_LINE = {name: (kind, part) for kind, (once, per_step) in _KINDS_OF.items()
              for name, part in ((per_step, "slope"), (once, "intercept"))}

Row = tuple  # (kind, steps, size, latency_us[, stub_us[, stub_in_us[, model_us[, steps_us]]]])


def crossings(kind: str, steps: int, size: int) -> dict[str, tuple[int, int]]:
    """Boundary -> (times crossed, bytes per crossing) for one request of a probe.

    Every crossing carries the tensor in and back out: ``2 * size`` bytes.
    """
    both = 2 * size
    if kind == "step":
        return {"request": (1, both), "stub": (1, both)}
    if kind in _KINDS_OF:
        once, per_step = _KINDS_OF[kind]
        return {"request": (1, both), once: (1, both), per_step: (steps, both), _STUB_OF[kind]: (steps, both)}
    raise ArgumentError(f"unknown probe kind {kind!r}; expected one of 'step', {', '.join(map(repr, _KINDS_OF))}")


def predict_us(costs: dict[str, Cost], kind: str, steps: int, size: int) -> float:
    """A probe's latency according to ``costs`` (µs): the line's figures, or the curve's where
    a cost has one."""
    costs = with_stand_ins(costs)
    total = 0.0
    for name, (times, nbytes) in crossings(kind, steps, size).items():
        cost = costs[name]
        one_way = nbytes // 2
        total += times * (cost.way_us(one_way, leaving=False) + cost.way_us(one_way, leaving=True))
    return total


def _clipped(us: float, clip: bool) -> float:
    """A cost the fit put below zero as zero, where ``clip``: a cost is a time. A bootstrap draw
    is fitted unclipped, so that a cost's interval says how far below zero the data put it,
    where a draw clipped at zero would make a cost that noise puts about nothing look certain
    (issue 43: a fixed cost of exactly 0 µs, and an interval of [0-1])."""
    return max(0.0, us) if clip else us


def _weighted_lstsq(a: np.ndarray, y: np.ndarray, weights: np.ndarray, *, clip: bool) -> np.ndarray:
    """Weighted least squares (numpy's lstsq); with ``clip``, every coefficient >= 0 (refitted
    without the most negative coefficient until none is left)."""
    free = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    coef = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free] * weights[:, None], y * weights, rcond=None)
        coef[:] = 0.0
        coef[free] = solution
        if not clip or solution.min() >= 0:
            break
        free.pop(int(np.argmin(solution)))  # the most negative cost is zero; fit the rest again
    return coef


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Intercept and slope of latency over chain length (least squares through the medians per
    length), or None with fewer than two lengths."""
    by_steps: dict[int, list[float]] = defaultdict(list)
    for steps, latency in points:
        by_steps[steps].append(latency)
    if len(by_steps) < 2:
        return None
    n = np.array(sorted(by_steps), float)
    y = np.array([median(by_steps[k]) for k in sorted(by_steps)])
    # Least squares, every length kept: the figures are already medians over rounds (fit_rounds),
    # so an outlier is gone before the line; a robust line on top would answer it twice.
    slope, intercept = np.polyfit(n, y, 1)
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
        stub_pair = _stub_pair([r for r in stub_rows if r[0] == "step"] or stub_rows)
        stub = sum(stub_pair)
        request = step - stub if step is not None else (lines["ensemble"] or (0.0, 0.0))[0]
    else:  # no statistics: the ensemble's intercept is the request, the step probe's rest the stub
        request = (lines["ensemble"] or (0.0, 0.0))[0]
        stub = _clipped(step - request, clip) if step is not None else 0.0
        stub_pair = (stub / 2, stub / 2)
    # Each form's steps priced by the statistics of its own probes' steps: the ensemble's
    # stubs cost more than the ones a BLS model calls (at 4 MiB, 1.63-1.76 ms against 1.27-1.44
    # on this machine's bundled server). What the kind's line leaves per step beyond them is
    # its call; where its stubs alone exceed the slope, the call is nothing and the steps cost
    # what Triton's statistics say (docs/server_profiles.md).
    stub_of = {}
    for kind in _KINDS_OF:
        own = [r for r in stub_rows if r[0] == kind]
        stub_of[kind] = _stub_pair(own) if own else stub_pair
    if stub_rows:
        for kind in ("ensemble", *BLS_KINDS):
            # How long the BLS model holds its instance (the ensemble, the request), over chain lengths:
            # its latency's line less the request, without the request's noise (see the module docstring).
            held = _line([(r[1], r[6]) for r in rows if r[0] == kind and r[6] is not None])
            if held is not None:
                lines[kind] = (held[0] + request, held[1])  # less the request below: the hold's own
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
    if not stub_rows:
        # without statistics, the BLS model's own stub is taken as one stub
        costs["bls_model"] = costs["bls_sync_model"] = stub
        costs["ensemble"] = 0.0
    pairs = {name: (_clipped(us, clip) / 2, _clipped(us, clip) / 2) for name, us in costs.items()}
    # The ensemble's own cost is mostly its answer's copy out of its last step (probes.Probe.stub_models):
    # it is paid by the request's outputs, on the way out.
    pairs["ensemble"] = (0.0, _clipped(costs["ensemble"], clip))
    pairs["stub"] = stub_pair
    pairs["ensemble_gate"] = (0.0, 0.0)  # read off the gated probe across sizes: _gate_from_gated
    # What a step's stub costs in a pipeline: the grown probe's, measured warm between steps that
    # grow and shrink the tensor, as a user's steps pass intermediates (at 4 MiB, 2.0-2.6 ms where
    # the chains' stubs, fed by a 4 MiB request and measured in turns, cost 2.8-3.4). The chains'
    # own stubs (stub_of) stay what their lines are read against: what a line leaves per step
    # beyond the stubs measured with it is the call's.
    for kind, name in _STUB_OF.items():
        grown = [r for r in stub_rows if r[0] == GROWN_ROW + kind]
        pairs[name] = _stub_pair(grown) if grown else stub_of[kind]
    return pairs


# A grown probe's calls: two ways of a few bytes (grow's request, shrink's answer), and every
# other way carries the intermediate (grow's answer, each identity's both ways, shrink's request).
_GROWN_WAYS = 2 * GROWN_STEPS + 2


def _calls_from_grown(at: dict[int, dict[str, tuple[float, float]]], by_size: dict[int, list[Row]], *,
                      clip: bool) -> None:
    """Each BLS kind's call cost at each size above the smallest, where its grown probe gave
    its BLS model's hold and its step models' (``model_us``, ``steps_us``), read off that probe.

    The hold less what its steps held and less its own stub is what its calls cost: requests
    back to back, between steps that grow and shrink the tensor, as a user's pipeline makes
    them. The chains' slope prices them cold: each request carries the tensor in and out,
    and the probes take turns with a dozen models. At 12 and 32 MiB that read a call at 965
    and 488 µs a way, less than at 4 MiB (1155), where the grown probe read 2408 and 8334
    (docs/server_profiles.md). The two small ways and the own stub are priced at the
    smallest size, by the chains.
    """
    smallest = min(at)
    for kind in BLS_KINDS:
        own, call = FORMS[kind].own_cost, FORMS[kind].call_cost
        small_way = sum(at[smallest][call]) / 2
        own_small = sum(at[smallest][own])
        for size, rows in by_size.items():
            grown = [r for r in rows if r[0] == GROWN_ROW + kind and r[6] is not None and r[7] is not None]
            if size == smallest or not grown:
                continue
            calls = median(r[6] - r[7] for r in grown) - own_small
            way = _clipped((calls - 2 * small_way) / _GROWN_WAYS, clip)
            at[size][call] = (way, way)


def _gate_from_gated(at: dict[int, dict[str, tuple[float, float]]], by_size: dict[int, list[Row]], *,
                     clip: bool) -> None:
    """What a gated ensemble pays beyond an ungated one, at each size where both grown probes
    were measured: the gated probe's latency less the grown ensemble's, less what the profile
    already prices its gate model by (a step and a stub, passing a few bytes: the smallest size's).

    The gated probe runs the same steps and a one-number step beside them (a step running
    beside others is what gates an ensemble), so each step carries a failure tensor in and
    out, and a gate model answers. On the bundled server that cost 0.7-1.4 ms a request more than the same chain
    ungated, at 1 KiB and at 4 MiB alike, where its gate's step and stub are 0.4 ms
    (docs/server_profiles.md)."""
    smallest = min(at)
    charged = sum(at[smallest]["ensemble_step"]) * 2 + sum(at[smallest]["ensemble_stub"])
    for size, rows in by_size.items():
        gated = [r[3] for r in rows if r[0] == GATED_ROW]
        plain = [r[3] for r in rows if r[0] == GROWN_ROW + "ensemble"]
        if gated and plain:
            extra = _clipped(median(gated) - median(plain) - charged, clip)
            at[size]["ensemble_gate"] = (extra / 2, extra / 2)


def _stub_pair(rows: Sequence[Row]) -> tuple[float, float]:
    """A stub's (way in, way out) µs: the medians of its statistics (compute input on the way in)."""
    stub_in = median(float(r[5]) if len(r) > 5 and r[5] is not None else r[4] / 2 for r in rows)
    stub = median(float(r[4]) for r in rows)
    return min(stub_in, stub), max(0.0, stub - stub_in)  # at least the way in, where noise put the total below it


def _summary_line(sizes: Sequence[int], totals: Sequence[float], *, clip: bool) -> tuple[float, float]:
    """Fixed µs and µs per MiB of the straight line through (in + out bytes, µs), relative errors
    (neither below zero, where ``clip``)."""
    x = np.array([2 * s / MIB for s in sizes])
    y = np.array(totals, float)
    if len(x) == 1:
        return float(y[0]), 0.0
    weights = 1.0 / np.maximum(y, max(1.0, 1e-3 * float(y.max())))
    fixed, per_mib = _weighted_lstsq(np.stack([np.ones_like(x), x], 1), y, weights, clip=clip)
    return float(fixed), float(per_mib)


def fit_costs(samples: Sequence[Row]) -> tuple[dict[str, Cost], tuple[Point, ...]]:
    """Fit every boundary's cost to ``(kind, steps, size, latency_us[, stub_us[, stub_in_us[, model_us[, steps_us]]]])``
    samples.

    ``stub_us`` is what one execution of a probe's step cost inside the server (Triton's
    statistics); ``stub_in_us`` the part of it on the way in; ``model_us``, for a BLS probe,
    what its BLS model held its instance, for an ensemble probe its own request time; ``steps_us``, for a grown BLS probe, what all its
    step models held theirs.
    Returns the costs and the points to plot: each boundary's cost at each size.
    """
    rows = _checked(samples)
    sizes, figures = _fit(rows, clip=True)
    costs: dict[str, Cost] = {}
    points: list[Point] = []
    for name, (fixed, per_mib, ins, outs) in figures.items():
        totals = [i + o for i, o in zip(ins, outs, strict=True)]
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
    rows = [(str(r[0]), int(r[1]), int(r[2]), float(r[3]), *(tuple(r[4:8]) + (None,) * 4)[:4]) for r in samples]
    if not all(r[3] > 0 for r in rows):
        raise ArgumentError("every latency must be positive (microseconds > 0); a sample of 0 or less was given")
    return rows


Figures = tuple[float, float, tuple[float, ...], tuple[float, ...]]  # fixed µs, µs per MiB, in µs and out µs by size


def _fit(rows: Sequence[Row], *, clip: bool) -> tuple[tuple[int, ...], dict[str, Figures]]:
    """The sizes, and every boundary's figures at them: each size fitted on its own, then the
    line through them. Without ``clip``, a figure the fit puts below zero stays there (and the
    figures read off it use it as it is): what a bootstrap draw's interval is read from."""
    by_size: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        by_size[r[2]].append(r)
    sizes = tuple(sorted(by_size))
    at = {s: _at_size(by_size[s], clip=clip) for s in sizes}
    _calls_from_grown(at, by_size, clip=clip)
    _gate_from_gated(at, by_size, clip=clip)
    figures = {}
    for name in _NAMES:
        ins = tuple(at[s][name][0] for s in sizes)
        outs = tuple(at[s][name][1] for s in sizes)
        totals = [i + o for i, o in zip(ins, outs, strict=True)]
        # one line for all: the figures are medians already
        figures[name] = (*_summary_line(sizes, totals, clip=clip), ins, outs)
    return sizes, figures


#: A probe's figures in one round: (kind, steps, size, round, latency_us, stub_us, stub_in_us,
#: model_us, steps_us), the last four None where not measured (see measure.Sample).
RoundRow = tuple


def _by_probe(rows: Sequence[RoundRow]) -> tuple[list[tuple[str, int, int]], np.ndarray]:
    """The probes in the order first seen, and their figures as an array [probe, round, 5] (NaN
    where a figure was not measured, or a probe missed a round)."""
    probes: dict[tuple[str, int, int], int] = {}
    rounds: dict[object, int] = {}
    for r in rows:
        probes.setdefault((str(r[0]), int(r[1]), int(r[2])), len(probes))
        rounds.setdefault(r[3], len(rounds))
    figures = np.full((len(probes), len(rounds), 5), np.nan)
    for r in rows:
        values = (tuple(r[4:9]) + (None,) * 5)[:5]
        figures[probes[str(r[0]), int(r[1]), int(r[2])], rounds[r[3]]] = [np.nan if v is None else float(v)
                                                                          for v in values]
    return list(probes), figures


def _medians(figures: np.ndarray) -> np.ndarray:
    """The median over the rounds (axis -2) of each figure, NaN where a figure has none."""
    measured = ~np.isnan(figures)
    out = np.full(figures.shape[:-2] + figures.shape[-1:], np.nan)
    some = measured.any(axis=-2)
    with warnings.catch_warnings():  # a figure never measured (a chain's BLS hold) is all NaN: it stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        out[some] = np.nanmedian(figures, axis=-2)[some]
    return out


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
    ``(kind, steps, size, latency_us, stub_us, stub_in_us, model_us, steps_us)`` row for
    :func:`fit_costs` (a latency of at least 1 µs; no time below zero)."""
    if not rows:
        raise ArgumentError("no rounds to fit: give (kind, steps, size, round, latency_us, ...) rows")
    probes, figures = _by_probe(rows)
    if np.isnan(figures[..., 0]).all(axis=1).any():
        raise ArgumentError("every probe needs a latency in at least one round")
    return _rows_of(probes, _medians(figures))


def fit_rounds(rows: Sequence[RoundRow], *, resamples: int = 1000, level: float = 0.95, seed: int = 0
               ) -> tuple[dict[str, Cost], tuple[Point, ...], list[Row]]:
    """Every boundary's cost from per-round figures, with its confidence intervals.

    The costs are :func:`fit_costs` of :func:`estimate` (each probe's medians over the
    rounds). The intervals come from ``resamples`` draws of the rounds with replacement,
    each round whole, that are estimated and fitted again. Each cost's ``fixed_ci``,
    ``per_mib_ci``, ``in_ci``, ``out_ci`` and ``total_ci`` hold the middle ``level`` of
    those draws (see the module docstring). Returns the costs, the points to plot, and
    the estimator's rows (one per probe).
    """
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
    lines = np.empty((resamples, len(names), 2))
    ways = np.empty((resamples, len(names), 3, len(costs[names[0]].sizes)))  # in, out, in + out by size
    for b in range(resamples):
        # Unclipped: a cost's interval reaches below zero where the data do (see _clipped).
        _, fitted = _fit(_checked(_rows_of(probes, drawn[:, b, :])), clip=False)
        for j, name in enumerate(names):
            fixed, per_mib, ins, outs = fitted[name]
            lines[b, j] = fixed, per_mib
            ways[b, j, 0], ways[b, j, 1] = ins, outs
            ways[b, j, 2] = np.add(ins, outs)
    tails = [(1 - level) / 2, 1 - (1 - level) / 2]
    line_ci = np.quantile(lines, tails, axis=0)  # [2, boundary, 2]
    way_ci = np.quantile(ways, tails, axis=0)  # [2, boundary, 3, size]

    def pairs(j: int, k: int) -> tuple[tuple[float, float], ...]:
        return tuple((float(lo), float(hi)) for lo, hi in zip(way_ci[0, j, k], way_ci[1, j, k], strict=True))

    with_ci = {}
    for j, name in enumerate(names):
        c = costs[name]
        with_ci[name] = Cost(c.fixed_us, c.us_per_mib, c.sizes, c.in_us, c.out_us,
                             fixed_ci=(float(line_ci[0, j, 0]), float(line_ci[1, j, 0])),
                             per_mib_ci=(float(line_ci[0, j, 1]), float(line_ci[1, j, 1])),
                             in_ci=pairs(j, 0), out_ci=pairs(j, 1), total_ci=pairs(j, 2))
    return with_ci, points, estimated
