"""What a pipeline compiles to, decided once: composing model names, live nodes,
and the ensemble tensor that carries each wire. The ensemble and BLS compilers
both read this plan, so the two forms always call the same models.

A step used by several nodes becomes **one** composing model, shared by those
nodes (as a hand-written ensemble refers to one model twice): its instances
and its dynamic batcher then serve both uses, so requests from the two nodes
can be batched together, and the repository loads one Python stub per instance
instead of one per node. Composing models are named ``<pipeline>__<step>``; a
different step object that reuses a step name is named ``<pipeline>__<node>``.
Nodes that feed no pipeline output are left out: nothing would read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import networkx as nx

from ..errors import CompileError, InvalidNameError
from ..graph import Pipeline, TensorRef
from ..names import MAX_NAME_LENGTH
from ..step import Step

__all__ = ["CompilePlan", "ModelPlan", "NodePlan", "TOP_LEVEL_SUFFIXES", "plan_pipeline"]

#: The suffix of each top-level model in a ``"both"`` repository.
TOP_LEVEL_SUFFIXES = {"ensemble": "_ensemble", "bls": "_bls", "bls-sync": "_bls_sync"}

# Two underscores keep composing names apart from the one-underscore suffixes above.
_SEPARATOR = "__"
# One path component holds at most 255 bytes on common file systems.
_MAX_MODEL_NAME = 2 * MAX_NAME_LENGTH - 1


@dataclass(frozen=True)
class ModelPlan:
    """One composing model: the step it serves and the nodes that call it."""

    name: str
    step: Step
    nodes: tuple[str, ...]
    max_batch_size: int


@dataclass(frozen=True)
class NodePlan:
    """One live node: the model it calls and how its tensors are wired.

    ``inputs`` and ``outputs`` map the step's tensor names to ensemble tensor
    names; ``outputs`` holds only the outputs something reads. ``sources``
    says which pipeline tensor feeds each input.
    """

    name: str
    step: Step
    model: str
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    sources: Mapping[str, TensorRef]


@dataclass(frozen=True)
class CompilePlan:
    """A validated pipeline, decided for compilation; see the module docstring."""

    pipeline: Pipeline
    models: tuple[ModelPlan, ...]
    nodes: tuple[NodePlan, ...]

    @property
    def repeated_outputs(self) -> list[tuple[str, str]]:
        """``(output, earlier output)`` pairs that expose one tensor twice."""
        seen: dict[tuple[str | None, str], str] = {}
        pairs = []
        for name, ref in self.pipeline.outputs.items():
            key = (ref.node, ref.name)
            if key in seen:
                pairs.append((name, seen[key]))
            else:
                seen[key] = name
        return pairs

    @property
    def name(self) -> str:
        return self.pipeline.name

    def model_of(self, node: str) -> str:
        return next(n.model for n in self.nodes if n.name == node)


def plan_pipeline(pipeline: Pipeline) -> CompilePlan:
    """Validate ``pipeline`` and decide its composing models and ensemble tensors."""
    pipeline.validate()
    _check_ranks(pipeline)
    live = _live_nodes(pipeline)
    order = [n for n in pipeline.topological_order() if n in live]
    models = _name_models(pipeline, order)
    tensors = _name_tensors(pipeline, order)

    nodes = []
    for node_name in order:
        node = pipeline.nodes[node_name]
        bindings = dict(node.bindings)
        inputs = {i: _tensor_of(ref, tensors) for i, ref in bindings.items()}
        outputs = {o: tensors[(node_name, o)] for o in node.step.outputs if (node_name, o) in tensors}
        nodes.append(
            NodePlan(
                name=node_name,
                step=node.step,
                model=models[node_name],
                inputs=MappingProxyType(inputs),
                outputs=MappingProxyType(outputs),
                sources=MappingProxyType(bindings),
            )
        )

    model_plans: dict[str, ModelPlan] = {}
    for node_name in order:
        model = models[node_name]
        if model in model_plans:
            prev = model_plans[model]
            model_plans[model] = ModelPlan(model, prev.step, prev.nodes + (node_name,), prev.max_batch_size)
        else:
            node = pipeline.nodes[node_name]
            model_plans[model] = ModelPlan(model, node.step, (node_name,), node.max_batch_size)
    return CompilePlan(pipeline, tuple(model_plans.values()), tuple(nodes))


def top_level_name(pipeline: Pipeline, target: str, *, both: bool) -> str:
    """The top-level model's name: the pipeline's own, or with its ``"both"`` suffix."""
    return pipeline.name + TOP_LEVEL_SUFFIXES[target] if both else pipeline.name


def _check_ranks(pipeline: Pipeline) -> None:
    # Triton rejects a tensor with no dims; a scalar per batch item is dims [1].
    specs = [(None, "pipeline input", n, s) for n, s in pipeline.inputs.items()]
    for node in pipeline.nodes.values():
        specs += [(node.name, "input", n, s) for n, s in node.step.inputs.items()]
        specs += [(node.name, "output", n, s) for n, s in node.step.outputs.items()]
    for node_name, what, tensor, spec in specs:
        if spec.rank == 0:
            where = f"step {node_name!r} {what}" if node_name else what
            raise CompileError(
                f"pipeline {pipeline.name!r}: {where} {tensor!r} is declared with no dims ({spec}); "
                f"Triton needs at least one dim, so declare it as TensorSpec({spec.dtype!r}, [1])",
                pipeline=pipeline.name, step=node_name, tensor=tensor,
            )


def _live_nodes(pipeline: Pipeline) -> set[str]:
    graph = pipeline.graph
    live: set[str] = set()
    for ref in pipeline.outputs.values():
        live |= nx.ancestors(graph, ref.node) | {ref.node}
    return live


def _name_models(pipeline: Pipeline, order: list[str]) -> dict[str, str]:
    """Node name -> composing model name, one model per distinct step object."""
    by_step: dict[int, str] = {}
    taken: dict[str, Step] = {}
    names = {}
    for node_name in order:
        step = pipeline.nodes[node_name].step
        name = by_step.get(id(step))
        if name is None:
            for candidate in _candidates(pipeline.name, step.name, node_name):
                if candidate not in taken:
                    name = candidate
                    break
            if len(name) > _MAX_MODEL_NAME:
                raise InvalidNameError(
                    f"pipeline {pipeline.name!r}: step {node_name!r} would compile to a model named "
                    f"{name!r} ({len(name)} characters, over {_MAX_MODEL_NAME}); shorten the pipeline "
                    "or the step name",
                    pipeline=pipeline.name, step=node_name,
                )
            by_step[id(step)] = name
            taken[name] = step
        names[node_name] = name
    return names


def _candidates(pipeline: str, step: str, node: str):
    yield f"{pipeline}{_SEPARATOR}{step}"
    yield f"{pipeline}{_SEPARATOR}{node}"
    i = 2
    while True:
        yield f"{pipeline}{_SEPARATOR}{node}_{i}"
        i += 1


def _name_tensors(pipeline: Pipeline, order: list[str]) -> dict[tuple[str, str], str]:
    """(node, output) -> ensemble tensor name, for every output something reads.

    A pipeline output keeps its own name. Internal wires are named
    ``<node>.<output>``, made unique against every other name, so no internal
    tensor can collide with a pipeline input or output.
    """
    names: dict[tuple[str, str], str] = {}
    used = set(pipeline.inputs)
    for out_name, ref in pipeline.outputs.items():
        key = (ref.node, ref.name)
        used.add(out_name)
        if key not in names:  # a second exposure of one tensor is the ensemble's problem, not BLS's
            names[key] = out_name
    for node_name in order:
        for input_ref in pipeline.nodes[node_name].bindings.values():
            key = (input_ref.node, input_ref.name)
            if input_ref.is_input or key in names:
                continue
            base = f"{input_ref.node}.{input_ref.name}"
            candidate, i = base, 1
            while candidate in used:
                candidate = f"{base}_{i}"
                i += 1
            names[key] = candidate
            used.add(candidate)
    return names


def _tensor_of(ref: TensorRef, tensors: Mapping[tuple[str, str], str]) -> str:
    return ref.name if ref.is_input else tensors[(ref.node, ref.name)]
