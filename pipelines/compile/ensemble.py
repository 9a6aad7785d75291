"""The ensemble form: ``platform: "ensemble"`` with one ``ensemble_scheduling``
step per live node, wired by ``input_map``/``output_map`` over the tensor names
the plan chose, plus two constructions that work around Triton's ensemble
scheduler (facts and sources in ``docs/triton_ensemble.md``):

- **Output copies.** Triton prunes the steps of an ensemble that a request's
  outputs do not need, and the pruning miscounts a tensor that is both an
  ensemble output and another step's input: asking for a subset of outputs
  then fails with "unexpected deadlock". Where a pipeline output is also read
  by a step, or exposed under a second name, the producing model declares one
  more output holding the same data, and that copy is the ensemble's output.
  An external model declares only its own outputs, so where it would need a
  copy the ensemble answers through a gate model instead (below).
- **Failures as data, raised by one gate.** Triton 2.51 crashes (HTTP) or
  hangs (gRPC) when a composing model answers with an error while a sibling
  step of the same request is still running. Where two live nodes can run at
  the same time, every Python step returns its outputs plus a UINT8 ``__err__``
  tensor (``serving.failure_tensor``: a flag byte, then the error's text) instead
  of an error response; a step whose upstream failed skips its
  work and passes the failure on; and a final gate model, which runs after
  every other step, answers the request: the outputs, or one error that names
  the node as the user named it. Where one Python node produces every output
  (a diamond's join), that node is the gate: it answers with the first failure
  upstream, or its own, at no extra model call. Chains keep plain error
  responses: a chain has no sibling running, and each step model names its node
  in its own error, so a chain pays nothing.
- **Node aliases.** A node has a step model of its own unless its step is
  declared ``share_model=True`` (:mod:`pipelines.core.plan`, model names). A model
  that several nodes share learns its node from the name its first input
  arrives under: that input and one alias of it per node (``x__at_<node>``) are
  declared optional, and each node's ensemble step maps the tensor to its own
  alias. The name costs nothing and frees the shared model's chain from the gate
  (docs/compiled_repository.md, compiled models against hand-written ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from ..core.plan import gated_ensemble
from ..core.planning import plan_of, refuse_streaming_form
from ..core.tensor import TensorSpec
from ..errors import CompileError
from .bound_plan import BoundNode, CompilePlan, bind_plan
from .configs import add_io
from .ensemble_streams import StreamWiring, stream_wiring
from .ensemble_wiring import (
    ERR_OUTPUT,
    NODE_ALIAS,
    TensorNames,
    alias_extras,
    aliased,
    exposure_copies,
    exposures_of,
    fresh_output,
    node_aliases,
    placeholders,
    readers_of,
    tensor_of,
)
from .repository import CompiledModel
from .step_models import PLAN_FORMAT, model_files, plan_json

__all__ = [
    "ERR_INPUT",
    "ERR_OUTPUT",
    "GATE_PLAN",
    "NODE_ALIAS",
    "EnsembleLayout",
    "ModelExtras",
    "compile_ensemble",
    "compile_form",
    "ensemble_layout_of",
    "layout_ensemble",
]

#: Prefix of the optional BYTES inputs that carry the failures of the steps upstream.
ERR_INPUT = "__err_in_"
GATE_PLAN = "gate.json"
# UINT8, not BYTES: a stub under numpy 2 (a GPU server's) cannot carry BYTES (docs/gpu.md).
_ERR_SPEC = TensorSpec("UINT8", [-1])


@dataclass(frozen=True)
class ModelExtras:
    """What a composing model declares beyond its step's own tensors, for the ensemble.

    ``copies`` maps each extra output to the step output whose data it repeats.
    ``err_inputs`` are the optional inputs carrying upstream failures, ``err_output``
    the output carrying the step's own (``None`` when failures stay error responses).
    ``placeholders`` gives, for each output, the dims of the stand-in value a failed
    step returns so that the ensemble can go on to the gate: every ``-1`` replaced
    by a size its readers accept. ``node_input`` is the input of a model shared by
    several nodes that arrives under another name from each (``node_aliases``:
    alias -> node); it and its aliases are optional.
    """

    copies: Mapping[str, str] = field(default_factory=dict)
    err_inputs: tuple[str, ...] = ()
    err_output: str | None = None
    placeholders: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    node_input: str | None = None
    node_aliases: Mapping[str, str] = field(default_factory=dict)
    carries: Mapping[str, tuple[str, TensorSpec]] = field(default_factory=dict)

    def add_to(self, config: mc.ModelConfig, step_outputs: Mapping[str, TensorSpec]) -> None:
        """Declare the extra tensors in the composing model's config."""
        if self.node_input is not None:
            declared = next(i for i in config.input if i.name == self.node_input)
            declared.optional = True  # each node gives it under its alias; a direct call under its name
            for alias in self.node_aliases:
                config.input.add(name=alias, data_type=declared.data_type, dims=list(declared.dims), optional=True)
        for alias, original in self.copies.items():
            spec = step_outputs[original]
            config.output.add(name=alias, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))
        for name in self.err_inputs:
            config.input.add(name=name, data_type=mc.TYPE_UINT8, dims=[-1], optional=True)
        if self.err_output:
            config.output.add(name=self.err_output, data_type=mc.TYPE_UINT8, dims=[-1])
        for output, (input_name, spec) in self.carries.items():
            # optional: a BLS model calling the streaming step directly gives none
            config.input.add(name=input_name, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims),
                             optional=True)
            config.output.add(name=output, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))

    def to_dict(self) -> dict:
        """The adapter's part of ``step.json`` (the node aliases only where the model has them)."""
        data = {
            "copies": dict(self.copies),
            "err_inputs": list(self.err_inputs),
            "err_output": self.err_output,
            "placeholders": {name: list(dims) for name, dims in self.placeholders.items()},
        }
        if self.node_input is not None:
            data.update(node_input=self.node_input, node_aliases=dict(self.node_aliases))
        if self.carries:
            data["carries"] = {out: {"input": i, "spec": spec.to_dict()} for out, (i, spec) in self.carries.items()}
        return data


@dataclass(frozen=True)
class _NodeWiring:
    node: BoundNode
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]


@dataclass(frozen=True)
class EnsembleLayout:
    """How one pipeline's ensemble is wired, decided before any model is compiled.

    ``gated`` says whether failures travel as data to the gate; ``extras`` holds
    what each composing model must declare for that (and for output copies).
    """

    plan: CompilePlan
    gated: bool
    extras: Mapping[str, ModelExtras]
    wiring: tuple[_NodeWiring, ...]
    # gate input -> ensemble tensor; pipeline output -> gate input
    gate_inputs: Mapping[str, str]
    gate_outputs: Mapping[str, str]
    # gate err input -> (node, model), in topological order
    gate_errors: Mapping[str, tuple[str, str]]

    def gate_name(self, ensemble: str) -> str:
        """``<ensemble>__gate``, or with a number where a step model (a step named "gate") has that name."""
        taken = {m.name for m in self.plan.models}
        name, i = f"{ensemble}__gate", 2
        while name in taken:
            name, i = f"{ensemble}__gate_{i}", i + 1
        return name


def layout_ensemble(plan: CompilePlan, *, gated: bool = False) -> EnsembleLayout:
    """Decide the ensemble's wiring, output copies and failure gate for ``plan``.

    It is gated where :func:`~pipelines.core.plan.gated_ensemble` says, or anyway with ``gated=True``
    (``benchmarks/compiled_vs_handwritten.py`` measures what the gate costs on a chain).
    """
    pipeline = plan.pipeline
    refuse_streaming_form(pipeline, "ensemble")  # a step that reads a stream whole
    used_inputs = {ref.name for node in plan.nodes for ref in node.sources.values() if ref.is_input}
    unused = [i for i in pipeline.inputs if i not in used_inputs]
    if unused:
        raise CompileError(
            f"pipeline {pipeline.name!r}: input {unused[0]!r} feeds no step that reaches an output; "
            "Triton refuses an ensemble with an unused input, so remove it or wire it to a step",
            pipeline=pipeline.name, tensor=unused[0],
        )
    names = TensorNames(plan)
    external = [n.name for n in plan.nodes if n.step.is_external]
    if gated or gated_ensemble(plan.plan, external, streams=streams(plan)):
        return _gated_layout(plan, names)
    return _plain_layout(plan, names)


def ensemble_layout_of(pipeline: Any) -> EnsembleLayout | None:
    """The layout ``pipeline``'s ensemble compiles to, or ``None`` where the compiler refuses it
    (the local runtime and the prediction run such a pipeline all the same).

    The prediction reads from it whether the ensemble has a gate model of its own
    (``gate_inputs``), which costs one more step per request.
    """
    try:  # its callers have said which nodes are dead already
        return layout_ensemble(bind_plan(pipeline, plan_of(pipeline, warn=False)))
    except Exception:  # noqa: BLE001 - whatever the compiler refuses: the caller says what follows
        return None


def compile_ensemble(plan: CompilePlan, name: str, layout: EnsembleLayout | None = None) -> list[CompiledModel]:
    """The ensemble model ``name`` over the composing models of ``plan``, and its gate if it has one."""
    layout = layout or layout_ensemble(plan)
    pipeline = plan.pipeline
    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=pipeline.max_batch_size)
    add_io(config, pipeline.inputs, pipeline.output_specs)
    if streams(plan):  # Triton serves it decoupled anyway; the config says what it does (docs/triton_decoupled.md)
        config.model_transaction_policy.decoupled = True
    for wiring in layout.wiring:
        step = config.ensemble_scheduling.step.add(model_name=wiring.node.model, model_version=-1)
        for key, value in wiring.inputs.items():
            step.input_map[key] = value
        for key, value in wiring.outputs.items():
            step.output_map[key] = value
    models = [CompiledModel(name, config, {})]
    if layout.gate_inputs:  # a gated ensemble whose last node is not the gate itself
        gate = _compile_gate(layout, layout.gate_name(name), ensemble=name)
        step = config.ensemble_scheduling.step.add(model_name=gate.name, model_version=-1)
        for key, value in layout.gate_inputs.items():
            step.input_map[key] = value
        for output in pipeline.outputs:
            step.output_map[output] = output
        models.append(gate)
    return models


def streams(plan: CompilePlan) -> bool:
    """Whether a live step of ``plan`` streams: the ensemble is decoupled and gated."""
    return any(node.step.streaming for node in plan.nodes)


# ------------------------------------------------------------------ shapes


# ------------------------------------------------------------------ plain ensembles


def _plain_layout(plan: CompilePlan, names: TensorNames) -> EnsembleLayout:
    """A chain: each step answers its own failures; copies only where an output is also read."""
    readers, exposed = readers_of(plan), exposures_of(plan)
    copies: dict[str, dict[str, str]] = {m.name: {} for m in plan.models}
    # Copies a node needs, by (node, output): one per exposure, except that an output no step
    # reads keeps its first exposure on the original tensor.
    wiring = []
    internal: dict[str, str] = {}  # plan tensor name -> the internal name its readers use now
    for node in plan.nodes:
        taken = set(node.step.outputs) | set(copies[node.model].values()) | set(copies[node.model])
        outputs = dict(node.outputs)
        for output in node.step.outputs:
            outs = exposed.get((node.name, output), [])
            read = bool(readers.get((node.name, output)))
            if not outs or (len(outs) == 1 and not read):
                continue
            if read:
                fresh = names.fresh(f"{node.name}.{output}")
                internal[outputs[output]] = fresh
                outputs[output] = fresh
            else:
                outputs[output], outs = outs[0], outs[1:]
            # A shared model declares the copies its busiest node needs; other nodes map fewer.
            mine = [alias for alias, original in copies[node.model].items() if original == output]
            for i, exposure in enumerate(outs):
                if i < len(mine):
                    alias = mine[i]
                else:
                    alias = fresh_output(taken, f"{output}__copy")
                    copies[node.model][alias] = output
                outputs[alias] = exposure
        wiring.append((node, outputs))
    aliases = node_aliases(plan)
    final = tuple(
        _NodeWiring(
            node,
            MappingProxyType(aliased({k: internal.get(v, v) for k, v in node.inputs.items()}, node, aliases)),
            MappingProxyType(outputs),
        )
        for node, outputs in wiring
    )
    extras = {
        model: ModelExtras(copies=MappingProxyType(copies[model]), **alias_extras(aliases.get(model)))
        for model in copies if copies[model] or model in aliases
    }
    empty = MappingProxyType({})
    return EnsembleLayout(plan, False, MappingProxyType(extras), final, empty, empty, empty)


# ------------------------------------------------------------------ gated ensembles


def _last_node_answers(plan: CompilePlan, python_nodes: set[str]) -> str | None:
    """The node that can be the gate itself, if there is one, else ``None``.

    That is a Python node that produces every pipeline output: every other live node
    is then upstream of it, so it runs last and alone, and no subset of outputs can
    prune it. Its model must be its own (it answers with error responses, where the
    nodes upstream carry theirs as data), and every failure text must name its node:
    a model shared by several nodes does, by its input's alias, unless it has no input.
    """
    producers = {ref.node for ref in plan.pipeline.outputs.values()}
    if len(producers) != 1 or plan.pipeline.negated_outputs:  # only the gate model negates an output
        return None
    (last,) = producers
    if streams(plan):  # a streaming step's model carries its failures as data: a gate answers for it
        last_step = next(n.step for n in plan.nodes if n.name == last)
        if last_step.streaming:
            return None
    shared = [m for m in plan.models if len(m.nodes) > 1 and not plan.step_of(m).is_external]
    if last not in python_nodes or any(last in m.nodes or not plan.step_of(m).inputs for m in shared):
        return None
    return last


def _gated_layout(plan: CompilePlan, names: TensorNames) -> EnsembleLayout:
    pipeline = plan.pipeline
    python_nodes = {n.name for n in plan.nodes if not n.step.is_external}
    by_name = {n.name: n for n in plan.nodes}
    last = _last_node_answers(plan, python_nodes)
    stream = stream_wiring(plan, names)

    # Every pipeline output comes out of the gate, and the steps write internal tensors;
    # unless the last node is the gate, which then writes the outputs itself.
    renamed = {}
    for node in plan.nodes:
        for output, tensor in node.outputs.items():
            if tensor in pipeline.outputs and node.name != last:
                renamed[tensor] = names.fresh(f"{node.name}.{output}")
    err_tensor = {n: names.fresh(f"{n}.{ERR_OUTPUT}") for n in sorted(python_nodes - {last})}

    # The failures a node must look at: its nearest Python producers (an external model
    # cannot carry a failure, so one upstream of it is looked through).
    sources: dict[str, list[str]] = {}
    for node in plan.nodes:
        found: list[str] = []
        for ref in node.sources.values():
            if ref.is_input:
                continue
            for source in ([ref.node] if ref.node in python_nodes else sources[ref.node]):
                if source not in found:
                    found.append(source)
        sources[node.name] = found
    if stream is not None:
        _carry_failures(stream, sources, python_nodes)

    err_counts: dict[str, int] = {}
    for node in plan.nodes:
        if node.name in python_nodes:
            err_counts[node.model] = max(err_counts.get(node.model, 0), len(sources[node.name]))

    aliases = node_aliases(plan)
    extras = {}
    for model in plan.models:
        step = plan.step_of(model)
        if step.is_external:
            continue
        taken = set(step.inputs) | set(step.outputs)
        if ERR_OUTPUT in taken or any(t.startswith(ERR_INPUT) for t in taken):
            raise CompileError(
                f"pipeline {pipeline.name!r}: step {model.nodes[0]!r} has a tensor named {ERR_OUTPUT!r} or "
                f"starting with {ERR_INPUT!r}; the ensemble uses those names to carry failures, so rename it",
                pipeline=pipeline.name, step=model.nodes[0],
            )
        err_inputs = tuple(f"{ERR_INPUT}{i}" for i in range(err_counts.get(model.name, 0)))
        carries = _carries_of(stream, model.nodes)
        if model.nodes == (last,):
            # It answers with the first failure upstream, or its own, as an error response.
            copies = exposure_copies(plan, by_name[last])
            extras[model.name] = ModelExtras(copies=MappingProxyType(copies), err_inputs=err_inputs)
            continue
        extras[model.name] = ModelExtras(
            err_inputs=err_inputs,
            err_output=ERR_OUTPUT,
            placeholders=MappingProxyType(placeholders(plan, model, by_name)),
            carries=carries,
            **alias_extras(aliases.get(model.name)),
        )

    wiring = []
    for node in plan.nodes:
        read = {k: stream.carried_input(node.name, v) if stream else v for k, v in node.inputs.items()}
        inputs = aliased({k: renamed.get(v, v) for k, v in read.items()}, node, aliases)
        outputs = {k: renamed.get(v, v) for k, v in node.outputs.items()}
        if stream is not None and node.name == stream.stream:
            for tensor, carry in stream.carries.items():
                inputs[carry.input], outputs[carry.output] = tensor, carry.tensor
        if node.name in python_nodes:
            for i, source in enumerate(sources[node.name]):
                inputs[f"{ERR_INPUT}{i}"] = err_tensor[source]
            if node.name == last:
                copies = extras[node.model].copies
                exposed = exposures_of(plan)
                for output in node.step.outputs:
                    aliases = [a for a, original in copies.items() if original == output]
                    for alias, exposure in zip(aliases, exposed.get((last, output), [])[1:], strict=True):
                        outputs[alias] = exposure
            else:
                outputs[ERR_OUTPUT] = err_tensor[node.name]
        wiring.append(_NodeWiring(node, MappingProxyType(inputs), MappingProxyType(outputs)))
    if last is not None:
        empty = MappingProxyType({})
        return EnsembleLayout(plan, True, MappingProxyType(extras), tuple(wiring), empty, empty, empty)

    gate_inputs: dict[str, str] = {}
    gate_outputs: dict[str, str] = {}
    by_tensor: dict[str, str] = {}
    for output, ref in pipeline.outputs.items():
        tensor = tensor_of(plan, ref, renamed)
        if tensor not in by_tensor:
            by_tensor[tensor] = f"value__{len(by_tensor)}"
            gate_inputs[by_tensor[tensor]] = tensor
        gate_outputs[output] = by_tensor[tensor]
    gate_errors = {}
    for node in plan.nodes:
        # Once per response, the gate cannot read a failure made once per request: the stream carries it.
        if node.name in python_nodes and (stream is None or node.name in stream.per_response | {stream.stream}):
            key = f"err__{len(gate_errors)}"
            gate_inputs[key] = err_tensor[node.name]
            gate_errors[key] = (node.name, node.model)
    return EnsembleLayout(
        plan, True, MappingProxyType(extras), tuple(wiring),
        MappingProxyType(gate_inputs), MappingProxyType(gate_outputs), MappingProxyType(gate_errors),
    )


def _carry_failures(stream: StreamWiring, sources: dict[str, list[str]], python_nodes: set[str]) -> None:
    """The failure inputs of a streaming ensemble (``sources``: node -> the nodes whose failures it
    reads), moved so that no step run once per response reads one made once per request: the
    streaming step reads the failures of the steps whose tensors it carries, and passes them on."""
    for node, found in sources.items():
        if node in stream.per_response:
            found[:] = [s for s in found if not stream.reads_the_request(node, s)]
    found = sources[stream.stream]
    for carry in stream.carries.values():
        if carry.producer is None:
            continue
        for source in [carry.producer] if carry.producer in python_nodes else sources[carry.producer]:
            if source not in found:
                found.append(source)


def _carries_of(stream: StreamWiring | None, nodes: tuple[str, ...]) -> Mapping[str, tuple[str, TensorSpec]]:
    """A streaming step model's carries: output -> (input, spec)."""
    if stream is None or stream.stream not in nodes:
        return MappingProxyType({})
    return MappingProxyType({c.output: (c.input, c.spec) for c in stream.carries.values()})


def _compile_gate(layout: EnsembleLayout, name: str, *, ensemble: str) -> CompiledModel:
    """The Python model that answers a gated ensemble: its outputs, or the first failure."""
    plan = layout.plan
    pipeline = plan.pipeline
    specs = {}
    for output, ref in pipeline.outputs.items():
        specs.setdefault(layout.gate_outputs[output], ref.spec)
    inputs = {key: specs[key] for key in layout.gate_inputs if key in specs}
    inputs.update({key: _ERR_SPEC for key in layout.gate_errors})
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=pipeline.max_batch_size)
    add_io(config, inputs, pipeline.output_specs)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if pipeline.max_batch_size > 0:
        # Requests that arrive while it is busy are handed over together (it only forwards them).
        config.dynamic_batching.SetInParent()
    data = {
        "format": PLAN_FORMAT,
        "pipeline": pipeline.name,
        "ensemble": ensemble,
        "outputs": {output: {"input": key, "dtype": pipeline.outputs[output].spec.dtype,
                             **({"negated": True} if output in pipeline.negated_outputs else {})}
                    for output, key in layout.gate_outputs.items()},
        "errors": [{"input": key, "node": node, "model": model} for key, (node, model) in layout.gate_errors.items()],
    }
    files = {**model_files("gate_model.py"), f"1/{GATE_PLAN}": plan_json(data)}
    return CompiledModel(name, config, files)


def compile_form(plan: CompilePlan, name: str, form: Any, options: Mapping[str, Any]) -> list[CompiledModel]:
    """The forms table's entry (:mod:`pipelines.forms`): the ensemble ``name`` and its gate."""
    return compile_ensemble(plan, name, options.get("ensemble_layout"))
