"""How one request runs through the plan in the local runtime: its state, each node's call,
and the three schedulers of :data:`pipelines.forms.FORMS` (``"event"``, ``"concurrent"``,
``"sequential"``; see :mod:`pipelines.runtime.local_runtime` for what each stands for).

A request runs the plan cut to the outputs it asks for (:class:`pipelines.serving.Schedule`,
the cut the server's executors make too); the step models are those the runtime opened.

When a sync step runs on a worker thread: a hop costs tens of µs (half a
millisecond on a busy VM), so with ``offload="auto"`` a sync step without a
timeout runs inline on the event loop when the hop cannot buy overlap:

- it is the only step of the only request in flight (nothing to overlap with), or of
  the only request in the round of a BLS model with one instance (``"bls"``,
  ``"bls-sync"``, ``"fused"``): the others wait for a round of their own, as they do on
  the server, and no step of theirs can start meanwhile. A sync BLS round at
  concurrency 4 thus runs its steps as one request alone does; handed to threads, they
  held each request of ``large``'s round 0.9 ms longer than at concurrency 1, or
- its typical compute time (an average over its last calls, after 3 of them) is
  below the cost of a hop, measured once per process (overlap would cost more
  than it saves).

Otherwise it runs on a worker thread (a batch of a dynamically batched step
follows the second rule only); async steps are awaited on the loop. ``offload="always"`` always hops;
``"never"`` never does, except for steps with a timeout, which need a thread
so that a stuck call can be abandoned.
"""

from __future__ import annotations

import graphlib
import math
from collections.abc import Iterable
from time import perf_counter
from typing import Any

import anyio

from ..core.plan import ExecutionPlan
from ..serving import SKIPPED, Branches, Rows, Schedule, bytes_tensor
from ..serving import negated as negated_values
from .bls_gate import BlsGate
from .device import CopyCounter
from .instances import StepModel

Key = tuple["str | None", str]  # (producing node or None for a pipeline input, tensor name)


class Request:
    """The state of one request in flight: live tensors, their remaining consumers, costs."""

    __slots__ = (
        "schedule", "values", "remaining", "pending", "copies", "trace", "rows", "inflight", "error", "tg", "branch"
    )

    def __init__(self, schedule: Schedule, rows: int) -> None:
        self.schedule = schedule
        self.values: dict[Key, Any] = {}
        self.remaining = dict(schedule.uses)
        self.pending: dict[str, int] | None = None
        self.copies = CopyCounter()
        self.trace: list[tuple[str, float, float, float, int]] = []
        self.rows = rows
        self.inflight = 0  # steps of this request that are ready or running
        self.error: BaseException | None = None
        self.tg: Any = None
        self.branch: Rows | None = None  # a conditional plan's rows (serving.Rows); None: every step, every row

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.tg.cancel_scope.cancel()  # the siblings of a failed step have nothing left to answer


class Scheduler:
    """Runs requests through the live nodes on the runtime's step models, in the order the
    form's ``scheduler`` keeps: ``await scheduler.run(request)``.

    ``branches``: a conditional plan's ``when`` blocks and fills (``serving.Branches``), or
    ``None``. ``crossings``: the copies a server makes of a step's tensors (none for the nodes
    ``in_process``). ``one_round``: the BLS gate of a BLS model with one instance, whose round
    decides whether a step is alone.
    """

    def __init__(
        self,
        plan: ExecutionPlan,
        scheduler: str,
        *,
        branches: Branches | None,
        crossings: int,
        in_process: frozenset[str],
        one_round: BlsGate | None,
    ) -> None:
        self.models: dict[str, StepModel] = {}  # by node; the runtime fills it as it opens
        self.active = 0  # requests in the runtime, from their check to their answer
        # A node reads the same tensors whatever outputs a request asks for.
        self.bindings = {n.name: tuple((s.input, s.key) for s in n.inputs) for n in plan.nodes}
        self.branches = branches
        self._crossings = crossings
        self._in_process = in_process
        self._one_round = one_round
        self.run = {"event": self._run_ensemble, "concurrent": self._run_bls, "sequential": self._run_bls_sync}[
            scheduler
        ]

    def request(self, schedule: Schedule, rows: int) -> Request:
        """A new request's state, with the rows of its ``when`` blocks where the plan has any."""
        req = Request(schedule, rows)
        if self.branches is not None:
            req.branch = Rows(self.branches, rows, req.values.__getitem__)
        return req

    def answer(self, req: Request) -> dict[str, Any]:
        """The outputs ``req`` asked for, as a server answers them (an output of a branch filled)."""
        values, branch, branches, negated = req.values, req.branch, self.branches, req.schedule.negated

        def value(name: str, key: Any) -> Any:  # an output declared as ~flag: negated, before any fill
            return negated_values(values[key]) if name in negated else values[key]

        if branch is None or branches is None:
            return {name: _answered(value(name, key)) for name, key in req.schedule.outputs}
        return {
            name: _answered(branch.filled(value(name, key), branches.terms_of(key), branches.fills[name]))
            for name, key in req.schedule.outputs
        }

    # -------------------------------------------------------------------- one node

    async def _run_node(self, req: Request, name: str, t_ready: float) -> None:
        """Run one node for one request: take its inputs, execute, keep the outputs someone needs."""
        branch, branches, rows = req.branch, self.branches, req.rows
        if branch is not None:
            rows = self._branch_rows(req, name, t_ready)
            if not rows:
                return
        model = self.models[name]
        values, remaining = req.values, req.remaining
        inputs = {}
        crossings = self._crossings if name not in self._in_process else 0
        for input_name, key in self.bindings[name]:
            value = values[key]
            if branch is not None:  # the rows of this node's `when` blocks only
                value = branch.gather(value, branches.terms_of(key), branches.when[name])
            inputs[input_name] = model.place(value, req.copies, input_name)
            if crossings:
                inputs[input_name] = _cross(inputs[input_name], crossings, req.copies)
            left = remaining[key] - 1
            remaining[key] = left
            if not left:  # no remaining consumer: drop our reference now (the step holds its own)
                del values[key]
        if branch is not None:
            _release(req, branches.conditions[name])
        alone = (self.active if self._one_round is None else self._one_round.admitted) == 1
        inline = model.always_inline or (model.inline_ok and (model.cheap or (alone and req.inflight == 1)))
        outputs, queue, compute, batch = await model.run(inputs, rows, inline=inline)
        del inputs
        crosses = name not in self._in_process
        for out in req.schedule.returns[name]:
            value = outputs[out]
            if crosses and value.dtype.kind in "OSU":  # serialised by Triton as the next model reads it
                value = bytes_tensor(value)
            values[(name, out)] = _cross(value, crossings, req.copies) if crossings else value
        req.trace.append((name, queue, compute, perf_counter() - t_ready - queue - compute, batch))

    def _branch_rows(self, req: Request, name: str, t_ready: float) -> int:
        """How many rows ``name`` runs on; 0 once it is done here: a select merged, or no row to run."""
        branch, branches = req.branch, self.branches
        assert branch is not None and branches is not None
        rows = branch.rows_of(name)
        if rows and name not in branches.selects:
            return rows
        values = req.values
        reads = [key for _, key in self.bindings[name]]
        if rows:  # a select: merged here, as the BLS and fused models merge it, with no model
            start = perf_counter()
            bound = dict(self.bindings[name])
            sources = {
                "condition": (bound["condition"], branches.terms_of(bound["condition"])),
                **{side: (values[bound[side]], branches.terms_of(bound[side])) for side in ("then", "otherwise")},
            }
            merged = branch.merge(name, sources)
            _release(req, reads + branches.conditions[name])
            values[(name, "output")] = merged
            compute = perf_counter() - start
            req.trace.append((name, 0.0, compute, start - t_ready, 1))
        else:  # no row holds its conditions: the step is not called at all
            _release(req, reads + branches.conditions[name])
            for out in req.schedule.returns[name]:
                values[(name, out)] = SKIPPED
        return 0

    # ------------------------------------------------------------------ schedulers

    async def _run_ensemble(self, req: Request) -> None:
        after = req.schedule.after
        req.pending = {name: len(preds) for name, preds in after.items()}
        roots = [name for name in req.schedule.order if not after[name]]
        req.inflight = len(roots)
        now = perf_counter()
        async with anyio.create_task_group() as tg:
            req.tg = tg
            for root in roots[1:]:
                tg.start_soon(self._ensemble_chain, req, root, now)
            await self._ensemble_chain(req, roots[0], now)
        if req.error is not None:
            raise req.error

    async def _ensemble_chain(self, req: Request, name: str, t_ready: float) -> None:
        """Run a node, then start each dependent it made ready; continue with one of them in this task."""
        dependents = req.schedule.before
        pending = req.pending
        assert pending is not None
        while True:
            try:
                await self._run_node(req, name, t_ready)
            except Exception as exc:
                req.fail(exc)
                return
            t_ready = perf_counter()
            follow = None
            for dep in dependents[name]:
                left = pending[dep] - 1
                pending[dep] = left
                if not left:
                    req.inflight += 1
                    if follow is None:
                        follow = dep  # a new task costs more than carrying on in this one
                    else:
                        req.tg.start_soon(self._ensemble_chain, req, dep, t_ready)
            req.inflight -= 1
            if follow is None:
                return
            name = follow

    async def _run_bls(self, req: Request) -> None:
        sorter = graphlib.TopologicalSorter(req.schedule.after)
        sorter.prepare()
        send, receive = anyio.create_memory_object_stream[str](math.inf)
        with send, receive:
            async with anyio.create_task_group() as tg:
                req.tg = tg
                while sorter.is_active():
                    ready = sorter.get_ready()
                    now = perf_counter()
                    if len(ready) == 1 and req.inflight == 0:
                        # Nothing to overlap with: await the step here rather than in a new task.
                        req.inflight = 1
                        try:
                            await self._run_node(req, ready[0], now)
                        except Exception as exc:
                            req.fail(exc)
                            break
                        req.inflight = 0
                        sorter.done(ready[0])
                        continue
                    req.inflight += len(ready)
                    for name in ready:
                        tg.start_soon(self._bls_call, req, name, now, send)
                    sorter.done(await receive.receive())
        if req.error is not None:
            raise req.error

    async def _bls_call(self, req: Request, name: str, t_ready: float, send: Any) -> None:
        try:
            await self._run_node(req, name, t_ready)
        except Exception as exc:
            req.fail(exc)
            return
        req.inflight -= 1
        send.send_nowait(name)

    async def _run_bls_sync(self, req: Request) -> None:
        req.inflight = 1
        for name in req.schedule.order:
            await self._run_node(req, name, perf_counter())


def _release(req: Request, keys: Iterable[Key]) -> None:
    values, remaining = req.values, req.remaining
    for key in keys:
        left = remaining[key] - 1
        remaining[key] = left
        if not left:
            del values[key]


def _answered(value: Any) -> Any:
    """A pipeline output as a server answers it: the caller's own array, BYTES as ``bytes``.

    A step may return its input or a view of it (read-only here, see
    ``serving.read_only``); the server copies every output into its response,
    so what a caller is answered is its own to write into, here as there.
    """
    if value.dtype.kind in "OSU":
        encoded = bytes_tensor(value)
        return encoded if encoded is not value else value.copy()
    return value.copy()  # numpy and CuPy alike


def _cross(array: Any, times: int, copies: Any) -> Any:
    """Copy ``array`` as a server does when it passes between processes, ``times`` times."""
    for _ in range(times):
        array = array.copy()  # numpy and CuPy alike; the copy stays on the array's device
        copies.add(getattr(array, "nbytes", 0))
    return array
