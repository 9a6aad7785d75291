"""A boundary's cost: a fixed cost plus a cost per MiB, its measured cost at each probe size on
the way in and out, and the confidence intervals of those figures; read from a profile's JSON
with each figure checked and named by its field.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PipelinesError

__all__ = ["BOUNDARIES", "FORM_COSTS", "MIB", "Cost", "FormCosts", "cost_from_json"]

MIB = float(1 << 20)

#: The kinds of boundary a profile prices, with what each one is.
BOUNDARIES = {
    "request": "a request entering and leaving the server (client, protocol, front end); bytes in + out",
    "ensemble": "the ensemble scheduler's own work per request, beyond its steps; bytes in + out",
    "ensemble_step": "an ensemble step's input and output, passed by the ensemble scheduler; bytes in + out",
    "bls_call": "a BLS call made from a stub and its response (async execute); bytes in + out",
    "bls_model": "the BLS model's own stub taking the request's tensors in and giving them out; bytes in + out",
    "bls_sync_call": "a BLS call made from a stub and its response (sync execute); bytes in + out",
    "bls_sync_model": "the sync BLS model's own stub, as bls_model; bytes in + out",
    "fused_model": "the fused model's own stub taking the request's tensors in and giving them out; bytes in + out",
    "fused_step": "the fused model's own work around each Python step it runs in its process (no copy: its "
    "tensors pass as references); fixed",
    "stub": "a Python step's stub: its inputs in, its fresh outputs out (shared memory, the stub process); "
    "bytes in + out",
    "ensemble_stub": "a Python step's stub as an ensemble runs it (its outputs go to the ensemble's tensors); "
    "bytes in + out",
    "bls_stub": "a Python step's stub as a BLS model calls it (async execute); bytes in + out",
    "bls_sync_stub": "a Python step's stub as a sync BLS model calls it; bytes in + out",
    "ensemble_gate": "what a gated ensemble pays per request beyond its gate model's step and stub (the failure "
    "tensors every step carries); by the intermediates' bytes",
}


@dataclass(frozen=True)
class FormCosts:
    """The boundaries of :data:`BOUNDARIES` that one form (:data:`pipelines.forms.FORMS`) pays.

    Per step call, and once per request for its top-level model (the ensemble scheduler, or the
    BLS model's stub); its Python steps' stubs cost more where the ensemble runs them than where a
    BLS model calls them (docs/calibration_internals.md)."""

    call_cost: str
    own_cost: str
    stub_cost: str
    # What the top-level model's own Python does around each step it runs in its process (the
    # fused model's bookkeeping per step), or "" where none runs so.
    in_process_step_cost: str = ""


#: What each form pays, by form name: the calibration fits these boundaries, the simulator charges them.
FORM_COSTS = {
    "ensemble": FormCosts(call_cost="ensemble_step", own_cost="ensemble", stub_cost="ensemble_stub"),
    "bls": FormCosts(call_cost="bls_call", own_cost="bls_model", stub_cost="bls_stub"),
    "bls-sync": FormCosts(call_cost="bls_sync_call", own_cost="bls_sync_model", stub_cost="bls_sync_stub"),
    # External models are called with async_exec(), as in "bls"; its own probes price the model (not
    # the BLS model's); its Python steps run in-process, so bls_stub is paid by none.
    "fused": FormCosts(call_cost="bls_call", own_cost="fused_model", stub_cost="bls_stub",
                       in_process_step_cost="fused_step"),
}


@dataclass(frozen=True)
class Cost:
    """``fixed_us`` per crossing plus ``us_per_mib`` for each MiB that crosses (in + out): the
    straight line through the boundary's measured costs, for the table and the plot.

    ``sizes`` are the tensor sizes the boundary was measured at, and ``in_us`` and
    ``out_us`` its cost at each of them on the way in and on the way out. Where they
    are given, they price a crossing (:meth:`way_us`), linear between two sizes: a
    server's cost per byte is not one number from 1 KiB to 32 MiB (HTTP bodies and
    fresh outputs cost more per byte the larger they are), and the way in and the
    way out differ (a step's fresh output costs its stub more than its input).

    The ``*_ci`` fields are confidence intervals, ``(low, high)`` µs, of those figures (a
    bootstrap over the calibration's rounds, :func:`pipelines.profiling.fit.fit_rounds`):
    ``fixed_ci`` and ``per_mib_ci`` of the line, and per size ``in_ci``, ``out_ci`` and
    ``total_ci`` (in + out). Empty, or ``None``, where a profile has none (older ones). They
    are the fit's before it clips a cost at zero, so a bound may be below zero (a cost the fit
    puts at 0 has an interval that says how far from nothing the data allow it to be).
    """

    fixed_us: float
    us_per_mib: float
    sizes: tuple[int, ...] = ()
    in_us: tuple[float, ...] = ()
    out_us: tuple[float, ...] = ()
    fixed_ci: tuple[float, float] | None = None
    per_mib_ci: tuple[float, float] | None = None
    in_ci: tuple[tuple[float, float], ...] = ()
    out_ci: tuple[tuple[float, float], ...] = ()
    total_ci: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not len(self.sizes) == len(self.in_us) == len(self.out_us):
            raise PipelinesError(f"a cost's curve needs one in and one out figure per size; got {len(self.sizes)} "
                                 f"sizes, {len(self.in_us)} in and {len(self.out_us)} out")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise PipelinesError(f"a cost's sizes must increase; got {list(self.sizes)}")
        for name in ("in_ci", "out_ci", "total_ci"):
            given = getattr(self, name)
            if given and len(given) != len(self.sizes):
                raise PipelinesError(f"a cost's {name} needs one interval per size; got {len(given)} for "
                                     f"{len(self.sizes)} sizes")
        for field, value in self.figures():
            if "_ci" in field:  # an interval's bound: finite, and below zero where the data put it there
                if not _is_bound(value):
                    raise PipelinesError(f"a cost's {field} is {_said(value)}; an interval's bounds are finite µs")
            elif not _is_time(value):  # a time spent: never negative, never NaN
                raise PipelinesError(f"a cost's {field} is {_said(value)}; every cost is finite µs >= 0")
        for name in ("fixed_ci", "per_mib_ci"):
            low_high = getattr(self, name)
            if low_high is not None and not low_high[0] <= low_high[1]:
                raise PipelinesError(f"a cost's {name} is an interval (low <= high); got {list(low_high)}")
        for name in ("in_ci", "out_ci", "total_ci"):
            for i, (low, high) in enumerate(getattr(self, name)):
                if not low <= high:
                    raise PipelinesError(f"a cost's {name}[{i}] is an interval (low <= high); got {[low, high]}")

    def figures(self) -> list[tuple[str, Any]]:
        """Every figure this cost holds, named as its JSON field is (``in_us[2]``, ``fixed_ci[1]``)."""
        found: list[tuple[str, Any]] = [("fixed_us", self.fixed_us), ("us_per_mib", self.us_per_mib)]
        for name in ("in_us", "out_us"):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(getattr(self, name))]
        for name in ("fixed_ci", "per_mib_ci"):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(getattr(self, name) or ())]
        for name in ("in_ci", "out_ci", "total_ci"):
            found += [(f"{name}[{i}][{j}]", v) for i, pair in enumerate(getattr(self, name)) for j, v in enumerate(pair)]
        return found

    def us(self, nbytes: float) -> float:
        """The line's cost of ``nbytes`` crossing in all (in + out)."""
        return self.fixed_us + self.us_per_mib * nbytes / MIB

    def way_us(self, nbytes: float, *, leaving: bool) -> float:
        """What ``nbytes`` cost on the way in (or out, ``leaving``): the measured curve where there is
        one (linear between sizes, the last slope past the largest), else half the line's fixed
        cost plus its cost per byte."""
        if not self.sizes:
            return self.fixed_us / 2 + self.us_per_mib * nbytes / MIB
        ys = self.out_us if leaving else self.in_us
        xs = self.sizes
        # As numpy.interp does (the first figure below the smallest size), but in plain Python:
        # a prediction prices every boundary of every request this way, and numpy.interp's
        # conversions of a handful of numbers cost 20 µs a call.
        i = bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return float(ys[i])
        if i == 0 or len(xs) == 1:
            return float(ys[0])
        if i < len(xs):
            return float(ys[i - 1] + (ys[i] - ys[i - 1]) * (nbytes - xs[i - 1]) / (xs[i] - xs[i - 1]))
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (nbytes - xs[-1])



def _is_time(value: Any) -> bool:
    """A number of microseconds a boundary can cost: finite, never negative (NaN is neither)."""
    return _is_bound(value) and value >= 0


def _is_bound(value: Any) -> bool:
    """A bound of a cost's interval: a finite number of microseconds, of either sign."""
    return (isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
            and math.isfinite(value))


def _said(value: Any) -> str:
    """A figure as a message names it: NaN, null, -5.0, 'abc'."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return "null" if value is None else repr(value)


def cost_from_json(name: str, data: Any) -> Cost:
    """Boundary ``name``'s cost from its JSON object, each figure checked and named as its field
    (``costs.bls_call.in_us[2]``) when it is missing or no time."""
    where = f"costs.{name}"
    if not isinstance(data, Mapping):
        raise PipelinesError(f"{where} is {_said(data)}, not an object of figures (fixed_us, us_per_mib, ...)")

    def times(key: str, value: Any, depth: int, *, bounds: bool = False) -> Any:
        """``value`` checked as a time (``depth`` 0), a list of them (1) or a list of pairs (2);
        ``bounds``: as an interval's bounds, which may be below zero."""
        if depth == 0:
            if bounds and not _is_bound(value):
                raise PipelinesError(f"{where}.{key} is {_said(value)}; an interval's bounds are finite µs")
            if not bounds and not _is_time(value):
                raise PipelinesError(f"{where}.{key} is {_said(value)}; every cost is finite µs >= 0")
            return float(value)
        if not isinstance(value, (list, tuple)):
            raise PipelinesError(f"{where}.{key} is {_said(value)}, not a list")
        return tuple(times(f"{key}[{i}]", v, depth - 1, bounds=bounds) for i, v in enumerate(value))

    for key in ("fixed_us", "us_per_mib"):
        if key not in data:
            raise PipelinesError(f"{where}.{key} is missing; every cost has fixed_us and us_per_mib")
    sizes = data.get("sizes", ())
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) and n >= 1 for n in sizes):
        raise PipelinesError(f"{where}.sizes is {_said(sizes)}; sizes are whole numbers of bytes >= 1")
    fixed_ci, per_mib_ci = data.get("fixed_ci"), data.get("per_mib_ci")
    try:
        return Cost(
            times("fixed_us", data["fixed_us"], 0),
            times("us_per_mib", data["us_per_mib"], 0),
            tuple(sizes),
            times("in_us", data.get("in_us", ()), 1),
            times("out_us", data.get("out_us", ()), 1),
            fixed_ci=None if fixed_ci is None else times("fixed_ci", fixed_ci, 1, bounds=True),
            per_mib_ci=None if per_mib_ci is None else times("per_mib_ci", per_mib_ci, 1, bounds=True),
            in_ci=times("in_ci", data.get("in_ci", ()), 2, bounds=True),
            out_ci=times("out_ci", data.get("out_ci", ()), 2, bounds=True),
            total_ci=times("total_ci", data.get("total_ci", ()), 2, bounds=True),
        )
    except PipelinesError as exc:
        if exc.message.startswith(where):
            raise
        said = exc.message.removeprefix("a cost's ")
        raise PipelinesError(f"{where}: {said}") from None


def size_label(n: int) -> str:
    """``n`` bytes as the probes are named: "64 KiB", "4 MiB"."""
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def checked_wake(points: Iterable[Sequence[float]]) -> tuple[tuple[float, float], ...]:
    """``points`` as sorted ``(waited µs, µs)`` pairs; refused, naming the pair, where one is not
    two finite numbers >= 0 or two share a wait."""
    out = []
    for pair in points:
        try:
            waited, us = (float(v) for v in pair)
        except (TypeError, ValueError):
            raise PipelinesError(f"a profile's wake is (waited µs, µs) pairs; got {pair!r}") from None
        if not (math.isfinite(waited) and math.isfinite(us) and waited >= 0 and us >= 0):
            raise PipelinesError(f"a profile's wake is (waited µs, µs) pairs of finite numbers >= 0; got {pair!r}")
        out.append((waited, us))
    out.sort()
    if len({w for w, _ in out}) != len(out):
        raise PipelinesError(f"a profile's wake has one pair per wait; got {out!r}")
    return tuple(out)
