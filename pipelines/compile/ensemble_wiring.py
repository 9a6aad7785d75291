"""The wiring an ensemble is laid out from: fresh tensor names, who reads and exposes each
node's outputs, the per-node input aliases of a shared model, and each composing model's
placeholders. :mod:`pipelines.compile.ensemble` lays the plain and the gated ensemble out with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..core.graph import TensorRef
from ..core.plan import ModelPlan
from .bound_plan import BoundNode, CompilePlan

__all__ = ["ERR_OUTPUT", "NODE_ALIAS", "TensorNames", "alias_extras", "aliased", "exposure_copies", "exposures_of", "fresh_output",
           "node_aliases", "placeholders", "readers_of", "tensor_of"]

#: The BYTES output a step returns its failure in (empty when it succeeded).
ERR_OUTPUT = "__err__"
#: ``<input>__at_<node>``: the name a shared step model's first input arrives under from that node.
NODE_ALIAS = "{input}__at_{node}"


class TensorNames:
    """Fresh ensemble tensor names that collide with none the plan already uses."""

    def __init__(self, plan: CompilePlan) -> None:
        self.used = set(plan.pipeline.inputs) | set(plan.pipeline.outputs)
        for node in plan.nodes:
            self.used |= set(node.inputs.values()) | set(node.outputs.values())

    def fresh(self, base: str) -> str:
        candidate, i = base, 1
        while candidate in self.used:
            candidate = f"{base}_{i}"
            i += 1
        self.used.add(candidate)
        return candidate


def readers_of(plan: CompilePlan) -> dict[tuple[str, str], list[tuple[BoundNode, str]]]:
    """(node, output) -> the live (node, input) pairs that read it."""
    readers: dict[tuple[str, str], list[tuple[BoundNode, str]]] = {}
    for node in plan.nodes:
        for input_name, ref in node.sources.items():
            if not ref.is_input:
                readers.setdefault((ref.node, ref.name), []).append((node, input_name))
    return readers


def exposures_of(plan: CompilePlan) -> dict[tuple[str, str], list[str]]:
    """(node, output) -> the pipeline outputs that expose it, in declaration order."""
    exposed: dict[tuple[str, str], list[str]] = {}
    for output, ref in plan.pipeline.outputs.items():
        exposed.setdefault((ref.node, ref.name), []).append(output)
    return exposed


def fresh_output(taken: set[str], base: str) -> str:
    candidate, i = base, 1
    while candidate in taken:
        candidate = f"{base}{i}"
        i += 1
    taken.add(candidate)
    return candidate


def node_aliases(plan: CompilePlan) -> dict[str, tuple[str, dict[str, str]]]:
    """Python model shared by several nodes -> (its first input, node -> that input's alias for it)."""
    found = {}
    for model in plan.models:
        step = plan.step_of(model)
        if len(model.nodes) < 2 or step.is_external or not step.inputs:
            continue
        first = next(iter(step.inputs))
        taken = {*step.inputs, *step.outputs, ERR_OUTPUT}
        found[model.name] = (first, {
            node: fresh_output(taken, NODE_ALIAS.format(input=first, node=node)) for node in model.nodes
        })
    return found


def aliased(
    inputs: dict[str, str], node: BoundNode, aliases: Mapping[str, tuple[str, dict[str, str]]]
) -> dict[str, str]:
    """``node``'s input map, its model's first input under the node's alias where the model is shared."""
    if node.model not in aliases:
        return inputs
    first, alias = aliases[node.model]
    return {alias[node.name] if key == first else key: value for key, value in inputs.items()}


def alias_extras(entry: tuple[str, dict[str, str]] | None) -> dict[str, Any]:
    if entry is None:
        return {}
    first, alias = entry
    return {"node_input": first, "node_aliases": MappingProxyType({a: node for node, a in alias.items()})}


def exposure_copies(plan: CompilePlan, node: BoundNode) -> dict[str, str]:
    """Extra outputs of ``node`` for the second and later exposures of one of its outputs."""
    taken = set(node.step.inputs) | set(node.step.outputs)
    copies = {}
    for output in node.step.outputs:
        for _ in exposures_of(plan).get((node.name, output), [])[1:]:
            copies[fresh_output(taken, f"{output}__copy")] = output
    return copies


def tensor_of(plan: CompilePlan, ref: TensorRef, renamed: Mapping[str, str]) -> str:
    node = next(n for n in plan.nodes if n.name == ref.node)
    tensor = node.outputs[ref.name]
    return renamed.get(tensor, tensor)


def placeholders(plan: CompilePlan, model: ModelPlan, by_name: Mapping[str, BoundNode]) -> dict[str, tuple[int, ...]]:
    """Dims a failed step's stand-in outputs take: each ``-1`` becomes what a reader fixes, else 1."""
    readers = readers_of(plan)
    dims = {}
    for output, spec in plan.step_of(model).outputs.items():
        shape = list(spec.dims)
        for node_name in model.nodes:
            for reader, input_name in readers.get((node_name, output), []):
                wanted = by_name[reader.name].step.inputs[input_name].dims
                for i, d in enumerate(shape):
                    if d == -1 and i < len(wanted) and wanted[i] != -1:
                        shape[i] = wanted[i]
        dims[output] = tuple(1 if d == -1 else d for d in shape)
    return dims
