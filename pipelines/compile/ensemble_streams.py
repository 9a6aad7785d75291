"""The ensemble of a streaming pipeline: which nodes run once per response, and the tensors the
streaming step's model carries to them (docs/compiled_repository.md, "Streaming steps").

Triton 2.51 refuses to load an ensemble in which one step takes tensors that originate from
different decoupled models ("step of model ... receives inputs originated from different
decoupled models"): a step that runs once per response of a stream cannot also read a tensor of
the request itself (a pipeline input, or a step's output made once per request), and neither can
the gate. So the streaming step's model **carries** each such tensor: it takes it as an extra
input (``__carry_in_<k>``) and sends it again, unchanged, on every response as an extra output
(``__carry_<k>``), which the steps after the stream read instead. The failures of the
once-per-request steps travel the same way: the streaming step takes them as failure inputs and
passes the first on as its own, which names the node where it began.

A streaming pipeline's ensemble has one live stream: its outputs all come from one stream, and a
second stream could reach them only through a step that reads it whole, which the ensemble refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..core.tensor import TensorSpec
from ..errors import CompileError
from .bound_plan import CompilePlan
from .ensemble_wiring import TensorNames

__all__ = ["CARRY_INPUT", "CARRY_OUTPUT", "Carry", "StreamWiring", "stream_wiring"]

#: ``__carry_in_<k>``: a once-per-request tensor the streaming step's model takes, to carry.
CARRY_INPUT = "__carry_in_"
#: ``__carry_<k>``: the same tensor again, on each of its responses.
CARRY_OUTPUT = "__carry_"


@dataclass(frozen=True)
class Carry:
    """One once-per-request tensor the streaming step carries to the steps after it."""

    input: str  # the streaming model's input that takes it
    output: str  # its output that repeats it on each response
    tensor: str  # the ensemble tensor that output writes, which the readers read
    spec: TensorSpec
    producer: str | None  # the node that makes it; None for a pipeline input


@dataclass(frozen=True)
class StreamWiring:
    """The one live stream of an ensemble: its node, the nodes run once per response of it,
    and the tensors it carries (by the ensemble tensor each reader read before)."""

    stream: str
    per_response: frozenset[str]
    carries: Mapping[str, Carry]

    def carried_input(self, node: str, tensor: str) -> str:
        """The ensemble tensor ``node`` reads for ``tensor``: its carry, once per response."""
        carry = self.carries.get(tensor) if node in self.per_response else None
        return tensor if carry is None else carry.tensor

    def reads_the_request(self, node: str, producer: str | None) -> bool:
        """Whether ``node``, run once per response, reads a tensor made once per request by ``producer``."""
        return node in self.per_response and producer != self.stream and producer not in self.per_response


def stream_wiring(plan: CompilePlan, names: TensorNames) -> StreamWiring | None:
    """How ``plan``'s ensemble streams, or ``None`` where no live step streams."""
    pipeline = plan.pipeline
    streams = [n.name for n in plan.nodes if n.step.streaming]
    if not streams:
        return None
    stream = streams[0]
    per_response = frozenset(n.name for n in plan.nodes if pipeline.stream_of(n.name) == stream)
    step = next(n.step for n in plan.nodes if n.name == stream)
    taken = [t for t in (*step.inputs, *step.outputs) if t.startswith((CARRY_INPUT, CARRY_OUTPUT))]
    carries: dict[str, Carry] = {}
    for node in plan.nodes:
        if node.name not in per_response:
            continue
        for input_name, ref in node.sources.items():
            if ref.node == stream or ref.node in per_response:
                continue
            tensor = node.inputs[input_name]
            if tensor in carries:
                continue
            if taken:
                raise CompileError(
                    f"pipeline {pipeline.name!r}: streaming step {stream!r} has a tensor named {taken[0]!r}; its "
                    f"ensemble model carries the request's tensors to the steps after it under names starting with "
                    f"{CARRY_OUTPUT!r}, so rename it",
                    pipeline=pipeline.name, step=stream, tensor=taken[0],
                )
            k = len(carries)
            carries[tensor] = Carry(f"{CARRY_INPUT}{k}", f"{CARRY_OUTPUT}{k}", names.fresh(f"{stream}.{CARRY_OUTPUT}{k}"),
                                    ref.spec, ref.node)
    return StreamWiring(stream, per_response, MappingProxyType(carries))
