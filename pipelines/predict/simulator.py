"""Predicts what Triton does with one configuration of a pipeline by simulating the server's
schedule on a virtual clock (SimPy): a prediction costs milliseconds instead of a measured run,
and since nothing sleeps or runs on a thread the same inputs always give the same figures.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Generator, Sequence
from itertools import chain

import numpy as np
import simpy

from ..calibration.cost import FORM_COSTS
from ..errors import PipelinesError
from .batcher import ModelScheduler, Waiting
from .clients import Meter, Snapshot, closed_loop, open_loop
from .locks import FusedInstance, Lock
from .processor_sharing import Cores, Cost
from .simulation_checks import FORMS, check
from .spec import Load, SimResult, SimSpec, StepSpec, interp

__all__ = ["FORMS", "core_ceiling", "cpu_per_request", "simulate"]

_IN, _OUT = 0, 1

Flow = Generator[simpy.Event, object, None]


def simulate(spec: SimSpec, load: Load) -> SimResult:
    """Latency percentiles, throughput and each model's utilisation of ``spec`` under ``load``."""
    check(spec, load)
    env = simpy.Environment()
    server = _Server(env, spec)
    meter = Meter(env, warmup=load.warmup, requests=load.requests, snapshot=server.snapshot)
    if load.concurrency is not None:
        closed_loop(env, meter, server.request, concurrency=int(load.concurrency))
    else:
        # Twice the requests it needs: never reached while the server keeps up with the rate.
        open_loop(env, meter, server.request, rate=float(load.rate), seed=load.seed,
                  limit=2 * (load.warmup + load.requests))
    env.run(until=meter.done)
    start, end = meter.start, meter.end
    span = end.at_us - start.at_us
    if span <= 0.0:  # and the last answer's instant would never end
        raise PipelinesError(
            f"every cost of this {spec.form} configuration is zero, so it answers without end in no time; "
            "give its steps and boundaries their measured costs")
    while env.peek() <= env.now:  # on to the end of the last answer's instant, for the answers that arrive with it
        env.step()
    latencies = np.asarray(meter.latencies)
    p50, p95, p99 = (float(x) for x in np.percentile(latencies, (50, 95, 99)))
    utilisation = {name: (end.instance_us[name] - start.instance_us[name]) / (model.instances * span)
                   for name, model in server.models.items()}
    cpu = (end.core_us - start.core_us) / (spec.cores * span)
    # The cores win a tie: while they are saturated, more instances would not help.
    bottleneck = max(chain([("cpu", cpu)], utilisation.items()), key=lambda kv: round(kv[1], 9))[0]
    return SimResult(p50_us=p50, p95_us=p95, p99_us=p99, mean_us=float(latencies.mean()),
                     throughput=meter.answers / span * 1e6, utilisation=utilisation,
                     cpu_utilisation=cpu, bottleneck=bottleneck)


def cpu_per_request(spec: SimSpec) -> float:
    """The least CPU time (µs) one request can cost ``spec``'s server: its ``request`` boundary both ways, and each step
    that every request runs (none in a ``when`` block) at the cheapest CPU time a row it can have, over the batch
    sizes it may run at (a request's rows; a dynamic batch; a fused round's joined rows), times the request's rows.
    Every other cost only adds to it."""
    total = spec.costs["request"][_IN].at(spec.rows * spec.in_bytes) + spec.costs["request"][_OUT].at(
        spec.rows * spec.out_bytes)
    # a fused round joins its requests' rows up to the least max_batch_size of its model and steps (none if one is 0)
    limits = [spec.top_max_batch_size, *(s.max_batch_size for s in spec.steps)]
    joined = 0 if 0 in limits else min(limits)
    for step in spec.steps:
        if step.when:
            continue
        if spec.form == "fused" and not step.external:
            most = max(spec.rows, joined)
        else:  # a model takes one request an execution unless it batches dynamically
            most = max(spec.rows, step.max_batch_size if step.dynamic_batching else 0)
        # cpu(b) / b is least at a measured size or at the largest (the curve is straight between its points)
        sizes = {r for r in step.cpu_us.rows if r <= most} | {most}
        total += spec.rows * min(max(0.0, step.cpu_us.at(b)) / b for b in sizes)
    return max(0.0, total)


def core_ceiling(spec: SimSpec) -> float:
    """What the cores can do at most (requests/s): the cores over :func:`cpu_per_request`; infinite where a request
    costs no CPU (a step on a GPU, a sleep). No simulation of ``spec`` answers faster, since every CPU cost is a job on
    the cores (:mod:`pipelines.predict.processor_sharing`), which never run more than ``cores`` at once, and a job of
    several cores (a step's threads, CPU time above its wall time) takes its CPU time of them."""
    cpu = cpu_per_request(spec)
    return spec.cores * 1e6 / cpu if cpu > 0.0 else float("inf")


class _Server:
    """The simulated server of one :class:`SimSpec`: its cores (every cost is a job on them), its models (each a queue
    and instances: :class:`ModelScheduler`), and each form's way of taking a request through them (:meth:`request`), as
    docs/simulation.md tells it: "The queues", and "Where each cost is paid" (which cost each form pays when, and what
    it holds meanwhile)."""

    def __init__(self, env: simpy.Environment, spec: SimSpec) -> None:
        self.env = env
        self.spec = spec
        self.cores = Cores(env, spec.cores)
        # The client's work (encoding requests, decoding answers) runs in the load generator's threads (the benchmark's
        # asyncio client has one): requests sent together arrive staggered, and a BLS round or a batch gathers fewer.
        self._client = Lock(env, spec.client_threads)
        self.models: dict[str, ModelScheduler] = {}
        # A chain runs its steps one after another in the request's process: each needs the one before.
        self._chain = all(spec.steps[i - 1].name in s.deps for i, s in enumerate(spec.steps) if i)
        self._dep_counts = [len(s.deps) for s in spec.steps]
        self._dependents = [[j for j, t in enumerate(spec.steps) if s.name in t.deps] for s in spec.steps]
        self._roots = [i for i, s in enumerate(spec.steps) if not s.deps]
        # `when` blocks' rows are drawn seeded: one SimSpec and load simulate alike every time.
        self._draws = random.Random(0)
        self._call_memo: dict[tuple[str, int], tuple[Cost, Cost]] = {}
        self._execution_memo: dict[tuple[str, int], tuple[Cost, float, float, Cost]] = {}
        # split into columns once: read at every hand-off
        self._wakes = tuple((tuple(w for w, _ in c), tuple(u for _, u in c)) if c else None
                            for c in (spec.wake, spec.wake_idle))
        for step in spec.steps:
            # Steps that name one model (one step used by several nodes) share its queue and instances.
            if (spec.form != "fused" or step.external) and step.model_name not in self.models:
                self._add_model(step.model_name, ModelScheduler(
                    env, instances=step.instances, execute=self._step_execution,
                    max_batch_size=step.max_batch_size, dynamic_batching=step.dynamic_batching,
                    preferred_batch_sizes=step.preferred_batch_sizes, max_queue_delay_us=step.max_queue_delay_us))
        in_bytes, out_bytes = spec.rows * spec.in_bytes, spec.rows * spec.out_bytes
        self._enter, self._leave = self._price("request", _IN, in_bytes), self._price("request", _OUT, out_bytes)
        if spec.form == "ensemble":
            self._set_up_ensemble(in_bytes, out_bytes)
        else:
            self._set_up_rounds(in_bytes, out_bytes)

    def _set_up_ensemble(self, in_bytes: float, out_bytes: float) -> None:
        spec = self.spec
        self._enter += self._price("ensemble", _IN, in_bytes)
        self._leave += self._price("ensemble", _OUT, out_bytes)
        self._step_ways = {s.name: (self._price("ensemble_step", _IN, spec.rows * s.in_bytes),
                                    self._price("ensemble_step", _OUT, spec.rows * s.out_bytes)) for s in spec.steps}
        if spec.gate:
            self._gate_in = self._price("ensemble_step", _IN, out_bytes)
            self._gate_out = self._price("ensemble_step", _OUT, out_bytes) + self._price("ensemble_gate", _IN, 0)
            gate_us = self._price("ensemble_stub", _IN, out_bytes) + self._price("ensemble_stub", _OUT, out_bytes)
            self._add_model("gate", ModelScheduler(self.env, instances=1,
                                                   execute=lambda _batch, _instance: self._holding(gate_us, None)))

    def _set_up_rounds(self, in_bytes: float, out_bytes: float) -> None:
        spec, form = self.spec, self.spec.form
        top = FORM_COSTS[form].own_cost
        self._top_fixed = self._price(top, _IN, 0)
        self._top_in = self._price(top, _IN, in_bytes)
        # A round's answers leave its stub together, as the list its execute() returns: the way out's fixed part is the
        # round's, as the way in's is, and each request pays its bytes. It is paid with the way in, as one job: the
        # round's answers leave as it ends either way (docs/simulation.md, "Where each cost is paid").
        self._out_fixed = self._price(top, _OUT, 0)
        self._top_out = self._price(top, _OUT, out_bytes) - self._out_fixed
        self._round_request = Cost(spec.round_request_us if form == "fused" else 0.0)
        work = {"bls": self._bls_round, "bls-sync": self._bls_sync_round, "fused": self._fused_round}[form]

        def rounds(batch: Sequence[Waiting], instance: int) -> Flow:
            began = self.env.now
            yield from work(batch, instance)
            yield from self._woken(began)  # the instance's thread in the server waited for the stub

        # The BLS model's own work (its ways in and out, its calls') is Python: one GIL an instance, whatever the cores.
        self._bls_gils = [Lock(self.env) for _ in range(spec.top_instances)]
        # async_exec() waits for each answer in a thread of the stub's default executor: at most call_threads calls of
        # an instance in flight (docs/simulation.md); a sync call waits in the loop's thread, one at a time anyway.
        self._call_threads = [Lock(self.env, spec.call_threads) if spec.call_threads else None
                              for _ in range(spec.top_instances)]
        self._add_model(form, ModelScheduler(
            self.env, instances=spec.top_instances, execute=rounds, max_batch_size=spec.top_max_batch_size,
            dynamic_batching=spec.top_max_batch_size > 0))
        if form == "fused":
            # One GIL per fused instance (a stub process of its own); each step instance in it takes one call at a time
            # (a lock in fused_model.py), which only a shared model or a round run side by side needs.
            python = {s.model_name for s in spec.steps if not s.external}
            self._fused = [FusedInstance(Lock(self.env), {m: Lock(self.env) for m in python}, threads, Lock(self.env),
                                  Lock(self.env, spec.step_threads) if spec.step_threads else None)
                           for threads in self._call_threads]
            nodes = Counter(s.model_name for s in spec.steps)
            self._shared = {m for m in python if nodes[m] > 1}
            # The fused model's own work around each Python step it runs: Python, so under its GIL. Its tensors pass
            # as references in one process, so no bytes cross: its fixed cost is all of it.
            step_cost = FORM_COSTS[form].in_process_step_cost
            self._around_step = (self._price(step_cost, _IN, 0) + self._price(step_cost, _OUT, 0)) if python else Cost()
            # The rows a joined run may hold, as compile/fused.py's _join_rows (0: none; that also refuses an
            # external model of a fixed batch size, which a SimSpec does not tell).
            limits = [spec.top_max_batch_size, *(s.max_batch_size for s in spec.steps)]
            self._join_rows = 0 if 0 in limits else min(limits)
            self._fused_memo: dict[tuple[str, int], tuple[float, float, float, float]] = {}

    def _add_model(self, name: str, model: ModelScheduler) -> None:
        if name in self.models:
            raise PipelinesError(
                f"a step's model is named {name!r}, as the {self.spec.form} form's own model is; rename the "
                "step so that each model's utilisation can be told apart", step=name)
        self.models[name] = model

    def _price(self, boundary: str, way: int, nbytes: float) -> Cost:
        """``boundary``'s cost at ``nbytes``; what it costs above its cost at no bytes is a copy."""
        cost = self.spec.costs[boundary][way]
        us = max(0.0, cost.at(nbytes))
        return Cost(us, max(0.0, us - max(0.0, cost.at(0.0))))

    def _tensors(self, boundary: str, way: int, nbytes: float, tensors: int) -> Cost:
        """``nbytes`` in ``tensors`` tensors crossing ``boundary``: the profile's probes cross it with one tensor, so
        each more pays its fixed cost again (yolov5's scale_boxes, 3 tensors in, spends 322 µs more in its stub)."""
        return self._price(boundary, way, nbytes) + max(0, tensors - 1) * self._price(boundary, way, 0)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.env.now, self.cores.busy(), {name: m.busy() for name, m in self.models.items()})

    def _dag(self, run: Callable[[StepSpec, bool], Flow]) -> Flow:
        """Each step run once the steps it takes from are done, independent ones side by side. ``run(step, alone)``:
        ``alone``, the step was the only one ready with nothing else of this run in flight (``run_concurrently``)."""
        if self._chain:
            for step in self.spec.steps:
                yield from run(step, True)
            return
        env = self.env
        waiting = list(self._dep_counts)  # by step index: how many of its deps are not done yet
        left, running = [len(waiting)], [0]  # steps not done, steps running
        all_done = env.event()

        def strand(i: int, alone: bool) -> Flow:
            # A step goes on in the process of the step that readied it: only a branch starts one (two events).
            while i >= 0:
                running[0] += 1
                yield from run(self.spec.steps[i], alone)
                running[0] -= 1
                left[0] -= 1
                i, readied = -1, i
                for after in self._dependents[readied]:
                    waiting[after] -= 1
                    if waiting[after] == 0:
                        if i < 0:
                            i, alone = after, not running[0]
                        else:
                            alone = False
                            env.process(strand(after, False))
            if not left[0]:
                all_done.succeed()

        roots = self._roots
        if len(roots) == 1:
            yield from strand(roots[0], True)
        else:
            # Every root starts a process of its own, so that a round's requests send their first calls request by
            # request, as a BLS model's tasks do: the order they take the stub's call threads in.
            for root in roots:
                env.process(strand(root, False))
        if left[0]:
            yield all_done

    def _step_execution(self, batch: Sequence[Waiting], _instance: int) -> Flow:
        """A step model's execution: its stub's way in, the step's compute, the stub's way out. Each request carries
        its step (``what``); a batch of two nodes of one shared model runs the first one's code on all the rows."""
        step: StepSpec = batch[0].what
        rows = sum(w.rows for w in batch)
        key = (step.name, rows)
        if (costs := self._execution_memo.get(key)) is None or any(w.what is not step for w in batch):
            stub = None if step.external else FORM_COSTS[self.spec.form].stub_cost
            in_bytes = sum(w.rows * w.what.in_bytes for w in batch)
            out_bytes = sum(w.rows * w.what.out_bytes for w in batch)
            span, cap = _compute(step, rows)
            costs = (self._tensors(stub, _IN, in_bytes, step.in_tensors) if stub else Cost(), span, cap,
                     self._tensors(stub, _OUT, out_bytes, step.out_tensors) if stub else Cost())
            if all(w.what is step for w in batch):
                self._execution_memo[key] = costs
        stub_in, span, cap, stub_out = costs
        began = self.env.now
        yield self.cores.pay(stub_in)
        yield self.cores.run(span, cap, step.memory, step.traffic)
        if stub_in:  # the instance's thread in the server waited for its stub, holding the instance
            yield from self._woken(began)
        yield self.cores.pay(stub_out)

    def _call(self, step: StepSpec, rows: int, gil: Lock | None = None, threads: Lock | None = None) -> Flow:
        """A BLS call of a step's model: the call's way in, the model, its way out. An async call holds one of its
        instance's ``threads`` from when it is sent until its answer is back."""
        if (ways := self._call_memo.get((step.name, rows))) is None:
            call = FORM_COSTS[self.spec.form].call_cost
            ways = self._call_memo[step.name, rows] = (
                self._tensors(call, _IN, rows * step.in_bytes, step.in_tensors),
                self._tensors(call, _OUT, rows * step.out_bytes, step.out_tensors))
        yield from self._holding(ways[0], gil)
        if threads is not None:
            yield from threads.take()
        since = self.env.now
        yield self.models[step.model_name].submit(rows, step)
        yield from self._woken(since)  # the BLS model's stub waited for the call's answer
        if threads is not None:
            threads.give()  # its thread is free once the answer is back
        yield from self._holding(ways[1], gil)

    def _holding(self, cost: Cost, lock: Lock | None) -> Flow:
        """``cost`` as CPU work, holding ``lock`` where there is one: a BLS instance's GIL, or a client's thread."""
        if lock is None or not cost:
            yield self.cores.pay(cost)
            return
        yield from lock.take()
        yield self.cores.pay(cost)
        lock.give()

    def request(self) -> Flow:
        """One request, from the client's way in to its way out (both in the client's threads)."""
        sent = self.env.now
        yield from self._holding(self._enter, self._client)
        if self.spec.form != "ensemble":
            yield self.models[self.spec.form].submit(self.spec.rows)
        else:
            yield from self._dag(self._ensemble_step)
            if self.spec.gate:
                yield self.cores.pay(self._gate_in)
                yield self.models["gate"].submit(self.spec.rows)
                yield self.cores.pay(self._gate_out)
        yield from self._woken(sent)  # the client's
        yield from self._holding(self._leave, self._client)

    def _ensemble_step(self, step: StepSpec, _alone: bool) -> Flow:
        way_in, way_out = self._step_ways[step.name]
        yield self.cores.pay(way_in)
        yield self.models[step.model_name].submit(self.spec.rows, step)
        yield self.cores.pay(way_out)

    def _woken(self, since: float) -> Flow:
        """The wake of a side that waited for another process since ``since``, by the profile's ``wake``: paid while
        a core idles (a busy machine's threads and cores are awake), as a delay that uses no core (the system's)."""
        wake, idle = self._wakes
        if not (wake or idle) or not self.cores.idle():
            return
        us = _at(wake, self.env.now - since)
        if idle:  # every core idled: the machine is woken too
            us = max(us, _at(idle, min(self.env.now - since, self.cores.idle_for())))
        if us > 0.0:
            yield self.env.timeout(us)

    def _round_in(self, count: int) -> Cost:
        """The top model's way in for a round of ``count`` requests, and the fixed part of its way out: the fixed
        parts once; in the fused model, each request beyond the first adds the profile's ``round_request_us``."""
        each = self._top_in - self._top_fixed + self._round_request
        return self._top_in + self._out_fixed + (count - 1) * each

    def _bls_round(self, batch: Sequence[Waiting], instance: int) -> Flow:
        gil, threads = self._bls_gils[instance], self._call_threads[instance]
        yield from self._holding(self._round_in(len(batch)), gil)
        if len(batch) == 1:
            yield from self._bls_request(batch[0].rows, gil, threads)
        else:
            yield self.env.all_of([self.env.process(self._bls_request(w.rows, gil, threads)) for w in batch])

    def _bls_request(self, rows: int, gil: Lock, threads: Lock | None) -> Flow:
        yield from self._dag(self._held(rows, lambda step, held, _alone: self._call(step, held, gil, threads)))
        yield from self._holding(self._top_out, gil)

    def _bls_sync_round(self, batch: Sequence[Waiting], _instance: int) -> Flow:
        for i, waiting in enumerate(batch):
            yield self.cores.pay(self._round_in(1) if i == 0 else self._top_in - self._top_fixed)
            call = self._held(waiting.rows, lambda step, held, _alone: self._call(step, held))
            for step in self.spec.steps:
                yield from call(step, True)
            yield self.cores.pay(self._top_out)

    def _held(self, rows: int, run: Callable[[StepSpec, int, bool], Flow]) -> Callable[[StepSpec, bool], Flow]:
        """A request of ``rows`` rows' way to run a step: ``run(step, held, alone)`` on the ``held`` rows where
        every condition of its ``when`` blocks holds, not at all where none does. Each block's rows are drawn once
        a request, from the rows of the block around it, so the steps of one block run on the same rows."""
        drawn: dict[tuple[str, ...], int] = {}

        def on_held(step: StepSpec, alone: bool) -> Flow:
            held = rows
            for depth in range(len(step.when)):
                block = step.when[: depth + 1]
                if (block_rows := drawn.get(block)) is None:
                    share = self.spec.when_rates.get(block[-1], 1.0)
                    block_rows = drawn[block] = sum(1 for _ in range(held) if self._draws.random() < share)
                held = block_rows
            if held:
                yield from run(step, held, alone)

        return on_held

    def _fused_round(self, batch: Sequence[Waiting], instance: int) -> Flow:
        yield self.cores.pay(self._round_in(len(batch)))
        fused = self._fused[instance]
        rows = sum(w.rows for w in batch)
        if len(batch) == 1 or rows <= self._join_rows:
            yield from self._dag(self._held(rows, lambda step, held, alone: self._fused_step(
                step, held, fused, self._shared, alone)))
            yield self.cores.pay(self._top_out * len(batch))
        else:
            # Side by side: every step's instance in this fused instance takes one call at a time.
            yield self.env.all_of([self.env.process(self._fused_request(w.rows, fused)) for w in batch])

    def _fused_request(self, rows: int, fused: FusedInstance) -> Flow:
        yield from self._dag(self._held(rows, lambda step, held, alone: self._fused_step(
            step, held, fused, fused.locks, alone)))
        yield self.cores.pay(self._top_out)

    def _fused_step(self, step: StepSpec, rows: int, fused: FusedInstance, locked: Collection[str], alone: bool) -> Flow:
        """A step inside the fused model's process: its ``gil_share`` of CPU time holds the instance's GIL as one phase
        before the rest, both at the step's own cores (at least one with the GIL), so alone it takes its wall time; it
        runs on the event loop's thread where ``alone`` in its run, else in the step pool (docs/simulation.md, "Fused,
        with its GIL share")."""
        if step.external:
            yield from self._call(step, rows, threads=fused.threads)
            return
        if (phases := self._fused_memo.get((step.name, rows))) is None:
            phases = self._fused_memo[step.name, rows] = _gil_phases(step, rows)
        gil_span, gil_cap, free_span, free_cap = phases
        # its model's lock where that is shared, then its thread: the event loop's, or one of the step pool's
        held = [lock for lock in (fused.locks[step.model_name] if step.model_name in locked else None,
                                  fused.loop if alone else fused.pool) if lock is not None]
        for lock in held:
            yield from lock.take()
        if gil_span > 0.0 or self._around_step:
            yield from fused.gil.take()
            yield self.cores.pay(self._around_step)
            yield self.cores.run(gil_span, gil_cap, step.memory, step.traffic)
            fused.gil.give()
        yield self.cores.run(free_span, free_cap, step.memory, step.traffic)
        for lock in reversed(held):
            lock.give()


def _at(curve: tuple[tuple[float, ...], tuple[float, ...]] | None, waited: float) -> float:
    """``curve``'s µs after ``waited`` µs (``(waited, µs)`` columns): straight between its points, flat beyond; none: 0."""
    return 0.0 if curve is None else interp(curve[0], curve[1], waited, extend=False)


def _compute(step: StepSpec, rows: int) -> tuple[float, float]:
    """A step's execution of ``rows`` rows as a job: (span alone, cores; 0 cores: a plain delay)."""
    wall, cpu = step.wall_us.at(rows), step.cpu_us.at(rows)
    if cpu <= 0.0:
        return max(0.0, wall), 0.0
    if wall <= 0.0:
        raise PipelinesError(
            f"step {step.name!r} has {cpu:g} µs of CPU time but {wall:g} µs of wall time at {rows} rows; a "
            "profile's wall time is above zero wherever its CPU time is: profile the step again", step=step.name)
    return wall, cpu / wall


def _gil_phases(step: StepSpec, rows: int) -> tuple[float, float, float, float]:
    """(GIL span, its cores, free span, its cores) of a fused step's ``rows`` rows: :meth:`_Server._fused_step`."""
    wall, cores = _compute(step, rows)
    if cores == 0.0:
        return 0.0, 0.0, wall, 0.0
    cpu = step.cpu_us.at(rows)
    gil_cores = max(1.0, cores)
    gil_span = step.gil_share * cpu / gil_cores
    free_span = max(0.0, wall - gil_span)
    free_cpu = (1.0 - step.gil_share) * cpu
    return gil_span, gil_cores, free_span, (free_cpu / free_span if free_span > 0.0 and free_cpu > 0.0 else 0.0)
