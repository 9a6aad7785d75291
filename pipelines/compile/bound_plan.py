"""The execution plan as the compilers see it: :class:`pipelines.core.plan.ExecutionPlan`
bound to the pipeline's own objects (each node's :class:`~pipelines.core.step.Step`,
each input's :class:`~pipelines.core.graph.TensorRef`), with the ensemble tensor of
every wire resolved. Nothing is decided here: live nodes, order, models and
tensor names all come from the one plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..core.graph import Graph, TensorRef
from ..core.plan import ExecutionPlan, ModelPlan
from ..core.planning import plan_of
from ..core.step import Step

__all__ = ["BoundNode", "CompilePlan", "bind_plan"]


@dataclass(frozen=True)
class BoundNode:
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
    """A pipeline and its execution plan, bound for compilation."""

    pipeline: Graph
    plan: ExecutionPlan
    nodes: tuple[BoundNode, ...]

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def models(self) -> tuple[ModelPlan, ...]:
        return self.plan.models

    def step_of(self, model: ModelPlan) -> Step:
        """The step ``model`` serves (its nodes all call the one step)."""
        return self.pipeline.nodes[model.nodes[0]].step

    @property
    def repeated_outputs(self) -> list[tuple[str, str]]:
        """``(output, earlier output)`` pairs that expose one tensor twice."""
        firsts = ((o.name, self.plan.tensor(o.key).outputs[0]) for o in self.plan.outputs)
        return [(name, first) for name, first in firsts if name != first]

    def model_of(self, node: str) -> str:
        return self.plan.node(node).model


def bind_plan(pipeline: Graph, plan: ExecutionPlan | None = None) -> CompilePlan:
    """Bind ``plan`` (default: the pipeline's plan, computed now) to ``pipeline``'s objects."""
    plan = plan if plan is not None else plan_of(pipeline)
    nodes = []
    for node in plan.nodes:
        declared = pipeline.nodes[node.name]
        bindings = dict(declared.bindings)
        nodes.append(
            BoundNode(
                name=node.name,
                step=declared.step,
                model=node.model,
                inputs=MappingProxyType({s.input: plan.ensemble_name(s.key) for s in node.inputs}),
                outputs=MappingProxyType({o: plan.ensemble_name((node.name, o)) for o in node.returns}),
                sources=MappingProxyType({s.input: bindings[s.input] for s in node.inputs}),
            )
        )
    return CompilePlan(pipeline, plan, tuple(nodes))
