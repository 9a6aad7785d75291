"""What ``p.predict`` answers: a :class:`PredictionRow` per form and load, each figure with its range, and the
:class:`Prediction` that holds them, names a winner only where its range clears the others', and shows them as a
table in the terminal and in notebooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..calibration.noise import MachineNoise
from ..errors import ArgumentError
from ..tables import format_table

__all__ = ["Prediction", "PredictionRow"]


@dataclass(frozen=True)
class PredictionRow:
    """One form at one load, as the simulation predicts it. ``p50_ms_range``, ``p95_ms_range`` and
    ``throughput_range``: ``(low, high)``, a 90 % interval for the figure the server will measure (:meth:`Predictor.row`,
    docs/prediction.md, "How a range is made"); ``None``: not computed (a configuration advise only screened).
    ``spreads``: for each figure (``p50_us``, ``p95_us``, ``throughput``) the sources of its range, each a standard
    deviation of the log of the figure (:mod:`pipelines.predict.ranges`)."""

    form: str
    concurrency: int | None
    rate: float | None
    p50_ms: float
    p95_ms: float
    p99_ms: float
    throughput: float
    bottleneck: str
    utilisation: Mapping[str, float] = field(default_factory=dict)
    configuration: str = ""
    p50_ms_range: tuple[float, float] | None = None
    p95_ms_range: tuple[float, float] | None = None
    throughput_range: tuple[float, float] | None = None
    spreads: Mapping[str, Mapping[str, float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["utilisation"] = dict(self.utilisation)
        data["spreads"] = None if self.spreads is None else {k: dict(v) for k, v in self.spreads.items()}
        for name in ("p50_ms_range", "p95_ms_range", "throughput_range"):
            data[name] = None if data[name] is None else list(data[name])
        return data

    def clears(self, other: PredictionRow) -> bool:
        """Whether this row's throughput range lies wholly above ``other``'s (their points where either has none)."""
        mine = self.throughput_range or (self.throughput, self.throughput)
        theirs = other.throughput_range or (other.throughput, other.throughput)
        return mine[0] > theirs[1]

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"{self.rate:g}/s"

    def bottleneck_text(self) -> str:
        share = self.utilisation.get(self.bottleneck)
        return self.bottleneck if share is None else f"{self.bottleneck} {share:.0%}"


@dataclass(frozen=True)
class Prediction:
    """Rows of ``form``, ``concurrency`` (or ``rate``), ``p50_ms``, ``p95_ms``, ``p99_ms``,
    ``throughput`` and ``bottleneck``, each figure with its range; a table in the terminal and in notebooks.
    ``noise``: what was seen of the machine, the profile's calibration and this prediction's own work together;
    ``machine``: what the ranges took of it, standard deviations (``measurement``, ``load``, ``steal``)."""

    pipeline: str
    rows: tuple[PredictionRow, ...]
    profile: str = ""
    notes: tuple[str, ...] = ()
    noise: MachineNoise | None = None
    machine: Mapping[str, float] | None = None

    def levels(self) -> list[tuple[int | None, float | None]]:
        """The loads predicted, ``(concurrency, rate)``, in the order first predicted."""
        return list(dict.fromkeys((r.concurrency, r.rate) for r in self.rows))

    def _at(self, concurrency: int | None, rate: float | None) -> list[PredictionRow]:
        at = [r for r in self.rows if r.concurrency == concurrency and r.rate == rate]
        if not at:
            raise ArgumentError(f"no prediction at concurrency={concurrency} rate={rate}")
        return sorted(at, key=lambda r: (-r.throughput, r.p50_ms))

    def leader(self, concurrency: int | None = None, rate: float | None = None) -> str:
        """The form with the highest predicted throughput at that load, clear winner or not."""
        return self._at(concurrency, rate)[0].form

    def winner(self, concurrency: int | None = None, rate: float | None = None) -> str | None:
        """The form whose throughput range clears every other's at that load; ``None`` where the leader's range
        overlaps the runner-up's (:meth:`tied` names the forms)."""
        at = self._at(concurrency, rate)
        return at[0].form if len(at) == 1 or at[0].clears(at[1]) else None

    def tied(self, concurrency: int | None = None, rate: float | None = None) -> tuple[str, ...]:
        """The forms the leader's range does not clear at that load, the leader first (one form: a clear winner)."""
        at = self._at(concurrency, rate)
        return tuple(r.form for r in at if r is at[0] or not at[0].clears(r))

    def verdicts(self) -> list[str]:
        """One line per load: its winner, or "no clear winner" with the forms that tie."""
        out = []
        for c, r in self.levels():
            where = f"concurrency {c}" if c is not None else f"{r:g} requests/s"
            won = self.winner(concurrency=c, rate=r)
            out.append(f"winner at {where}: {won}" if won else
                       f"no clear winner at {where}: {', '.join(self.tied(concurrency=c, rate=r))} tie")
        return out

    def as_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.rows]

    def level_records(self) -> list[dict[str, Any]]:
        """Each load predicted: its ``concurrency``, ``rate``, ``winner`` (a form, or ``None`` where no range
        clears the others) and the forms that ``tied``."""
        return [{"concurrency": c, "rate": r, "winner": self.winner(concurrency=c, rate=r),
                 "tied": list(self.tied(concurrency=c, rate=r))} for c, r in self.levels()]

    def noise_record(self) -> dict[str, Any] | None:
        """The noise record as data, with whether it reads busy, what the ranges took of it (standard deviations) and
        how far that alone widens them."""
        noise = self.noise
        if noise is None:
            return None
        machine = dict(self.machine) if self.machine is not None else noise.spreads()
        return {**noise.to_dict(), "busy": noise.busy, "spreads": machine, "widening": noise.widening(machine)}

    def as_json(self) -> list[dict[str, Any]]:
        """What ``predict --json`` prints: the rows, each with its ranges, and its load's ``winner`` (a form,
        or null) and ``tied`` forms beside today's fields, so a list of rows stays a list of rows."""
        verdict = {(level["concurrency"], level["rate"]): level for level in self.level_records()}
        rows = []
        for row in self.rows:
            level = verdict[(row.concurrency, row.rate)]
            rows.append({**row.as_dict(), "winner": level["winner"], "tied": level["tied"]})
        return rows

    def _table(self) -> tuple[list[str], list[list[str]]]:
        headers = ["form", "load", "p50 ms", "p95 ms", "p99 ms", "infer/s", "bottleneck"]
        body = [[r.form, r.load, _ranged(r.p50_ms, r.p50_ms_range, 2), _ranged(r.p95_ms, r.p95_ms_range, 2),
                 f"{r.p99_ms:.2f}", _ranged(r.throughput, r.throughput_range, 1), r.bottleneck_text()]
                for r in self.rows]
        return headers, body

    def _lines(self) -> list[str]:
        return [*self.verdicts(), *(f"note: {n}" for n in self.notes)]

    def __str__(self) -> str:
        headers, body = self._table()
        text = f"predicted for pipeline {self.pipeline!r} ({self.profile})\n" + format_table(headers, body)
        return "\n".join([text, *self._lines()])

    def _repr_html_(self) -> str:
        from html import escape

        headers, body = self._table()
        head = "".join(f"<th>{escape(h)}</th>" for h in headers)
        rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in body)
        lines = "".join(f"<p>{escape(n)}</p>" for n in self._lines())
        return (f"<p>predicted for pipeline <b>{escape(self.pipeline)}</b> ({escape(self.profile)})</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{lines}")


def _ranged(value: float, bounds: tuple[float, float] | None, digits: int) -> str:
    """``12.31 (11.02-14.10)``: a figure and its range."""
    if bounds is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ({bounds[0]:.{digits}f}-{bounds[1]:.{digits}f})"
