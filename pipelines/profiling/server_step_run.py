"""One short run of a pipeline's step models on a Triton server (the bundled one, started on them and their twins,
or one at a URL that serves them), each called at two batch sizes and timed by Triton's statistics; the fused model
times its own steps. What :func:`~pipelines.profiling.server_steps.server_step_costs` makes step costs of
(docs/prediction.md, "Take step costs from your server").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compile import compile_pipeline
from ..core.plan import ExecutionPlan, NodePlan
from ..core.planning import plan_of
from ..core.requests import check_request
from ..errors import ArgumentError, PipelinesError
from ..predict.step_profile import StepProfile
from .code_digest import code_digest
from .step_cache import cache_key, value_digest
from .step_runner import host, rows_of

if TYPE_CHECKING:  # pragma: no cover
    from ..core.graph import Graph

__all__ = ["METHOD", "CannotServe", "Measured", "ServerRun", "first_line", "model_name_of"]

#: Calls of a step's model at each batch size: at least this many, for at least this long, at most
#: :data:`MOST` (after :data:`WARMUP` untimed: a stub's first calls allocate its shared memory).
LEAST, SECONDS, MOST, WARMUP = 3, 0.03, 100, 1
#: The most bytes (in and out) one timed request carries: every one crosses the client too, over the protocol,
#: so a larger batch is not timed on the server; its cost follows the local curve (:func:`_spanned`).
TIMED_BYTES = 8 << 20
#: Rounds over the steps: each figure is the median of its rounds' means.
ROUNDS = 3
Measured = dict[str, tuple[StepProfile, dict[str, Any]]]  # by node: a profile as measured, and how
#: How the server's figures are taken, in the cache's keys: figures taken otherwise are not reused.
# 1: each step less its twin, at two batch sizes, in three rounds
METHOD = 1


class CannotServe(PipelinesError):
    """The server cannot serve the pipeline's short run; its message says which model and why."""



def _identity(url: str | None, protocol: str) -> str:
    """The server that measured, for the cache's key and the notes: the bundled Triton by its wheel's version
    (none started to ask), one at a URL by its own answer (``?`` where it gives none: it cannot serve the run
    either, and nothing is kept)."""
    if url is not None:
        from ..triton import TritonClient

        try:
            with TritonClient(url, protocol, timeout=10) as client:
                version = str(client.metadata().get("version") or "?")
        except PipelinesError:
            version = "?"
        return f"the Triton {version} server at {url} over {protocol}"
    try:
        version = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return f"the bundled Triton server (nvidia-pytriton {version}) over {protocol}"


class ServerRun:
    """One pipeline's server step costs: each node's cache key, and the run on the server."""

    def __init__(self, pipeline: Graph, inputs: Mapping[str, Any], local: Mapping[str, StepProfile],
                 url: str | None, protocol: str) -> None:
        if protocol not in ("http", "grpc"):
            raise ArgumentError(f"protocol must be 'http' or 'grpc'; got {protocol!r}")
        self.pipeline, self.local, self.url, self.protocol = pipeline, local, url, protocol
        self.plan: ExecutionPlan = plan_of(pipeline, warn=False)
        self.request = check_request(inputs, pipeline.inputs, pipeline=pipeline.name,
                                     max_batch_size=pipeline.max_batch_size)
        self.request_rows = int(next(iter(self.request.values())).shape[0]) \
            if pipeline.batched and self.request else 1
        self.where = _identity(url, protocol)
        self.keys = self._keys()

    def _timed(self, n: NodePlan) -> bool:
        """Whether node ``n`` is timed on the server: a step with a model, measured here (not a cost given)."""
        mine = self.local.get(n.name)
        return n.kind == "step" and mine is not None and mine.source in ("measured", "stand_in")

    def _keys(self) -> dict[str, str]:
        """Each timed node's cache key: as a step profile's (its code, and where each input came from), and the server."""
        origins = {(None, name): value_digest(host(value)) for name, value in self.request.items()}
        keys: dict[str, str] = {}
        for n in self.plan.nodes:
            step = self.pipeline.nodes[n.name].step
            mine = self.local[n.name]
            key = cache_key(code_digest(step), mine.inputs, n.returns, mine.rows, mine.device, None,
                            {s.input: origins[s.key] for s in n.inputs}, server=f"{self.where}, method {METHOD}")
            origins.update({(n.name, out): f"{key}/{out}" for out in (*n.returns, *step.outputs)})
            if self._timed(n):
                keys[n.name] = key
        return keys

    def measure(self, nodes: list[str], say: Callable[[str], None]) -> tuple[Measured, Measured]:
        """``nodes`` timed on the server as step models, and (the bundled server) inside the fused model;
        :class:`CannotServe` where it cannot serve them."""
        try:
            with tempfile.TemporaryDirectory(prefix="pipelines-step-times-") as times:
                with self._served(say, times) as (client, cpu_of):
                    say(f"timing {len(nodes)} steps on {self.where}")
                    found = self._walk(client, cpu_of, set(nodes))
                    if self.url is None:
                        self._time_fused(client)
                # the server has stopped: each fused instance wrote its steps' times as it was finalized
                return found, self._fused_times(Path(times), set(nodes))
        except CannotServe:
            raise
        except PipelinesError as exc:  # the server failed meanwhile (it died, a call timed out)
            raise CannotServe(f"{self.where} failed the short run of pipeline {self.pipeline.name!r} "
                               f"({first_line(exc)})") from None

    @contextlib.contextmanager
    def _served(self, say: Callable[[str], None], times: str
                ) -> Iterator[tuple[Any, Callable[[str], Callable[[], int] | None]]]:
        """A client of the server that serves the step models (and on the bundled server their twins), and for a
        model a reading of its stubs' CPU ns (None where they cannot be read: another machine's server)."""
        from ..triton import TritonClient
        from ..triton.statistics import process_cpu_ns
        from ..triton.stubs import server_stubs

        models = sorted({self.plan.node(n).model for n in self.keys})
        with contextlib.ExitStack() as stack:
            if self.url is not None:
                try:
                    client = stack.enter_context(TritonClient(self.url, self.protocol, timeout=60))
                    client.metadata()
                except PipelinesError as exc:
                    raise CannotServe(f"the server at {self.url} cannot be reached ({first_line(exc)})") from None
                if missing := [m for m in models if not client.ready(m)]:
                    raise CannotServe(
                        f"the server at {self.url} does not serve model {missing[0]!r}"
                        f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}: deploy the pipeline's "
                        f"ensemble or bls repository there (pipelines compile)")
                yield client, lambda model: None
                return
            server = self._bundled(models, say, stack, times)
            stack.callback(server.stop)
            client = stack.enter_context(server.client(self.protocol, timeout=60))

            def cpu_of(model: str) -> Callable[[], int] | None:
                pids = [s.pid for s in server_stubs(server.pid) if s.model == model]
                if not pids or any(process_cpu_ns(pid) is None for pid in pids):
                    return None
                return lambda: sum(process_cpu_ns(pid) or 0 for pid in pids)

            yield client, cpu_of

    def _bundled(self, models: list[str], say: Callable[[str], None], stack: contextlib.ExitStack, times: str) -> Any:
        """The bundled server, started on the pipeline's step models, their twins and its fused model, which
        writes its steps' times into ``times``; :class:`CannotServe` naming a model that fails to load, with
        Triton's reason."""
        import warnings

        from ..compile.models.fused_model import STEP_TIMES
        from ..compile.repository import ModelRepository
        from ..triton import TritonServer

        form = "bls" if self.plan.conditional else "ensemble"  # an ensemble cannot skip a `when` block's steps
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a step sent by value is said so when the pipeline is compiled
                compiled = compile_pipeline(self.pipeline.validate(), form)
        except PipelinesError as exc:
            raise CannotServe(f"pipeline {self.pipeline.name!r} does not compile to the {form} form "
                               f"({first_line(exc)})") from None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                twins = compile_pipeline(self.twins.validate(), "ensemble")
                fused = compile_pipeline(self.pipeline.validate(), "fused")
        except PipelinesError as exc:
            raise CannotServe(f"the twins of the steps of pipeline {self.pipeline.name!r} (what their stubs cost) "
                               f"do not compile ({first_line(exc)})") from None
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-step-costs-")))
        served = {m: compiled.models[m] for m in models}
        served.update({m: twins.models[m] for m in self.twin_models.values()})
        served.update({m: model for m, model in fused.models.items() if m not in served})
        ModelRepository(served).write(root / "repo")
        say(f"starting the bundled Triton server on {len(models)} step models of {self.pipeline.name!r} "
            "and their twins")
        server = TritonServer(root / "repo", restart_on_crash=False, restart_dead_stubs=False, env={STEP_TIMES: times})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a model that fails to load: said below, with its reason
                server.start()
        except PipelinesError as exc:
            raise CannotServe(f"the bundled Triton server did not start ({first_line(exc)})") from None
        if server.unavailable:
            # a step's own model first: the fused model that runs the same step fails with it
            model = min(server.unavailable, key=lambda m: (m not in models, m))
            reason = server.unavailable[model]
            server.stop()
            raise CannotServe(f"the bundled Triton server cannot serve model {model!r} of pipeline "
                               f"{self.pipeline.name!r}: it failed to load ({first_line(reason)})")
        return server

    @functools.cached_property
    def twins(self) -> Graph:
        """A pipeline of each timed step's twin: its inputs and outputs, and no work (:func:`_twin`). What the
        twin holds its instance for is its stub's (and adapter's) part of the step's, in the same moment."""
        from ..core.graph import Graph

        specs = {f"in__{node}__{name}": spec for node in self.keys
                 for name, spec in self.pipeline.nodes[node].step.inputs.items()}
        twins = Graph(f"{self.pipeline.name}__twins", inputs=specs, max_batch_size=self.pipeline.max_batch_size)
        for node in self.keys:
            step = self.pipeline.nodes[node].step
            added = twins.add(_twin(node, step, self.local[node], self.pipeline.batched), name=node,
                              **{name: twins.input(f"in__{node}__{name}") for name in step.inputs})
            for out in self.plan.node(node).returns:
                twins.output(f"out__{node}__{out}", added[out])
        return twins

    @functools.cached_property
    def twin_models(self) -> dict[str, str]:
        """Each timed node's twin's model, by node."""
        plan = plan_of(self.twins, warn=False)
        return {node: plan.node(node).model for node in self.keys}

    def _walk(self, client: Any, cpu_of: Callable[[str], Callable[[], int] | None],
              timed: set[str]) -> dict[str, tuple[StepProfile, dict[str, Any]]]:
        """The request propagated through the step models in the plan's order (a select merged here,
        as the executors do); then each node in ``timed`` timed at two of its batch sizes (:func:`_timed_sizes`), with its
        twin where it has one, in :data:`ROUNDS` rounds over the nodes (a moment the machine slowed weighs on
        one round of a step)."""
        values: dict[tuple[str | None, str], Any] = {(None, name): v for name, v in self.request.items()}
        handed_to: dict[str, dict[str, Any]] = {}
        for n in self.plan.nodes:
            step = self.pipeline.nodes[n.name].step
            handed = {s.input: values[s.key] for s in n.inputs}
            if n.kind != "step" or not self._timed(n):  # a select, or a cost given: run here for what follows
                try:
                    outputs = step(**handed) if step.impl is not None else self._zeros(step)
                except Exception as exc:  # noqa: BLE001 - whatever the user's step raises: said with it
                    raise CannotServe(f"step {n.name!r} of pipeline {self.pipeline.name!r} failed here, where it "
                                       f"feeds the steps after it ({type(exc).__name__}: {exc})") from None
            else:
                outputs = self._call(client, n.model, n, handed)
                if n.name in timed:
                    handed_to[n.name] = handed
            values.update({(n.name, name): np.asarray(host(outputs[name])) for name in n.returns})
        twinned = self.url is None
        jobs = []  # (node, index of the size, model, batch)
        for name, handed in handed_to.items():
            n, rows = self.plan.node(name), self.local[name].rows
            for i in _timed_sizes(self.local[name]):
                batch = rows_of(handed, rows[i], self.request_rows) if self.pipeline.batched else dict(handed)
                jobs.append((n, i, n.model, batch))
                if twinned:
                    jobs.append((n, i, self.twin_models[name], batch))
        cpus = {model: cpu_of(model) for _, _, model, _ in jobs}
        for n, _, model, batch in jobs:  # a stub's first calls at a size allocate its shared memory: untimed
            for _ in range(WARMUP):
                self._call(client, model, n, batch)
        rounds: dict[tuple[str, int, str], list[tuple[int, float, float]]] = {}
        for _ in range(ROUNDS):
            for n, i, model, batch in jobs:
                rows = self.local[n.name].rows[i]
                rounds.setdefault((n.name, i, model), []).append(self._burst(client, model, n, rows, batch,
                                                                             cpus[model]))
        out = {}
        for name in handed_to:
            n, mine = self.plan.node(name), self.local[name]
            known = cpus[n.model] is not None and (not twinned or cpus[self.twin_models[name]] is not None)
            measured, spreads, requests = {}, [], 0
            for i in _timed_sizes(mine):
                own = held = rounds[name, i, n.model]
                requests += sum(r[0] for r in own)
                if twinned:  # each round's step less its twin's, taken side by side
                    twin = rounds[name, i, self.twin_models[name]]
                    own = [(c, w - tw, u - tu) for (c, w, u), (_, tw, tu) in zip(own, twin, strict=True)]
                wall = statistics.median(r[1] for r in own)
                measured[i] = (wall, statistics.median(r[2] for r in own))
                # over what the model held: a step of a few µs less its twin would read its noise as hundreds of %
                whole = statistics.median(r[1] for r in held)
                spreads.append((max(r[1] for r in own) - min(r[1] for r in own)) / 2 / whole if whole > 0 else 0.0)
            wall_us, cpu_us = _spanned(mine, measured)
            found = replace(mine, wall_us=wall_us, cpu_us=cpu_us if known else wall_us, warm_wall_us=(),
                            warm_cpu_us=(), source="server")
            if "spread" in {f.name for f in fields(StepProfile)}:  # how far its rounds disagreed, as a profile's
                found = replace(found, spread=max(spreads))
            out[name] = (found, {"model": n.model, "requests": requests, "cpu": known, "twin": twinned,
                                 "sizes": [mine.rows[i] for i in sorted(measured)]})
        return out

    def _time_fused(self, client: Any) -> None:
        """The fused model called one request after another at the first batch size and at the smallest of the
        steps' largest timed ones (their own times are the model's to write)."""
        model = model_name_of(self.pipeline)
        timed = [self.local[name] for name in self.keys]
        if not timed:
            return
        sizes = tuple(sorted({timed[0].rows[0], min(p.rows[_timed_sizes(p)[-1]] for p in timed)}))
        for rows in sizes:
            batch = rows_of(self.request, rows, self.request_rows) if self.pipeline.batched else dict(self.request)
            for _ in range(WARMUP + ROUNDS * LEAST):
                try:
                    client.infer(model, batch)
                except PipelinesError as exc:
                    raise CannotServe(f"the fused model {model!r} failed on the server ({first_line(exc)})") from None

    def _fused_times(self, folder: Path, nodes: set[str]) -> Measured:
        """Each of ``nodes``' times inside the fused model, from the files its instances wrote: the median
        call at each of its batch sizes it ran at (a step of a `when` block runs on the rows it selects), the
        sizes between along its local curve (warm, as the fused form reads it), its CPU time the local share
        of its wall time."""
        import json

        calls: dict[tuple[str, int], list[float]] = {}
        for path in folder.glob("*.json"):
            try:
                for node, rows, us in json.loads(path.read_text(encoding="utf-8")):
                    calls.setdefault((node, int(rows)), []).append(float(us))
            except (OSError, ValueError, TypeError):  # an instance that did not finish its file: its calls are lost
                continue
        out: Measured = {}
        for name in sorted(nodes):
            mine = self.local[name]
            base = replace(mine, wall_us=mine.warm_wall_us or mine.wall_us, cpu_us=mine.warm_cpu_us or mine.cpu_us)
            share = {rows: c / w if w > 0 else 1.0 for rows, c, w in zip(base.rows, base.cpu_us, base.wall_us,
                                                                          strict=True)}
            measured = {i: (statistics.median(calls[name, rows]), statistics.median(calls[name, rows]) * share[rows])
                        for i, rows in enumerate(mine.rows) if calls.get((name, rows))}
            if not measured:  # an async step, or one that ran at none of its sizes: not timed
                continue
            wall_us, cpu_us = _spanned(base, measured)
            out[name] = (replace(mine, wall_us=wall_us, cpu_us=cpu_us, warm_wall_us=(), warm_cpu_us=(),
                                 source="server"),
                         {"model": model_name_of(self.pipeline), "requests": sum(len(calls[name, mine.rows[i]])
                                                                                  for i in measured),
                          "cpu": False, "fused": True, "sizes": [mine.rows[i] for i in sorted(measured)]})
        return out

    def _call(self, client: Any, model: str, n: NodePlan, arrays: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return client.infer(model, dict(arrays), outputs=list(n.returns) or None)
        except PipelinesError as exc:
            raise CannotServe(f"model {model!r} (step {n.name!r}) failed on the server ({first_line(exc)})") from None

    def _burst(self, client: Any, model: str, n: NodePlan, rows: int, batch: Mapping[str, Any],
               cpu: Callable[[], int] | None) -> tuple[int, float, float]:
        """``model`` called one request after another on ``batch`` (``rows`` rows): the calls, what one execution
        held its instance (Triton's batch statistics, µs) and its stubs' CPU time per call (µs)."""
        from ..triton.statistics import held_by_batch

        before = client.statistics(model)
        cpu_before = cpu() if cpu is not None else 0
        began, calls = time.perf_counter(), 0
        while calls < LEAST or (time.perf_counter() - began < SECONDS and calls < MOST):
            self._call(client, model, n, batch)
            calls += 1
        cpu_used = (cpu() - cpu_before) if cpu is not None else 0
        held = held_by_batch(before, client.statistics(model), model)
        executions, held_us = held.get(rows) or max(held.values(), default=(calls, math.nan))
        if not math.isfinite(held_us):
            raise CannotServe(f"model {model!r} (step {n.name!r}) reported no statistics on the server")
        return calls, held_us, cpu_used / 1e3 / max(executions, 1)

    def _zeros(self, step: Any) -> dict[str, Any]:
        rows = (self.request_rows,) if self.pipeline.batched else ()
        return {o: np.full(rows + tuple(1 if d == -1 else d for d in spec.dims), b"" if spec.dtype == "BYTES" else 0,
                           dtype=spec.numpy_dtype) for o, spec in step.outputs.items()}


def model_name_of(pipeline: Graph) -> str:
    """The pipeline's fused model."""
    from ..forms import model_name

    return model_name(pipeline.name, "fused", side_by_side=False)


def _timed_sizes(mine: StepProfile) -> list[int]:
    """Which of a step's batch sizes (indices) are timed on the server: its first, and its largest whose request
    and answer carry at most :data:`TIMED_BYTES`."""
    fits = [i for i, rows in enumerate(mine.rows) if rows * (mine.in_bytes + mine.out_bytes) <= TIMED_BYTES]
    return sorted({0, max(fits, default=0)})


def _twin(node: str, step: Any, mine: StepProfile, batched: bool) -> Any:
    """A step with ``step``'s inputs and outputs that does no work: it answers fresh zeros shaped as the step's
    outputs were (by the batch's rows), so its stub copies as many bytes in and out as the step's does."""
    from ..core.step import step as declare

    shapes = {out: (spec.numpy_dtype, tuple(spec.dims)) for out, spec in mine.outputs.items()}

    def twin(**arrays: Any) -> dict[str, Any]:
        lead = (len(next(iter(arrays.values()))),) if batched and arrays else ()
        return {out: np.zeros(lead + dims, dtype=dtype) if dtype != np.object_ else np.full(lead + dims, b"", object)
                for out, (dtype, dims) in shapes.items()}

    return declare(twin, inputs=dict(step.inputs), outputs={o: step.outputs[o] for o in shapes}, name=f"{node}_twin")


def _spanned(mine: StepProfile, measured: Mapping[int, tuple[float, float]]) -> tuple[tuple[float, ...], ...]:
    """Wall and CPU µs at each of the local profile's rows from the server's at its first and last (by index): the
    sizes between follow the local curve, scaled by the server's over the local, that ratio taken linearly in rows
    between the two ends."""
    first, last = min(measured), max(measured)

    def ratio(server: float, local: float) -> float:
        return server / local if local > 0 else 1.0

    walls, cpus = [], []
    for i, rows in enumerate(mine.rows):
        at = 0.0 if last == first else (rows - mine.rows[first]) / (mine.rows[last] - mine.rows[first])
        for figure, local, out in ((0, mine.wall_us, walls), (1, mine.cpu_us, cpus)):
            if i in measured:  # a step cheaper than its twin's noise: a µs of wall time, not nothing
                out.append(max(measured[i][figure], 1.0 - figure))
                continue
            scale = (1 - at) * ratio(measured[first][figure], local[first]) + at * ratio(measured[last][figure],
                                                                                           local[last])
            out.append(max(local[i] * scale, 1.0 - figure))
    return tuple(walls), tuple(cpus)



def first_line(what: Any) -> str:
    """The first line of an error's message (its type's name where it says nothing)."""
    text = str(what).strip()
    return text.splitlines()[0] if text else type(what).__name__
