"""``p.predict(profile, ...)``: a pipeline's forms simulated on a server profile.

The server profile (``pipelines calibrate``) prices the boundaries; the step profiles
(:mod:`pipelines.predict.step_profiles`, each step run for real here) price the steps; the
simulator (:mod:`pipelines.predict.simulator`) plays the server's schedule on a virtual
clock. This module builds what the simulator is given (:class:`~pipelines.predict.spec.SimSpec`)
from those three, and shapes its answers into a :class:`Prediction`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..forms import FORMS
from ..forms import form as form_named
from ..graph import Pipeline
from ..plan import ensemble_refusal, plan_of
from ..tables import format_table
from ..tensor import TensorSpec, numpy_dtype
from .configuration import Configuration, default_configuration
from .spec import Curve, Load, SimResult, SimSpec, StepSpec, WayCost

__all__ = ["Prediction", "PredictionRow", "Predictor", "predict"]

MIB = float(1 << 20)
#: A closed loop's measured requests and warm-up. It settles into a repeating schedule: 500 give the
#: figures of 8000 within 0.8 % (throughput) and 1.4 % (p50), most of them exactly, in half the time
#: of 1000 (docs/prediction.md, "The queues"). An open loop's figures are a sample: it keeps Load's 1000.
CLOSED_LOOP = {"requests": 500, "warmup": 50}


@dataclass(frozen=True)
class PredictionRow:
    """One form at one load, as the simulation predicts it."""

    form: str
    concurrency: int | None
    rate: float | None
    p50_ms: float
    p95_ms: float
    p99_ms: float
    throughput: float
    bottleneck: str
    utilisation: Mapping[str, float] = field(default_factory=dict)
    configuration: str = ""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["utilisation"] = dict(self.utilisation)
        return data

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"{self.rate:g}/s"

    def bottleneck_text(self) -> str:
        share = self.utilisation.get(self.bottleneck)
        return self.bottleneck if share is None else f"{self.bottleneck} {share:.0%}"


@dataclass(frozen=True)
class Prediction:
    """Rows of ``form``, ``concurrency`` (or ``rate``), ``p50_ms``, ``p95_ms``, ``p99_ms``,
    ``throughput`` and ``bottleneck``; a table in the terminal and in notebooks."""

    pipeline: str
    rows: tuple[PredictionRow, ...]
    profile: str = ""
    notes: tuple[str, ...] = ()

    def winner(self, concurrency: int | None = None, rate: float | None = None) -> str:
        """The form with the highest predicted throughput at that load."""
        at = [r for r in self.rows if r.concurrency == concurrency and r.rate == rate]
        if not at:
            raise ArgumentError(f"no prediction at concurrency={concurrency} rate={rate}")
        return max(at, key=lambda r: (r.throughput, -r.p50_ms)).form

    def as_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.rows]

    def _table(self) -> tuple[list[str], list[list[str]]]:
        headers = ["form", "load", "p50 ms", "p95 ms", "p99 ms", "infer/s", "bottleneck"]
        body = [[r.form, r.load, f"{r.p50_ms:.2f}", f"{r.p95_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.throughput:.1f}",
                 r.bottleneck_text()] for r in self.rows]
        return headers, body

    def __str__(self) -> str:
        headers, body = self._table()
        text = f"predicted for pipeline {self.pipeline!r} ({self.profile})\n" + format_table(headers, body)
        return "\n".join([text, *(f"note: {n}" for n in self.notes)])

    def _repr_html_(self) -> str:
        from html import escape

        headers, body = self._table()
        head = "".join(f"<th>{escape(h)}</th>" for h in headers)
        rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in body)
        notes = "".join(f"<p>{escape(n)}</p>" for n in self.notes)
        return (f"<p>predicted for pipeline <b>{escape(self.pipeline)}</b> ({escape(self.profile)})</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{notes}")


def _ways(cost: Any) -> tuple[WayCost, WayCost]:
    """A profile boundary as the simulator reads it: the measured curve each way, or, for an
    old profile with only a line, half its fixed cost each way plus its cost per byte."""
    if cost.sizes:
        return WayCost(tuple(cost.sizes), tuple(cost.in_us)), WayCost(tuple(cost.sizes), tuple(cost.out_us))
    line = WayCost((0, int(MIB)), (cost.fixed_us / 2, cost.fixed_us / 2 + cost.us_per_mib))
    return line, line


def _rows_of(pipeline: Pipeline, inputs: Mapping[str, Any]) -> int:
    if not pipeline.batched:
        return 1
    first = next(iter(inputs.values()))
    return int(np.shape(first)[0]) if np.ndim(first) else 1


def _nbytes(arrays: Mapping[str, Any]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())


def _row_bytes(spec: TensorSpec) -> float:
    """What one row of ``spec`` weighs: its dims (a variable one counts 1) by its item size (BYTES:
    one pointer an element)."""
    itemsize = 8 if spec.dtype == "BYTES" else numpy_dtype(spec.dtype).itemsize
    return float(np.prod([max(1, d) for d in spec.dims])) * itemsize


class Predictor:
    """Everything one pipeline's simulations share: the server profile's boundaries, the step
    profiles, the request's sizes. :meth:`spec` builds one configuration's
    :class:`~pipelines.predict.spec.SimSpec`; :meth:`simulate` runs it. ``advise`` makes one
    and simulates hundreds of configurations with it, measuring the steps once.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        profile: Any,
        *,
        inputs: Mapping[str, Any] | None = None,
        module: Any = None,
        costs: Mapping[str, Any] | None = None,
        cache: str | os.PathLike[str] | bool | None = True,
        cores: float | None = None,
        allow_mismatch: bool = False,
        progress: Callable[[int, int, str], None] | None = None,
        when_rates: Mapping[str, float] | None = None,
    ) -> None:
        from ..calibration.profile import default_lanes, load_profile
        from .step_profiles import profile_steps

        if not isinstance(pipeline, Pipeline):
            raise ArgumentError(f"predict needs a Pipeline; got {type(pipeline).__name__}")
        pipeline.validate()
        self.pipeline = pipeline
        self.server = load_profile(profile)
        self.notes: list[str] = []
        self._require_match(allow_mismatch)
        if inputs is None:
            inputs = sample_inputs(pipeline, module)
        self.inputs = dict(inputs)
        if cache is True:
            cache = (Path(profile).with_suffix(".steps.json")
                     if isinstance(profile, (str, os.PathLike)) else None)
        elif cache is False:
            cache = None
        self.steps = profile_steps(pipeline, self.inputs, cache=cache, costs=costs, progress=progress)
        self.plan = plan_of(pipeline, warn=False)
        self.rows = _rows_of(pipeline, self.inputs)
        self.in_bytes = _nbytes(self.inputs) / self.rows
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
        self.when_rates = self._when_rates(when_rates or {}, module)

    def _output_bytes(self) -> float:
        """What the request's answer weighs per row: each output's shape as its step handed it
        on (from the step profiles, so an external step priced by ``costs=`` needs no stand-in)."""
        total = 0.0
        for ref in self.pipeline.outputs.values():
            spec = self.steps[ref.node].outputs.get(ref.name)
            if spec is None:
                continue
            total += _row_bytes(spec)
        return total

    def _when_rates(self, given: Mapping[str, float], module: Any) -> dict[str, float]:
        """Each ``when`` condition's share of rows where it holds, by :meth:`Term.describe`.

        A condition tensor's share of true rows is ``given`` (by ``NODE.TENSOR``, a pipeline
        input's name, or ``NODE`` where the node gives one BOOL), else counted over the sample
        requests (the module's own ``sample_inputs``, or the request given) where the tensor is
        a pipeline input or the output of a step that reads pipeline inputs only; else 1 with
        a note. A negated condition holds on the other rows.
        """
        terms = {t.describe(): t for n in self.plan.nodes for t in n.when}
        if not terms and given:
            raise ArgumentError(f"pipeline {self.pipeline.name!r} has no `when` block; drop when_rates")
        names = {}
        for t in terms.values():
            names[t.tensor if t.node is None else f"{t.node}.{t.tensor}"] = t
            if t.node is not None:
                names.setdefault(t.node, t)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ArgumentError(f"when_rates names {unknown}; the conditions of pipeline {self.pipeline.name!r} "
                                f"are {sorted(k for k in names if '.' in k or k in self.pipeline.inputs)}")
        shares: dict[tuple[str | None, str], float] = {}
        for name, share in given.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                raise ArgumentError(f"when_rates[{name!r}] is the share of rows where it is true, 0..1; got {share!r}")
            shares[names[name].key] = float(share)
        rates = {}
        for label, term in terms.items():
            share = shares.get(term.key)
            if share is None:
                share = shares[term.key] = self._counted_share(term, module)
            rates[label] = 1.0 - share if term.negated else share
        return rates

    def _counted_share(self, term: Any, module: Any) -> float:
        """The share of true rows of a condition tensor over the sample requests, where it can be had."""
        from ..sample_inputs import sample_requests

        label = term.tensor if term.node is None else f"{term.node}.{term.tensor}"
        if module is None:  # the module that declared the pipeline, as the benchmark finds it
            module = sys.modules.get(getattr(self.pipeline, "__module__", "") or "")
        try:
            requests = sample_requests(self.pipeline, module=module) if module is not None else [self.inputs]
        except Exception:  # noqa: BLE001 - any failure of a user's sample hook: the request given stands in
            requests = [self.inputs]
        node = self.plan.node(term.node) if term.node is not None else None
        if node is not None and any(s.node is not None for s in node.inputs):
            self.notes.append(f"when: {label}'s share of true rows was taken as 1 (it is computed from other steps); "
                              f"give when_rates={{{label!r}: SHARE}} (--when-rate {label}=SHARE)")
            return 1.0
        values = []
        for request in requests:
            if term.node is None:
                value = request[term.tensor]
            else:
                step = self.pipeline.nodes[term.node].step
                value = step(**{s.input: request[s.tensor] for s in node.inputs})[term.tensor]
            values.append(np.asarray(value, dtype=bool).reshape(-1))
        share = float(np.concatenate(values).mean()) if values else 1.0
        self.notes.append(f"when: {label} is true on {share:.0%} of the sample's rows "
                          f"({sum(v.size for v in values)} rows); --when-rate {label}=SHARE sets another share")
        return share

    def _require_match(self, allow_mismatch: bool) -> None:
        """Step profiles are measured on this machine: the server profile must come from one like it."""
        from ..machine import machine_info

        found = self.server.require_match(machine=machine_info(), allow_mismatch=allow_mismatch)
        self.notes += [f"the profile was measured elsewhere: {d}" for d in found]

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

    def spec(self, configuration: Configuration) -> SimSpec:
        """The simulator's view of ``configuration`` (steps in the plan's order)."""
        fused = configuration.form == "fused"

        def warm(name: str, measured: Any, figure: str) -> tuple[float, ...]:
            # In the fused model a step reads what the steps before it just wrote in the same
            # process, from the caches; a stub reads what another process wrote (timed cold).
            timed = getattr(measured, "warm_" + figure)
            fed_in_process = all(s.node is not None for s in self.plan.node(name).inputs)
            return timed if fused and timed and fed_in_process else getattr(measured, figure)

        steps = []
        for model in self.plan.models:
            choice = configuration.models.get(model.name)
            for node_name in model.nodes:
                node = self.pipeline.nodes[node_name]
                measured = self.steps[node_name]
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
            costs=self.costs,
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

    def row(self, configuration: Configuration, load: Load, label: str = "") -> PredictionRow:
        result = self.simulate(configuration, load)
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


def sample_inputs(pipeline: Pipeline, module: Any = None) -> dict[str, Any]:
    """One request for a pipeline with no inputs given: ``module``'s own ``sample_inputs()`` or
    ``make_sample()`` where it has one (as the benchmark sends), else random tensors shaped by
    the pipeline's input specs."""
    from ..sample_inputs import sample_requests

    return dict(sample_requests(pipeline, module=module)[0])


def predict(
    pipeline: Pipeline,
    profile: Any,
    concurrency: Sequence[int] | int | None = (1, 4, 16),
    forms: Iterable[str] | None = None,
    *,
    rate: Sequence[float] | float | None = None,
    **options: Any,
) -> Prediction:
    """Predict each form of ``pipeline`` at each concurrency (closed loop) or rate (open loop).

    ``profile``: a server profile or the path of its JSON file. ``options`` are
    :class:`Predictor`'s: ``inputs``, one sample request
    (default: the pipeline module's own samples, else random tensors). ``costs``: µs per call
    (or ``{rows: µs}``) for steps not to measure here, such as external models without a
    stand-in. ``cache``: where the step profiles are kept (default: beside the profile file).
    ``cores``: the server's cores (default: those of the machine the profile was measured on);
    ``allow_mismatch``: use a profile measured on another machine (warns instead of refusing).
    """
    wanted = loads(concurrency, rate)
    predictor = Predictor(pipeline, profile, **options)
    rows = []
    for name in predictor.forms(forms):
        configuration = predictor.default(name)
        for load in wanted:
            rows.append(predictor.row(configuration, load))
    return Prediction(pipeline.name, tuple(rows), predictor.describe(), tuple(predictor.notes))
