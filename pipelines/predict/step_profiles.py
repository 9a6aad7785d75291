"""Step profiles: what each live step of a pipeline costs when it runs for real, here, on the
tensors the pipeline hands it, at each batch size. The simulator reads them as the curves of
:class:`~pipelines.predict.spec.StepSpec`; they are cached as JSON beside the server profile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields, replace
from time import perf_counter, process_time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import serving
from ..errors import ArgumentError, InferenceError, PipelinesError, StepError
from ..freed_memory import keep_freed_memory_here
from ..output_paths import output_file, replace_text
from ..plan import ExecutionPlan, NodePlan, plan_of
from ..requests import check_request
from ..step import Step, check_outputs, instance_config
from ..tensor import TensorSpec, numpy_dtype
from .code_digest import code_digest
from .gil_share import gil_share, usable_cores
from .spec import Curve

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import Pipeline

__all__ = ["CACHE_FORMAT", "MAX_REPEATS", "MIN_REPEATS", "TARGET_S", "StepProfile", "profile_steps"]

#: Seconds of repeats to aim for at each batch size, when ``repeats`` is not given.
TARGET_S = 0.2
MIN_REPEATS = 3
MAX_REPEATS = 1000
#: Version of the cache file; a cache of another format is not read (and is replaced).
CACHE_FORMAT = 1

_SOURCES = ("measured", "stand_in", "given")

Key = tuple["str | None", str]
Progress = Callable[[int, int, str], Any]


# ------------------------------------------------------------------ the profile


@dataclass(frozen=True)
class StepProfile:
    """One live step, measured (or given): what one execution costs by batch rows.

    ``name`` is the node's name in the pipeline, ``step`` the step's own. ``digest``: its
    code (:func:`~pipelines.predict.code_digest.code_digest`). ``inputs``/``outputs``: the
    dtype and dims of one row of each input it was handed and each output it hands on (the
    whole tensor where the pipeline does not batch). ``rows``: the batch sizes measured;
    ``wall_us``/``cpu_us``: the median µs of one execution at each. ``gil_share`` (0..1): the
    part of its CPU time that holds the GIL. ``in_bytes``/``out_bytes``: what its inputs and
    the outputs it hands on weigh per row. ``source``: ``"measured"``, ``"stand_in"`` (an
    external model's Python stand-in was timed) or ``"given"`` (``costs=``).
    """

    name: str
    step: str
    digest: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    device: str
    rows: tuple[int, ...]
    wall_us: tuple[float, ...]
    cpu_us: tuple[float, ...]
    gil_share: float
    in_bytes: float
    out_bytes: float
    external: bool = False
    source: str = "measured"

    def __post_init__(self) -> None:
        def refuse(what: str) -> ArgumentError:
            return ArgumentError(f"step profile {self.name!r}: {what}", step=self.name)

        rows = tuple(int(r) for r in self.rows)
        if not rows or any(r < 1 for r in rows) or list(rows) != sorted(set(rows)):
            raise refuse(f"rows must be increasing batch sizes >= 1; got {list(self.rows)}")
        for field_name in ("wall_us", "cpu_us"):
            values = tuple(float(v) for v in getattr(self, field_name))
            if len(values) != len(rows):
                raise refuse(f"{field_name} has {len(values)} figures for {len(rows)} rows {list(rows)}")
            if not all(math.isfinite(v) and v >= 0 for v in values):
                raise refuse(f"{field_name} must be finite µs >= 0; got {list(values)}")
            object.__setattr__(self, field_name, values)
        for field_name in ("in_bytes", "out_bytes", "gil_share"):
            value = float(getattr(self, field_name))
            if not math.isfinite(value) or value < 0 or (field_name == "gil_share" and value > 1):
                bound = "between 0 and 1" if field_name == "gil_share" else "finite and >= 0"
                raise refuse(f"{field_name} must be {bound}; got {getattr(self, field_name)!r}")
            object.__setattr__(self, field_name, value)
        if self.device not in ("cpu", "gpu"):
            raise refuse(f"device must be 'cpu' or 'gpu'; got {self.device!r}")
        if self.source not in _SOURCES:
            raise refuse(f"source must be one of {list(_SOURCES)}; got {self.source!r}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "external", bool(self.external))
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        object.__setattr__(self, "outputs", MappingProxyType(dict(self.outputs)))

    def wall_curve(self) -> Curve:
        """Wall µs of one execution by batch rows, for :attr:`StepSpec.wall_us`."""
        return Curve(self.rows, self.wall_us)

    def cpu_curve(self) -> Curve:
        """CPU µs of one execution by batch rows, for :attr:`StepSpec.cpu_us`."""
        return Curve(self.rows, self.cpu_us)

    def to_json(self) -> dict[str, Any]:
        """The profile as JSON-ready data; :meth:`from_json` reads it back equal."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update({k: {n: spec.to_dict() for n, spec in data[k].items()} for k in ("inputs", "outputs")})
        data.update({k: list(data[k]) for k in ("rows", "wall_us", "cpu_us")})
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> StepProfile:
        """A profile written by :meth:`to_json` (as data or JSON text); a missing field, a
        negative or NaN cost is an :class:`~pipelines.errors.ArgumentError` naming it."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        if not isinstance(data, Mapping):
            raise ArgumentError(f"a step profile is a JSON object; got {type(data).__name__}")
        name = data.get("name", "?")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ArgumentError(f"step profile {name!r} has no {missing[0]!r}; profile the step again", step=name)
        try:
            specs = {k: {n: TensorSpec.from_dict(d) for n, d in dict(data[k]).items()} for k in ("inputs", "outputs")}
            return cls(**{**{f.name: data[f.name] for f in fields(cls) if f.name in data}, **specs})
        except PipelinesError:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise ArgumentError(f"step profile {name!r} is malformed ({type(exc).__name__}: {exc})", step=name) from None


# ------------------------------------------------------------------ profiling a pipeline


def profile_steps(
    pipeline: Pipeline,
    inputs: Mapping[str, Any],
    *,
    cache: str | os.PathLike[str] | None = None,
    batch_sizes: Sequence[int] | None = None,
    repeats: int | None = None,
    costs: Mapping[str, float | Mapping[int, float]] | None = None,
    progress: Progress | None = None,
) -> dict[str, StepProfile]:
    """Profile each live step of ``pipeline`` (by node name, in the plan's order).

    ``inputs``: one request, as :meth:`Pipeline.run` takes it; it is propagated through
    the DAG, each step running once on what its predecessors gave, and each step is then
    timed on batches made by repeating the rows it was handed: 1, 2, 4, ... and its
    ``max_batch_size`` (``batch_sizes`` to choose others; sizes above a step's
    ``max_batch_size`` are left out for it; a step that does not batch runs once a request).
    ``repeats``: timed calls at each size (default: until about :data:`TARGET_S`, at least
    :data:`MIN_REPEATS`). ``costs``: ``{"node or step name": µs}`` (one figure for any
    rows) or ``{name: {rows: µs}}``, a cost known to the user, used instead of measuring;
    an external model step needs this or a Python stand-in. ``cache``: a JSON file of
    profiles keyed by each step's code digest, input shapes and batch sizes; a step found
    there is not run. ``progress(done, total, node)`` is called as each step is done.

    A step that fails is a :class:`~pipelines.errors.StepError` naming the pipeline and
    the step, with its error.

    A step is timed as its Triton model runs it: one instance, ``initialize(config)`` once,
    then one ``execute`` a batch, its outputs taken as arrays; on its device (a
    ``device="gpu"`` step gets CuPy arrays, as the server hands them, and its kernels are
    waited for; any other gets numpy arrays, as a Python backend model does). Wall time is
    :func:`time.perf_counter`; CPU time is :func:`time.process_time`, not ``thread_time``:
    numpy may work on threads of its own (BLAS, OpenMP), and those keep the server's cores
    busy too (nothing else runs in this process meanwhile). Each size has a warm-up call;
    the figures are medians. The GIL share is measured at the smallest size
    (:mod:`pipelines.predict.gil_share`).
    """
    # The server's stubs keep the memory freed arrays give back (pipelines.freed_memory): a step
    # measured here must not page-fault its fresh arrays in on every call when there it does not.
    keep_freed_memory_here()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:  # a notebook's loop runs in this thread: async steps need a loop of their own
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="profile_steps") as pool:
            call = pool.submit(_Profiler(pipeline, inputs, cache, batch_sizes, repeats, costs, progress).run)
            return call.result()
    return _Profiler(pipeline, inputs, cache, batch_sizes, repeats, costs, progress).run()


class _Profiler:
    """One call of :func:`profile_steps`: the checked arguments, and the walk over the plan."""

    def __init__(
        self,
        pipeline: Pipeline,
        inputs: Mapping[str, Any],
        cache: str | os.PathLike[str] | None,
        batch_sizes: Sequence[int] | None,
        repeats: int | None,
        costs: Mapping[str, Any] | None,
        progress: Progress | None,
    ) -> None:
        self.pipeline = pipeline
        self.plan: ExecutionPlan = plan_of(pipeline, warn=False)
        request = check_request(inputs, pipeline.inputs, pipeline=pipeline.name, max_batch_size=pipeline.max_batch_size)
        self.batched = pipeline.batched
        self.request_rows = int(next(iter(request.values())).shape[0]) if self.batched and request else 1
        self.sizes = _batch_sizes(batch_sizes)
        if repeats is not None and (isinstance(repeats, bool) or int(repeats) < 1):
            raise ArgumentError(f"repeats is an int >= 1, or None to choose by time; got {repeats!r}")
        self.repeats = None if repeats is None else int(repeats)
        self.given = _given_costs(self.plan, costs)
        self.progress = progress
        self.cache = _Cache(cache) if cache is not None else None
        self._refuse_what_cannot_run()
        # Arrays flow as in the local runtime: by (producing node or None, tensor name).
        self.values: dict[Key, Any] = {(None, name): value for name, value in request.items()}
        self.shapes: dict[Key, TensorSpec] = {
            (None, name): _row_spec(self.pipeline.inputs[name].dtype, value, self.batched) for name, value in request.items()
        }
        self.ran: set[str] = set()
        self.digests: dict[int, str] = {}  # by step object: a step used by several nodes is read once
        self.readers: dict[str, set[str]] = {n.name: set(n.before) for n in self.plan.nodes}

    # ---------------------------------------------------------------- checks first

    def _refuse_what_cannot_run(self) -> None:
        p = self.pipeline.name
        for n in self.plan.nodes:
            step = self.pipeline.nodes[n.name].step
            if n.name in self.given:
                continue
            if step.impl is None:
                raise ArgumentError(
                    f"pipeline {p!r} step {n.name!r} is an external model ({_backend(step)}) with no Python "
                    f"stand-in to profile; pass costs={{{n.name!r}: µs}} (or {{{n.name!r}: {{rows: µs}}}}) with "
                    "what one execution costs, or declare it with external_model(..., stand_in=fn)",
                    pipeline=p, step=n.name, node=n.name,
                )
            if step.options.device == "gpu" and not _gpu_available():
                raise InferenceError(
                    f"pipeline {p!r} step {n.name!r} runs on the GPU (device='gpu'), but CuPy with a CUDA device "
                    f"is not available here, so it cannot be profiled; profile on a machine with a GPU "
                    f"(pip install cupy-cuda12x), or pass costs={{{n.name!r}: µs}}",
                    pipeline=p, step=n.name, node=n.name,
                )

    # ---------------------------------------------------------------- the walk

    def run(self) -> dict[str, StepProfile]:
        profiles: dict[str, StepProfile] = {}
        total = len(self.plan.nodes)
        try:
            for i, n in enumerate(self.plan.nodes):
                profiles[n.name] = self._profile(n)
                self._release()
                if self.progress is not None:
                    self.progress(i + 1, total, n.name)
        finally:
            if self.cache is not None:
                self.cache.write()
        return profiles

    def _profile(self, n: NodePlan) -> StepProfile:
        node = self.pipeline.nodes[n.name]
        step = node.step
        inputs = {s.input: self.shapes[s.key] for s in n.inputs}
        sizes = self._sizes_of(node.max_batch_size) if n.name not in self.given else self.given[n.name][0]
        digest = self.digests.get(id(step))
        if digest is None:
            digest = self.digests[id(step)] = code_digest(step)
        key = _cache_key(digest, inputs, n.returns, sizes, _device(step), self.given.get(n.name))
        found = self.cache.get(key) if self.cache is not None else None
        if found is not None:
            profile = replace(found, name=n.name, step=step.name)
        else:
            profile = self._measure(n, step, digest, inputs, sizes)
            if self.cache is not None:
                self.cache.put(key, profile)
        for out, spec in profile.outputs.items():
            self.shapes[(n.name, out)] = spec
        return profile

    def _measure(
        self, n: NodePlan, step: Step, digest: str, inputs: Mapping[str, TensorSpec], sizes: tuple[int, ...]
    ) -> StepProfile:
        runner = self._run(n.name, keep=n.name not in self.given)  # the propagation: one call, outputs kept
        failed = True
        try:
            handed = {s.input: self.values[s.key] for s in n.inputs}
            outputs = {out: self.values[(n.name, out)] for out in n.returns}
            rows = self.request_rows
            common = {
                "name": n.name, "step": step.name, "digest": digest, "inputs": inputs,
                "outputs": {out: _row_spec(step.outputs[out].dtype, v, self.batched) for out, v in outputs.items()},
                "device": _device(step), "external": step.is_external,
                "in_bytes": sum(_nbytes(v) for v in handed.values()) / rows,
                "out_bytes": sum(_nbytes(v) for v in outputs.values()) / rows,
            }
            if n.name in self.given:
                given_rows, given_us = self.given[n.name]
                gpu = step.options.device == "gpu" or step.options.instance_kind == "gpu"
                return StepProfile(
                    **common, rows=given_rows, wall_us=given_us, cpu_us=(0.0,) * len(given_us) if gpu else given_us,
                    gil_share=0.0 if step.is_external else 1.0, source="given",
                )
            assert runner is not None
            walls, cpus = [], []
            with self._blame(n.name):
                batches = {b: runner.placed(_rows_of(handed, b, rows) if self.batched else handed) for b in sizes}
                for b in sizes:
                    # On the server a step's inputs were written by another process, and other
                    # stubs ran since its last call: its data is not in the caches. Timed on the
                    # same arrays call after call, it would be (yolov5's detector: 6.3 ms warm,
                    # 6.8 ms after 64 MiB of other traffic, 7.5 ms in the server's statistics).
                    cold = _evict if not runner.gpu and common["in_bytes"] * b >= _COLD_BYTES else None
                    wall, cpu = _time(runner.caller(batches[b]), self.repeats, before=cold)
                    walls.append(wall)
                    cpus.append(cpu)
                # An external model runs in another backend's process: it never holds this one's GIL.
                gil = 0.0 if step.is_external else self._gil_share(runner, batches[sizes[0]], walls[0])
            failed = False
            return StepProfile(
                **common, rows=sizes, wall_us=tuple(w * 1e6 for w in walls), cpu_us=tuple(c * 1e6 for c in cpus),
                gil_share=gil, source="stand_in" if step.is_external else "measured",
            )
        finally:
            if runner is not None:
                runner.finalize(quiet=failed)  # an error in finalize() must not hide the step's own

    def _run(self, name: str, *, keep: bool) -> _Runner | None:
        """Run node ``name`` once on its real inputs (running the nodes it needs first, where
        they have not run: a step found in the cache runs only for what follows it).
        ``keep``: return its instance, initialised and warm, rather than finalize it."""
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
            runner = _Runner(self, name, step, node.max_batch_size)
            try:
                with self._blame(name):
                    outputs = runner.call(runner.placed(handed))
            except BaseException:
                runner.finalize(quiet=True)
                raise
        for out in n.returns:
            self.values[(name, out)] = _host(outputs[out])
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
            stacklevel=2,
        )
        rows = (self.request_rows,) if self.batched else ()
        out = {}
        for o, spec in step.outputs.items():
            dims = tuple(1 if d == -1 else d for d in spec.dims)
            dtype = np.dtype(object) if spec.dtype == "BYTES" else numpy_dtype(spec.dtype)
            out[o] = np.full(rows + dims, b"" if spec.dtype == "BYTES" else 0, dtype=dtype)
        return out

    def _release(self) -> None:
        """Drop the arrays every reader of which has run (a large pipeline's tensors are not all
        kept). A reader found in the cache has not run, and may yet, for a step after it that
        is not: what it reads is kept."""
        for key in [k for k in self.values if k[0] is not None and self.readers[k[0]] <= self.ran]:
            del self.values[key]

    def _sizes_of(self, max_batch: int) -> tuple[int, ...]:
        if not self.batched or max_batch <= 0:
            return (1,)
        if self.sizes is not None:
            return tuple(b for b in self.sizes if b <= max_batch) or (1,)
        sizes, b = [], 1
        while b < max_batch:
            sizes.append(b)
            b *= 2
        return (*sizes, max_batch)

    def _gil_share(self, runner: _Runner, batch: Mapping[str, Any], wall: float) -> float:
        """Two instances, as two instances of the fused model hold it (a class step's state is
        its own), each on a thread (:func:`~pipelines.predict.gil_share.gil_share`)."""
        twin = _Runner(self, runner.name, runner.step, runner.max_batch_size, instance_index=1)
        try:
            return gil_share(runner.caller(batch), twin.caller(twin.placed(batch)), wall)
        finally:
            twin.finalize()

    @contextmanager
    def _blame(self, name: str, what: str = "") -> Iterator[None]:
        """What the step's own code raises here becomes a StepError naming the pipeline and the step."""
        p = self.pipeline.name
        try:
            yield
        except PipelinesError as exc:
            if exc.pipeline == p and exc.step == name:
                raise
            raise StepError(f"pipeline {p!r} step {name!r} failed while being profiled{what}: {exc.message}",
                            pipeline=p, step=name, node=name, tensor=exc.tensor) from exc
        except Exception as exc:
            raise StepError(
                f"pipeline {p!r} step {name!r} failed while being profiled{what}: {serving.exception_reason(exc)}",
                pipeline=p, step=name, node=name,
            ) from exc


class _Runner:
    """One instance of a step, as its Triton model holds it: ``initialize(config)`` once, then
    one ``execute`` a batch, outputs as arrays, on the step's device."""

    def __init__(self, profiler: _Profiler, name: str, step: Step, max_batch_size: int, *, instance_index: int = 0) -> None:
        self.profiler = profiler
        self.name = name
        self.step = step
        self.max_batch_size = max_batch_size
        self.gpu = step.options.device == "gpu"
        config = instance_config(
            step,
            pipeline=profiler.pipeline.name,
            node=name,
            model_name=profiler.plan.node(name).model,
            instance_index=instance_index,
            device="gpu" if self.gpu else "cpu",
            max_batch_size=max_batch_size,
        )
        with profiler._blame(name, " (in initialize())"):
            self.instance = step.instantiate(config)
        self._loops: list[asyncio.AbstractEventLoop] = []

    def placed(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """The arrays where the step's model receives them: on the GPU for a GPU step, else in host
        memory; read-only, as every form hands them."""
        if self.gpu:
            import cupy

            return {n: cupy.asarray(v) for n, v in arrays.items()}
        return {n: serving.read_only(_host(v)) for n, v in arrays.items()}

    def caller(self, inputs: Mapping[str, Any]) -> Callable[[], Any]:
        """One execution on ``inputs``, as a call for the thread that makes it (an async step gets
        an event loop of its own; a GPU step's kernels are waited for: their time is its time)."""
        instance = self.instance
        if instance.is_async:
            loop = asyncio.new_event_loop()
            self._loops.append(loop)

            def run() -> Any:
                return loop.run_until_complete(instance.execute_async(inputs))
        else:
            run = functools.partial(instance.execute, inputs)
        if not self.gpu:
            return lambda: serving.as_arrays(run())
        import cupy

        def on_gpu() -> Any:
            outputs = serving.as_arrays(run())
            cupy.cuda.Device().synchronize()
            return outputs

        return on_gpu

    def call(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """One execution, its outputs checked against the step's declaration."""
        outputs = self.caller(inputs)()
        batched = self.profiler.batched
        rows = int(next(iter(inputs.values())).shape[0]) if batched and inputs else None
        check_outputs(self.step, outputs, batched=batched, batch_size=rows)
        return outputs

    def finalize(self, *, quiet: bool = False) -> None:
        """``finalize()`` the instance; ``quiet``: say nothing of its error (another is on its way)."""
        for loop in self._loops:
            loop.close()
        self._loops.clear()
        try:
            with self.profiler._blame(self.name, " (in finalize())"):
                self.instance.finalize()
        except StepError:
            if not quiet:
                raise


# ------------------------------------------------------------------ timing


#: Inputs from this size up are timed out of the caches (below it, a cold read costs nothing
#: that shows, and evicting before each of hundreds of calls would cost seconds).
_COLD_BYTES = 256 << 10
_EVICTION = 32 << 20  # bytes written between two timed calls: more than the last-level cache
_evicting: list[Any] = []


def _evict() -> None:
    """Write more memory than the caches hold, so the next call reads its inputs from memory."""
    if not _evicting:
        _evicting.append(np.zeros(_EVICTION, np.uint8))
    _evicting[0] += 1


def _time(call: Callable[[], Any], repeats: int | None,
          before: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median wall and CPU seconds of ``call()`` after one warm-up call; ``before()`` runs, untimed,
    before each timed call."""
    call()
    walls: list[float] = []
    cpus: list[float] = []
    start = perf_counter()
    while True:
        if before is not None:
            before()
        c0, w0 = process_time(), perf_counter()
        call()
        w1, c1 = perf_counter(), process_time()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        done = len(walls)
        if repeats is not None:
            if done >= repeats:
                break
        elif done >= MAX_REPEATS or (done >= MIN_REPEATS and w1 - start >= TARGET_S):
            break
    return statistics.median(walls), statistics.median(cpus)


# ------------------------------------------------------------------ the cache


class _Cache:
    """The profiles file: ``{"format": 1, "profiles": {key: profile}}``; written whole, through
    a temporary file (:func:`~pipelines.output_paths.replace_text`), keeping the entries of other
    pipelines and steps that share it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = output_file(path, "the step profile cache")
        self.entries = self._read(warn=True)
        self.added: dict[str, dict[str, Any]] = {}

    def _read(self, *, warn: bool) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("profiles"), dict):
                raise PipelinesError(f"format {data.get('format')!r}, not {CACHE_FORMAT}")
        except (OSError, ValueError, AttributeError, PipelinesError) as exc:
            if warn:
                warnings.warn(
                    f"step profile cache {str(self.path)!r} cannot be read ({exc}); its steps are profiled again "
                    "and the file is replaced",
                    stacklevel=2,
                )
            return {}
        return data["profiles"]

    def get(self, key: str) -> StepProfile | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            return StepProfile.from_json(entry)
        except PipelinesError:  # a damaged entry is measured again
            return None

    def put(self, key: str, profile: StepProfile) -> None:
        self.entries[key] = self.added[key] = profile.to_json()

    def write(self) -> None:
        if not self.added:
            return
        entries = self._read(warn=False)  # what another run may have added meanwhile
        entries.update(self.added)
        replace_text(self.path, json.dumps({"format": CACHE_FORMAT, "profiles": entries}, indent=1, sort_keys=True))
        self.added = {}


def _cache_key(
    digest: str,
    inputs: Mapping[str, TensorSpec],
    returns: Sequence[str],
    sizes: Sequence[int],
    device: str,
    given: tuple[tuple[int, ...], tuple[float, ...]] | None,
) -> str:
    """The step's code, what it is handed (dtype and dims of a row), what it hands on, the batch
    sizes, its device, any cost given, and this machine's Python, numpy and cores."""
    key = {
        "format": CACHE_FORMAT,
        "digest": digest,
        "inputs": {n: s.to_dict() for n, s in inputs.items()},
        "returns": list(returns),
        "rows": list(sizes),
        "device": device,
        "given": None if given is None else [list(given[0]), list(given[1])],
        "environment": _environment(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _environment() -> list[Any]:
    return [platform.python_version(), np.__version__, platform.machine(), usable_cores()]


# ------------------------------------------------------------------ arguments


def _batch_sizes(batch_sizes: Sequence[int] | None) -> tuple[int, ...] | None:
    if batch_sizes is None:
        return None
    sizes = list(batch_sizes) if not isinstance(batch_sizes, (int, str)) else [batch_sizes]
    if not sizes or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in sizes):
        raise ArgumentError(f"batch_sizes are ints >= 1, such as (1, 2, 4, 8); got {batch_sizes!r}")
    return tuple(sorted({int(b) for b in sizes}))


def _given_costs(plan: ExecutionPlan, costs: Mapping[str, Any] | None) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
    """``costs=`` by live node: a node's own name wins over its step's name."""
    if not costs:
        return {}
    if not isinstance(costs, Mapping):
        raise ArgumentError(f"costs is a dict of step name -> µs (or -> {{rows: µs}}); got {type(costs).__name__}")
    by_step: dict[str, list[str]] = {}
    for n in plan.nodes:
        by_step.setdefault(n.step, []).append(n.name)
    nodes = set(plan.order)
    out: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}
    for name in sorted(costs, key=lambda k: k in nodes):  # step names first, then node names override
        targets = [name] if name in nodes else by_step.get(name, [])
        if not targets:
            raise ArgumentError(
                f"costs names {name!r}, which is no live step of pipeline {plan.pipeline!r}; "
                f"its steps are {list(plan.order)}",
                pipeline=plan.pipeline, step=str(name),
            )
        curve = _given_curve(plan.pipeline, name, costs[name])
        for target in targets:
            out[target] = curve
    return out


def _given_curve(pipeline: str, name: str, value: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
    def refuse() -> ArgumentError:
        return ArgumentError(
            f"costs[{name!r}] is {value!r}; give µs >= 0 for one execution, or {{rows: µs}} by batch size",
            pipeline=pipeline, step=name,
        )

    points = value if isinstance(value, Mapping) else {1: value}
    try:
        pairs = sorted((int(r), float(us)) for r, us in points.items())
    except (TypeError, ValueError):
        raise refuse() from None
    if not pairs or any(r < 1 or not math.isfinite(us) or us < 0 for r, us in pairs) or len({r for r, _ in pairs}) != len(pairs):
        raise refuse()
    return tuple(r for r, _ in pairs), tuple(us for _, us in pairs)


def _backend(step: Step) -> str:
    ext = step.external
    return (ext.backend or ext.platform or "another backend") if ext is not None else "no Python code"


# ------------------------------------------------------------------ arrays


def _row_spec(dtype: str, value: Any, batched: bool) -> TensorSpec:
    """The dtype and dims of one row of ``value`` (the whole tensor where the pipeline does not batch)."""
    shape = tuple(int(d) for d in value.shape)
    return TensorSpec(dtype, shape[1:] if batched else shape)


def _rows_of(arrays: Mapping[str, Any], rows: int, have: int) -> dict[str, Any]:
    """A batch of ``rows`` rows made by repeating the ``have`` rows of each array."""
    index = np.arange(rows) % have
    return {n: np.take(_host(v), index, axis=0) for n, v in arrays.items()}


def _nbytes(value: Any) -> int:
    """What a tensor weighs on the wire: its bytes, or for BYTES each element's length plus its
    4-byte length prefix (Triton's serialisation)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return sum(4 + len(item if isinstance(item, bytes) else str(item).encode()) for item in value.flat)
    return int(getattr(value, "nbytes", 0))


def _host(value: Any) -> Any:
    if hasattr(value, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(value)
    return value


def _device(step: Step) -> str:
    return "gpu" if step.options.device == "gpu" else "cpu"


def _gpu_available() -> bool:
    from ..runtime.device import gpu_available  # imported here: the runtime only matters to a GPU step

    return gpu_available()

