"""``pipelines advise``: which form, how many instances, which batching.

Every configuration is simulated (:mod:`pipelines.predict.simulator`) on the same server
profile and step profiles, so a search costs CPU seconds, not hours of a real server.

The space is a product (forms × each step model's instances × its batching × the top-level
model's instances), too large to enumerate for more than two or three steps. The search is a
local search from each form's default: each round simulates every configuration one change
away from the best ones so far (one model's instances or batching, or the top-level model's
instances), keeps the best few (a beam), and stops when two rounds in a row find nothing
better or the budget of simulations is spent. Every configuration is screened on a shorter closed
loop (:data:`SCREEN`); each form's default, and the leaders until the :data:`CONFIRM` best are
all such figures, are simulated again on the full one. A change that the simulator can tell
nothing about is never proposed: batching a step whose ``max_batch_size`` is 0, step-model options in the
fused form, whose Python steps run in its own process. Configurations the simulation cannot
tell apart (:data:`TIE`) rank simplest first (docs/prediction.md, "The ranking").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ArgumentError
from ..tables import format_table
from .configuration import Configuration, ModelChoice
from .prediction import CLOSED_LOOP, PredictionRow, Predictor
from .spec import Load

__all__ = ["Advice", "Candidate", "QUEUE_DELAYS_US", "TIE", "advice_load", "search"]

#: The dynamic batcher's queue delays the search tries (µs).
QUEUE_DELAYS_US = (0, 100, 500, 2000)
INSTANCE_COUNTS = (1, 2, 3, 4)
_BEAM = 3
#: Rounds that find nothing better before a form's search stops: the beam then moves on to
#: its runners-up's neighbours, so a plateau (a change that pays only with another) is crossed.
_PATIENCE = 1
#: Configurations whose figures are within this share of the best's are ties: the simulation
#: does not tell them apart (it meets the server within 5-15 %, and the benchmark calls forms
#: measured within 5 % a tie too), so the one that changes least ranks first.
TIE = 0.05
#: The closed loop a configuration is screened on: 300 measured requests gave the figures of
#: 8000 within 3.1 % (throughput and p50; most of them exactly) on the benchmark's six
#: pipelines, at 60 % of the full run's cost (docs/prediction.md, "advise: the search").
SCREEN = {"requests": 300, "warmup": 30}
#: How many of the screened leaders are simulated again on the full closed loop.
CONFIRM = 12


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the simulation predicts for it."""

    configuration: Configuration
    row: PredictionRow
    meets_bound: bool


@dataclass(frozen=True)
class Advice:
    """The ranked configurations (best first), the default of each form, and how many were
    simulated."""

    pipeline: str
    load: Load
    p95_ms: float | None
    ranked: tuple[Candidate, ...]
    defaults: Mapping[str, Candidate]
    simulated: int
    profile: str = ""
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def top(self, k: int) -> tuple[Candidate, ...]:
        return self.ranked[:k]

    def tied(self, k: int = 5) -> tuple[int, ...]:
        """Which of the top ``k`` (1-based) the best's range does not clear: by throughput under a p95 bound (among
        those that meet it), else by p95. ``(1,)``: a clear pick."""
        best = self.ranked[0]
        out = [1]
        for i, c in enumerate(self.top(k)[1:], 2):
            if self.p95_ms is not None:
                overlap = c.meets_bound and not best.row.clears(c.row)
            else:
                mine = best.row.p95_ms_range or (best.row.p95_ms, best.row.p95_ms)
                theirs = c.row.p95_ms_range or (c.row.p95_ms, c.row.p95_ms)
                overlap = theirs[0] <= mine[1]
            if overlap:
                out.append(i)
        return tuple(out)

    def table(self, k: int = 5) -> str:
        from .prediction_rows import _ranged

        headers = ["#", "configuration", "p50 ms", "p95 ms", "infer/s", "bottleneck", "meets p95"]
        body = []
        for i, c in enumerate(self.top(k), 1):
            default = self.defaults.get(c.configuration.form)
            body.append([str(i), c.configuration.label(default.configuration if default else None),
                         _ranged(c.row.p50_ms, c.row.p50_ms_range, 2), _ranged(c.row.p95_ms, c.row.p95_ms_range, 2),
                         _ranged(c.row.throughput, c.row.throughput_range, 1),
                         c.row.bottleneck_text(), "yes" if c.meets_bound else "no"])
        return format_table(headers, body)

    def verdict(self, k: int = 5) -> str:
        """One line: the pick is clear, or which of the top picks tie within their ranges."""
        tied = self.tied(k)
        if len(tied) == 1:
            return "#1 is a clear pick: its range clears the others' shown"
        by = "throughput" if self.p95_ms is not None else "p95"
        return f"no clear pick: {', '.join(f'#{i}' for i in tied)} tie on {by} within their ranges"

    def settings(self, k: int = 5) -> list[str]:
        """For each of the top ``k``: the exact arguments to set, as code."""
        out = []
        for i, c in enumerate(self.top(k), 1):
            default = self.defaults.get(c.configuration.form)
            changes = c.configuration.changes(default.configuration) if default else [c.configuration.compile_arguments()]
            out.append(f"#{i}: " + "\n    ".join(changes))
        return out

    def __str__(self) -> str:
        return self.text()

    def text(self, k: int = 5) -> str:
        """The top ``k`` as a table, the options each sets, and each form's default."""
        load = f"concurrency {self.load.concurrency}" if self.load.concurrency else f"{self.load.rate:g} requests/s"
        bound = f", p95 <= {self.p95_ms:g} ms" if self.p95_ms is not None else ""
        head = (f"advice for pipeline {self.pipeline!r} at {load}{bound}: {self.simulated} configurations simulated "
                f"({self.profile})")
        base = "\n".join(f"default {name}: {c.row.throughput:.1f} infer/s, p95 {c.row.p95_ms:.2f} ms"
                         for name, c in self.defaults.items())
        return "\n".join([head, self.table(k), self.verdict(k), "", "set:", *self.settings(k), "", base,
                          *(f"note: {n}" for n in self.notes)])

    def as_dicts(self, k: int | None = None) -> list[dict[str, Any]]:
        rows = []
        for c in self.ranked[:k]:
            default = self.defaults.get(c.configuration.form)
            rows.append({**c.row.as_dict(), "meets_p95": c.meets_bound,
                         "settings": c.configuration.changes(default.configuration) if default else []})
        return rows


def _lower_edge(row: PredictionRow) -> float:
    """The throughput that ``row`` surely reaches: its range's lower edge (its point where it has none)."""
    return row.throughput_range[0] if row.throughput_range is not None else row.throughput


def _choices(base: ModelChoice, batchable: bool, cores: float) -> list[ModelChoice]:
    counts = sorted(set(INSTANCE_COUNTS) | ({int(cores)} if cores > max(INSTANCE_COUNTS) else set()))
    out = [replace(base, instance_count=n) for n in counts]
    if batchable:
        out.append(replace(base, dynamic_batching=False, max_queue_delay_us=0))
        out += [replace(base, dynamic_batching=True, max_queue_delay_us=d) for d in QUEUE_DELAYS_US]
    return out


def _neighbours(c: Configuration, predictor: Predictor, batch_limits: Mapping[str, int],
                external: frozenset[str]) -> Iterable[Configuration]:
    """Every configuration one change away from ``c`` that can be compiled (``external``: the
    models that are another backend's, which the fused form still calls)."""
    in_process = c.form == "fused"
    for name, choice in c.models.items():
        if in_process and name not in external:
            continue  # runs inside the fused model: its own model options change nothing
        for alternative in _choices(choice, batch_limits[name] > 0, predictor.cores):
            if alternative != choice:
                yield replace(c, models={**c.models, name: alternative})
    if c.form != "ensemble":
        for n in INSTANCE_COUNTS:
            if n != c.top_instances:
                yield replace(c, top_instances=n)


def _key(configuration: Configuration) -> tuple:
    return (configuration.form, configuration.top_instances, tuple(sorted(configuration.models.items())))


def _changes(c: Candidate, defaults: Mapping[str, Candidate]) -> tuple[int, int, int]:
    """How far ``c`` is from its form's default: the options it changes (each model's, and the
    top-level model's instances), then the instances it runs, then its queue delays (µs)."""
    configuration = c.configuration
    default = defaults.get(configuration.form)
    models = default.configuration.models if default is not None else {}
    changed = sum(1 for name, choice in configuration.models.items() if models.get(name) != choice)
    changed += default is not None and configuration.top_instances != default.configuration.top_instances
    instances = configuration.top_instances + sum(m.instance_count for m in configuration.models.values())
    delays = sum(m.max_queue_delay_us for m in configuration.models.values() if m.dynamic_batching)
    return changed, instances, delays


def _simplest_first(ranked: list[Candidate], defaults: Mapping[str, Candidate],
                    p95_ms: float | None) -> tuple[Candidate, ...]:
    """``ranked`` with the best's ties first, in order of :func:`_changes`: fewer changes,
    instances and delays. The ties meet the bound (without one, their p95 is within
    :data:`TIE` of the best's), and their throughput is within :data:`TIE` of the highest
    of those. A queue delay the simulated arrivals fall inside may be one the server's, which
    jitter, fall outside."""
    if not ranked or not ranked[0].meets_bound:
        return tuple(ranked)
    p95 = ranked[0].row.p95_ms
    near = [c for c in ranked if c.meets_bound and (p95_ms is not None or c.row.p95_ms <= p95 * (1.0 + TIE))]
    # under a bound, ranked by what each surely reaches: its range's lower edge
    reach = _lower_edge if p95_ms is not None else (lambda row: row.throughput)
    most = max(reach(c.row) for c in near)
    ties = [c for c in near if reach(c.row) >= most * (1.0 - TIE)]
    tied = {id(c) for c in ties}
    ties.sort(key=lambda c: _changes(c, defaults))  # stable: equal changes keep their ranking
    return (*ties, *(c for c in ranked if id(c) not in tied))


def search(
    predictor: Predictor,
    load: Load,
    *,
    forms: Iterable[str] | None = None,
    p95_ms: float | None = None,
    budget: int = 300,
    progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """Search the configurations of ``predictor``'s pipeline at ``load`` (see the module docstring)."""
    if p95_ms is not None and not p95_ms > 0:
        raise ArgumentError(f"the p95 bound is milliseconds > 0; got {p95_ms!r}")
    if budget < 1:
        raise ArgumentError(f"the search budget is a number of simulations >= 1; got {budget!r}")
    seen: dict[tuple, Candidate] = {}
    # Screened without ranges: only the leaders' are worth their two more simulations.
    screen = replace(load, **SCREEN) if load.concurrency is not None else load

    def score(c: Candidate) -> tuple:
        # Throughput among those under the bound, by its range's lower edge (what it surely does; a screened one has
        # no range, and its figure stands in); without a bound, the lowest p95.
        if p95_ms is None:
            return (0, c.row.p95_ms, -c.row.throughput)
        return (0 if c.meets_bound else 1, -_lower_edge(c.row) if c.meets_bound else c.row.p95_ms, c.row.p95_ms)

    def by_figure(c: Candidate) -> tuple:
        # the leaders are chosen by their figures: a range only lowers an edge, so ranking the screened (no range)
        # against the confirmed by edges would confirm nearly every one
        return score(replace(c, row=replace(c.row, throughput_range=None)))

    def simulated(configuration: Configuration, on: Load, ranges: bool = False) -> Candidate:
        row = predictor.row(configuration, on, configuration.label(), ranges=ranges)
        return Candidate(configuration, row, p95_ms is None or row.p95_ms <= p95_ms)

    def run(configuration: Configuration) -> Candidate:
        key = _key(configuration)
        found = seen.get(key)
        if found is None:
            found = seen[key] = simulated(configuration, screen)
            if progress is not None:
                progress(len(seen), budget)
        return found

    names = predictor.forms(forms)
    defaults = {name: run(predictor.default(name)) for name in names}
    batch_limits = {m.name: predictor.pipeline.nodes[m.nodes[0]].max_batch_size for m in predictor.plan.models}
    external = frozenset(m.name for m in predictor.plan.models if predictor.pipeline.nodes[m.nodes[0]].step.is_external)
    # Each form searched from its own default with its share of the budget: a form that is
    # slow as declared (one BLS instance, say) may be the fastest once configured.
    share = max(1, budget // max(1, len(names)))
    for name in names:
        beam = [defaults[name]]
        best, stale = score(beam[0]), 0
        limit = min(budget, len(seen) + share)
        while len(seen) < limit:
            frontier = []
            for parent in beam:
                for neighbour in _neighbours(parent.configuration, predictor, batch_limits, external):
                    if len(seen) >= limit:
                        break
                    if _key(neighbour) not in seen:
                        frontier.append(run(neighbour))
            if not frontier:
                break
            beam = sorted({_key(c.configuration): c for c in [*beam, *frontier]}.values(), key=score)[:_BEAM]
            if score(beam[0]) < best:
                best, stale = score(beam[0]), 0
            else:
                stale += 1
                if stale > _PATIENCE:
                    break  # rounds that found nothing better: the beam's neighbours are no better either
    candidates = list(seen.values())
    # The leaders, simulated again with their ranges (on the full loop where they were screened on a shorter one).
    full: dict[int, Candidate] = {}  # by the screened candidate's id: its figures on the full loop

    def confirm(c: Candidate) -> None:
        full[id(c)] = simulated(c.configuration, load, ranges=True)

    for c in defaults.values():  # what each "x N" is read against
        confirm(c)
    defaults = {name: full[id(c)] for name, c in defaults.items()}
    while True:  # until the leaders are all figures of the full loop
        leaders = sorted(candidates, key=lambda c: by_figure(full[id(c)] if id(c) in full else c))[:CONFIRM]
        if all(id(c) in full for c in leaders):
            break
        for c in leaders:
            if id(c) not in full:
                confirm(c)
    candidates = [full.get(id(c), c) for c in candidates]
    if p95_ms is None:
        ranked = _simplest_first(sorted(candidates, key=score), defaults, p95_ms)
    else:  # by the ranges' lower edges: of those that meet the bound, the confirmed (with ranges) first, the
        # screened after them by their figures; then those that do not, by p95
        def final(c: Candidate) -> tuple:
            ranged = c.row.throughput_range is not None
            return (0 if c.meets_bound else 1, 0 if ranged or not c.meets_bound else 1,
                    score(c) if ranged else by_figure(c))

        ordered = sorted(candidates, key=final)
        confirmed = [c for c in ordered if c.meets_bound and c.row.throughput_range is not None]
        ranked = (*_simplest_first(confirmed, defaults, p95_ms), *ordered[len(confirmed):])
    return Advice(predictor.pipeline.name, load, p95_ms, ranked, defaults, len(seen), predictor.describe(),
                  tuple(predictor.notes))


def advice_load(concurrency: int | None = None, rate: float | None = None) -> Load:
    """The load ``advise`` ranks at: ``concurrency`` clients in a closed loop (default 8), or ``rate`` requests/s."""
    if concurrency is not None and rate is not None:
        raise ArgumentError("advise takes a concurrency or a rate, not both")
    return Load(rate=float(rate)) if rate is not None else Load(concurrency=int(concurrency or 8), **CLOSED_LOOP)
