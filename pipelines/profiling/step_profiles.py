"""Step profiles: what each live step of a pipeline costs when it runs for real, here, on the
tensors the pipeline hands it, at each batch size (docs/step_profiles.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import statistics
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.plan import ExecutionPlan, NodePlan
from ..core.planning import plan_of
from ..core.requests import check_request
from ..core.step import Step
from ..core.tensor import TensorSpec
from ..errors import ArgumentError, InferenceError
from ..freed_memory import keep_freed_memory_here
from ..predict.step_profile import StepProfile
from .code_digest import code_digest
from .gil_share import GIL_PAIRS, GIL_TARGET_S, gil_losses
from .memory_share import MIN_CPU_US, measure_memory_share, streamer
from .step_cache import StepCache, cache_key, value_digest
from .step_runner import StepRunner, blame, host, rows_of
from .step_timing import COLD_BYTES, TARGET_S, evict, time_call

if TYPE_CHECKING:  # pragma: no cover
    from ..core.graph import Graph

__all__ = ["StepProfile", "profile_steps"]

Key = tuple["str | None", str]
Progress = Callable[[int, int, str], Any]
Given = tuple[tuple[int, ...], tuple[float, ...]]  # a cost given by the user: rows, µs

#: Rounds over a pipeline's steps: each figure of a step is the median of its rounds.
ROUNDS = 3


def profile_steps(pipeline: Graph, inputs: Mapping[str, Any], *, cache: str | os.PathLike[str] | None = None,
                  batch_sizes: Sequence[int] | None = None, repeats: int | None = None,
                  costs: Mapping[str, float | Mapping[int, float]] | None = None,
                  progress: Progress | None = None) -> dict[str, StepProfile]:
    """Profile each live step of ``pipeline`` (by node name, in the plan's order) as its Triton model runs it, on its
    device, on ``inputs`` (one request, as :meth:`Pipeline.run` takes it) propagated through the DAG: at 1, 2, 4, ...
    rows and its ``max_batch_size`` (or ``batch_sizes`` up to it), ``repeats`` times in each of :data:`ROUNDS` rounds
    (default: by time). ``costs`` and ``cache``: docs/step_profiles.md.
    ``progress(done, total, node)`` is called as each step is done; a step that fails is a
    :class:`~pipelines.errors.StepError` naming the pipeline and the step, with its error."""
    # As the server's stubs do (pipelines.freed_memory): a step must not page-fault its fresh arrays in at every call.
    keep_freed_memory_here()
    profiler = _Profiler(pipeline, inputs, cache, batch_sizes, repeats, costs, progress)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return profiler.run()
    # a notebook's loop runs in this thread: async steps need a loop of their own
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="profile_steps") as pool:
        return pool.submit(profiler.run).result()


class _Profiler:
    """One call of :func:`profile_steps`: the checked arguments, and the walk over the plan."""

    def __init__(self, pipeline: Graph, inputs: Mapping[str, Any], cache: str | os.PathLike[str] | None,
                 batch_sizes: Sequence[int] | None, repeats: int | None, costs: Mapping[str, Any] | None,
                 progress: Progress | None) -> None:
        self.pipeline = pipeline
        self.plan: ExecutionPlan = plan_of(pipeline, warn=False)
        request = check_request(inputs, pipeline.inputs, pipeline=pipeline.name, max_batch_size=pipeline.max_batch_size)
        self.batched = pipeline.batched
        self.request_rows = int(next(iter(request.values())).shape[0]) if self.batched and request else 1
        self.sizes: tuple[int, ...] | None = None  # None: by each step's max_batch_size
        if batch_sizes is not None:
            sizes = list(batch_sizes) if not isinstance(batch_sizes, (int, str)) else [batch_sizes]
            if not sizes or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in sizes):
                raise ArgumentError(f"batch_sizes are ints >= 1, such as (1, 2, 4, 8); got {batch_sizes!r}")
            self.sizes = tuple(sorted({int(b) for b in sizes}))
        if repeats is not None and (isinstance(repeats, bool) or int(repeats) < 1):
            raise ArgumentError(f"repeats is an int >= 1, or None to choose by time; got {repeats!r}")
        self.repeats = None if repeats is None else int(repeats)  # calls a round
        self.given = _given_costs(self.plan, costs)
        self.progress = progress if progress is not None else lambda done, total, node: None
        self.cache = StepCache(cache) if cache is not None else None
        self._refuse_what_cannot_run()
        # Arrays flow as in the local runtime: by (producing node or None, tensor name).
        self.values: dict[Key, Any] = {(None, name): value for name, value in request.items()}
        self.shapes: dict[Key, TensorSpec] = {(None, name): _row_spec(pipeline.inputs[name].dtype, value, self.batched)
                                              for name, value in request.items()}
        # where each tensor came from, for the cache's keys: the request's values, or the giving step's key
        self.origins: dict[Key, str] = {(None, name): value_digest(host(value)) for name, value in request.items()}
        self.ran: set[str] = set()
        self.digests: dict[int, str] = {}  # by step object: a step used by several nodes is read once
        self.readers: dict[str, set[str]] = {n.name: set(n.before) for n in self.plan.nodes}

    def _refuse_what_cannot_run(self) -> None:
        p = self.pipeline.name
        for n in self.plan.nodes:
            step = self.pipeline.nodes[n.name].step
            if n.name in self.given:
                continue
            if step.impl is None:  # so an external model, which names a backend or a platform (Step checks both)
                backend = step.external.backend or step.external.platform
                raise ArgumentError(
                    f"pipeline {p!r} step {n.name!r} is an external model ({backend}) with no Python "
                    f"stand-in to profile; pass costs={{{n.name!r}: µs}} (or {{{n.name!r}: {{rows: µs}}}}) with "
                    "what one execution costs, or declare it with external_model(..., stand_in=fn)",
                    pipeline=p, step=n.name, node=n.name)
            if step.options.device == "gpu" and not _gpu_available():
                raise InferenceError(
                    f"pipeline {p!r} step {n.name!r} runs on the GPU (device='gpu'), but CuPy with a CUDA device "
                    f"is not available here, so it cannot be profiled; profile on a machine with a GPU "
                    f"(pip install cupy-cuda12x), or pass costs={{{n.name!r}: µs}}",
                    pipeline=p, step=n.name, node=n.name)

    def run(self) -> dict[str, StepProfile]:
        profiles: dict[str, StepProfile] = {}
        measuring: dict[str, Generator[StepProfile | None, None, None]] = {}
        try:
            for n in self.plan.nodes:  # each step's cache entry, or its real inputs and a warm instance
                found = self._profile(n)
                if isinstance(found, StepProfile):
                    profiles[n.name] = found
                    self.progress(len(profiles), len(self.plan.nodes), n.name)
                else:
                    measuring[n.name] = found
                self._release()
            # Rounds over the steps: a moment the machine slowed weighs on one round of a step, not on its median.
            for _ in range(ROUNDS):
                for name in list(measuring):
                    if (profile := next(measuring[name])) is not None:
                        profiles[name] = profile
                        measuring.pop(name).close()
                        self.progress(len(profiles), len(self.plan.nodes), name)
        finally:
            for rounds in measuring.values():
                rounds.close()  # a step not done yet: its instances finalized, quietly (an error is on its way)
            if self.cache is not None:
                self.cache.write()
        return {n.name: profiles[n.name] for n in self.plan.nodes}

    def _profile(self, n: NodePlan) -> StepProfile | Generator[StepProfile | None, None, None]:
        """Node ``n``'s profile where it is given or cached; else its rounds, which yield it last."""
        node = self.pipeline.nodes[n.name]
        step = node.step
        inputs = {s.input: self.shapes[s.key] for s in n.inputs}
        sizes = self._sizes_of(node.max_batch_size) if n.name not in self.given else self.given[n.name][0]
        if (digest := self.digests.get(id(step))) is None:
            digest = self.digests[id(step)] = code_digest(step)
        key = cache_key(digest, inputs, n.returns, sizes, _device(step), self.given.get(n.name),
                        {s.input: self.origins[s.key] for s in n.inputs})
        found = self.cache.get(key) if self.cache is not None else None
        if found is not None:
            found = replace(found, name=n.name, step=step.name)
            outputs = found.outputs
        else:
            found = self._measure(n, step, digest, inputs, sizes, key)
            outputs = next(found)  # the propagation: what it hands on
        self.shapes.update({(n.name, out): spec for out, spec in outputs.items()})
        self.origins.update({(n.name, out): f"{key}/{out}" for out in {*n.returns, *outputs}})
        return found

    def _measure(self, n: NodePlan, step: Step, digest: str, inputs: Mapping[str, TensorSpec],
                 sizes: tuple[int, ...], key: str) -> Generator[Any, None, None]:
        """Runs the step once on its real inputs and yields what it hands on; then one round a
        ``next()``, yielding ``None`` after each but the last, and the profile after the last."""
        runner = self._run(n.name, keep=n.name not in self.given)  # the propagation: one call, outputs kept
        failed = True
        try:
            handed = {s.input: self.values[s.key] for s in n.inputs}
            outputs = {out: self.values[(n.name, out)] for out in n.returns}
            common = {
                "name": n.name, "step": step.name, "digest": digest, "inputs": inputs,
                "outputs": {out: _row_spec(step.outputs[out].dtype, v, self.batched) for out, v in outputs.items()},
                "device": _device(step), "external": step.is_external,
                "in_bytes": sum(_nbytes(v) for v in handed.values()) / self.request_rows,
                "out_bytes": sum(_nbytes(v) for v in outputs.values()) / self.request_rows,
            }
            yield common["outputs"]
            if n.name in self.given:
                given_rows, given_us = self.given[n.name]
                gpu = step.options.device == "gpu" or step.options.instance_kind == "gpu"
                profile = StepProfile(
                    **common, rows=given_rows, wall_us=given_us, cpu_us=(0.0,) * len(given_us) if gpu else given_us,
                    gil_share=0.0 if step.is_external else 1.0, source="given")
            else:
                assert runner is not None
                profile = yield from self._rounds(n.name, runner, handed, sizes, common)
            if self.cache is not None:
                self.cache.put(key, profile)
            failed = False
            yield profile
        finally:
            if runner is not None:
                runner.finalize(quiet=failed)  # an error in finalize() must not hide the step's own

    def _rounds(self, name: str, runner: StepRunner, handed: Mapping[str, Any], sizes: tuple[int, ...],
                common: dict[str, Any]) -> Generator[None, None, StepProfile]:
        """:data:`ROUNDS` rounds of the step's timings at each size, its GIL share and its memory share (a
        ``yield`` after each but the last); its profile, their medians."""
        timed, warm, gils, memory = [], [], [], []
        with blame(self.pipeline.name, name):
            # An external model runs in another backend's process: it never holds this one's GIL.
            twin = None if common["external"] else runner.twin()  # as the fused model's two instances
            try:
                batches = [runner.placed(rows_of(handed, b, self.request_rows) if self.batched else handed)
                           for b in sizes]
                # Untimed before each timed call: on the server, large inputs are not in the caches
                # (docs/step_profiles.md); a GPU step's inputs are on its device.
                colds = [evict if not runner.gpu and common["in_bytes"] * b >= COLD_BYTES else None for b in sizes]
                # made once for every round: an async step's caller opens an event loop of its own
                calls = [runner.caller(b) for b in batches]
                second = twin.caller(twin.placed(batches[0])) if twin is not None else None
                for round_ in range(ROUNDS):
                    if round_:
                        yield
                    timed.append([time_call(call, self.repeats, before=c, target_s=TARGET_S / ROUNDS)
                                  for call, c in zip(calls, colds, strict=True)])
                    # and as the fused model's steps read their inputs: just written, in the caches
                    warm.append([time_call(call, self.repeats, target_s=TARGET_S / ROUNDS) if c else t
                                 for call, c, t in zip(calls, colds, timed[-1], strict=True)])
                    if second is not None:
                        gils += gil_losses(calls[0], second, timed[-1][0][0], target_s=GIL_TARGET_S / ROUNDS,
                                           least=-(-GIL_PAIRS // ROUNDS))
                    # none on a GPU (its time is its device's), nor for a call too short to tell
                    if not runner.gpu and timed[-1][0][1] * 1e6 >= MIN_CPU_US:
                        memory.append(measure_memory_share(calls[0], streamer(), before=colds[0], repeats=self.repeats))
            finally:
                if twin is not None:
                    twin.finalize()

        def medians(by_round: list[list[tuple[float, float]]], figure: int) -> tuple[float, ...]:
            return tuple(statistics.median(r[i][figure] for r in by_round) * 1e6 for i in range(len(sizes)))

        def spread(by_round: list[list[tuple[float, float]]]) -> float:
            walls = [[r[i][0] for r in by_round] for i in range(len(sizes))]
            return max(((max(w) - min(w)) / 2 / statistics.median(w) if statistics.median(w) > 0 else 0.0)
                       for w in walls)

        cpus = medians(timed, 1)
        if cpus[0] < MIN_CPU_US:  # a round or two above it does not make the step one that moves memory
            memory = []
        traffics = [m.traffic for m in memory if m.traffic is not None]
        cold = any(colds)
        return StepProfile(
            **common, rows=sizes, wall_us=medians(timed, 0), cpu_us=cpus,
            gil_share=min(max(statistics.median(gils), 0.0), 1.0) if gils else 0.0,  # over every round's pairs
            memory=statistics.median(m.share for m in memory) if memory else 0.0,
            traffic=statistics.median(traffics) if traffics else None,
            source="stand_in" if common["external"] else "measured", spread=spread(timed),
            warm_wall_us=medians(warm, 0) if cold else (), warm_cpu_us=medians(warm, 1) if cold else ())

    def _run(self, name: str, *, keep: bool) -> StepRunner | None:
        """Run node ``name`` once on its real inputs, after the nodes it needs (a step found in the
        cache runs only for what follows it); ``keep``: return its instance, warm, not finalized."""
        if name in self.ran:
            return None
        n = self.plan.node(name)
        for s in n.inputs:
            if s.node is not None and s.node not in self.ran:
                self._run(s.node, keep=False)
        node = self.pipeline.nodes[name]
        step = node.step
        handed = {s.input: self.values[s.key] for s in n.inputs}
        self.ran.add(name)
        if step.impl is None or (step.options.device == "gpu" and not _gpu_available()):
            outputs = self._stand_for(name, step)
            runner = None
        else:
            runner = StepRunner(self.pipeline.name, name, step, model=n.model, max_batch_size=node.max_batch_size,
                                batched=self.batched)
            try:
                with blame(self.pipeline.name, name):
                    outputs = runner.call(runner.placed(handed))
            except BaseException:
                runner.finalize(quiet=True)
                raise
        self.values.update({(name, out): host(outputs[out]) for out in n.returns})
        if runner is not None and not keep:
            runner.finalize()
            runner = None
        return runner

    def _stand_for(self, name: str, step: Step) -> dict[str, Any]:
        """Zeros of the declared outputs, for a step that cannot run here but has a cost."""
        warnings.warn(
            f"pipeline {self.pipeline.name!r} step {name!r} cannot run here (an external model without a "
            "stand-in, or a GPU step without CUDA); the steps after it are profiled on zeros of its declared "
            "outputs, with 1 for each variable dim: give it a stand_in to profile them on real values",
            stacklevel=2)
        rows = (self.request_rows,) if self.batched else ()
        return {o: np.full(rows + tuple(1 if d == -1 else d for d in spec.dims), b"" if spec.dtype == "BYTES" else 0,
                           dtype=spec.numpy_dtype) for o, spec in step.outputs.items()}

    def _release(self) -> None:
        """Drop the arrays every reader of which has run. A reader found in the cache has not run,
        and may yet, for a step after it that is not: what it reads is kept."""
        for key in [k for k in self.values if k[0] is not None and self.readers[k[0]] <= self.ran]:
            del self.values[key]

    def _sizes_of(self, max_batch: int) -> tuple[int, ...]:
        if not self.batched or max_batch <= 0:
            return (1,)
        if self.sizes is not None:
            return tuple(b for b in self.sizes if b <= max_batch) or (1,)
        return (*(1 << i for i in range((max_batch - 1).bit_length())), max_batch)  # 1, 2, 4, ... below it


def _given_costs(plan: ExecutionPlan, costs: Mapping[str, Any] | None) -> dict[str, Given]:
    """``costs=`` by live node: a node's own name wins over its step's name."""
    if not costs:
        return {}
    if not isinstance(costs, Mapping):
        raise ArgumentError(f"costs is a dict of step name -> µs (or -> {{rows: µs}}); got {type(costs).__name__}")
    nodes = set(plan.order)
    out: dict[str, Given] = {}
    for name in sorted(costs, key=lambda k: k in nodes):  # step names first, then node names override
        targets = [name] if name in nodes else [n.name for n in plan.nodes if n.step == name]
        if not targets:
            raise ArgumentError(
                f"costs names {name!r}, which is no live step of pipeline {plan.pipeline!r}; "
                f"its steps are {list(plan.order)}",
                pipeline=plan.pipeline, step=str(name))
        value = costs[name]
        points = value if isinstance(value, Mapping) else {1: value}
        try:
            pairs = sorted((int(r), float(us)) for r, us in points.items())
        except (TypeError, ValueError):
            pairs = []
        rows = tuple(r for r, _ in pairs)
        if not pairs or any(r < 1 or not math.isfinite(us) or us < 0 for r, us in pairs) or len(set(rows)) != len(rows):
            raise ArgumentError(
                f"costs[{name!r}] is {value!r}; give µs >= 0 for one execution, or {{rows: µs}} by batch size",
                pipeline=plan.pipeline, step=name)
        out.update(dict.fromkeys(targets, (rows, tuple(us for _, us in pairs))))
    return out


def _row_spec(dtype: str, value: Any, batched: bool) -> TensorSpec:
    """The dtype and dims of one row of ``value`` (the whole tensor where the pipeline does not batch)."""
    shape = tuple(int(d) for d in value.shape)
    return TensorSpec(dtype, shape[1:] if batched else shape)


def _nbytes(value: Any) -> int:
    """What a tensor weighs on the wire: its bytes, or for BYTES each element's length plus its
    4-byte length prefix (Triton's serialisation)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return sum(4 + len(item if isinstance(item, bytes) else str(item).encode()) for item in value.flat)
    return int(getattr(value, "nbytes", 0))


def _device(step: Step) -> str:
    return "gpu" if step.options.device == "gpu" else "cpu"


def _gpu_available() -> bool:
    from ..runtime.device import gpu_available  # imported here: the runtime only matters to a GPU step

    return gpu_available()

