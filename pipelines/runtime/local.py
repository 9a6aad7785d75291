"""The local runtime: run a pipeline's execution plan without a server, as Triton would.

There is one mode per form of :data:`pipelines.forms.FORMS`; all give the same
answers and run the same plan (:mod:`pipelines.plan`: live nodes only, pruned to
the requested outputs). They differ in the form's scheduler:

- ``"event"`` (``"ensemble"``): like Triton's ensemble scheduler. Each finished
  step counts down its dependents (precomputed dependency counts) and starts the
  ones that became ready; no orchestrator sits in the middle.
- ``"concurrent"`` (``"bls"``, ``"fused"``): one orchestrator per request walks a
  ``graphlib.TopologicalSorter`` and awaits the ready steps concurrently (an
  ``async def execute`` Python model). In ``"fused"`` the Python steps run inside
  that one model, so they cross no process (no server copy at their boundaries);
  external steps are still called through BLS.
- ``"sequential"`` (``"bls-sync"``): one orchestrator calls the steps one after
  another in topological order (a BLS model using ``exec()``).

In every mode each step is one step model with ``instance_count`` instances, a
FIFO queue and optional dynamic batching; the nodes of a step used twice share
it, as they share one composing model in a compiled repository. Parallel work
runs in anyio task groups: a failing step cancels its siblings and the error
names the pipeline and the step.

When a sync step runs on a worker thread: a hop costs tens of µs (half a
millisecond on a busy VM), so with ``offload="auto"`` a sync step without a
timeout runs inline on the event loop when the hop cannot buy overlap:

- it is the only step of the only request in flight (nothing to overlap with), or of
  the only request in the round of a BLS model with one instance (``"bls"``,
  ``"bls-sync"``, ``"fused"``): the others wait for a round of their own, as they do on
  the server, and no step of theirs can start meanwhile. A sync BLS round at
  concurrency 4 thus runs its steps as one request alone does; handed to threads, they
  held each request of ``large``'s round 0.9 ms longer than at concurrency 1
  (docs/server_profiles.md), or
- its typical compute time (an average over its last calls, after 3 of them) is
  below the cost of a hop, measured once per process (overlap would cost more
  than it saves).

Otherwise it runs on a worker thread (a batch of a dynamically batched step
follows the second rule only); async steps are awaited on the loop. ``offload="always"`` always hops;
``"never"`` never does, except for steps with a timeout, which need a thread
so that a stuck call can be abandoned.
"""

from __future__ import annotations

import dataclasses
import functools
import graphlib
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from time import perf_counter
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from ..blocking import run_blocking
from ..errors import ArgumentError, InferenceError, InputError, NotCompilableError, PipelinesError, StepError
from ..forms import form, form_names
from ..freed_memory import keep_freed_memory_here
from ..graph import Pipeline
from ..plan import ExecutionPlan, ensemble_refusal, gated_ensemble, plan_of
from ..requests import check_request
from ..serving import SKIPPED, Branches, Rows, bytes_tensor
from .bls_gate import BlsGate
from .device import CopyCounter, Placement, gpu_available, resolve_device
from .instances import StepModel, thread_hop_cost
from .report import CostRecorder, Report
from .step_process import ISOLATIONS, is_async_impl, isolation_supported
from .workers import StepThreads

__all__ = ["MODES", "LocalRuntime", "run_many", "run_pipeline"]

#: The local runtime's modes: one per form of the table in :mod:`pipelines.forms`.
MODES = form_names()
_OFFLOAD = ("auto", "always", "never")
#: What an old ``profile=`` argument is told: the runtime executes, and prediction is a simulation.
NO_REPLAY = (
    "the local runtime no longer replays server profiles; predict the server with "
    "p.predict(profile, concurrency=...) or `pipelines predict MODULE:ATTR --profile FILE`"
)

Key = tuple["str | None", str]  # (producing node or None for a pipeline input, tensor name)


@dataclass(frozen=True)
class _Routes:
    """The execution plan indexed for the scheduler's hot path (dicts by node name)."""

    plan: ExecutionPlan
    order: tuple[str, ...]
    predecessors: Mapping[str, tuple[str, ...]]
    dependents: Mapping[str, tuple[str, ...]]
    dep_counts: Mapping[str, int]
    roots: tuple[str, ...]
    bindings: Mapping[str, tuple[tuple[str, Key], ...]]
    returns: Mapping[str, tuple[str, ...]]
    reads: Mapping[Key, int]
    inputs_used: tuple[str, ...]
    outputs: tuple[tuple[str, Key], ...]

    @classmethod
    def of(cls, plan: ExecutionPlan) -> _Routes:
        nodes = plan.nodes
        return cls(
            plan=plan,
            order=plan.order,
            predecessors={n.name: n.after for n in nodes},
            dependents={n.name: n.before for n in nodes},
            dep_counts={n.name: len(n.after) for n in nodes},
            roots=tuple(n.name for n in nodes if not n.after),
            bindings={n.name: tuple((s.input, s.key) for s in n.inputs) for n in nodes},
            returns={n.name: n.returns for n in nodes},
            reads=plan.reads,
            inputs_used=plan.inputs_used,
            outputs=tuple((o.name, o.key) for o in plan.outputs),
        )


class _Request:
    """The state of one request in flight: live tensors, their remaining consumers, costs."""

    __slots__ = (
        "routes", "values", "remaining", "pending", "copies", "trace", "rows", "inflight", "error", "tg", "branch"
    )

    def __init__(self, routes: _Routes, values: dict[Key, Any], rows: int) -> None:
        self.routes = routes
        self.values = values
        self.remaining = dict(routes.reads)
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


class LocalRuntime:
    """Run a pipeline locally in one of Triton's forms::

        async with LocalRuntime(p, mode="ensemble") as rt:
            out = await rt.infer({"x": x})
        print(rt.report())

    ``device``: ``None`` leaves request tensors where the caller put them;
    ``"cpu"``, ``"gpu"`` or ``"auto"`` (GPU when CuPy and CUDA are present) moves
    them there first, counting the copy. A step's own ``device`` option moves its
    inputs; a step with none takes them where they are.
    ``force_cpu_only_input_tensors=True`` mimics Triton's Python backend, which
    hands every step its inputs on CPU unless the model sets the parameter
    ``FORCE_CPU_ONLY_INPUT_TENSORS`` to ``"no"``; each such copy is counted.
    ``server_copies=True`` copies each tensor where a Triton server moves it
    between processes, so that the report counts the bytes each form moves: each
    Python-backend step runs in a stub process of its own, so a step's inputs
    and outputs cross one process boundary each in an ensemble, and two in BLS,
    where they also pass through the BLS model's stub. Each copy is counted.
    ``offload`` is when sync steps hop to a worker thread (see the module docstring).
    ``bls_instance_count`` is the BLS model's instance count in the two BLS modes, and
    ``fused_instance_count`` the fused model's in ``"fused"``: like Triton, each instance
    runs one ``execute()`` call at a time (see :mod:`pipelines.runtime.bls_gate`).
    ``profile`` is gone: the runtime executes and predicts nothing, and passing one
    raises :class:`~pipelines.errors.ArgumentError` saying what replaced it
    (``p.predict(profile, concurrency=...)``, a simulation of the server).
    ``isolation`` is where a step's instances run: ``"thread"`` (the default) runs them in
    this process, where a debugger and ``print`` reach them; ``"process"`` gives each
    instance a forked process of its own, as Triton gives each Python model instance a
    stub, so that steps side by side do not wait for each other's GIL
    (:mod:`pipelines.runtime.step_process`). A hop to a process costs a few hundred µs a
    call, so it pays for steps that keep a core busy for milliseconds.
    ``keep_freed_memory`` (on by default) gives this process, when the runtime
    opens, the ``malloc`` thresholds the bundled server gives its stubs, so that a
    step's fresh arrays cost what they cost there and the same from run to run
    (see :mod:`pipelines.freed_memory`; process-wide, once; variables the user
    set win).
    A step's ``timeout`` does what its server form does with it (docs/running_locally.md): the
    BLS modes give up waiting for a call past it, which goes on holding its instance (the
    requests queued behind it time out in turn); the fused mode abandons the call for a
    fresh instance; the ensemble mode, like Triton's ensemble, does not time a step out at
    all. ``enforce_timeouts=True`` makes the ensemble mode time steps out as the fused one
    does, for a test that must not hang on a stuck step; it is off by default, since no
    server does it.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        mode: str = "ensemble",
        *,
        device: str | None = None,
        force_cpu_only_input_tensors: bool = False,
        server_copies: bool = False,
        offload: str = "auto",
        threads: int | None = None,
        bls_instance_count: int = 1,
        fused_instance_count: int = 1,
        profile: Any = None,
        keep_freed_memory: bool = True,
        isolation: str | None = "thread",
        enforce_timeouts: bool = False,
    ) -> None:
        if not isinstance(pipeline, Pipeline):
            raise InferenceError(f"LocalRuntime needs a Pipeline; got {type(pipeline).__name__}")
        name = pipeline.name
        self._enforce_timeouts = bool(enforce_timeouts)
        if profile is not None:
            raise ArgumentError(f"pipeline {name!r}: profile= was given, but {NO_REPLAY}", pipeline=name)
        try:
            self.form = form(mode, what="mode")
        except ValueError as exc:
            raise InferenceError(f"pipeline {name!r}: {exc}", pipeline=name) from None
        if offload not in _OFFLOAD:
            raise InferenceError(
                f"pipeline {name!r}: offload must be one of {', '.join(_OFFLOAD)}; got {offload!r}", pipeline=name
            )
        isolation = "thread" if isolation is None else isolation
        if isolation == "auto":
            raise InferenceError(
                f"pipeline {name!r}: isolation='auto' is gone (it moved a busy step into processes to predict "
                "a server, and the runtime no longer predicts); choose isolation='thread' or 'process'",
                pipeline=name,
            )
        if isolation not in ISOLATIONS:
            raise InferenceError(
                f"pipeline {name!r}: isolation must be one of {', '.join(ISOLATIONS)}; got {isolation!r}",
                pipeline=name,
            )
        if isolation == "process" and not isolation_supported():
            raise InferenceError(
                f"pipeline {name!r}: isolation='process' forks a process per step instance and shares memory "
                f"with it through memfd, which needs Linux; this is {sys.platform}. Use isolation='thread'",
                pipeline=name,
            )
        try:
            self.device = resolve_device(device)
        except ValueError as exc:
            raise InferenceError(f"pipeline {name!r}: {exc}", pipeline=name) from None
        pipeline.validate()
        self.pipeline = pipeline
        self.mode = mode
        self.offload = offload
        self.force_cpu_only_input_tensors = bool(force_cpu_only_input_tensors)
        self.keep_freed_memory = bool(keep_freed_memory)
        # Process boundaries a step's tensors cross on a server, each one a copy (see above).
        self._crossings = self.form.server_copies if server_copies else 0
        self.isolation = isolation
        self.plan = plan_of(pipeline)
        if self.form.scheduler == "event" and self.plan.conditional:
            raise NotCompilableError(ensemble_refusal(self.plan, what="the local 'ensemble' mode"), pipeline=name)
        # A conditional plan runs each node on the rows its `when` blocks select (serving.Rows).
        self._branches = Branches(self.plan.to_json()) if self.plan.conditional or self.plan.fills else None
        # Nodes that run inside the top-level model (the fused form's Python steps): no server copy.
        self._in_process = frozenset(
            n for n in self.plan.order if self.form.in_process and not pipeline.nodes[n].step.is_external
        )
        self._routes = {None: _Routes.of(self.plan)}  # by requested outputs (None: all)
        self._bytes_inputs = frozenset(n for n, spec in pipeline.inputs.items() if spec.dtype == "BYTES")
        live = [pipeline.nodes[n] for n in self.plan.order]
        for node in live:
            if not node.step.runnable:
                raise StepError(
                    f"pipeline {name!r} step {node.name!r} is an external model with no Python stand-in; "
                    "give external_model(..., stand_in=fn) to run it in the local runtime, or run it on Triton",
                    pipeline=name,
                    step=node.name,
                )
            wants = node.step.options.device
            if (wants == "gpu" or self.device == "gpu") and not gpu_available():
                who = f"step {node.name!r} asks" if wants == "gpu" else "the runtime was asked"
                raise InferenceError(
                    f"pipeline {name!r}: {who} for device 'gpu' but CuPy with a CUDA device is not available; "
                    "install cupy-cuda12x on a machine with a GPU, or use device 'cpu'",
                    pipeline=name,
                    step=node.name if wants == "gpu" else None,
                )
        instances = sum(n.step.options.instance_count for n in live)
        self._threads = max(2, threads if threads is not None else instances)
        self._models: dict[str, StepModel] = {}
        self._recorder = CostRecorder(
            pipeline=name,
            mode=mode,
            steps=self.plan.order,
            critical_path=self.plan.critical_path,
        )
        self._service: Any = None
        self._executor: StepThreads | None = None
        self._open = False
        self._active = 0
        self._schedule = {
            "event": self._run_ensemble, "concurrent": self._run_bls, "sequential": self._run_bls_sync
        }[self.form.scheduler]
        for option, count in (("bls_instance_count", bls_instance_count), ("fused_instance_count", fused_instance_count)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InferenceError(f"pipeline {name!r}: {option} must be an int >= 1; got {count!r}", pipeline=name)
        self._fused_instances = fused_instance_count
        self._bls_gate = None
        if self.form.one_execute_per_instance:
            self._bls_gate = BlsGate(
                instances=fused_instance_count if self.form.in_process else bls_instance_count,
                concurrent=self.form.scheduler == "concurrent",
                max_rows=pipeline.max_batch_size or 1,
            )
        # One BLS instance: no step of another request can start before this round ends. With more,
        # a step run inline would keep the other instances from starting their rounds beside it.
        self._one_round = self._bls_gate if self._bls_gate is not None and self._bls_gate.instances == 1 else None

    def _isolation_of(self, node: Any) -> str:
        """Where ``node``'s instances run: the runtime's ``isolation``, or ``"thread"`` where
        a process cannot stand for the server's: a fused model's Python steps, which share the
        fused model's one process on the server too; a step on a GPU, since CUDA cannot be used
        in a forked process; an ``async def`` step, which runs on the event loop.
        """
        if self.isolation == "thread" or node.name in self._in_process:
            return "thread"
        wants = node.step.options.device
        on_cpu = wants == "cpu" or (wants is None and self.device != "gpu")
        return self.isolation if on_cpu and not is_async_impl(node.step.impl) else "thread"

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> LocalRuntime:
        if self._open:
            raise InferenceError(
                f"pipeline {self.pipeline.name!r}: this LocalRuntime is already open", pipeline=self.pipeline.name
            )
        if self.keep_freed_memory:
            keep_freed_memory_here()
        self._executor = StepThreads(self._threads)
        routes = self._routes[None]
        owners: dict[int, StepModel] = {}  # one step model per step, shared by its nodes
        try:
            for name in routes.order:
                node = self.pipeline.nodes[name]
                if node.is_select:  # merged by the scheduler itself
                    continue
                model = StepModel(
                    node,
                    pipeline=self.pipeline.name,
                    bindings=routes.bindings[name],
                    kept_outputs=routes.returns[name],
                    placement=Placement(node.step.options.device, self.force_cpu_only_input_tensors),
                    offload=self.offload,
                    threads=self._executor,
                    in_model=self._fused_instances if name in self._in_process else None,
                    timeout_covers_queue=self.form.one_execute_per_instance and name not in self._in_process,
                    isolation=self._isolation_of(node),
                    timeout_enforced=self.form.name != "ensemble" or self._enforce_timeouts,
                )
                owner = owners.get(id(node.step))
                if owner is None:
                    # initialize() may load weights for seconds: keep the event loop free meanwhile
                    await anyio.to_thread.run_sync(model.start)
                    owners[id(node.step)] = model
                else:
                    model.share(owner)
                self._models[name] = model
            if self.offload == "auto":
                hop = await thread_hop_cost()
                for model in self._models.values():
                    model.hop_cost = hop
            self._service = anyio.create_task_group()
            await self._service.__aenter__()
            for model in self._models.values():
                if model.batcher is not None and not model.shared:
                    self._service.start_soon(model.batcher.serve, model.instance_count)
            if self._bls_gate is not None:
                self._service.start_soon(self._bls_gate.serve)
        except BaseException:
            self._close_models()
            raise
        self._open = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        try:
            if self._service is not None:
                self._service.cancel_scope.cancel()
                await self._service.__aexit__(None, None, None)
        finally:
            self._service = None
            errors = self._close_models()
        if errors and exc is None:
            first = errors[0]
            raise StepError(
                f"pipeline {self.pipeline.name!r}: finalize() raised {type(first).__name__}: {first}",
                pipeline=self.pipeline.name,
            ) from first

    def _close_models(self) -> list[BaseException]:
        errors: list[BaseException] = []
        for model in self._models.values():
            errors.extend(model.close())
        self._models = {}
        if self._executor is not None:
            # An abandoned (timed-out) call may still run: do not wait for it.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        return errors

    # ------------------------------------------------------------------ serving

    async def infer(self, inputs: Mapping[str, Any], outputs: Iterable[str] | None = None) -> dict[str, Any]:
        """Answer one request: a dict of the pipeline's outputs (``outputs``: only these, as tritonclient asks).

        Only the nodes the requested outputs need run, as in Triton, except in the
        ensemble mode of a pipeline whose ensemble compiles gated (steps that can run side
        by side), where every live node runs for every request, as on the server;
        ``None`` or an empty list asks for every output, as in Triton. Raises :class:`InputError`
        before any step runs when the request does not match the pipeline's inputs
        or names an output the pipeline does not have, and :class:`StepError`
        naming the step that failed.
        """
        answer, _ = await self._infer(inputs, outputs, keep_trace=False)
        return answer

    async def infer_with_report(
        self, inputs: Mapping[str, Any], outputs: Iterable[str] | None = None
    ) -> tuple[dict[str, Any], Report]:
        """Like :meth:`infer`, plus the cost report of this one request."""
        answer, report = await self._infer(inputs, outputs, keep_trace=True)
        assert report is not None
        return answer, report

    def _routes_for(self, outputs: Iterable[str] | None) -> _Routes:
        if outputs is None:
            return self._routes[None]
        names = [outputs] if isinstance(outputs, str) else list(outputs)
        if not names:  # as in Triton: naming no output asks for every output
            return self._routes[None]
        key = frozenset(names)
        routes = self._routes.get(key)
        if routes is None:
            try:
                plan = self.plan.for_outputs(names)
            except ValueError as exc:
                unknown = next((n for n in names if n not in self.plan.output_names), None)
                raise InputError(str(exc), pipeline=self.pipeline.name, tensor=unknown) from None
            if self._runs_every_step:
                every = self._routes[None]
                routes = dataclasses.replace(every, outputs=tuple(o for o in every.outputs if o[0] in key))
            else:
                routes = _Routes.of(plan)
            self._routes[key] = routes
        return routes

    @functools.cached_property
    def _runs_every_step(self) -> bool:
        """Whether a request for some outputs still runs every live step, as the server does in
        a gated ensemble: each step's failure travels to the gate, which every output passes
        through, so Triton prunes none of them (docs/triton_requested_outputs.md)."""
        if self.mode != "ensemble":
            return False
        external = [n.name for n in self.plan.nodes if self.pipeline.nodes[n.name].step.is_external]
        return gated_ensemble(self.plan, external)

    def report(self) -> Report:
        """Costs aggregated over every request served since the start (or :meth:`reset_report`)."""
        report = self._recorder.report()
        isolated = tuple(name for name, model in self._models.items() if model.isolated)
        return dataclasses.replace(report, in_processes=isolated) if isolated else report

    def reset_report(self) -> None:
        """Forget the costs gathered so far (e.g. after a warm-up)."""
        self._recorder.reset()

    async def _infer(
        self, inputs: Mapping[str, Any], wanted: Iterable[str] | None, *, keep_trace: bool
    ) -> tuple[dict[str, Any], Report | None]:
        p = self.pipeline
        if not self._open:
            raise InferenceError(
                f"pipeline {p.name!r}: the runtime is not open; use 'async with LocalRuntime(p) as rt:'",
                pipeline=p.name,
            )
        start = perf_counter()
        self._active += 1
        try:
            try:
                routes = self._routes_for(wanted)
                arrays = check_request(inputs, p.inputs, pipeline=p.name, max_batch_size=p.max_batch_size)
            except InputError:
                self._recorder.error()
                raise
            rows = int(arrays[next(iter(arrays))].shape[0]) if p.max_batch_size > 0 else 1
            req = _Request(routes, {}, rows)
            if self._branches is not None:
                req.branch = Rows(self._branches, rows, req.values.__getitem__)
            entry = Placement(self.device)
            for name in routes.inputs_used:
                array = arrays[name]
                if name in self._bytes_inputs:  # as the client serialises it: str items become UTF-8 bytes
                    array = bytes_tensor(array)
                req.values[(None, name)] = entry.place(array, req.copies, pipeline=p.name, step="(request)", tensor=name)
            del arrays
            # Let requests submitted together all register before the first step decides to run inline.
            await anyio.lowlevel.checkpoint()
            try:
                if self._bls_gate is None:
                    await self._schedule(req)
                else:
                    async with self._bls_gate.slot(req.rows if p.max_batch_size > 0 else 1):
                        await self._schedule(req)
            except PipelinesError:
                self._recorder.error()
                raise
            values = req.values
            if req.branch is None:
                outputs = {name: _answered(values[key]) for name, key in routes.outputs}
            else:
                branch, branches = req.branch, self._branches
                outputs = {
                    name: _answered(branch.filled(values[key], branches.terms_of(key), branches.fills[name]))
                    for name, key in routes.outputs
                }
            end = perf_counter()
            self._recorder.record(req.trace, start=start, end=end, copies=req.copies.count, copy_bytes=req.copies.bytes)
            if not keep_trace:
                return outputs, None
            single = CostRecorder(
                pipeline=p.name,
                mode=self.mode,
                steps=routes.order,
                critical_path=routes.plan.critical_path,
            )
            single.record(req.trace, start=start, end=end, copies=req.copies.count, copy_bytes=req.copies.bytes)
            return outputs, single.report()
        finally:
            self._active -= 1

    # --------------------------------------------------------------- scheduling

    async def _run_node(self, req: _Request, name: str, t_ready: float) -> None:
        """Run one node for one request: take its inputs, execute, keep the outputs someone needs."""
        branch, rows = req.branch, req.rows
        if branch is not None:
            rows = self._branch_rows(req, name, t_ready)
            if not rows:
                return
        model = self._models[name]
        values, remaining = req.values, req.remaining
        inputs = {}
        crossings = self._crossings if name not in self._in_process else 0
        for input_name, key in req.routes.bindings[name]:
            value = values[key]
            if branch is not None:  # the rows of this node's `when` blocks only
                value = branch.gather(value, self._branches.terms_of(key), self._branches.when[name])
            inputs[input_name] = model.place(value, req.copies, input_name)
            if crossings:
                inputs[input_name] = _cross(inputs[input_name], crossings, req.copies)
            left = remaining[key] - 1
            remaining[key] = left
            if not left:  # no remaining consumer: drop our reference now (the step holds its own)
                del values[key]
        if branch is not None:
            self._release(req, self._branches.conditions[name])
        alone = (self._active if self._one_round is None else self._one_round.admitted) == 1
        inline = model.always_inline or (model.inline_ok and (model.cheap or (alone and req.inflight == 1)))
        outputs, queue, compute, batch = await model.run(inputs, rows, inline=inline)
        del inputs
        crosses = name not in self._in_process
        for out in req.routes.returns[name]:
            value = outputs[out]
            if crosses and value.dtype.kind in "OSU":  # serialised by Triton as the next model reads it
                value = bytes_tensor(value)
            values[(name, out)] = _cross(value, crossings, req.copies) if crossings else value
        req.trace.append((name, queue, compute, perf_counter() - t_ready - queue - compute, batch))

    def _branch_rows(self, req: _Request, name: str, t_ready: float) -> int:
        """How many rows ``name`` runs on; 0 once it is done here: a select merged, or no row to run."""
        branch, branches = req.branch, self._branches
        assert branch is not None and branches is not None
        branch.read_conditions(name)
        rows = branch.count(branches.when[name])
        if rows and name not in branches.selects:
            return rows
        values = req.values
        reads = [key for _, key in req.routes.bindings[name]]
        if rows:  # a select: merged here, as the BLS and fused models merge it, with no model
            start = perf_counter()
            bound = dict(req.routes.bindings[name])
            sources = {
                "condition": (bound["condition"], branches.terms_of(bound["condition"])),
                **{side: (values[bound[side]], branches.terms_of(bound[side])) for side in ("then", "otherwise")},
            }
            merged = branch.merge(name, sources)
            self._release(req, reads + branches.conditions[name])
            values[(name, "output")] = merged
            compute = perf_counter() - start
            req.trace.append((name, 0.0, compute, start - t_ready, 1))
        else:  # no row holds its conditions: the step is not called at all
            self._release(req, reads + branches.conditions[name])
            for out in req.routes.returns[name]:
                values[(name, out)] = SKIPPED
        return 0

    @staticmethod
    def _release(req: _Request, keys: Iterable[Key]) -> None:
        values, remaining = req.values, req.remaining
        for key in keys:
            left = remaining[key] - 1
            remaining[key] = left
            if not left:
                del values[key]

    async def _run_ensemble(self, req: _Request) -> None:
        routes = req.routes
        req.pending = dict(routes.dep_counts)
        roots = routes.roots
        req.inflight = len(roots)
        now = perf_counter()
        async with anyio.create_task_group() as tg:
            req.tg = tg
            for root in roots[1:]:
                tg.start_soon(self._ensemble_chain, req, root, now)
            await self._ensemble_chain(req, roots[0], now)
        if req.error is not None:
            raise req.error

    async def _ensemble_chain(self, req: _Request, name: str, t_ready: float) -> None:
        """Run a node, then start each dependent it made ready; continue with one of them in this task."""
        dependents = req.routes.dependents
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

    async def _run_bls(self, req: _Request) -> None:
        sorter = graphlib.TopologicalSorter(req.routes.predecessors)
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

    async def _bls_call(self, req: _Request, name: str, t_ready: float, send: Any) -> None:
        try:
            await self._run_node(req, name, t_ready)
        except Exception as exc:
            req.fail(exc)
            return
        req.inflight -= 1
        send.send_nowait(name)

    async def _run_bls_sync(self, req: _Request) -> None:
        req.inflight = 1
        for name in req.routes.order:
            await self._run_node(req, name, perf_counter())


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


# ---------------------------------------------------------------------- blocking helpers


def run_pipeline(
    pipeline: Pipeline,
    inputs: Mapping[str, Any],
    *,
    mode: str = "ensemble",
    outputs: Iterable[str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run one request in a fresh :class:`LocalRuntime` and return its outputs (blocking).

    ``outputs``: answer only these (only the steps they need run). Inside a
    running event loop (Jupyter), it runs on a worker thread with its own loop.
    """

    runtime = LocalRuntime(pipeline, mode, **options)  # here, so a warning points at the caller

    async def main() -> dict[str, Any]:
        async with runtime as rt:
            return await rt.infer(inputs, outputs)

    return run_blocking(main)


def run_many(
    pipeline: Pipeline,
    requests: Iterable[Mapping[str, Any]],
    *,
    mode: str = "ensemble",
    concurrency: int = 8,
    return_exceptions: bool = False,
    outputs: Iterable[str] | None = None,
    **options: Any,
) -> tuple[list[Any], Report]:
    """Answer many requests, ``concurrency`` at a time, in one runtime (blocking).

    Returns the outputs in request order and the aggregated report. With
    ``return_exceptions=True`` a failed request's slot holds its error instead of raising.
    ``outputs``: every request asks for only these.
    """
    wanted = None if outputs is None else ([outputs] if isinstance(outputs, str) else list(outputs))
    requests = list(requests)
    if concurrency < 1:
        raise InferenceError(
            f"pipeline {pipeline.name!r}: concurrency must be >= 1; got {concurrency}", pipeline=pipeline.name
        )

    runtime = LocalRuntime(pipeline, mode, **options)  # here, so a warning points at the caller

    async def main() -> tuple[list[Any], Report]:
        results: list[Any] = [None] * len(requests)
        errors: list[BaseException] = []
        async with runtime as rt:
            limit = anyio.Semaphore(concurrency)

            async def one(i: int) -> None:
                async with limit:
                    try:
                        results[i] = await rt.infer(requests[i], wanted)
                    except PipelinesError as exc:
                        results[i] = exc
                        errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            report = rt.report()
        if errors and not return_exceptions:
            raise errors[0]
        return results, report

    return run_blocking(main)
