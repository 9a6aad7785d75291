"""The benchmark's conclusion: which form wins at which load, and, with ``--profile``,
whether the simulation of the server (``pipelines.predict``) named the same winners.

:func:`compare_ratios` keeps the local runtime's ensemble/BLS p50-latency ratio beside the
server's in results.json: how far in-process execution is from the server's (the local
runtime executes, it does not predict).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .measurement import FORMS, Measurement

__all__ = ["LevelVerdict", "RatioComparison", "compare_ratios", "level_verdicts", "verdict"]

#: Throughputs closer than this are called a tie: below it, windows disagree by as much.
TIE = 0.05


@dataclass(frozen=True)
class RatioComparison:
    """``ensemble``/``versus`` p50 latency ratio, predicted locally and measured on the server.

    ``gap`` is ``predicted / measured - 1``: 0.1 means the local runtime
    overstated the ratio by 10%.
    """

    concurrency: int
    versus: str
    predicted: float
    measured: float

    @property
    def gap(self) -> float:
        return self.predicted / self.measured - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gap": self.gap}


def _index(measurements: Sequence[Measurement]) -> dict[tuple[str, str, int], Measurement]:
    return {(m.config.where, m.config.form, m.concurrency): m for m in measurements}


def _ratio(a: Measurement | None, b: Measurement | None) -> float | None:
    if a is None or b is None or not a.latency.p50_ms or not b.latency.p50_ms:
        return None
    return a.latency.p50_ms / b.latency.p50_ms


def compare_ratios(measurements: Sequence[Measurement]) -> list[RatioComparison]:
    """Predicted (local) against measured (server) ensemble/BLS ratios, wherever both were measured."""
    at = _index(measurements)
    levels = sorted({m.concurrency for m in measurements})
    out = []
    for versus in FORMS[1:]:
        for c in levels:
            predicted = _ratio(at.get(("local", "ensemble", c)), at.get(("local", versus, c)))
            measured = _ratio(at.get(("server", "ensemble", c)), at.get(("server", versus, c)))
            if predicted is not None and measured is not None:
                out.append(RatioComparison(c, versus, predicted, measured))
    return out


def _levels(values: Sequence[int]) -> str:
    values = [str(v) for v in values]
    if len(values) == 1:
        return f"concurrency {values[0]}"
    return f"concurrency {', '.join(values[:-1])} and {values[-1]}"


def _served(measurements: Sequence[Measurement], where: str) -> list[Measurement]:
    """The measurements taken ``where`` ("local", "server") in which some request was answered."""
    return [m for m in measurements if m.config.where == where and m.throughput > 0]


@dataclass(frozen=True)
class LevelVerdict:
    """What one concurrency level's measurements say: a ``winner`` (a form), a tie between
    ``tied`` forms (throughputs within :data:`TIE`), or neither (``unsettled``: the margin is
    inside what unsettled windows moved by). Both the bench's sentence and the prediction's
    score are read from this one judgement, so that they never disagree."""

    concurrency: int
    winner: str | None
    tied: tuple[str, ...]
    unsettled: bool
    note: str

    @property
    def kind(self) -> str:
        return "no clear winner" if self.unsettled else self.winner or "a tie between " + " and ".join(self.tied)


def level_verdicts(measurements: Sequence[Measurement], where: str) -> dict[int, LevelVerdict]:
    """The judgement at each level where two forms or more served requests ``where``."""
    by_level: dict[int, list[Measurement]] = {}
    for m in _served(measurements, where):
        by_level.setdefault(m.concurrency, []).append(m)
    out = {}
    for c in sorted(by_level):
        ranked = sorted(by_level[c], key=lambda m: m.throughput, reverse=True)
        if len(ranked) < 2:
            continue
        best, second = ranked[0], ranked[1]
        ratio = best.throughput / second.throughput
        wobble = max(_wobble(best), _wobble(second))
        tied = tuple(sorted(m.config.form for m in ranked if m.throughput * (1 + TIE) > best.throughput))
        if ratio >= 1 + TIE and ratio - 1 <= wobble and not (best.stable and second.stable):
            # The margin is inside what the unsettled windows moved by: another run may reverse it.
            out[c] = LevelVerdict(c, None, (best.config.form, second.config.form), True,
                                  f"{best.config.form} leads {second.config.form} by {ratio - 1:.0%}, but their "
                                  f"windows varied by up to {wobble:.0%}")
        elif ratio >= 1 + TIE:
            out[c] = LevelVerdict(c, best.config.form, (best.config.form,), False, f"{ratio:.2f}× {second.config.form}")
        else:
            out[c] = LevelVerdict(c, None, tied, False, f"{ratio:.2f}× {second.config.form}")
    return out


def _winners(measurements: Sequence[Measurement], where: str) -> list[str]:
    """Sentences naming, for each run of concurrency levels with one judgement, the winner."""
    runs: list[tuple[str, list[int], list[str]]] = []  # judgement, levels, one note per level
    for c, judged in level_verdicts(measurements, where).items():
        if runs and runs[-1][0] == judged.kind:
            runs[-1][1].append(c)
            runs[-1][2].append(judged.note)
        else:
            runs.append((judged.kind, [c], [judged.note]))
    sentences = []
    for kind, levels, notes in runs:
        if kind == "no clear winner":
            sentences.append(f"there is no clear winner at {_levels(levels)} ({'; '.join(notes)}; lengthen "
                             "--duration, or measure in turns with --turns 3, to settle it)")
        elif kind.startswith("a tie"):
            sentences.append(f"{_levels(levels)} is {kind} (throughput within {TIE:.0%}: {', '.join(notes)})")
        else:
            sentences.append(f"{kind} wins at {_levels(levels)} ({', '.join(notes)} in throughput)")
    return sentences


def _wobble(m: Measurement) -> float:
    """How far one measurement's windows moved: (max - min) / mean of their throughputs."""
    values = [v for v in m.window_throughputs if v > 0]
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / (sum(values) / len(values))


def _first_response(measurements: Sequence[Measurement], where: str) -> str | None:
    """For a streaming pipeline: which form answers first at the lowest load, and the others' times."""
    served = [m for m in _served(measurements, where) if m.stream is not None and m.stream.ttft.p50_ms is not None]
    if not served:
        return None
    low = min(m.concurrency for m in served)
    ranked = sorted((m for m in served if m.concurrency == low), key=lambda m: m.stream.ttft.p50_ms)
    best, rest = ranked[0], ranked[1:]
    others = f" ({', '.join(f'{m.config.form} {m.stream.ttft.p50_ms:.2f} ms' for m in rest)})" if rest else ""
    return (f"the first response comes soonest from {best.config.form} at concurrency {low}: p50 "
            f"{best.stream.ttft.p50_ms:.2f} ms{others}")


def _spread(measurements: Sequence[Measurement], where: str) -> str | None:
    """How much slower bls-sync is than the ensemble at the lowest load, where steps are not queued."""
    at = _index(measurements)
    levels = sorted({m.concurrency for m in measurements if m.config.where == where})
    if not levels:
        return None
    ratio = _ratio(at.get((where, "bls-sync", levels[0])), at.get((where, "ensemble", levels[0])))
    if ratio is None:
        return None
    return f"bls-sync's p50 latency is {ratio:.2f}× the ensemble's at concurrency {levels[0]}"


def verdict(measurements: Sequence[Measurement], *, pipeline: str,
            predictions: Sequence[Mapping[str, Any]] = ()) -> str:
    """One paragraph: winners on the server (else locally), whether the prediction (rows of
    ``p.predict(...).as_dicts()``) named the same winners, errors and instability."""
    parts = []
    wheres = [w for w in ("server", "local") if any(m.config.where == w for m in measurements)]
    for where in wheres:
        winners = _winners(measurements, where)
        where_text = "On the Triton server" if where == "server" else "In the local runtime"
        if winners:
            parts.append(f"{where_text}, for pipeline {pipeline!r}, " + "; ".join(winners) + ".")
        elif alone := _alone(measurements, where):
            parts.append(f"{where_text}, for pipeline {pipeline!r}, {alone}.")
        spread = _spread(measurements, where)
        if spread:
            parts.append(f"{where_text.split(',')[0]}, {spread}.")
        first = _first_response(measurements, where)
        if first:
            parts.append(f"{where_text.split(',')[0]}, {first}.")
    if predictions:
        parts.append(_prediction_verdict(predictions, measurements))
    errors = sum(m.errors for m in measurements)
    if errors:
        failing = sorted({m.config.label for m in measurements if m.errors})
        parts.append(f"{errors} requests failed ({', '.join(failing)}); their messages are in results.json.")
    unstable = [f"{m.config.label} at {m.concurrency}" for m in measurements if not m.stable]
    if unstable:
        parts.append(
            f"{len(unstable)} measurement(s) did not stabilise ({', '.join(unstable)}); "
            "lengthen --duration or raise --max-trials."
        )
    if not parts:
        if not any(m.requests for m in measurements):
            return (f"No request of pipeline {pipeline!r} finished within a measurement window, so nothing was "
                    "measured; lengthen --duration (or use --requests).")
        return f"No request of pipeline {pipeline!r} succeeded, so no form can be recommended."
    return " ".join(parts)


def _alone(measurements: Sequence[Measurement], where: str) -> str | None:
    """Where one form alone was measured: its throughput per level, and that there is nothing to compare."""
    served = _served(measurements, where)
    forms = {m.config.form for m in served}
    if len(forms) != 1:
        return None
    figures = ", ".join(f"{m.throughput:,.1f} infer/s at concurrency {m.concurrency}"
                        for m in sorted(served, key=lambda m: m.concurrency))
    return f"only {forms.pop()} was measured ({figures}); give --forms two or more forms to compare them"


def _prediction_verdict(predictions: Sequence[Mapping[str, Any]], measurements: Sequence[Measurement]) -> str:
    """Whether the simulation named the server's winner at each level where both exist, judged
    against the same per-level verdict the bench states: a tie accepts any of its forms, and a
    level with no clear winner is not scored."""
    judged = level_verdicts(measurements, "server")
    server_forms = {(m.config.form, m.concurrency) for m in _served(measurements, "server")}
    said = []
    for c in sorted({int(r["concurrency"]) for r in predictions if r.get("concurrency") is not None}):
        rows = [r for r in predictions if r.get("concurrency") == c and (r["form"], c) in server_forms]
        level = judged.get(c)
        if len(rows) < 2 or level is None:
            continue
        guess = max(rows, key=lambda r: float(r["throughput"]))["form"]
        if level.unsettled:
            said.append(f"at concurrency {c} it named {guess}, where the server has no clear winner (not scored)")
            continue
        said.append(f"at concurrency {c} it named {guess}, the server's winner {'/'.join(level.tied)}: "
                    f"{'right' if guess in level.tied else 'WRONG'}")
    if not said:
        return "The prediction has no level measured on the server beside it."
    return "The simulation's prediction (--profile) " + "; ".join(said) + "."
