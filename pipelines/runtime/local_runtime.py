"""The local runtime: run a pipeline's execution plan without a server, as Triton would.

There is one mode per form of :data:`pipelines.forms.FORMS`; all give the same
answers and run the same plan (:mod:`pipelines.core.plan`: live nodes only, pruned to
the requested outputs by ``serving.Schedule``, as the server's executors prune it).
They differ in the form's scheduler (:mod:`pipelines.runtime.scheduler`):

- ``"event"`` (``"ensemble"``): like Triton's ensemble scheduler. Each finished
  step counts down its dependents' counts of the steps they wait for and starts the
  ones that became ready; no orchestrator sits in the middle.
- ``"concurrent"`` (``"bls"``, ``"fused"``): one orchestrator per request walks a
  ``graphlib.TopologicalSorter`` and awaits the ready steps concurrently (an
  ``async def execute`` Python model). In ``"fused"`` the Python steps run inside
  that one model, so they cross no process (no server copy at their boundaries);
  external steps are still called through BLS.
- ``"sequential"`` (``"bls-sync"``): one orchestrator calls the steps one after
  another in topological order (a BLS model using ``exec()``).

In every mode each composing model of the plan is one step model with
``instance_count`` instances, a FIFO queue and optional dynamic batching: one per
node, except that the nodes of a step declared ``share_model=True`` (an external
model's, by default) share one, as they share one composing model when compiled. Parallel work
runs in anyio task groups: a failing step cancels its siblings and the error
names the pipeline and the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from time import perf_counter
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from ..core.graph import Graph
from ..core.plan import critical_path, ensemble_refusal, gated_ensemble
from ..core.planning import plan_of
from ..core.requests import check_request
from ..errors import InferenceError, InputError, NotCompilableError, PipelinesError, StepError
from ..forms import form_names
from ..freed_memory import keep_freed_memory_here
from ..serving import Branches, Schedule, bytes_tensor
from .bls_gate import BlsGate
from .device import Placement
from .instances import StepModel, thread_hop_cost
from .options import NO_REPLAY as NO_REPLAY  # re-exported: it was defined here
from .options import check_instance_counts, check_steps, checked_options
from .report import CostRecorder, Report
from .scheduler import Scheduler
from .step_process import is_async_impl
from .streams import StreamLayout, StreamRun, layout_of
from .workers import StepThreads

__all__ = ["MODES", "LocalRuntime"]

#: The local runtime's modes: one per form of the table in :mod:`pipelines.forms`.
MODES = form_names()


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
    ``offload`` is when sync steps hop to a worker thread (see :mod:`pipelines.runtime.scheduler`).
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
        pipeline: Graph,
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
        if not isinstance(pipeline, Graph):
            raise InferenceError(f"LocalRuntime needs a Pipeline; got {type(pipeline).__name__}")
        name = pipeline.name
        self._enforce_timeouts = bool(enforce_timeouts)
        self.form, self.isolation, self.device = checked_options(
            name, mode=mode, profile=profile, offload=offload, isolation=isolation, device=device
        )
        pipeline.validate()
        self.pipeline = pipeline
        self.mode = mode
        self.offload = offload
        self.force_cpu_only_input_tensors = bool(force_cpu_only_input_tensors)
        self.keep_freed_memory = bool(keep_freed_memory)
        self.plan = plan_of(pipeline)
        if self.form.scheduler == "event" and self.plan.conditional:
            raise NotCompilableError(ensemble_refusal(self.plan, what="the local 'ensemble' mode"), pipeline=name)
        # Nodes that run inside the top-level model (the fused form's Python steps): no server copy.
        self._in_process = frozenset(
            n for n in self.plan.order if self.form.in_process and not pipeline.nodes[n].step.is_external
        )
        # The plan as the server's executors read it: serving.Schedule cuts it to a request's outputs.
        self._plan_data = self.plan.to_json()
        self._schedules: dict[frozenset[str] | None, Schedule] = {None: Schedule(self._plan_data, self.plan.output_names)}  # None: every output
        self._layouts: dict[int, StreamLayout] = {}  # a streaming pipeline's, by schedule
        self._bytes_inputs = frozenset(n for n, spec in pipeline.inputs.items() if spec.dtype == "BYTES")
        check_steps(pipeline, self.plan, self.device)
        instances = sum(pipeline.nodes[n].step.options.instance_count for n in self.plan.order)
        self._threads = max(2, threads if threads is not None else instances)
        self._recorder = CostRecorder(
            pipeline=name,
            mode=mode,
            steps=self.plan.order,
            critical_path=self.plan.critical_path,
        )
        self._service: Any = None
        self._executor: StepThreads | None = None
        self._open = False
        check_instance_counts(name, bls_instance_count=bls_instance_count, fused_instance_count=fused_instance_count)
        self._fused_instances = fused_instance_count
        self._bls_gate = None
        if self.form.one_execute_per_instance:
            self._bls_gate = BlsGate(
                instances=fused_instance_count if self.form.in_process else bls_instance_count,
                concurrent=self.form.scheduler == "concurrent",
                max_rows=pipeline.max_batch_size or 1,
            )
        self._scheduler = Scheduler(
            self.plan,
            self.form.scheduler,
            # A conditional plan runs each node on the rows its `when` blocks select (serving.Rows).
            branches=Branches(self._plan_data) if self.plan.conditional or self.plan.fills else None,
            # Process boundaries a step's tensors cross on a server, each one a copy (see above).
            crossings=self.form.server_copies if server_copies else 0,
            in_process=self._in_process,
            # One BLS instance: no step of another request can start before this round ends. With more,
            # a step run inline would keep the other instances from starting their rounds beside it.
            one_round=self._bls_gate if self._bls_gate is not None and self._bls_gate.instances == 1 else None,
        )

    @property
    def _models(self) -> dict[str, StepModel]:
        """The open step models, by node: the scheduler calls them."""
        return self._scheduler.models

    def _isolation_of(self, node: Any) -> str:
        """Where ``node``'s instances run: the runtime's ``isolation``, or ``"thread"`` where
        a process cannot stand for the server's: a fused model's Python steps, which share the
        fused model's one process on the server too; a step on a GPU, since CUDA cannot be used
        in a forked process; an ``async def`` step, which runs on the event loop.
        """
        if self.isolation == "thread" or node.name in self._in_process:
            return "thread"
        if node.step.streaming or node.step.whole_stream:  # a generator cannot be handed across a fork
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
        every = self._schedules[None]
        models = self._models
        owners: dict[str, StepModel] = {}  # one step model per composing model of the plan
        try:
            for name in every.order:
                node = self.pipeline.nodes[name]
                if node.is_select:  # merged by the scheduler itself
                    continue
                model = StepModel(
                    node,
                    pipeline=self.pipeline.name,
                    bindings=self._scheduler.bindings[name],
                    kept_outputs=tuple(every.returns[name]),
                    placement=Placement(node.step.options.device, self.force_cpu_only_input_tensors),
                    offload=self.offload,
                    threads=self._executor,
                    in_model=self._fused_instances if name in self._in_process else None,
                    timeout_covers_queue=self.form.one_execute_per_instance and name not in self._in_process,
                    isolation=self._isolation_of(node),
                    timeout_enforced=self.form.name != "ensemble" or self._enforce_timeouts,
                )
                owner = owners.get(self.plan.node(name).model)
                if owner is None:
                    # initialize() may load weights for seconds: keep the event loop free meanwhile
                    await anyio.to_thread.run_sync(model.start)
                    owners[self.plan.node(name).model] = model
                else:
                    model.share(owner)
                models[name] = model
            if self.offload == "auto":
                hop = await thread_hop_cost()
                for model in models.values():
                    model.hop_cost = hop
            self._service = anyio.create_task_group()
            await self._service.__aenter__()
            for model in models.values():
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
        self._scheduler.models = {}
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
        if self.pipeline.streaming:
            raise InferenceError(
                f"pipeline {self.pipeline.name!r} streams (it answers a request many times), and infer() "
                "answers once; take its responses with rt.stream(inputs, deliver), which calls deliver(response) "
                "for each, or with p.stream (as they come) or p.run (a list)",
                pipeline=self.pipeline.name,
            )
        answer, _ = await self._infer(inputs, outputs, keep_trace=False)
        return answer

    async def stream(
        self,
        inputs: Mapping[str, Any],
        deliver: Callable[[dict[str, Any]], None],
        outputs: Iterable[str] | None = None,
    ) -> None:
        """Answer one request of a streaming pipeline: ``deliver(response)`` for each response as it
        comes (a dict of the outputs, as :meth:`infer` answers), in this mode's order
        (:mod:`pipelines.runtime.streams`). A failure is raised after the responses before it were
        delivered; cancelling the call stops the generators. A pipeline that does not stream is
        answered once."""
        await self._infer(inputs, outputs, keep_trace=False, deliver=deliver)

    async def infer_with_report(
        self, inputs: Mapping[str, Any], outputs: Iterable[str] | None = None
    ) -> tuple[dict[str, Any], Report]:
        """Like :meth:`infer`, plus the cost report of this one request."""
        answer, report = await self._infer(inputs, outputs, keep_trace=True)
        assert report is not None
        return answer, report

    def _schedule_for(self, outputs: Iterable[str] | None) -> Schedule:
        if outputs is None:
            return self._schedules[None]
        names = [outputs] if isinstance(outputs, str) else list(outputs)
        if not names:  # as in Triton: naming no output asks for every output
            return self._schedules[None]
        key = frozenset(names)
        schedule = self._schedules.get(key)
        if schedule is None:
            try:
                self.plan.for_outputs(names)  # says which output the pipeline does not have
            except ValueError as exc:
                unknown = next((n for n in names if n not in self.plan.output_names), None)
                raise InputError(str(exc), pipeline=self.pipeline.name, tensor=unknown) from None
            schedule = Schedule(self._plan_data, key, every_node=self._runs_every_step)
            self._schedules[key] = schedule
        return schedule

    @functools.cached_property
    def _runs_every_step(self) -> bool:
        """Whether a request for some outputs still runs every live step, as the server does in
        a gated ensemble: each step's failure travels to the gate, which every output passes
        through, so Triton prunes none of them (docs/triton_requested_outputs.md)."""
        if self.mode != "ensemble":
            return False
        external = [n.name for n in self.plan.nodes if self.pipeline.nodes[n.name].step.is_external]
        return gated_ensemble(self.plan, external, streams=self.pipeline.streaming)

    def report(self) -> Report:
        """Costs aggregated over every request served since the start (or :meth:`reset_report`)."""
        report = self._recorder.report()
        isolated = tuple(name for name, model in self._models.items() if model.isolated)
        return dataclasses.replace(report, in_processes=isolated) if isolated else report

    def reset_report(self) -> None:
        """Forget the costs gathered so far (e.g. after a warm-up)."""
        self._recorder.reset()

    async def _infer(
        self,
        inputs: Mapping[str, Any],
        wanted: Iterable[str] | None,
        *,
        keep_trace: bool,
        deliver: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Any], Report | None]:
        p = self.pipeline
        if not self._open:
            raise InferenceError(
                f"pipeline {p.name!r}: the runtime is not open; use 'async with LocalRuntime(p) as rt:'",
                pipeline=p.name,
            )
        start = perf_counter()
        scheduler = self._scheduler
        scheduler.active += 1
        try:
            try:
                schedule = self._schedule_for(wanted)
                arrays = check_request(inputs, p.inputs, pipeline=p.name, max_batch_size=p.max_batch_size)
            except InputError:
                self._recorder.error()
                raise
            rows = int(arrays[next(iter(arrays))].shape[0]) if p.max_batch_size > 0 else 1
            req = scheduler.request(schedule, rows)
            entry = Placement(self.device)
            for name in schedule.inputs:
                array = arrays[name]
                if name in self._bytes_inputs:  # as the client serialises it: str items become UTF-8 bytes
                    array = bytes_tensor(array)
                req.values[(None, name)] = entry.place(array, req.copies, pipeline=p.name, step="(request)", tensor=name)
            del arrays
            # Let requests submitted together all register before the first step decides to run inline.
            await anyio.lowlevel.checkpoint()
            streams = deliver is not None and p.streaming
            run = self._stream_run(schedule, deliver).run if streams and deliver is not None else scheduler.run
            try:
                if self._bls_gate is None:
                    await run(req)
                else:
                    async with self._bls_gate.slot(req.rows if p.max_batch_size > 0 else 1):
                        await run(req)
            except PipelinesError:
                self._recorder.error()
                raise
            outputs = {} if streams else scheduler.answer(req)
            if deliver is not None and not streams:  # a pipeline that does not stream answers once
                deliver(outputs)
            end = perf_counter()
            self._recorder.record(req.trace, start=start, end=end, copies=req.copies.count, copy_bytes=req.copies.bytes)
            if not keep_trace:
                return outputs, None
            single = CostRecorder(
                pipeline=p.name,
                mode=self.mode,
                steps=schedule.order,
                critical_path=functools.partial(critical_path, schedule.order, schedule.after.__getitem__),
            )
            single.record(req.trace, start=start, end=end, copies=req.copies.count, copy_bytes=req.copies.bytes)
            return outputs, single.report()
        finally:
            scheduler.active -= 1

    def _stream_run(self, schedule: Schedule, deliver: Callable[[dict[str, Any]], None]) -> StreamRun:
        layout = self._layouts.get(id(schedule))
        if layout is None:
            layout = self._layouts[id(schedule)] = layout_of(self.pipeline, schedule)
        return StreamRun(pipeline=self.pipeline, scheduler=self._scheduler, layout=layout, mode=self.mode, deliver=deliver)
