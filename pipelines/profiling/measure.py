"""Measuring the probes: requests one at a time, in rounds over every probe, each probe's
figures per round; and the server's lanes, how many requests' boundary work it does at once.

Costs are measured at concurrency 1 on purpose: a fitted cost is what one
boundary costs when nothing else runs, and what predicts the server adds the
queueing that concurrency brings. That queueing includes the server's CPU:
its boundary costs burn cores, so requests at once compete for them.
:func:`measure_lanes` sees how much by the throughput of one probe at
concurrency 1 and at a high one (one asyncio client, as ``pipelines bench``
drives a server).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter
from typing import Any

import numpy as np

from ..blocking import run_blocking
from ..errors import ArgumentError
from .probes import BLS_KINDS, HELD_KINDS, Probe

__all__ = ["Budget", "Sample", "measure_lanes", "measure_probes", "measure_rounds", "round_request_us"]

#: What one probe gives in one round: (latency µs, stub µs, of which in, model's hold µs, steps' hold µs,
#: reader µs), each the median of the round's requests, its steps' own work taken off; None where not
#: measured.
Figures = tuple  # (float, float | None, float | None, float | None, float | None, float | None)


@dataclass(frozen=True)
class Sample:
    """One probe's measurement: its :data:`Figures` in each round (``rounds``), from ``requests``
    timed answers in all.

    ``latency_us`` is a request's latency less its steps' own work. ``stub_us`` is what one
    execution of the probe's identity step models cost inside the server (Triton's compute
    input + infer + output for them; ``None`` without statistics), of which ``stub_in_us`` on
    the way in (compute input). ``model_us``, for a BLS or fused probe, is how long one
    execution of its top-level model held that model's instance, less its steps' own work (its
    compute input + infer + output, which hold its calls, or the steps it runs in its process);
    for an ensemble probe, how long the request was in the ensemble (Triton's own request time
    for it, from receiving the request to answering it), less its steps' work. Neither holds
    the client's send, which stalls a 4 MiB request by 40-60 ms in some requests and not in
    others (docs/calibration_internals.md). ``None`` for the step probe, or without statistics.
    ``steps_us``, for a grown BLS probe, what all its step models (``grow``, the identities,
    ``shrink``) held their instances for one request, less the identities' work: the hold
    less these is what its calls cost, warm, as a user's pipeline makes them.
    ``reader_us``, for a grown probe, what one execution of its ``shrink`` step model cost in
    its stub (compute infer + output): a step that reads an input of the size and answers one
    byte, whose own work is nothing. Above its figure at the smallest size, it is the part of a
    stub's cost that its input's size sets on the stub's side (docs/calibration_internals.md).

    Those six are read per round; the fit (:func:`pipelines.profiling.fit.fit_rounds`)
    takes their medians over the rounds, and bootstraps the rounds for the intervals.
    """

    probe: Probe
    rounds: tuple[Figures, ...]
    requests: int

    def round_rows(self) -> list[tuple]:
        """``(kind, steps, bytes, round, latency_us, stub_us, stub_in_us, model_us, steps_us,
        reader_us)`` per round: what :func:`pipelines.profiling.fit.fit_rounds` reads."""
        p = self.probe
        return [(p.row_kind, p.steps, p.size, k, *figures) for k, figures in enumerate(self.rounds)]


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How a calibration measures: ``rounds`` rounds over every probe; in each, each probe takes at
    least ``min_requests`` and at most ``max_requests`` timed answers, and no longer than its
    share of ``seconds`` (``seconds / rounds``) once ``min_requests`` are in. ``warmup`` untimed
    answers per probe come first (the first calls of a stub allocate its shared memory), and
    ``lanes_seconds`` is each window of :func:`measure_lanes`."""

    # Seven rounds: an odd count, so a median is one round's figure. The bootstrap's 95 % interval
    # of a median of seven lies between the second and the sixth round's figures, which hold the
    # true median with 87.5 % whatever the noise (Bin(7, 1/2)): fewer rounds would widen it to
    # the extremes, and more would cost the largest sizes' time, which one request a round sets.
    # ``seconds`` keeps a full calibration near 100 s on 2 cores: the 32 MiB probes set each round's floor.
    rounds: int = 7
    min_requests: int = 1
    max_requests: int = 4
    seconds: float = 0.15
    warmup: int = 1
    lanes_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.min_requests < 1 or self.max_requests < self.min_requests:
            raise ArgumentError(f"a budget needs rounds >= 1 and 1 <= min_requests <= max_requests; got "
                                f"rounds={self.rounds}, min_requests={self.min_requests}, "
                                f"max_requests={self.max_requests}")


# A grown probe's requests come in bursts of this many timed ones, after one untimed: back to back,
# as a pipeline's requests are, and in turns with the other kinds' grown probes of the size. Only
# the first of a burst follows a read of the statistics (which makes a 4 MiB request 4-9 % faster:
# docs/calibration_internals.md, "Rounds, turns and bursts").
_GROWN_BURST = 4


def measure_probes(
    infer: Callable[[str, dict[str, Any]], Any],
    probes: Sequence[Probe],
    budget: Budget | None = None,
    progress: Callable[[int, int, Probe], None] | None = None,
    statistics: Callable[[str], Any] | None = None,
    busy_ms: float = 0.0,
    *,
    clock: Callable[[], float] = perf_counter,
) -> list[Sample]:
    """Time ``infer(model, inputs)`` on each probe in ``budget.rounds`` rounds over them all;
    ``progress(done, total, probe)`` as each probe's part of a round ends.

    Noise is met by the design of the measurement, not by rules for particular spells:

    - **Rounds.** Each round measures every probe, of every size, with its share of the
      budget, so that each probe's figures are spread over the whole calibration: a slow
      spell of the machine (a busy neighbour, memory being reclaimed) lands in a round or
      two of a probe, and the median over rounds (the fit's) does not see it. The rounds
      are also what the bootstrap resamples for each cost's interval: a spell moves every
      probe of its round, and resampling whole rounds keeps that together.
    - **The probes of one size take turns** within a round, one request each per turn, so
      that a drift moves them alike: the fit reads a size's costs from the differences
      between its probes. Each round starts at another size (the order rotates), so no
      size always follows the same one.
    - **A grown probe's requests come back to back:** it prices the stubs and calls a
      pipeline pays, and a pipeline's stubs serve requests one after another, warm (at
      4 MiB, 2.0 ms a stub back to back against 2.7 ms taken in turns with other models,
      on the bundled server: docs/calibration_internals.md). So the grown probes of one size take
      turns in bursts of :data:`_GROWN_BURST` timed requests after an untimed one, which
      warms the model again, and the statistics are read around the timed ones whole. The
      fused chains take turns as the other chains do: a fused model whose steps take a while
      idles between them, as a probe taking turns does (docs/design_notes.md).

    ``statistics(model)`` (Triton's statistics API answer), when given, is read around each
    timed request of a chain (around each burst of a grown probe) for the stub's own cost, and
    for a BLS or ensemble probe its top-level model's (what it holds its instance, or the
    request; see :class:`Sample`). ``busy_ms`` is
    what each probe step works before it answers (:data:`~pipelines.profiling.probes.BUSY_MS`):
    it is taken off them all, so that a sample holds the server's costs only. ``clock`` is what times requests and rounds
    (seconds; a virtual one in tests, which then know each figure exactly).
    """
    from ..triton.statistics import breakdown, parse_statistics

    busy_us = busy_ms * 1e3
    budget = budget or Budget()
    least, most, seconds = budget.min_requests, budget.max_requests, budget.seconds / budget.rounds
    groups: dict[object, list[int]] = {}
    for i, probe in enumerate(probes):
        groups.setdefault(("grown", probe.size) if probe.grown else probe.size, []).append(i)
    order = list(groups.values())
    rounds: list[list[Figures]] = [[] for _ in probes]
    requests = [0] * len(probes)
    done = 0
    for r in range(budget.rounds):
        for members in order[r % len(order):] + order[:r % len(order)]:
            inputs = probes[members[0]].inputs()
            for i in members:
                for _ in range(budget.warmup if r == 0 else 0):  # the first calls of a stub allocate its shared memory
                    infer(probes[i].model, inputs)
            measured = {i: _Measured() for i in members}
            # chains: one request each per turn; grown probes: a burst each, its first untimed
            warm, timed = (1, _GROWN_BURST) if probes[members[0]].grown else (0, 1)
            began = clock()
            turns = 0
            # a grown probe's bursts read their own, after the untimed request
            last = parse_statistics(statistics("")) if statistics is not None and not warm else None
            while turns * timed < most and (turns * timed < least or clock() - began < seconds * len(members)):
                for i in members:
                    probe = probes[i]
                    for _ in range(warm):
                        infer(probe.model, inputs)
                    if warm and statistics is not None:
                        last = parse_statistics(statistics(""))
                    for _ in range(timed):
                        t = clock()
                        infer(probe.model, inputs)
                        measured[i].times.append(clock() - t)
                        if statistics is not None and not warm:
                            # a chain's: read around every request, so the stub's figure is a median as the latency is
                            now = parse_statistics(statistics(""))  # every model: the probe's step models in one answer
                            measured[i].add_statistics(probe, breakdown(last, now))
                            last = now
                    if warm and statistics is not None:
                        # a burst's: read around it whole, as a read between its requests would part them
                        now = parse_statistics(statistics(""))
                        measured[i].add_statistics(probe, breakdown(last, now), requests=timed)
                        last = now
                turns += 1
            for i in members:
                rounds[i].append(measured[i].figures(probes[i], busy_us))
                requests[i] += len(measured[i].times)
                done += 1
                if progress is not None:
                    progress(done, len(probes) * budget.rounds, probes[i])
    return [Sample(probe, tuple(rounds[i]), requests[i]) for i, probe in enumerate(probes)]


@dataclass
class _Measured:
    """One probe's figures in one round: latencies (s), stub figures (µs: what its step models
    held, of which on the way in), the top-level model's holds (µs), all its step models' holds
    per request (µs), and a grown probe's ``shrink`` on its stub's side (µs)."""

    times: list[float] = field(default_factory=list)
    stubs: list[tuple[float, float]] = field(default_factory=list)
    holds: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    readers: list[float] = field(default_factory=list)

    def add_statistics(self, probe: Probe, between: Sequence[Any], requests: int = 1) -> None:
        """What one request of ``probe`` held, from the breakdown of the statistics around
        ``requests`` of its requests (the mean of theirs)."""
        stub = _held_us(between, probe.stub_models)
        hold = (_held_us(between, (probe.model,)) if probe.kind in HELD_KINDS
                else _request_us(between, probe.model) if probe.kind == "ensemble" else None)
        grown_bls = probe.grown and probe.kind in BLS_KINDS
        steps = _held_us(between, probe.all_step_models, per_request=True) if grown_bls else None
        reader = _held_us(between, (f"{probe.pipeline}__shrink",)) if probe.grown else None
        if reader is not None:
            self.readers.append(reader[0] - reader[1])  # its stub's side: compute infer + output
        if stub is not None:
            self.stubs.append(stub)
        if hold is not None:
            self.holds.append(hold[0])
        if steps is not None:
            self.steps.append(steps[0] / requests)

    def figures(self, probe: Probe, busy_us: float) -> Figures:
        """The round's :data:`Figures`: the median of each over its requests, the steps' work taken off."""
        stub_us = median(s[0] for s in self.stubs) - busy_us if self.stubs else None
        stub_in_us = median(s[1] for s in self.stubs) if self.stubs else None
        latency_us = median(self.times) * 1e6 - probe.steps * busy_us
        model_us = median(self.holds) - probe.steps * busy_us if self.holds else None
        steps_us = median(self.steps) - probe.steps * busy_us if self.steps else None
        reader_us = median(self.readers) if self.readers else None
        return (latency_us, stub_us, stub_in_us, model_us, steps_us, reader_us)


def _request_us(between: Sequence[Any], model: str) -> tuple[float, float] | None:
    """Triton's own time per request of ``model`` in ``between`` (µs), as ``(µs, 0)``, or None:
    for an ensemble, from the request received whole to its answer, which no instance holds."""
    rows = [t for t in between if t.model == model and t.requests > 0]
    return (rows[0].total_us, 0.0) if rows else None


def _held_us(between: Sequence[Any], models: Sequence[str], *, per_request: bool = False
             ) -> tuple[float, float] | None:
    """Mean time one execution of the ``models`` held its instance in ``between`` (the
    breakdown of two statistics answers: compute input + infer + output), and of that its
    compute input (µs), or None. ``per_request``: their total over ``between`` instead, which
    holds one request, and None unless every one of the ``models`` ran in it."""
    rows = [t for t in between if t.model in models]
    executions = sum(t.requests for t in rows)
    if not rows or executions <= 0 or (per_request and {t.model for t in rows} != set(models)):
        return None
    total = sum((t.compute_input_us + t.compute_infer_us + t.compute_output_us) * t.requests for t in rows)
    total_in = sum(t.compute_input_us * t.requests for t in rows)
    return (total, total_in) if per_request else (total / executions, total_in / executions)


def measure_lanes(
    connect: Callable[[], Any], probes: Sequence[Probe], cores: int | None, seconds: float = 1.0
) -> tuple[float, list[tuple[str, float, float, float, float]]]:
    """The server's lanes: per probe, its throughput at concurrency ``2 * cores`` (at least 4;
    8 where the server's cores are not known) over its throughput at concurrency 1 (medians
    of three windows of ``seconds / 2`` each, taken in turn), the mean over ``probes``,
    between 1 and ``cores`` (the high concurrency where they are not known).

    ``connect()`` makes an asyncio client (``infer(model, inputs)``, ``close()``). Returns
    the lanes and, per probe, ``(label, infer/s at 1, infer/s at the high concurrency,
    its own lanes, its windows' spread)``: a probe's tensor size sets how many requests' copies
    the server makes at once (docs/calibration_internals.md); the spread is how far the server's
    throughput moved from one window to the next, half the range of a concurrency's three
    windows over their median, the larger of the two concurrencies'.
    """

    high = min(32, max(4, 2 * cores)) if cores else 8

    def bounded(ratio: float) -> float:
        return min(float(cores or high), max(1.0, ratio))

    async def window(client: Any, probe: Probe, concurrency: int) -> float:
        await _in_flight(client, probe, concurrency, 0.0)  # warm: every connection opened, every stub awake
        began = perf_counter()
        return await _in_flight(client, probe, concurrency, seconds / 2) / (perf_counter() - began)

    def spread(windows: list[float]) -> float:
        middle = median(windows)
        return (max(windows) - min(windows)) / 2 / middle if middle > 0 else 0.0

    async def main() -> list[tuple[str, float, float, float, float]]:
        client = connect()
        rows = []
        try:
            for p in probes:
                # short windows taken in turn, medians: a machine whose load drifts shifts both alike
                ones, highs = [], []
                for _ in range(3):
                    ones.append(await window(client, p, 1))
                    highs.append(await window(client, p, high))
                one, at_high = median(ones), median(highs)
                rows.append((p.label, one, at_high, bounded(at_high / one) if one > 0 else 1.0,
                             max(spread(ones), spread(highs))))
        finally:
            await client.close()
        return rows

    rows = run_blocking(main)  # calibrate() from a notebook cell, whose loop is running
    lanes = [row[3] for row in rows]
    return (sum(lanes) / len(lanes) if lanes else 1.0), rows


async def _in_flight(client: Any, probe: Probe, concurrency: int, seconds: float) -> int:
    """Keep ``concurrency`` requests to ``probe``'s model in flight for ``seconds`` (0: one each),
    each sent as the one before it is answered; returns how many were answered."""
    import anyio

    inputs = probe.inputs()
    until = perf_counter() + seconds
    done = 0

    async def caller() -> None:
        nonlocal done
        while True:
            await client.infer(probe.model, inputs)
            done += 1
            if perf_counter() >= until:
                return

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(caller)
    return done


def measure_rounds(connect: Callable[[], Any], probe: Probe, concurrency: int = 8, seconds: float = 1.0
                   ) -> dict[int, tuple[int, float]]:
    """How long ``probe``'s top-level model held its instance for a round of each size: ``concurrency``
    requests kept in flight for ``seconds`` by one asyncio client (``connect()``, as
    :func:`measure_lanes`), so that those that queue while a round runs reach the model together as
    the next one. Returns ``{rows: (executions, mean µs held)}`` from Triton's ``batch_stats`` (compute
    input + infer + output of each execution, by its batch size) over those seconds."""
    def held(answer: Any) -> dict[int, tuple[int, float]]:
        rows = {}
        for model in answer.get("model_stats", ()) or ():
            for batch in model.get("batch_stats", ()) or ():
                parts = [batch.get(k) or {} for k in ("compute_input", "compute_infer", "compute_output")]
                count = int(parts[1].get("count", 0) or 0)
                rows[int(batch["batch_size"])] = (count, sum(float(part.get("ns", 0) or 0) for part in parts))
        return rows

    async def main() -> dict[int, tuple[int, float]]:
        client = connect()
        try:
            await _in_flight(client, probe, concurrency, 0.0)  # warm: every connection opened, the stub awake
            before = held(await client.statistics(probe.model))
            await _in_flight(client, probe, concurrency, seconds)
            after = held(await client.statistics(probe.model))
        finally:
            await client.close()
        rounds = {}
        for rows, (count, ns) in after.items():
            was_count, was_ns = before.get(rows, (0, 0.0))
            if count > was_count:
                rounds[rows] = (count - was_count, (ns - was_ns) / (count - was_count) / 1e3)
        return rounds

    return run_blocking(main)  # calibrate() from a notebook cell, whose loop is running


def round_request_us(rounds: dict[int, tuple[int, float]]) -> float:
    """What each request of a round adds to its hold beyond the first, from :func:`measure_rounds`'
    ``{rows: (executions, mean µs held)}``: the slope of hold over rows, each size weighted by its
    executions, at least 0; 0 where fewer than two sizes ran (nothing to tell it by)."""
    sizes = [(rows, count, us) for rows, (count, us) in sorted(rounds.items()) if count > 0]
    if len(sizes) < 2:
        return 0.0
    rows, counts, us = (np.array(column, float) for column in zip(*sizes, strict=True))
    # polyfit weighs each residual by w: the square root of the executions weighs each squared one by them
    return max(0.0, float(np.polyfit(rows, us, 1, w=np.sqrt(counts))[0]))
