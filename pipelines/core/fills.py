"""``otherwise=``: what the rows that did not run a ``when`` block get in its output.

The value is checked against the output's spec when ``p.output(...)`` is called and
held as a :class:`~pipelines.core.plan.Fill`, plain data that the plan carries as JSON.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConditionError
from .node import GraphView
from .plan import Fill
from .tensor_ref import TensorRef
from .wiring import terms

__all__ = ["UNSET", "fill_for"]

# The default of ``otherwise=``: "not given", which None (a value one may fill with) cannot say.
UNSET: Any = object()


def fill_for(p: GraphView, name: str, ref: TensorRef, otherwise: Any) -> Fill | None:
    """``otherwise`` checked against output ``name`` (``ref``) and held as plan data."""
    when = terms(p, ref)
    if not when:
        if otherwise is not UNSET:
            raise ConditionError(
                f"pipeline {p.name!r}: output {name!r} was given otherwise=, but {ref.describe()} is "
                "made for every row (in no when block); drop otherwise=",
                pipeline=p.name, step=ref.node, tensor=name,
            )
        return None
    block = when[-1].describe()
    if otherwise is UNSET:
        raise ConditionError(
            f"pipeline {p.name!r}: output {name!r} is {ref.describe()}, which step {ref.node!r} makes only "
            f"in {block}; say what the other rows get: p.output({name!r}, ..., otherwise=0), or merge "
            "it with p.select(...)",
            pipeline=p.name, step=ref.node, tensor=name,
        )
    spec = ref.spec
    head = f"pipeline {p.name!r}: output {name!r} ({spec}, made in {block}) got otherwise={otherwise!r}"
    if spec.dtype == "BYTES":
        array = np.asarray(otherwise, dtype=object)
        items = array.reshape(-1).tolist()
        if not all(isinstance(x, (bytes, str)) for x in items):
            raise ConditionError(
                f"{head}; a BYTES output is filled with bytes, such as otherwise=b''",
                pipeline=p.name, step=ref.node, tensor=name,
            )
        data = tuple((x.encode() if isinstance(x, str) else x).decode("latin-1") for x in items)
    elif spec.dtype == "BF16":
        raise ConditionError(
            f"{head}; a BF16 output cannot be filled (numpy has no BF16); expose it as FP32 instead",
            pipeline=p.name, step=ref.node, tensor=name,
        )
    else:
        try:
            array = np.asarray(otherwise)
            cast = array.astype(spec.numpy_dtype)
        except (TypeError, ValueError):
            cast = None
        if cast is None or array.dtype.kind in "OSUV" or not np.array_equal(cast, array, equal_nan=True):
            raise ConditionError(
                f"{head}, which a {spec.dtype} tensor cannot hold exactly; give a value of its dtype",
                pipeline=p.name, step=ref.node, tensor=name,
            )
        data = tuple(cast.reshape(-1).tolist())
    if array.ndim:
        if -1 in spec.dims:
            raise ConditionError(
                f"{head} of shape {list(array.shape)}, but the output's dims {list(spec.dims)} have a variable "
                "size, so the rows the branch ran may differ from it; give a scalar, which takes the "
                "branch's size",
                pipeline=p.name, step=ref.node, tensor=name,
            )
        if tuple(array.shape) != spec.dims:
            raise ConditionError(
                f"{head} of shape {list(array.shape)}; give a scalar, or an array of the output's dims "
                f"{list(spec.dims)} (without the batch dimension)",
                pipeline=p.name, step=ref.node, tensor=name,
            )
    return Fill(spec.dtype, spec.dims, tuple(array.shape), data)
