"""Building the execution plan from a validated pipeline: its live nodes, each node's
composing model and its name, and the ensemble tensor that carries each wire.

:func:`plan_of` is the way in; the plan itself, its JSON form and its
queries are :mod:`pipelines.core.plan`'s.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import NotCompilableError
from .plan import (
    MODEL_SEPARATOR,
    DeadNodeWarning,
    ExecutionPlan,
    Key,
    ModelPlan,
    NodePlan,
    OutputPlan,
    Source,
    TensorPlan,
    Term,
    project,
)

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph

__all__ = ["STREAMING_FORMS", "build_plan", "plan_of", "refuse_streaming", "refuse_streaming_form"]


def plan_of(pipeline: Graph, *, warn: bool = True) -> ExecutionPlan:
    """The execution plan of ``pipeline`` (validated first).

    ``warn``: say, with a :class:`DeadNodeWarning`, which nodes feed no output. The
    building is :func:`build_plan`'s.
    """
    return build_plan(pipeline, warn=warn)


def refuse_streaming(pipeline: Graph, what: str) -> None:
    """Raise :class:`~pipelines.errors.NotCompilableError` if ``pipeline`` streams: ``what`` (a
    prediction) has no model of a stream; the bench measures every form of one."""
    if pipeline.streaming:
        streams = [repr(n.name) for n in pipeline.nodes.values() if n.step.streaming]
        raise NotCompilableError(
            f"pipeline {pipeline.name!r} streams ({'steps' if len(streams) > 1 else 'step'} {', '.join(streams)}), "
            f"and {what} does not simulate streams: measure its forms with `pipelines bench ... --server` "
            "(time to first response and between responses)",
            pipeline=pipeline.name,
        )


#: The forms whose compiled models stream a streaming pipeline so far; every other form refuses it
#: (:func:`refuse_streaming_form`).
STREAMING_FORMS = ("ensemble", "bls", "bls-sync", "fused")


def refuse_streaming_form(pipeline: Graph, form: str) -> None:
    """Raise :class:`~pipelines.errors.NotCompilableError` if the form named ``form`` cannot run
    ``pipeline``, which streams: naming the pipeline, the step, why, and the forms that can.

    The one place that says, form by form, what a streaming pipeline compiles to. The ensemble
    cannot run a step that reads a stream whole: Triton hands the step after a decoupled one one
    request per response, with nothing tying the requests to their stream.
    """
    if not pipeline.streaming:
        return
    live = plan_of(pipeline, warn=False).order
    streams = [name for name in live if pipeline.nodes[name].step.streaming]
    if not streams:  # the steps that stream feed no output: nothing streams
        return
    if form == "ensemble":
        whole = [name for name in live if pipeline.nodes[name].step.whole_stream]
        if whole:
            raise NotCompilableError(
                f"pipeline {pipeline.name!r}: the ensemble form cannot run step {whole[0]!r}, which reads the stream "
                f"of {pipeline.stream_input(whole[0])!r} whole (whole_stream=True): Triton's ensemble gives the step "
                "after a stream one request per response, with nothing tying them to their stream; the 'bls', "
                "'bls-sync' and 'fused' forms can run it",
                pipeline=pipeline.name, step=whole[0],
            )
    if form not in STREAMING_FORMS:
        raise NotCompilableError(
            f"pipeline {pipeline.name!r} streams (step {streams[0]!r}), and the {form!r} form does not stream yet; "
            f"compile it to {' or '.join(map(repr, STREAMING_FORMS))}, or run it in the local runtime "
            "(p.stream(inputs, mode=...))",
            pipeline=pipeline.name, step=streams[0],
        )


def build_plan(pipeline: Graph, *, warn: bool = True) -> ExecutionPlan:
    """The execution plan of ``pipeline`` (validated first).

    ``warn``: say, with a :class:`DeadNodeWarning`, which nodes feed no output.
    """
    pipeline.validate()
    order = pipeline.topological_order()
    position = {name: i for i, name in enumerate(pipeline.nodes)}  # declaration order
    nodes = []
    for name in order:
        node = pipeline.nodes[name]
        inputs = tuple(
            Source(input_name, ref.node, ref.name, ref.spec.dtype) for input_name, ref in node.bindings.items()
        )
        nodes.append(
            NodePlan(
                name=name,
                step=node.step.name,
                model="",  # named below, once the live nodes are known
                inputs=inputs,
                returns=tuple(node.step.outputs),
                after=(),
                before=(),
                when=tuple(Term(c.ref.node, c.ref.name, c.negated) for c in node.when),
                kind="select" if node.is_select else "step",
            )
        )
    fills, negated = pipeline.fills, pipeline.negated_outputs
    outputs = tuple(
        OutputPlan(name, ref.node, ref.name, ref.spec.dtype, (), fills.get(name), name in negated)
        for name, ref in pipeline.outputs.items()
    )
    every = ExecutionPlan(
        pipeline=pipeline.name,
        max_batch_size=pipeline.max_batch_size,
        inputs=tuple(pipeline.inputs),
        outputs=outputs,
        nodes=tuple(nodes),
        groups=(),
        tensors=(),
        models=(),
        dropped=(),
    )
    live = project(every, frozenset(pipeline.outputs), position=position)
    dropped = tuple(name for name in order if name not in set(live.order))
    if dropped and warn:
        many = len(dropped) > 1
        warnings.warn(
            f"pipeline {pipeline.name!r}: step{'s' if many else ''} {', '.join(map(repr, dropped))} "
            f"feed{'' if many else 's'} no pipeline output, so no form runs {'them' if many else 'it'}; "
            f"wire {'them' if many else 'it'} to an output or remove {'them' if many else 'it'}",
            DeadNodeWarning,
            stacklevel=_caller_level(),
        )
    models, model_of = _name_models(pipeline, live.order)
    ensemble = _name_tensors(pipeline, live)
    return ExecutionPlan(
        pipeline=live.pipeline,
        max_batch_size=live.max_batch_size,
        inputs=live.inputs,
        outputs=live.outputs,
        nodes=tuple(
            dataclasses.replace(n, model=model_of.get(n.name, "")) for n in live.nodes
        ),
        groups=live.groups,
        tensors=tuple(
            TensorPlan(t.node, t.name, t.dtype, ensemble.get(t.key, t.name), t.consumers, t.outputs, t.last_use)
            for t in live.tensors
        ),
        models=models,
        dropped=dropped,
    )


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _name_models(pipeline: Graph, order: tuple[str, ...]) -> tuple[tuple[ModelPlan, ...], dict[str, str]]:
    """Each live node's composing model, and the models in the order of their first node.

    A Python step gets one model per node it is used at: the model knows its node, so its
    own error names it and a chain needs no gate (:func:`gated_ensemble`). The first node
    that uses a step name gets ``<pipeline>__<step>``, each later one ``<pipeline>__<node>``
    (a step used once keeps the name it always had). A step declared ``share_model=True``,
    and an external model unless it says ``share_model=False``, is one model
    ``<pipeline>__<step>`` serving all its nodes.
    """
    steps = {name: pipeline.nodes[name].step for name in order if not pipeline.nodes[name].is_select}
    # Group the nodes into models, in order: a shared step by its object, any other by node.
    members: dict[Any, list[str]] = {}
    by_node: set[Any] = set()  # models named after their node
    named: set[str] = set()  # step names that a model is named after already
    for node_name, step in steps.items():
        key: Any = ("step", id(step)) if _shares_model(step) else ("node", node_name)
        if key not in members and step.name in named:
            by_node.add(key)
        named.add(step.name)
        members.setdefault(key, []).append(node_name)
    # Models named after their step claim their names first, so that a model named after its
    # node never moves one of them.
    names: dict[Any, str] = {}
    taken: set[str] = set()
    for key in sorted(members, key=lambda k: k in by_node):
        first = members[key][0]
        candidates = (
            _candidates_by_node(pipeline.name, first) if key in by_node
            else _candidates(pipeline.name, steps[first].name, first)
        )
        names[key] = next(c for c in candidates if c not in taken)
        taken.add(names[key])
    models = tuple(
        ModelPlan(
            name=names[key],
            step=steps[nodes[0]].name,
            nodes=tuple(nodes),
            max_batch_size=pipeline.nodes[nodes[0]].max_batch_size,
        )
        for key, nodes in members.items()
    )
    return models, {node: names[key] for key, nodes in members.items() for node in nodes}


def _shares_model(step: Any) -> bool:
    """Whether the nodes that use ``step`` share one model (``share_model``, by default an external one)."""
    share = getattr(step.options, "share_model", None)
    return step.is_external if share is None else bool(share)


def _candidates(pipeline: str, step: str, node: str) -> Iterable[str]:
    yield f"{pipeline}{MODEL_SEPARATOR}{step}"
    yield from _candidates_by_node(pipeline, node)


def _candidates_by_node(pipeline: str, node: str) -> Iterable[str]:
    yield f"{pipeline}{MODEL_SEPARATOR}{node}"
    i = 2
    while True:
        yield f"{pipeline}{MODEL_SEPARATOR}{node}_{i}"
        i += 1


def _name_tensors(pipeline: Graph, live: ExecutionPlan) -> dict[Key, str]:
    """Tensor -> ensemble tensor name, for every tensor something reads.

    A pipeline output keeps its own name (the first output, where one tensor
    is exposed twice). Internal wires are named ``<node>.<output>``, made
    unique against every other name, so no internal tensor can collide with a
    pipeline input or output.
    """
    names: dict[Key, str] = {}
    used = set(pipeline.inputs)
    for o in live.outputs:
        used.add(o.name)
        names.setdefault(o.key, o.name)
    for node in live.nodes:
        for s in node.inputs:
            if s.node is None or s.key in names:
                continue
            base = f"{s.node}.{s.tensor}"
            candidate, i = base, 1
            while candidate in used:
                candidate = f"{base}_{i}"
                i += 1
            names[s.key] = candidate
            used.add(candidate)
    return names
