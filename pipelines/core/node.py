"""``Node``: one use of a step in a pipeline, under its own name.

A node is a handle into its pipeline: what it is bound to and which ``when`` blocks
it runs in are kept by the pipeline, which the node reads here (hence ``_bindings``).
:class:`GraphView` is what a node and the wiring checks read of it, typed apart from
:class:`~pipelines.core.graph.Graph` so that the graph imports them and not the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from ..errors import UnknownTensorError
from .step import Step
from .tensor import TensorSpec
from .tensor_ref import Condition, TensorRef

__all__ = ["GraphView", "Node"]


class GraphView(Protocol):
    """What a :class:`Node` and the wiring checks read of the graph they belong to
    (a :class:`~pipelines.core.graph.Graph`)."""

    name: str
    max_batch_size: int
    _bindings: dict[str, dict[str, TensorRef]]  # node -> input -> the tensor that feeds it
    _when: dict[str, tuple[Condition, ...]]  # node -> the conditions it runs under
    _selects: set[str]

    @property
    def inputs(self) -> Mapping[str, TensorSpec]: ...

    @property
    def nodes(self) -> Mapping[str, Node]: ...

    @property
    def batched(self) -> bool: ...


@dataclass(frozen=True, eq=False)
class Node:
    """One use of a step in a pipeline, under its own name. ``node["out"]`` is a typed reference."""

    pipeline: GraphView
    name: str
    step: Step

    def __getitem__(self, output: str) -> TensorRef:
        spec = self.step.outputs.get(output)
        if spec is None:
            raise UnknownTensorError(
                f"pipeline {self.pipeline.name!r}: step {self.name!r} has no output {output!r}; "
                f"its outputs are {list(self.step.outputs)}",
                pipeline=self.pipeline.name, step=self.name, tensor=output,
            )
        return TensorRef(self.pipeline.name, self.name, output, spec)

    @property
    def outputs(self) -> dict[str, TensorRef]:
        return {name: self[name] for name in self.step.outputs}

    @property
    def bindings(self) -> Mapping[str, TensorRef]:
        """Which tensor feeds each bound input."""
        return MappingProxyType(self.pipeline._bindings[self.name])

    @property
    def max_batch_size(self) -> int:
        """The step's own ``max_batch_size``, or the pipeline's when the step left it unset."""
        own = self.step.options.max_batch_size
        return self.pipeline.max_batch_size if own is None else own

    @property
    def unbound(self) -> list[str]:
        return [i for i in self.step.inputs if i not in self.pipeline._bindings[self.name]]

    @property
    def when(self) -> tuple[Condition, ...]:
        """The conditions of the ``when`` blocks it was added in, outermost first (none: every row)."""
        return self.pipeline._when.get(self.name, ())

    @property
    def is_select(self) -> bool:
        """Whether it is a :meth:`Pipeline.select`: a row-by-row merge that the executors do themselves."""
        return self.name in self.pipeline._selects

    def __repr__(self) -> str:
        return f"<Node {self.name!r} step={self.step.name!r}>"
