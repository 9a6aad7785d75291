"""What the simulator is given: one configuration of one pipeline in one form, with every cost it needs, as plain frozen
data (built by :mod:`pipelines.predict.prediction`). Times are microseconds, sizes bytes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import PipelinesError

__all__ = ["Curve", "Load", "SimResult", "SimSpec", "StepSpec", "WayCost", "interp", "way_costs"]


def interp(xs: Sequence[float], ys: Sequence[float], x: float, *, extend: bool = True) -> float:
    """Linear between points, the first value below the first point, past the last point the last slope (never
    negative) where ``extend``, else the last value."""
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return float(ys[i])
    if i == 0 or len(xs) == 1:
        return float(ys[0])
    if i < len(xs):
        return float(ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1]))
    if not extend:
        return float(ys[-1])
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return float(ys[-1] + slope * (x - xs[-1]))


@dataclass(frozen=True)
class Curve:
    """A cost by batch size: ``us[i]`` at ``rows[i]`` rows, linear between them."""

    rows: tuple[int, ...]
    us: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.us) or list(self.rows) != sorted(set(self.rows)):
            raise PipelinesError(f"a curve needs increasing rows and one figure each; got {self.rows}, {self.us}")

    @classmethod
    def flat(cls, us: float) -> Curve:
        return cls((1,), (float(us),))

    def at(self, rows: int) -> float:
        return interp(self.rows, self.us, rows)


@dataclass(frozen=True)
class WayCost:
    """One boundary of the server profile, one way: µs at ``sizes`` bytes (linear between, the last slope past the
    largest). Made from :class:`pipelines.calibration.profile.Cost`."""

    sizes: tuple[int, ...]
    us: tuple[float, ...]

    def at(self, nbytes: float) -> float:
        return interp(self.sizes, self.us, nbytes)


def way_costs(cost: Any, bound: int = 0) -> tuple[WayCost, WayCost]:
    """A profile boundary as the simulator reads it: the measured curve each way, or, for an
    old profile with only a line, half its fixed cost each way plus its cost per byte. ``bound``
    -1 or 1: each figure at the low or high end of its confidence interval (never below zero, and
    never past the figure itself the wrong way), where the profile has intervals."""
    if cost.sizes:
        ins, outs = tuple(cost.in_us), tuple(cost.out_us)
        if bound and cost.in_ci and cost.out_ci:
            ins, outs = _bounded(ins, cost.in_ci, bound), _bounded(outs, cost.out_ci, bound)
        return WayCost(tuple(cost.sizes), ins), WayCost(tuple(cost.sizes), outs)
    fixed, per_mib = cost.fixed_us, cost.us_per_mib
    if bound and cost.fixed_ci and cost.per_mib_ci:
        fixed, per_mib = _bounded((fixed, per_mib), (cost.fixed_ci, cost.per_mib_ci), bound)
    line = WayCost((0, 1 << 20), (fixed / 2, fixed / 2 + per_mib))
    return line, line


def _bounded(figures: Sequence[float], intervals: Sequence[tuple[float, float]], bound: int) -> tuple[float, ...]:
    """Each figure at the low (``bound`` -1) or high (1) end of its interval, never below zero, and never past the
    figure itself the wrong way (a bootstrap's interval need not hold the fit's clipped figure)."""
    if bound < 0:
        return tuple(max(0.0, min(f, lo)) for f, (lo, _) in zip(figures, intervals, strict=True))
    return tuple(max(f, hi) for f, (_, hi) in zip(figures, intervals, strict=True))


@dataclass(frozen=True)
class StepSpec:
    """One live step as its Triton model runs it.

    ``deps``: the steps whose outputs it takes (names in :attr:`SimSpec.steps`). ``wall_us``/``cpu_us``: one execution
    of the step's own code by batch rows (CPU above wall: it runs threads; below: it waits on something else).
    ``gil_share``: the part of its CPU time that holds Python's GIL (what threads of one process cannot overlap: the
    fused form). ``in_bytes``/``out_bytes``: what its inputs and outputs weigh per row. ``external``: another backend's
    model, which has no Python stub. ``max_batch_size`` 0: one request an execution. ``model``: the Triton model that
    runs it ("": its own name); steps that name one model (a step used by several nodes) share its instances and queue.
    ``in_tensors``/``out_tensors``: how many tensors it takes and gives; a stub and a BLS call pay their boundary's
    fixed cost for each (the profile's probes have one of each). ``when``: the conditions of the ``when`` blocks it sits
    in, outermost first (keys of :attr:`SimSpec.when_rates`); it runs on the rows where all of them hold, not at all
    where none does. ``memory`` (0..1): the share of its own time that waits on memory, which such work on other cores
    stretches (:mod:`pipelines.predict.processor_sharing`). ``traffic`` (0..1): how much it slows a copy on another
    core; ``None``: its ``memory``.
    """

    name: str
    deps: tuple[str, ...]
    wall_us: Curve
    cpu_us: Curve
    in_bytes: float
    out_bytes: float
    gil_share: float = 1.0
    external: bool = False
    instances: int = 1
    max_batch_size: int = 0
    dynamic_batching: bool = False
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: float = 0.0
    model: str = ""
    in_tensors: int = 1
    out_tensors: int = 1
    when: tuple[str, ...] = ()
    memory: float = 0.0
    traffic: float | None = None

    @property
    def model_name(self) -> str:
        return self.model or self.name


@dataclass(frozen=True)
class SimSpec:
    """One configuration to simulate.

    ``form``: ``ensemble``, ``bls``, ``bls-sync`` or ``fused``. ``steps``: the live steps in a topological order.
    ``rows``: rows per request. ``in_bytes``/``out_bytes``: what the request's inputs and outputs weigh per row.
    ``top_instances`` and ``top_max_batch_size``: the BLS or fused model's instance count and the rows one ``execute()``
    may take. ``gate``: an ensemble that ends in a gate model. ``cores``: the server's cores, shared by every CPU cost.
    ``costs``: the server profile's boundaries by name (:data:`pipelines.calibration.profile.BOUNDARIES`), each as
    ``(in, out)`` :class:`WayCost`. ``client_threads``: the load generator's threads, which pay each request's
    ``request`` cost one at a time (the benchmark's and the calibration's asyncio client has one). ``when_rates``: for
    each condition a step's ``when`` names, the share of rows where it holds (0..1), against which each request's rows
    are drawn, once a request for each block. ``wake`` and ``wake_idle`` (the server profile's): what a hand-off between
    processes costs once its waiting side has waited, or every core has idled, a while, as ``(waited µs, µs)`` points;
    none: nothing. ``call_threads``: how many ``async_exec()`` calls one BLS or fused instance has in flight at most,
    the threads of its stub's default executor (Python's ``min(32, cpu_count + 4)``); 0: no limit. ``step_threads``: the
    pool a fused instance runs its Python steps in off its event loop (``fused_model.py``: ``max(2, the widest group's
    Python steps)``); 0: no limit. ``round_request_us`` (the server profile's): what each request of a fused round adds
    to it beyond the first and its bytes.
    """

    form: str
    steps: tuple[StepSpec, ...]
    rows: int
    in_bytes: float
    out_bytes: float
    costs: Mapping[str, tuple[WayCost, WayCost]]
    cores: float
    top_instances: int = 1
    top_max_batch_size: int = 0
    gate: bool = False
    client_threads: int = 1
    when_rates: Mapping[str, float] = field(default_factory=dict)
    wake: tuple[tuple[float, float], ...] = ()
    wake_idle: tuple[tuple[float, float], ...] = ()
    call_threads: int = 0
    step_threads: int = 0
    round_request_us: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))
        object.__setattr__(self, "when_rates", MappingProxyType(dict(self.when_rates)))


@dataclass(frozen=True)
class Load:
    """How clients load the server: ``concurrency`` clients in a closed loop (as perf_analyzer), or Poisson arrivals
    at ``rate`` requests/s (open loop); one of the two. ``requests`` are measured after ``warmup`` more; ``seed``
    makes arrivals repeatable (how many an open loop needs: docs/simulation.md, "The queues")."""

    concurrency: int | None = None
    rate: float | None = None
    requests: int = 1000
    warmup: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise PipelinesError("a load is a concurrency or a rate, one of the two")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or int(self.concurrency) < 1):
            raise PipelinesError(f"concurrency is an int >= 1; got {self.concurrency!r}")
        if self.rate is not None and not float(self.rate) > 0:
            raise PipelinesError(f"rate is requests/s > 0; got {self.rate!r}")


@dataclass(frozen=True)
class SimResult:
    """What one simulation gives: latency percentiles (µs), throughput (requests/s), the busy share (0..1) of each
    model's instances by model name (the BLS or fused model's under its form's name, an ensemble's gate model's under
    ``"gate"``), the cores' busy share, and the bottleneck's name (the busiest of those, ``"cpu"`` for the cores)."""

    p50_us: float
    p95_us: float
    p99_us: float
    mean_us: float
    throughput: float
    utilisation: Mapping[str, float] = field(default_factory=dict)
    cpu_utilisation: float = 0.0
    bottleneck: str = ""
