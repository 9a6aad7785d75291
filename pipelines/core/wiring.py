"""The checks a ``Graph`` makes as it is wired: references, dtypes, dims, batching,
``when`` blocks and bound inputs. Each raises where the mistake is made, naming both
ends of the wire and the fix; the pipeline keeps the state, these only read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import (
    BatchingMismatchError,
    ConditionError,
    DeclarationError,
    DtypeMismatchError,
    ShapeMismatchError,
    UnboundInputError,
    UnknownTensorError,
)
from .node import GraphView, Node
from .step import Step
from .tensor_ref import Condition, TensorRef

__all__ = [
    "as_ref",
    "check_batching",
    "check_bound",
    "check_condition",
    "check_reach",
    "check_select",
    "check_wire",
    "terms",
]


def as_ref(p: GraphView, value: Any, where: str) -> TensorRef:
    """``value`` as a reference to a tensor of ``p``: a ``TensorRef``, or a step with one output."""
    if isinstance(value, Node):
        if len(value.step.outputs) != 1:
            raise UnknownTensorError(
                f"pipeline {p.name!r}: {where} was given step {value.name!r} itself, which has "
                f"outputs {list(value.step.outputs)}; pick one, e.g. {value.name}[{next(iter(value.step.outputs))!r}]",
                pipeline=p.name, step=value.name,
            )
        value = value[next(iter(value.step.outputs))]
    if not isinstance(value, TensorRef):
        raise DeclarationError(
            f"pipeline {p.name!r}: {where} was given {value!r}; expected a tensor reference "
            "such as p.input('x') or node['y']",
            pipeline=p.name,
        )
    nodes = p.nodes
    known = (
        value.pipeline == p.name
        and (
            (value.node is None and value.name in p.inputs)
            or (value.node in nodes and value.name in nodes[value.node].step.outputs)
        )
    )
    if not known:
        raise UnknownTensorError(
            f"pipeline {p.name!r}: {where} was given {value.describe()}, which belongs to "
            f"{'pipeline ' + repr(value.pipeline) if value.pipeline != p.name else 'no step of this pipeline'}; "
            "wire tensors of this pipeline only",
            pipeline=p.name, tensor=value.qualname,
        )
    return value


def check_wire(p: GraphView, node: Node, input_name: str, value: Any, *, when: tuple[Condition, ...] = ()) -> TensorRef:
    """``value`` checked as what feeds ``node``'s input ``input_name`` inside the ``when`` blocks ``when``."""
    expected = node.step.inputs.get(input_name)
    if expected is None:
        raise UnknownTensorError(
            f"pipeline {p.name!r}: step {node.name!r} has no input {input_name!r}; "
            f"its inputs are {list(node.step.inputs)}",
            pipeline=p.name, step=node.name, tensor=input_name,
        )
    ref = as_ref(p, value, f"step {node.name!r} input {input_name!r}")
    head = f"pipeline {p.name!r}: step {node.name!r} input {input_name!r} expects {expected}"
    if ref.spec.dtype != expected.dtype:
        raise DtypeMismatchError(
            f"{head} but {ref.qualname!r} is {ref.spec}; cast it or change the step's declared dtype",
            pipeline=p.name, step=node.name, tensor=input_name,
        )
    if not expected.dims_compatible(ref.spec):
        why = "rank" if expected.rank != ref.spec.rank else "dims"
        raise ShapeMismatchError(
            f"{head} but {ref.qualname!r} is {ref.spec}; the {why} differ "
            "(-1 matches any size), so reshape it or change the step's declared dims",
            pipeline=p.name, step=node.name, tensor=input_name,
        )
    check_reach(p, ref, when, f"step {node.name!r} input {input_name!r}")
    return ref


def terms(p: GraphView, ref: TensorRef) -> tuple[Condition, ...]:
    """The conditions under which ``ref`` exists: its producer's ``when`` blocks."""
    return () if ref.node is None else p.nodes[ref.node].when


def check_reach(p: GraphView, ref: TensorRef, when: tuple[Condition, ...], where: str) -> None:
    """Refuse a read of ``ref`` where some rows may not have run the block that makes it."""
    missing = [c for c in terms(p, ref) if c not in when]
    if missing:
        here = " and ".join(c.describe() for c in when) if when else "every row"
        raise ConditionError(
            f"pipeline {p.name!r}: {where} reads {ref.describe()}, which step {ref.node!r} makes only "
            f"in {missing[0].describe()}, but it is read for {here}; read it inside that block, expose "
            f"it with p.output(..., otherwise=...), or merge it with p.select(...)",
            pipeline=p.name, step=ref.node, tensor=ref.qualname,
        )


def check_condition(p: GraphView, value: Any, what: str, *, when: tuple[Condition, ...]) -> Condition:
    """``value`` as a checked condition: a BOOL tensor with one element per row, readable in ``when``."""
    cond = value if isinstance(value, Condition) else Condition(as_ref(p, value, f"{what}(...)"))
    ref = as_ref(p, cond.ref, f"{what}(...)")
    head = f"pipeline {p.name!r}: {cond.describe() if what == 'when' else what + '(...)'} needs a condition"
    one = "dims [1] (one element per row)" if p.batched else "shape [1] (max_batch_size is 0)"
    if ref.spec.dtype != "BOOL":
        raise DtypeMismatchError(
            f"{head} of BOOL {one}, but {ref.describe()} is {ref.spec.dtype}; compute it in a step "
            "that outputs TensorSpec('BOOL', [1])",
            pipeline=p.name, step=ref.node, tensor=ref.qualname,
        )
    if ref.spec.dims != (1,):
        raise ShapeMismatchError(
            f"{head} of BOOL {one}, but {ref.describe()} has dims {list(ref.spec.dims)}; reduce it to "
            "one element per row in a step that outputs TensorSpec('BOOL', [1])",
            pipeline=p.name, step=ref.node, tensor=ref.qualname,
        )
    check_reach(p, ref, when, f"{what}(...)")
    return Condition(ref, cond.negated)


def check_select(
    p: GraphView, cond: Condition, then: Any, otherwise: Any, *, when: tuple[Condition, ...]
) -> tuple[TensorRef, TensorRef]:
    """The two sides of a select on ``cond`` inside ``when``: one spec, fixed dims, each made where it is read."""
    what = f"select({cond.describe()[5:-1]})"
    then = as_ref(p, then, f"{what} then=")
    other = as_ref(p, otherwise, f"{what} otherwise=")
    head = f"pipeline {p.name!r}: {what} merges then={then.describe()} and otherwise={other.describe()}"
    if then.spec.dtype != other.spec.dtype:
        raise DtypeMismatchError(
            f"{head}, whose dtypes differ; both sides of a select must have one spec, so cast one of them",
            pipeline=p.name, tensor=other.qualname,
        )
    if then.spec.dims != other.spec.dims:
        raise ShapeMismatchError(
            f"{head}, whose dims differ; both sides of a select must have one spec, so reshape one of them",
            pipeline=p.name, tensor=other.qualname,
        )
    if -1 in then.spec.dims:
        raise ConditionError(
            f"{head}, whose dims {list(then.spec.dims)} have a variable size: rows of the two sides may "
            "differ in it and no padding can be defined; declare fixed dims, or expose each side as an "
            "output of its own with otherwise=",
            pipeline=p.name, tensor=then.qualname,
        )
    for side, ref, holds in (("then", then, cond), ("otherwise", other, ~cond)):
        check_reach(p, ref, (*when, holds), f"{what} {side}=")
    return then, other


def check_batching(p: GraphView, step: Step, node_name: str) -> None:
    """Refuse a step whose own ``max_batch_size`` cannot serve the pipeline's batches."""
    own = step.options.max_batch_size
    if own is None:
        return
    mbs = p.max_batch_size
    head = f"pipeline {p.name!r}: step {node_name!r} has max_batch_size {own} but the pipeline has {mbs}"
    if (own == 0) != (mbs == 0):
        fix = (
            "a batching pipeline needs batching steps: drop the step's max_batch_size so it follows the pipeline"
            if mbs else "a non-batching pipeline needs non-batching steps: set the step's max_batch_size to 0"
        )
        raise BatchingMismatchError(f"{head}; {fix}", pipeline=p.name, step=node_name)
    if own < mbs:
        raise BatchingMismatchError(
            f"{head}; Triton rejects an ensemble whose batch exceeds a composing model's, "
            f"so raise the step's max_batch_size to at least {mbs} or lower the pipeline's",
            pipeline=p.name, step=node_name,
        )


def check_bound(p: GraphView, node_names: Iterable[str], *, why: str) -> None:
    """Refuse the first of ``node_names`` (in declaration order) with an input left unbound."""
    wanted = set(node_names)
    for n, node in p.nodes.items():
        missing = node.unbound if n in wanted else None
        if missing:
            raise UnboundInputError(
                f"pipeline {p.name!r}: step {n!r} input {missing[0]!r} "
                f"({node.step.inputs[missing[0]]}) is not bound, which {why} needs; "
                f"wire it with p.bind({n!r}, {missing[0]}=...) or in p.add(...)",
                pipeline=p.name, step=n, tensor=missing[0],
            )
