"""One step model of the local runtime: its instances, their queue, and one execution.

Each node of a pipeline becomes a :class:`StepModel`, as each composing model of
an ensemble has its own ``instance_group`` and queue in Triton. An execution runs
inline on the event loop, on a worker thread, or awaited (async steps).

A step's timeout does what its server form does with it. Where the server calls the step
through a BLS call (the BLS forms, and an external model in the fused form), it bounds the
wait for an instance and the execution together, since Triton drops a BLS request queued
past its ``timeout``; a call past it keeps its instance (``Lease.held``) until it returns,
as the step model runs the call its BLS model gave up on to its end. A fused model's Python
steps bound the execution alone: a stuck call is abandoned and keeps its instance, which is
then no longer trusted (it may hold a lock or half-written state), and a fresh instance
takes its place at once (``initialize()`` runs again, on a thread of its own), so later
requests are served; the stuck instance is finalized if its call ever returns. An
ensemble's steps are not timed out at all, as Triton's ensemble times none out, unless
the runtime is asked to (``enforce_timeouts``; then as in the fused form). Worker threads
are daemon threads (:mod:`pipelines.runtime.workers`), so a stuck call never keeps the
process from exiting.

With ``isolation="process"`` each instance runs in a forked process of its own
(:mod:`pipelines.runtime.step_process`), which a worker thread waits for.

The instances and their queue are :mod:`pipelines.runtime.instance_pool`; the hand-over
of one execution to a worker thread, :mod:`pipelines.runtime.thread_calls`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from time import perf_counter
from typing import Any

import anyio

from .. import serving
from ..core.graph import Node
from ..core.step import DynamicBatching, check_outputs, instance_config
from ..errors import PipelinesError, StepError, StepTimeoutError
from .batching import DynamicBatcher
from .device import CopyCounter, Placement
from .instance_pool import InstancePool, Lease
from .step_process import ProcessInstance
from .thread_calls import ThreadCall, running_asyncio_loop, thread_hop_cost, wait_for_future
from .workers import StepThreads

# InstancePool, Lease and thread_hop_cost are re-exported for their importer (local).
__all__ = ["InstancePool", "Lease", "StepModel", "thread_hop_cost"]


#: How many executions are timed before a step may be judged cheap enough to run inline.
_SAMPLES = 3


class StepModel:
    """A node as a Triton model: ``instance_count`` instances, a queue, optional dynamic batching."""

    def __init__(
        self,
        node: Node,
        *,
        pipeline: str,
        bindings: tuple[tuple[str, tuple[str | None, str]], ...],
        kept_outputs: tuple[str, ...],
        placement: Placement,
        offload: str,
        threads: StepThreads,
        in_model: int | None = None,
        timeout_covers_queue: bool = False,
        isolation: str = "thread",
        timeout_enforced: bool = True,
    ) -> None:
        step = node.step
        # Inside a fused model (``in_model`` = its instance count) a step has one instance per
        # fused instance and no batcher of its own: the fused model runs the requests of one
        # execute() through it as one batch, which a batcher without delay stands in for.
        self.instance_count = in_model if in_model is not None else step.options.instance_count
        # A stream holds its instance to its end (pipelines.runtime.streams): it is never batched.
        streams = step.streaming or step.whole_stream
        self.dynamic_batching = DynamicBatching() if in_model is not None and not streams else step.options.dynamic_batching
        self.name = node.name
        self.step = step
        self.pipeline = pipeline
        self.bindings = bindings
        self.kept_outputs = kept_outputs
        self.placement = placement
        self.batched = node.max_batch_size > 0
        self.max_batch_size = node.max_batch_size
        # An ensemble cannot time a step out on the server: its local mode does not either,
        # unless asked to (LocalRuntime(enforce_timeouts=True)).
        self.timeout = step.options.timeout if timeout_enforced else None
        self.timeout_covers_queue = timeout_covers_queue  # called through BLS on the server (see above)
        # Called through BLS, a call past its timeout goes on holding its instance, as the step
        # model on the server runs it to its end; the requests queued behind it time out in turn.
        self.keep_stuck = timeout_covers_queue
        self.offload = offload
        # Each instance in a process of its own, as a Triton stub (pipelines.runtime.step_process).
        self.isolated = isolation == "process"
        self._threads = threads
        self.pool: InstancePool | None = None
        self.batcher: DynamicBatcher | None = None
        self.is_async = False
        self.shared = False
        # Inline runs cannot be timed out or overlapped, so only plain sync steps without a timeout qualify.
        self.inline_ok = False
        self.always_inline = False
        # A step whose typical compute is below one thread hop gains nothing from the hop.
        self.hop_cost = 0.0
        self.cheap = False
        self._typical = 0.0
        self._timed = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Create the instances (each runs ``initialize(config)`` once) and the batcher."""
        count = self.instance_count
        leases = []
        try:
            for i in range(count):
                leases.append(self._instantiate(i))
        except PipelinesError:
            self._finalize(leases)
            raise
        except Exception as exc:
            self._finalize(leases)
            raise self._raised(exc, "initialize()") from exc
        self.pool = InstancePool(leases, renew=self._instantiate, pipeline=self.pipeline, step=self.name)
        self.is_async = leases[0].instance.is_async
        # A process's instance is waited for in a worker thread: inline, it would block the event loop.
        # A step that declares a timeout may hang: never on the event loop, enforced or not.
        self.inline_ok = (not self.is_async and self.step.options.timeout is None and self.offload != "always"
                          and not self.isolated)
        self.always_inline = self.inline_ok and self.offload == "never"
        db = self.dynamic_batching
        if db is not None and self.batched:
            self.batcher = DynamicBatcher(
                step=self.name,
                pool=self.pool,
                execute=self._execute_batch,
                max_batch_size=self.max_batch_size,
                max_queue_delay_s=db.max_queue_delay_us / 1e6,
                preferred_batch_sizes=db.preferred_batch_sizes,
                rerun_stuck=not self.timeout_covers_queue,
            )

    def _instantiate(self, index: int) -> Lease:
        if self.isolated:
            instance = ProcessInstance(self.step, self._config(index), pipeline=self.pipeline, node=self.name)
            return Lease(instance, index, isolated=True)
        return Lease(self.step.instantiate(self._config(index)), index)

    def share(self, owner: StepModel) -> None:
        """Serve this node with ``owner``'s instances and batcher.

        Nodes of one step share one step model, as they share one composing model
        in a compiled repository: the same instances, queue and dynamic batcher.
        """
        self.pool = owner.pool
        self.batcher = owner.batcher
        self.is_async = owner.is_async
        self.isolated = owner.isolated
        self.inline_ok = owner.inline_ok
        self.always_inline = owner.always_inline
        self.shared = True

    def close(self) -> list[BaseException]:
        if self.shared:  # the owner finalizes the instances
            return []
        return self.pool.close() if self.pool is not None else []

    def _finalize(self, leases: list[Lease]) -> None:
        for lease in leases:
            try:
                lease.instance.finalize()
            except Exception:  # the initialize error is the one worth reporting
                pass

    def _config(self, index: int) -> dict[str, Any]:
        # The same keys the step adapter gives initialize() on a Triton server.
        return instance_config(
            self.step,
            pipeline=self.pipeline,
            node=self.name,
            model_name=self.name,
            instance_index=index,
            device=self.placement.device,
            max_batch_size=self.max_batch_size,
        )

    # ------------------------------------------------------------------ running

    def place(self, array: Any, copies: CopyCounter, tensor: str) -> Any:
        return self.placement.place(array, copies, pipeline=self.pipeline, step=self.name, tensor=tensor)

    async def run(self, inputs: dict[str, Any], rows: int, *, inline: bool) -> tuple[dict[str, Any], float, float, int]:
        """Execute once for one request: ``(outputs, queue_wait_s, compute_s, requests_in_batch)``.

        The step's timeout bounds the execution, and the wait for an instance too where
        ``timeout_covers_queue``; a stuck execution's instance is replaced at its timeout,
        so the requests queued behind it do not hang either way.
        """
        # One bound over the wait and the run, or a bound on the run alone.
        queue_timeout, run_timeout = (self.timeout, None) if self.timeout_covers_queue else (None, self.timeout)
        if self.batcher is not None:
            # A batch's own run is bounded by _execute_batch.
            try:
                if queue_timeout is None:
                    return await self.batcher.submit(inputs, rows)
                try:
                    with anyio.fail_after(queue_timeout):
                        return await self.batcher.submit(inputs, rows)
                except TimeoutError:
                    raise self._timeout_error("waiting in its dynamic batcher or running") from None
            except StepError as exc:
                if not self.shared or exc.node == self.name:
                    raise
                # A shared batcher runs its owner's code, which names the owner's node; the batcher
                # reruns a failed batch's requests alone, so this node's request is the one that failed.
                said = serving.parse_error(exc.message)
                raise self._told(type(exc), said.reason if said else exc.message, exc.tensor) from exc
        assert self.pool is not None
        lease = self.pool.try_acquire()
        if lease is not None and inline:
            try:
                outputs, compute = await self.execute(lease, inputs, rows, inline=True)
            finally:
                self.pool.give_back(lease)
            return outputs, 0.0, compute, 1
        t0 = perf_counter()
        where = "waiting for a free instance"
        try:
            with _bounded(queue_timeout):
                if lease is None:
                    lease = await self.pool.acquire()
                queue = perf_counter() - t0
                where = "running"
                try:
                    with _bounded(run_timeout):
                        outputs, compute = await self.execute(lease, inputs, rows, inline=False)
                finally:
                    self.pool.give_back(lease)
        except TimeoutError:
            raise self._timeout_error(where) from None
        return outputs, queue, compute, 1

    async def _execute_batch(self, lease: Lease, inputs: dict[str, Any], rows: int) -> tuple[dict[str, Any], float]:
        if self.timeout is None:
            return await self.execute(lease, inputs, rows, inline=self.always_inline or (self.inline_ok and self.cheap))
        # The batch itself is bounded too: a stuck batch is abandoned and its instance replaced.
        try:
            with anyio.fail_after(self.timeout):
                return await self.execute(lease, inputs, rows, inline=False)
        except TimeoutError:
            raise self._timeout_error("running a batch") from None

    async def execute(
        self, lease: Lease, inputs: dict[str, Any], rows: int, *, inline: bool
    ) -> tuple[dict[str, Any], float]:
        """Run the step on one instance and check its outputs: ``(outputs, compute_s)``."""
        instance = lease.instance
        try:
            if self.is_async:
                t = perf_counter()
                outputs = await instance.execute_async(inputs)
                compute = perf_counter() - t
            elif inline:
                t = perf_counter()
                outputs = instance.execute(inputs)
                compute = perf_counter() - t
            else:
                outputs, compute = await self._in_thread(lease, inputs)
            try:
                outputs = serving.as_arrays(outputs)
            except serving.Refused as exc:
                raise StepError(f"output {exc}", step=self.name, tensor=exc.tensor) from None
            check_outputs(self.step, outputs, batched=self.batched, batch_size=rows if self.batched else None)
            self._learn(compute)
        except PipelinesError as exc:
            if exc.pipeline == self.pipeline and exc.step == self.name:
                raise
            # The checks word their reason after the step's name; the wire format names it apart.
            reason = exc.message.removeprefix(f"step {self.step.name!r} ")
            raise self._told(StepError, reason, exc.tensor) from exc
        except Exception as exc:
            raise self._raised(exc) from exc
        return outputs, compute

    def _told(self, kind: type[StepError], reason: str, tensor: str | None = None) -> StepError:
        """An error in the words a server's model puts on the wire (``serving.WireError``), so local and
        server failures read alike: ``StepError in pipeline 'p', node 'n', step 's': reason``."""
        text = serving.WireError(kind.__name__, self.pipeline, reason, self.name, self.step.name, tensor).text()
        return kind(text, pipeline=self.pipeline, step=self.name, node=self.name, tensor=tensor)

    def _raised(self, exc: BaseException, what: str = "") -> StepError:
        """The step's own exception told as a StepError: ``raised ValueError: what it said``."""
        home = serving.code_home(self.step.impl) if self.step.impl is not None else None
        return self._told(StepError, (f"{what} " if what else "") + serving.exception_reason(exc, home))

    def _learn(self, compute: float) -> None:
        # an exponential average follows a step that changes pace without storing a history
        self._typical = compute if not self._timed else self._typical + 0.2 * (compute - self._typical)
        self._timed += 1
        self.cheap = self._timed >= _SAMPLES and self._typical < self.hop_cost

    async def _in_thread(self, lease: Lease, inputs: dict[str, Any]) -> tuple[dict[str, Any], float]:
        assert self.pool is not None
        call = ThreadCall(lease, self.pool, self._threads, keep=self.keep_stuck)
        instance = lease.instance
        execute: Callable[[dict[str, Any]], dict[str, Any]] = instance.execute
        isolated = lease.isolated
        # The pool's work item outlives the call by a moment (the answer wakes the loop first), so
        # the closure holds the inputs in a box it empties: a tensor is freed once its last step has it.
        box = [inputs]

        def work() -> tuple[dict[str, Any], float] | None:
            if not call.begin():
                return None
            try:
                t = perf_counter()
                outputs = execute(box.pop())
                # In a process: the step's function alone; the rest of the call moved tensors
                # through shared memory, and the report counts it as overhead.
                compute = instance.last_compute if isolated else perf_counter() - t
                return outputs, compute
            finally:
                call.end()

        try:
            loop = running_asyncio_loop()
            if loop is not None:
                # The thread starts now: anyio's to_thread yields to the event loop first, and
                # the loop may then run for a millisecond (e.g. the callers of the last batch)
                # while the instance sits idle.
                result = await loop.run_in_executor(self._threads, work)
            else:
                result = await wait_for_future(self._threads.submit(work))
        except BaseException:
            # A sync function cannot be killed: leave it running and answer now.
            call.cancel()
            raise
        assert result is not None  # only a dropped call returns None, and its caller was cancelled
        return result

    def _timeout_error(self, where: str) -> StepError:
        return self._told(
            StepTimeoutError,
            f"ran past its timeout of {self.timeout:g} s ({where}); the request was answered with this error, a "
            "stuck call was abandoned and a fresh instance replaces the one it holds. Raise the step's timeout, "
            "or find why it does not return",
        )


def _bounded(seconds: float | None) -> AbstractContextManager[Any]:
    """``anyio.fail_after(seconds)``, or nothing without a timeout: an unbounded cancel scope,
    made and left twice for every step call, was 12 % of the event loop's time in ``chain10``'s
    ensemble at concurrency 4 (cProfile), time the requests wait for the loop."""
    return nullcontext() if seconds is None else anyio.fail_after(seconds)
