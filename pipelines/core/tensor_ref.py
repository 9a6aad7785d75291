"""``TensorRef`` and ``Condition``: the typed handles a pipeline gives out for wiring.

A reference names a pipeline input or a step's output together with its spec, so a
wire can be checked where it is made; a condition selects the rows a ``when`` block runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tensor import TensorSpec

__all__ = ["Condition", "TensorRef"]


@dataclass(frozen=True)
class TensorRef:
    """A typed reference to a tensor: a pipeline input (``node is None``) or a step output."""

    pipeline: str
    node: str | None
    name: str
    spec: TensorSpec

    @property
    def is_input(self) -> bool:
        return self.node is None

    @property
    def qualname(self) -> str:
        """``'detector.output'`` for a step output, ``'images'`` for a pipeline input."""
        return self.name if self.node is None else f"{self.node}.{self.name}"

    def describe(self) -> str:
        what = f"pipeline input {self.name!r}" if self.node is None else repr(self.qualname)
        return f"{what} ({self.spec})"

    def __repr__(self) -> str:
        return f"<TensorRef {self.qualname} {self.spec}>"

    def __invert__(self) -> Condition:
        """``~ref``: the rows where this BOOL condition is false (``with p.when(~ok):``)."""
        return Condition(self, negated=True)


@dataclass(frozen=True)
class Condition:
    """The rows a ``when`` block runs on: a BOOL tensor with one element per row, or its negation."""

    ref: TensorRef
    negated: bool = False

    def __invert__(self) -> Condition:
        return Condition(self.ref, not self.negated)

    def describe(self) -> str:
        """``"when(~quality.ok)"``: how messages and diagrams name the block."""
        return f"when({'~' if self.negated else ''}{self.ref.qualname})"

    def __repr__(self) -> str:
        return f"<Condition {self.describe()}>"
