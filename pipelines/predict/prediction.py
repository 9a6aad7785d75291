"""A pipeline's forms simulated on a server profile: the table of ``p.predict(profile, ...)``.

The server profile (``pipelines calibrate``) prices the boundaries; what was measured of the pipeline
(:class:`~pipelines.predict.measured.PipelineCosts`: the step profiles, the ``when`` shares, the machine's noise,
measured by :func:`pipelines.profiling.pipeline_costs.measure_pipeline`) prices the steps; the simulator
(:mod:`pipelines.predict.simulator`) plays the server's schedule on a virtual clock. This module builds what the
simulator is given (:class:`~pipelines.predict.spec.SimSpec`) from those, and shapes its answers into a
:class:`Prediction`. It measures nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from ..calibration.noise import MachineNoise
from ..calibration.profile import Profile, default_lanes, load_profile
from ..core.graph import Graph
from ..core.plan import ensemble_refusal
from ..core.planning import plan_of, refuse_streaming
from ..core.tensor import TensorSpec, numpy_dtype
from ..errors import ArgumentError
from ..forms import FORMS
from ..forms import form as form_named
from .configuration import Configuration, default_configuration
from .measured import PipelineCosts
from .prediction_rows import Prediction, PredictionRow
from .ranges import (
    MODEL_SPREAD,
    SIMULATION_SPREAD,
    Spread,
    Z,
    machine_spread,
    shift_spread,
    step_spread,
    ways,
    wide_sources,
    widening,
)
from .spec import Curve, Load, SimResult, SimSpec, StepSpec, WayCost

__all__ = ["SIMULATION_SPREAD", "Prediction", "PredictionRow", "Predictor", "checked_profile", "loads",
           "predicted_forms"]

#: A closed loop's measured requests and warm-up. It settles into a repeating schedule: 500 give the
#: figures of 8000 within 0.8 % (throughput) and 1.4 % (p50), most of them exactly, in half the time
#: of 1000 (docs/simulation.md, "The queues"). An open loop's figures are a sample: it keeps Load's 1000.
CLOSED_LOOP = {"requests": 500, "warmup": 50}
#: The closed loop each source of a range is simulated on (its costs one standard error up): it gives the figures of
#: 500 within 1.3 % in 29 % of the time, so a prediction with its ranges costs about 1.6 times one without.
RANGE_LOOP = {"requests": 120, "warmup": 30}


def _ways(cost: Any, shift: float = 0.0) -> tuple[WayCost, WayCost]:
    """A profile boundary as the simulator reads it (:func:`pipelines.predict.ranges.ways`)."""
    return ways(cost, shift)


def _row_bytes(spec: TensorSpec) -> float:
    """What one row of ``spec`` weighs: its dims (a variable one counts 1) by its item size (BYTES:
    one pointer an element)."""
    itemsize = 8 if spec.dtype == "BYTES" else numpy_dtype(spec.dtype).itemsize
    return float(np.prod([max(1, d) for d in spec.dims])) * itemsize


def checked_profile(pipeline: Graph, profile: Profile | str | os.PathLike[str], *,
                    allow_mismatch: bool = False) -> tuple[Profile, list[str]]:
    """What is checked before anything is measured: ``pipeline`` (a valid pipeline that does not stream) and the
    server ``profile`` (loaded), which must come from a machine like this one, where the steps are measured
    (:class:`~pipelines.errors.ProfileMismatchError`; with ``allow_mismatch`` a warning). The profile, and a note
    for each difference."""
    from ..commands.machine import machine_info

    if not isinstance(pipeline, Graph):
        raise ArgumentError(f"predict needs a Pipeline; got {type(pipeline).__name__}")
    pipeline.validate()
    refuse_streaming(pipeline, "predicting (or advising) its forms")
    server = load_profile(profile)
    found = server.require_match(machine=machine_info(), allow_mismatch=allow_mismatch)
    return server, [f"the profile was measured elsewhere: {d}" for d in found]


class Predictor:
    """Everything one pipeline's simulations share: the server profile's boundaries, the step
    profiles, the request's sizes (all measured before, :class:`~pipelines.predict.measured.PipelineCosts`).
    :meth:`spec` builds one configuration's :class:`~pipelines.predict.spec.SimSpec`; :meth:`simulate` runs
    it. ``advise`` makes one and simulates hundreds of configurations with it.
    """

    def __init__(
        self,
        pipeline: Graph,
        server: Profile,
        measured: PipelineCosts,
        *,
        cores: float | None = None,
        notes: Iterable[str] = (),
    ) -> None:
        """``server``: the server profile, as :func:`checked_profile` gives it (its ``notes`` with it);
        ``measured``: the pipeline's costs; ``cores``: the server's (default: the profile's machine's)."""
        self.pipeline = pipeline
        self.server = server
        self.notes: list[str] = [*notes, *measured.notes]
        self.measured = measured
        self.steps = dict(measured.steps)
        self.local_steps = dict(measured.local_steps)
        self.fused_steps = dict(measured.fused_steps)
        self.plan = plan_of(pipeline, warn=False)
        self.rows = measured.rows
        self.in_bytes = measured.in_bytes
        self.out_bytes = self._output_bytes()
        self.costs = {name: _ways(cost) for name, cost in self.server.costs.items()}
        if cores is not None and not (isinstance(cores, (int, float)) and cores >= 1):
            raise ArgumentError(f"cores is a number >= 1 (the server's cores); got {cores!r}")
        # The server machine's cores, as the profile recorded them: the simulation shares them
        # between every CPU cost itself (the profile's measured "lanes" fold the client's own
        # one-thread limit into the cores, which the simulation now models apart).
        self.cores = float(cores) if cores is not None else default_lanes(self.server.machine)
        # The threads of a BLS stub's default executor, which runs its async_exec() calls: Python's
        # default, by all the machine's CPUs (os.cpu_count(), not those this process may use).
        cpus = int(cores) if cores is not None else int(self.server.machine.get("cpu_count") or self.cores)
        self.call_threads = min(32, cpus + 4)
        # fused_model.py's pool for its Python steps: max(2, the widest group's Python steps).
        python = {n.name for n in self.plan.nodes if n.kind == "step" and not pipeline.nodes[n.name].step.is_external}
        self.step_threads = max(2, max((sum(1 for n in g if n in python) for g in self.plan.groups), default=1))
        self.gate, self.ensemble_refused = self._ensemble_shape()
        self.when_rates = dict(measured.when_rates)
        self.noise, self.machine = self._noise(measured.noise)
        self._shifted_costs: dict[float, dict[str, tuple[WayCost, WayCost]]] = {0.0: self.costs}

    def _noise(self, own: MachineNoise) -> tuple[MachineNoise, dict[str, float]]:
        """What was seen of the machine (``own``: while the steps were measured, with the profile's record), and the
        machine's sources of every range (:func:`~pipelines.predict.ranges.machine_spread`): the server's own spread
        from window to window, and the larger load and steal of the calibration's and this prediction's (the steps'
        rounds' spread prices their costs' range already)."""
        recorded = self.server.noise
        seen = MachineNoise(other_load=own.other_load, steal=own.steal, cores=own.cores).combined(recorded)
        machine = machine_spread(seen, self.server.window_spread())
        wide = widening(machine)
        if recorded is None:
            self.notes.append("the profile has no noise record (calibrated before they were kept): how busy its "
                              "machine was is unknown; calibrate again to know")
        elif recorded.busy:
            self.notes.append(recorded.line("the machine the profile was calibrated on", wide))
        if own.busy:
            self.notes.append(own.line("this machine, while predict measured the steps,", wide))
        return own.combined(recorded), machine

    def _output_bytes(self) -> float:
        """What the request's answer weighs per row: each output's shape as its step handed it
        on (from the step profiles, so an external step priced by ``costs=`` needs no stand-in)."""
        total = 0.0
        for ref in self.pipeline.outputs.values():
            spec = self.steps[cast(str, ref.node)].outputs.get(ref.name)  # an output is a step's (Graph.output)
            if spec is None:
                continue
            total += _row_bytes(spec)
        return total

    def _ensemble_shape(self) -> tuple[bool, str | None]:
        """Whether the ensemble ends in a gate model, or why the compiler refuses an ensemble."""
        from ..compile.ensemble import ensemble_layout_of

        if self.plan.conditional:  # Triton's ensemble cannot skip the steps of a `when` block
            return False, ensemble_refusal(self.plan)

        layout = ensemble_layout_of(self.pipeline)
        if layout is None:
            return False, "the ensemble compiler refuses this pipeline"
        return bool(layout.gate_inputs), None

    def forms(self, forms: Iterable[str] | None = None) -> tuple[str, ...]:
        """The forms asked for (all by default), less the ensemble where it cannot be compiled."""
        names = tuple(FORMS) if forms is None else tuple(form_named(f).name for f in forms)
        if self.ensemble_refused and "ensemble" in names:
            self.notes.append(f"ensemble left out: {self.ensemble_refused}")
            names = tuple(n for n in names if n != "ensemble")
        return names

    def default(self, form: str) -> Configuration:
        return default_configuration(self.pipeline, form)

    def spec(self, configuration: Configuration, *, step_shift: float = 0.0, boundary_shift: float = 0.0) -> SimSpec:
        """The simulator's view of ``configuration`` (steps in the plan's order); ``step_shift`` and
        ``boundary_shift``: every step's cost, and every boundary's, that many of its standard errors up (down where
        negative): a step's from its rounds' spread, a boundary's from the profile's bootstrap intervals
        (:mod:`.ranges`)."""
        fused = configuration.form == "fused"

        def warm(name: str, measured: Any, figure: str) -> tuple[float, ...]:
            # In the fused model a step reads what the steps before it just wrote in the same
            # process, from the caches; a stub reads what another process wrote (timed cold).
            timed = getattr(measured, "warm_" + figure)
            fed_in_process = all(s.node is not None for s in self.plan.node(name).inputs)
            figures = timed if fused and timed and fed_in_process else getattr(measured, figure)
            if not step_shift or not measured.spread:
                return figures
            scale = math.exp(step_shift * step_spread(measured.spread))
            return tuple(v * scale for v in figures)

        steps = []
        for model in self.plan.models:
            choice = configuration.models.get(model.name)
            for node_name in model.nodes:
                node = self.pipeline.nodes[node_name]
                measured = (self.fused_steps if fused else self.steps)[node_name]
                if choice is None:
                    raise ArgumentError(f"the configuration has no options for model {model.name!r}")
                steps.append((node_name, StepSpec(
                    name=node_name,
                    deps=self._deps(node_name),
                    when=tuple(t.describe() for t in self.plan.node(node_name).when),
                    wall_us=Curve(tuple(measured.rows), tuple(warm(node_name, measured, "wall_us"))),
                    cpu_us=Curve(tuple(measured.rows), tuple(warm(node_name, measured, "cpu_us"))),
                    in_bytes=max(0.0, float(measured.in_bytes) - self._on_gpu_bytes(node_name, measured, "in")),
                    out_bytes=max(0.0, float(measured.out_bytes) - self._on_gpu_bytes(node_name, measured, "out")),
                    gil_share=float(measured.gil_share),
                    memory=float(measured.memory),
                    traffic=measured.traffic,
                    external=node.step.is_external,
                    instances=choice.instance_count,
                    max_batch_size=choice.max_batch_size,
                    dynamic_batching=choice.dynamic_batching and choice.max_batch_size > 0,
                    preferred_batch_sizes=choice.preferred_batch_sizes,
                    max_queue_delay_us=float(choice.max_queue_delay_us),
                    model=model.name,
                    in_tensors=max(1, len(measured.inputs)),
                    out_tensors=max(1, len(measured.outputs)),
                )))
        order = {name: i for i, name in enumerate(self.plan.order)}
        steps.sort(key=lambda pair: order[pair[0]])
        return SimSpec(
            form=configuration.form,
            steps=tuple(s for _, s in steps),
            rows=self.rows,
            in_bytes=self.in_bytes,
            out_bytes=self.out_bytes,
            costs=self._costs_at(boundary_shift),
            cores=self.cores,
            top_instances=configuration.top_instances,
            top_max_batch_size=self.pipeline.max_batch_size,
            gate=self.gate and configuration.form == "ensemble",
            when_rates=self.when_rates,
            wake=self.server.wake,
            wake_idle=self.server.wake_idle,
            call_threads=self.call_threads,
            step_threads=self.step_threads,
            round_request_us=self.server.round_request_us,
        )

    def _costs_at(self, shift: float) -> dict[str, tuple[WayCost, WayCost]]:
        if (found := self._shifted_costs.get(shift)) is None:
            found = self._shifted_costs[shift] = {name: ways(c, shift, self.server.ci_level)
                                                  for name, c in self.server.costs.items()}
        return found

    def _deps(self, name: str) -> tuple[str, ...]:
        """The steps ``name`` waits for; a select (merged by the executor, no model) stands for its own."""
        out: list[str] = []
        for after in self.plan.node(name).after:
            for dep in (self._deps(after) if self.plan.node(after).kind == "select" else (after,)):
                if dep not in out:
                    out.append(dep)
        return tuple(out)

    def _on_gpu(self, name: str) -> bool:
        """Whether node ``name`` gives its outputs on the GPU (a select: where all its branches do)."""
        if self.plan.node(name).kind == "select":
            return all(self._on_gpu(after) for after in self.plan.node(name).after)
        node = self.pipeline.nodes.get(name)
        return node is not None and node.step.options.device == "gpu"

    def _on_gpu_bytes(self, name: str, measured: Any, way: str) -> float:
        """Bytes per row that GPU step ``name`` takes from GPU steps (``way`` "in") or gives (``"out"``).

        They stay in device memory: a stub and a BLS call hand them on as a CUDA IPC handle, so
        no boundary prices them per byte (docs/gpu.md: one host-to-GPU copy a request, in every
        form). What comes from the host is priced as ever, and so is a GPU output that a CPU step
        takes: it is counted in that step's inputs."""
        if not self._on_gpu(name):
            return 0.0
        if way == "out":
            tensors = list(measured.outputs.values())
        else:
            tensors = [measured.inputs[s.input] for s in self.plan.node(name).inputs
                       if s.node is not None and s.input in measured.inputs and self._on_gpu(s.node)]
        return sum(_row_bytes(t) for t in tensors if t.dtype != "BYTES")

    def simulate(self, configuration: Configuration, load: Load) -> SimResult:
        from .simulator import simulate

        return simulate(self.spec(configuration), load)

    def row(self, configuration: Configuration, load: Load, label: str = "", *, ranges: bool = True) -> PredictionRow:
        """``configuration`` at ``load``: its simulated figures and, with ``ranges``, each one's 90 % interval
        (:mod:`pipelines.predict.ranges`): the simulation's own error, the steps' and the boundaries' costs (the
        configuration simulated again with each one standard error up), the server's window-to-window spread and the
        machine's load, in quadrature; a throughput's high end at most what the cores can do at the costs' low end."""
        from .simulator import core_ceiling, simulate

        result = self.simulate(configuration, load)
        bounds: dict[str, tuple[float, float] | None] = dict.fromkeys(("p50_ms_range", "p95_ms_range",
                                                                       "throughput_range"))
        spreads: dict[str, dict[str, float]] | None = None
        if ranges:
            short = replace(load, **RANGE_LOOP) if load.concurrency is not None else load
            moved = {}  # each source simulated one standard error up, where it has one
            if any(p.spread for p in self.steps.values()) or any(p.spread for p in self.fused_steps.values()):
                moved["steps"] = simulate(self.spec(configuration, step_shift=1.0), short)
            if any(c.in_ci or c.fixed_ci for c in self.server.costs.values()):
                moved["boundaries"] = simulate(self.spec(configuration, boundary_shift=1.0), short)
            alone = "alone" if load.concurrency == 1 else "queued"
            spreads = {}
            for name, figure in (("p50_ms_range", "p50_us"), ("p95_ms_range", "p95_us"),
                                 ("throughput_range", "throughput")):
                point = getattr(result, figure)
                model = MODEL_SPREAD["queued" if figure == "p95_us" else alone]
                parts = {"model": model, "simulation": SIMULATION_SPREAD,
                         **{source: shift_spread(point, getattr(r, figure)) for source, r in moved.items()},
                         **self.machine}
                spreads[figure] = parts
                low, high = Spread(parts).around(point)
                if figure == "throughput" and load.concurrency is not None:
                    # an open loop's throughput is its rate (what it sends, not the cores)
                    cheap = self.spec(configuration, step_shift=-Z, boundary_shift=-Z)
                    high = max(point, min(high, core_ceiling(cheap)))
                scale = 1e3 if figure.endswith("_us") else 1.0
                bounds[name] = (low / scale, high / scale)
        return PredictionRow(
            form=configuration.form,
            concurrency=load.concurrency,
            rate=load.rate,
            p50_ms=result.p50_us / 1e3,
            p95_ms=result.p95_us / 1e3,
            p99_ms=result.p99_us / 1e3,
            throughput=result.throughput,
            bottleneck=result.bottleneck,
            utilisation=dict(result.utilisation, cpu=result.cpu_utilisation),
            configuration=label,
            **bounds,
            spreads=spreads,
        )

    def describe(self) -> str:
        p = self.server
        return f"Triton {p.server_version or '?'} over {p.protocol}, {self.cores:g} cores, profiled {p.date}"


def loads(concurrency: Iterable[int] | int | None, rate: Iterable[float] | float | None) -> list[Load]:
    """The loads asked for: each concurrency, and each rate."""
    out: list[Load] = []
    if isinstance(concurrency, int):
        concurrency = (concurrency,)
    if isinstance(rate, (int, float)):
        rate = (rate,)
    for c in concurrency or ():
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
            raise ArgumentError(f"a concurrency is an int >= 1; got {c!r}")
        out.append(Load(concurrency=int(c), **CLOSED_LOOP))
    for r in rate or ():
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ArgumentError(f"a rate is requests/s > 0; got {r!r}")
        out.append(Load(rate=float(r)))
    if not out:
        raise ArgumentError("predict needs at least one concurrency or rate")
    return out


def predicted_forms(predictor: Predictor, wanted: Sequence[Load], forms: Iterable[str] | None = None) -> Prediction:
    """Each form of ``predictor``'s pipeline (``forms``: those asked for, all by default) simulated in its default
    configuration at each load of ``wanted`` (:func:`loads`): the table that ``p.predict(profile, ...)`` gives."""
    rows = []
    for name in predictor.forms(forms):
        configuration = predictor.default(name)
        for load in wanted:
            rows.append(predictor.row(configuration, load))
    if line := wide_sources([r.spreads for r in rows]):
        predictor.notes.append(line)
    return Prediction(predictor.pipeline.name, tuple(rows), predictor.describe(), tuple(predictor.notes),
                      predictor.noise, predictor.machine)
