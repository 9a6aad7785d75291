"""Measuring the probes: requests one at a time, the median latency of each probe; and the
server's lanes, how many requests' boundary work it does at once.

Costs are measured at concurrency 1 on purpose: a fitted cost is what one
boundary costs when nothing else runs, and the local runtime's replay adds
the queueing that concurrency brings. That queueing includes the server's CPU:
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

from ..blocking import run_blocking
from ..errors import ArgumentError
from .probes import BLS_KINDS, Probe

__all__ = ["Budget", "Sample", "measure_lanes", "measure_probes"]


@dataclass(frozen=True)
class Sample:
    """One probe's measurement: the median latency over ``requests`` answers (µs), less its
    steps' own work, and
    ``stub_us``, what one execution of the identity step model cost inside the server
    (Triton's compute input + infer + output for it, the median over the requests;
    ``None`` without statistics), of which ``stub_in_us`` on the way in (compute input);
    and for a BLS probe ``model_us``, how long one execution of its BLS model held that
    model's instance, less its steps' own work (its compute input + infer + output, which
    hold its calls: ``None`` for other probes, or without statistics); and for a grown BLS
    probe ``steps_us``, what all its step models (``grow``, the identities, ``shrink``) held
    their instances for one request, less the identities' work: the hold less these is
    what its calls cost, warm, as a user's pipeline makes them.
    """

    probe: Probe
    latency_us: float
    requests: int
    stub_us: float | None = None
    stub_in_us: float | None = None
    model_us: float | None = None
    steps_us: float | None = None

    @property
    def row(self) -> tuple[str, int, int, float, float | None, float | None, float | None, float | None]:
        return (self.probe.row_kind, self.probe.steps, self.probe.size, self.latency_us, self.stub_us,
                self.stub_in_us, self.model_us, self.steps_us)


@dataclass(frozen=True)
class Budget:
    """How long each probe is measured: at least ``min_requests``, at most ``max_requests``
    answers, and no longer than ``seconds`` once ``min_requests`` are in; in ``passes``
    over every probe, which share those answers and seconds (see :func:`measure_probes`)."""

    min_requests: int = 4
    max_requests: int = 30
    seconds: float = 0.45  # 102 probes in two passes: 114-118 s at 0.5, 103-117 s at 0.45 (the issue asks under 120)
    warmup: int = 1
    lanes_seconds: float = 1.0  # each window of measure_lanes
    passes: int = 2

    def __post_init__(self) -> None:
        if self.passes < 1 or self.min_requests < 1 or self.max_requests < self.min_requests:
            raise ArgumentError(f"a budget needs passes >= 1 and 1 <= min_requests <= max_requests; got "
                                f"passes={self.passes}, min_requests={self.min_requests}, "
                                f"max_requests={self.max_requests}")

    def per_pass(self) -> tuple[int, int, float]:
        """``(min_requests, max_requests, seconds)`` of one pass."""
        return (-(-self.min_requests // self.passes), -(-self.max_requests // self.passes), self.seconds / self.passes)


# A grown probe's requests come in bursts of this many timed ones, after one untimed: back to back,
# as a pipeline's requests are, and in turns with the other kinds' grown probes of the size.
_GROWN_BURST = 2

# A pass whose probes of one group took this much longer than another pass's (the median of
# their ratios) met the machine in a slow spell, and is left out of that group's figures.
_SLOW_PASS = 0.10


def measure_probes(
    infer: Callable[[str, dict[str, Any]], Any],
    probes: Sequence[Probe],
    budget: Budget | None = None,
    progress: Callable[[int, int, Probe], None] | None = None,
    statistics: Callable[[str], Any] | None = None,
    busy_ms: float = 0.0,
) -> list[Sample]:
    """Time ``infer(model, inputs)`` on each probe; ``progress(done, total, probe)`` as they finish.

    The chains of one tensor size are measured in turns, one request each per
    turn, so that a drift of the machine (a busy neighbour, memory being
    reclaimed) moves them all alike: the fit reads a size's costs from the
    differences between its probes. A grown probe's requests come back to back:
    it prices the stubs and calls the replay charges, and a pipeline's stubs serve
    requests one after another, warm (at 4 MiB, 2.0 ms a stub back to back against
    2.7 ms taken in turns with other models, on the bundled server:
    docs/server_profiles.md). So the grown probes of one size take turns in bursts of
    :data:`_GROWN_BURST` timed requests after an untimed one, which warms the model
    again: a spell of the machine moves every form's grown probe alike (measured one
    after the other, two calibrations minutes apart put the async BLS one's at 4 MiB
    12.4 and 15.5 ms, against its ensemble's 7.7 and 7.5), and the forms' ratios are
    what users choose by. Every probe is measured in ``budget.passes``
    passes over the whole plan, which share its answers and seconds; where one pass met a
    slow spell of the machine, its figures of that size are left out (:func:`_unslowed`),
    and the others' are pooled. ``progress`` counts each probe once per pass.
    ``statistics(model)`` (Triton's statistics
    API answer), when given, is read around each timed request for the stub's own
    cost (the median per execution), and for a BLS probe its BLS model's (what it holds its
    instance; see :class:`Sample`). ``busy_ms`` is what each probe step works before it
    answers (:data:`~pipelines.calibration.probes.BUSY_MS`): it is taken off both, so that
    a sample holds the server's costs only.
    """
    from ..bench.stats import breakdown, parse_statistics

    busy_us = busy_ms * 1e3
    budget = budget or Budget()
    least, most, seconds = budget.per_pass()
    groups: dict[object, list[int]] = {}
    for i, probe in enumerate(probes):
        groups.setdefault(("grown", probe.size) if probe.grown else probe.size, []).append(i)
    passes: list[dict[int, _Measured]] = []
    done = 0
    for n in range(budget.passes):
        measured = {i: _Measured() for i in range(len(probes))}
        for members in groups.values():
            inputs = probes[members[0]].inputs()
            for i in members:
                for _ in range(budget.warmup if n == 0 else 0):  # the first calls of a stub allocate its shared memory
                    infer(probes[i].model, inputs)
            # chains: one request each per turn; grown probes: a burst each, its first untimed
            warm, timed = (1, _GROWN_BURST) if probes[members[0]].grown else (0, 1)
            began = perf_counter()
            turns = 0
            last = parse_statistics(statistics("")) if statistics is not None else None
            while turns * timed < most and (turns * timed < least or perf_counter() - began < seconds * len(members)):
                for i in members:
                    probe = probes[i]
                    for _ in range(warm):
                        infer(probe.model, inputs)
                    if warm and statistics is not None:
                        last = parse_statistics(statistics(""))
                    for _ in range(timed):
                        t = perf_counter()
                        infer(probe.model, inputs)
                        measured[i].times.append(perf_counter() - t)
                        if statistics is not None:
                            # read around every request, so the stub's figure is a median as the latency is
                            now = parse_statistics(statistics(""))  # every model: the probe's step models in one answer
                            measured[i].add_statistics(probe, breakdown(last, now))
                            last = now
                turns += 1
            for i in members:
                done += 1
                if progress is not None:
                    progress(done, len(probes) * budget.passes, probes[i])
        passes.append(measured)
    kept: dict[int, _Measured] = {}
    for members in groups.values():
        chosen = _unslowed([[m[i] for i in members] for m in passes])
        kept |= {i: pooled for i, pooled in zip(members, chosen, strict=True)}
    return [kept[i].sample(probes[i], busy_us) for i in range(len(probes))]


@dataclass
class _Measured:
    """One probe's figures from one pass or more: latencies (s), stub figures (µs: what its
    step models held, of which on the way in), BLS holds (µs), all its step models' holds per
    request (µs)."""

    times: list[float] = field(default_factory=list)
    stubs: list[tuple[float, float]] = field(default_factory=list)
    holds: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)

    def add_statistics(self, probe: Probe, between: Sequence[Any]) -> None:
        """What one request of ``probe`` held, from the breakdown of the statistics around it."""
        stub = _held_us(between, probe.stub_models)
        bls = probe.kind in BLS_KINDS
        hold = _held_us(between, (probe.model,)) if bls else None
        steps = _held_us(between, probe.all_step_models, per_request=True) if bls and probe.grown else None
        if stub is not None:
            self.stubs.append(stub)
        if hold is not None:
            self.holds.append(hold[0])
        if steps is not None:
            self.steps.append(steps[0])

    def __add__(self, other: _Measured) -> _Measured:
        return _Measured(self.times + other.times, self.stubs + other.stubs, self.holds + other.holds,
                         self.steps + other.steps)

    def sample(self, probe: Probe, busy_us: float) -> Sample:
        stub_us = max(0.0, median(s[0] for s in self.stubs) - busy_us) if self.stubs else None
        stub_in_us = median(s[1] for s in self.stubs) if self.stubs else None
        latency_us = max(1.0, median(self.times) * 1e6 - probe.steps * busy_us)
        model_us = max(0.0, median(self.holds) - probe.steps * busy_us) if self.holds else None
        steps_us = max(0.0, median(self.steps) - probe.steps * busy_us) if self.steps else None
        return Sample(probe, latency_us, len(self.times), stub_us, stub_in_us, model_us, steps_us)


def _unslowed(passes: Sequence[Sequence[_Measured]]) -> list[_Measured]:
    """One group's probes (the chains of one size, or its grown probes), pooled over the passes
    that did not meet a slow spell of the machine.

    A pass is slow where its probes took :data:`_SLOW_PASS` longer than the fastest pass's
    (the median of their ratios): a calibration on this machine once measured every probe
    of 4 MiB 8-52 % slower than the next one did (the sizes on either side within their
    noise), which priced ``large``'s BLS forms 28 % slow (docs/server_profiles.md). The
    whole group goes with its pass: a size's costs are differences between its probes,
    which one spell of the machine moves alike.
    """
    def pace(measured: Sequence[_Measured]) -> list[float]:
        return [median(m.times) for m in measured]

    paces = [pace(p) for p in passes]
    fastest = min(range(len(passes)), key=lambda k: median(a / b for a, b in zip(paces[k], paces[0], strict=True)))
    kept = [p for k, p in enumerate(passes)
            if median(a / b for a, b in zip(paces[k], paces[fastest], strict=True)) <= 1 + _SLOW_PASS]
    return [sum(rest, first) for first, *rest in zip(*kept, strict=True)]


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
) -> tuple[float, list[tuple[str, float, float, float]]]:
    """The server's lanes: per probe, its throughput at concurrency ``2 * cores`` (at least 4;
    8 where the server's cores are not known) over its throughput at concurrency 1 (medians
    of three windows of ``seconds / 2`` each, taken in turn), the mean over ``probes``,
    between 1 and ``cores`` (the high concurrency where they are not known).

    ``connect()`` makes an asyncio client (``infer(model, inputs)``, ``close()``). Returns
    the lanes and, per probe, ``(label, infer/s at 1, infer/s at the high concurrency,
    its own lanes)``: a probe's tensor size sets how many requests' copies the server makes
    at once (docs/server_profiles.md).
    """
    import anyio

    high = min(32, max(4, 2 * cores)) if cores else 8

    def bounded(ratio: float) -> float:
        return min(float(cores or high), max(1.0, ratio))

    async def window(client: Any, probe: Probe, concurrency: int) -> float:
        inputs = probe.inputs()
        done = 0

        async def caller(until: float) -> None:
            nonlocal done
            while perf_counter() < until:
                await client.infer(probe.model, inputs)
                done += 1

        async with anyio.create_task_group() as tg:  # warm: every connection opened, every stub awake
            for _ in range(concurrency):
                tg.start_soon(client.infer, probe.model, inputs)
        began = perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(caller, began + seconds / 2)
        return done / (perf_counter() - began)

    async def main() -> list[tuple[str, float, float, float]]:
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
                rows.append((p.label, one, at_high, bounded(at_high / one) if one > 0 else 1.0))
        finally:
            await client.close()
        return rows

    rows = run_blocking(main)  # calibrate() from a notebook cell, whose loop is running
    lanes = [row[3] for row in rows]
    return (sum(lanes) / len(lanes) if lanes else 1.0), rows
