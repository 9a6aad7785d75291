"""The execution plan: what runs, in which order, and what each step hands on,
computed once from a validated pipeline and read by every form.

The compiler (ensemble, BLS, step models), every local runtime mode and the
in-server BLS executor (which reads it as JSON, see :meth:`ExecutionPlan.to_json`)
all run from this one plan, so they agree on:

- the **live nodes**: the nodes some pipeline output depends on. A node that
  feeds no output is dropped everywhere (a :class:`DeadNodeWarning` names it);
- their **order** (topological, ties in declaration order) and **parallel
  groups** (generations: no node of a group depends on another of it);
- each tensor's **producer and consumers**, the pipeline outputs that expose
  it, and its **last use**, after which it can be released;
- the outputs each node must **return** (those something reads);
- each node's **composing model**: one per node, which knows its node and names
  it in its errors: ``<pipeline>__<step>`` for the first node that uses a step
  name, ``<pipeline>__<node>`` for each later one; a step declared
  ``share_model=True`` (an external model by default) is one model
  ``<pipeline>__<step>`` shared by its nodes;
- the **ensemble tensor** that carries each wire: a pipeline output keeps its
  name, an internal wire is ``<node>.<output>`` made unique.
- whether the ensemble form is **gated** (:func:`gated_ensemble`): the compiler
  wires it by this, and the local runtime's ensemble mode runs by it;
- each node's **conditions** (``when`` blocks, :class:`Term`): it runs on the rows
  where all of them hold, and reads each condition as it reads an input; a
  **select** node (``kind == "select"``) merges two branches row by row in the
  executor itself, with no model; an output of a branch has its **fill**
  (:class:`Fill`, ``otherwise=``) for the other rows.

:meth:`ExecutionPlan.for_outputs` prunes the plan to the nodes a subset of the
outputs needs (cached per subset), for requests that ask for fewer outputs.

:func:`pipelines.core.planning.plan_of` builds it from a graph, which this module does not know.
Not copied into a model repository: the BLS executor inside Triton reads the plan as JSON,
and cuts it as this module does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArgumentError
from ..serving import cut_plan

__all__ = [
    "PLAN_FORMAT",
    "DeadNodeWarning",
    "ExecutionPlan",
    "Fill",
    "ModelPlan",
    "NodePlan",
    "OutputPlan",
    "Source",
    "TensorPlan",
    "Term",
    "critical_path",
    "ensemble_refusal",
    "gated_ensemble",
]

#: Version of the plan's JSON form; bumped on any incompatible change.
PLAN_FORMAT = 2

Key = tuple["str | None", str]  # (producing node, or None for a pipeline input; tensor name)

# Two underscores keep composing model names apart from the one-underscore form suffixes.
MODEL_SEPARATOR = "__"


class DeadNodeWarning(UserWarning):
    """A node feeds no pipeline output, so no form runs it."""


@dataclass(frozen=True)
class Source:
    """One input of a node: the tensor that feeds it."""

    input: str
    node: str | None  # None: a pipeline input
    tensor: str
    dtype: str

    @property
    def key(self) -> Key:
        return (self.node, self.tensor)


@dataclass(frozen=True)
class Term:
    """One condition of a ``when`` block: a BOOL tensor, one element per row, or its negation."""

    node: str | None  # None: a pipeline input
    tensor: str
    negated: bool = False

    @property
    def key(self) -> Key:
        return (self.node, self.tensor)

    def describe(self) -> str:
        name = self.tensor if self.node is None else f"{self.node}.{self.tensor}"
        return f"when({'~' if self.negated else ''}{name})"

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "tensor": self.tensor, "negated": self.negated}


@dataclass(frozen=True)
class Fill:
    """What the rows a branch did not run get in a pipeline output (``otherwise=``).

    ``data`` holds ``shape``'s values flat (``()``: one scalar), as JSON-ready Python
    values; BYTES as ``latin-1`` text, which maps each byte to one character and back.
    ``dims`` are the output's own dims (without the batch dimension): a ``-1`` there
    takes the branch's size, or 0 where no row ran it.
    """

    dtype: str
    dims: tuple[int, ...]
    shape: tuple[int, ...]
    data: tuple[Any, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "dims": list(self.dims), "shape": list(self.shape), "data": list(self.data)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fill:
        return cls(data["dtype"], tuple(data["dims"]), tuple(data["shape"]), tuple(data["data"]))


@dataclass(frozen=True)
class NodePlan:
    """One live node: its step, its composing model, its inputs and what it returns."""

    name: str
    step: str
    model: str
    inputs: tuple[Source, ...]
    returns: tuple[str, ...]  # the step's outputs that something reads, in the step's order
    after: tuple[str, ...]  # live nodes it waits for
    before: tuple[str, ...]  # live nodes that wait for it
    when: tuple[Term, ...] = ()  # it runs on the rows where all of these hold (none: every row)
    kind: str = "step"  # "select": a row-by-row merge the executor does itself (no model)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor that something reads: its producer, its readers, its ensemble name."""

    node: str | None  # producer; None for a pipeline input
    name: str  # the producer's output name (or the pipeline input's name)
    dtype: str
    ensemble: str  # the ensemble tensor that carries it
    consumers: tuple[str, ...]  # live nodes that read it, once per binding, in order
    outputs: tuple[str, ...]  # pipeline outputs that expose it
    last_use: str | None  # the last consumer in order; None while an output holds it to the end

    @property
    def key(self) -> Key:
        return (self.node, self.name)

    @property
    def reads(self) -> int:
        """How many times it is read before it can be released (each binding, each output)."""
        return len(self.consumers) + len(self.outputs)


@dataclass(frozen=True)
class OutputPlan:
    """One pipeline output: the tensor it exposes and the nodes it needs, in order."""

    name: str
    node: str
    tensor: str
    dtype: str
    needs: tuple[str, ...]
    otherwise: Fill | None = None  # the fill of the rows its node did not run (an output of a branch)
    negated: bool = False  # declared as ~flag: the executor answers the tensor's element-wise not

    @property
    def key(self) -> Key:
        return (self.node, self.tensor)


@dataclass(frozen=True)
class ModelPlan:
    """One composing model: the step it serves and the live nodes that call it."""

    name: str
    step: str
    nodes: tuple[str, ...]
    max_batch_size: int


@dataclass(frozen=True)
class ExecutionPlan:
    """A validated pipeline, decided for execution; see the module docstring."""

    pipeline: str
    max_batch_size: int
    inputs: tuple[str, ...]  # every pipeline input, in declaration order
    outputs: tuple[OutputPlan, ...]
    nodes: tuple[NodePlan, ...]  # live nodes, in order
    groups: tuple[tuple[str, ...], ...]
    tensors: tuple[TensorPlan, ...]
    models: tuple[ModelPlan, ...]
    dropped: tuple[str, ...]  # nodes that feed no output of the full pipeline
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    # ------------------------------------------------------------------ lookups

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)

    @property
    def conditional(self) -> tuple[Term, ...]:
        """The conditions of the live nodes' ``when`` blocks (and selects), each once (none: a static DAG)."""
        terms = [t for n in self.nodes for t in n.when]
        for n in self.nodes:
            if n.kind == "select":
                cond = n.inputs[0]
                terms.append(Term(cond.node, cond.tensor))
        return tuple(dict.fromkeys(terms))

    @property
    def fills(self) -> tuple[str, ...]:
        """The outputs that have an ``otherwise=`` fill."""
        return tuple(o.name for o in self.outputs if o.otherwise is not None)

    def node(self, name: str) -> NodePlan:
        return self._index("nodes", lambda: {n.name: n for n in self.nodes})[name]

    def tensor(self, key: Key) -> TensorPlan | None:
        return self._index("tensors", lambda: {t.key: t for t in self.tensors}).get(key)

    def ensemble_name(self, key: Key) -> str:
        tensor = self.tensor(key)
        return key[1] if tensor is None else tensor.ensemble

    @property
    def reads(self) -> dict[Key, int]:
        """Tensor -> how many reads it has left at the start of a request."""
        return dict(self._index("reads", lambda: {t.key: t.reads for t in self.tensors}))

    @property
    def inputs_used(self) -> tuple[str, ...]:
        """The pipeline inputs some live node reads."""
        return tuple(name for name in self.inputs if self.tensor((None, name)) is not None)

    def critical_path(self, costs: Mapping[str, float] | None = None) -> tuple[list[str], float]:
        """The most expensive chain of live nodes and its cost (each node costs 1 by default)."""
        after = {n.name: n.after for n in self.nodes}
        return critical_path(self.order, after.__getitem__, costs)

    def _index(self, what: str, build: Any) -> Any:
        found = self._cache.get(what)
        if found is None:
            found = self._cache[what] = build()
        return found

    # ------------------------------------------------------------ output subsets

    def for_outputs(self, names: Iterable[str] | None) -> ExecutionPlan:
        """The plan that answers only the outputs ``names``.

        ``None``, an empty selection or all of them give this plan: as in Triton,
        a request that names no output gets every output. An unknown output is an
        :class:`~pipelines.errors.ArgumentError` (a ``ValueError``) naming it and the valid ones.
        """
        if names is None:
            return self
        if isinstance(names, str):
            names = [names]
        wanted = frozenset(names)
        if not wanted:
            return self
        cached = self._cache.get(("outputs", wanted))
        if cached is not None:
            return cached
        valid = self.output_names
        unknown = sorted(n for n in wanted if n not in valid)
        if unknown:
            raise ArgumentError(
                f"pipeline {self.pipeline!r} has no output {unknown[0]!r}; its outputs are {list(valid)}"
            )
        plan = self if wanted == frozenset(valid) else project(self, wanted)
        self._cache[("outputs", wanted)] = plan
        return plan

    # ---------------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (lists and dicts); :meth:`from_json` reads it back equal."""
        return {
            "format": PLAN_FORMAT,
            "pipeline": self.pipeline,
            "max_batch_size": self.max_batch_size,
            "inputs": list(self.inputs),
            "outputs": [_output_json(o) for o in self.outputs],
            "nodes": [_node_json(n) for n in self.nodes],
            "groups": [list(g) for g in self.groups],
            "tensors": [
                {
                    "node": t.node,
                    "name": t.name,
                    "dtype": t.dtype,
                    "ensemble": t.ensemble,
                    "consumers": list(t.consumers),
                    "outputs": list(t.outputs),
                    "last_use": t.last_use,
                }
                for t in self.tensors
            ],
            "models": [
                {"name": m.name, "step": m.step, "nodes": list(m.nodes), "max_batch_size": m.max_batch_size}
                for m in self.models
            ],
            "dropped": list(self.dropped),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | bytes) -> ExecutionPlan:
        """The plan written by :meth:`to_json` (as data, or as JSON text)."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        if data.get("format") != PLAN_FORMAT:
            raise ArgumentError(
                f"execution plan format {data.get('format')!r} is not {PLAN_FORMAT}; "
                "recompile the repository with this version of pipelines"
            )
        return cls(
            pipeline=data["pipeline"],
            max_batch_size=int(data["max_batch_size"]),
            inputs=tuple(data["inputs"]),
            outputs=tuple(
                OutputPlan(
                    o["name"], o["node"], o["tensor"], o["dtype"], tuple(o["needs"]),
                    Fill.from_json(o["otherwise"]) if o.get("otherwise") is not None else None,
                    bool(o.get("negated", False)),
                )
                for o in data["outputs"]
            ),
            nodes=tuple(
                NodePlan(
                    name=n["name"],
                    step=n["step"],
                    model=n["model"],
                    inputs=tuple(Source(s["input"], s["node"], s["tensor"], s["dtype"]) for s in n["inputs"]),
                    returns=tuple(n["returns"]),
                    after=tuple(n["after"]),
                    before=tuple(n["before"]),
                    when=tuple(Term(t["node"], t["tensor"], bool(t["negated"])) for t in n.get("when", ())),
                    kind=n.get("kind", "step"),
                )
                for n in data["nodes"]
            ),
            groups=tuple(tuple(g) for g in data["groups"]),
            tensors=tuple(
                TensorPlan(
                    node=t["node"],
                    name=t["name"],
                    dtype=t["dtype"],
                    ensemble=t["ensemble"],
                    consumers=tuple(t["consumers"]),
                    outputs=tuple(t["outputs"]),
                    last_use=t["last_use"],
                )
                for t in data["tensors"]
            ),
            models=tuple(
                ModelPlan(m["name"], m["step"], tuple(m["nodes"]), int(m["max_batch_size"])) for m in data["models"]
            ),
            dropped=tuple(data["dropped"]),
        )


def _output_json(o: OutputPlan) -> dict[str, Any]:
    data = {"name": o.name, "node": o.node, "tensor": o.tensor, "dtype": o.dtype, "needs": list(o.needs)}
    if o.otherwise is not None:  # absent from a static pipeline's plan, which reads as it always did
        data["otherwise"] = o.otherwise.to_json()
    if o.negated:  # absent where no output is negated, as above
        data["negated"] = True
    return data


def _node_json(n: NodePlan) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": n.name,
        "step": n.step,
        "model": n.model,
        "inputs": [{"input": s.input, "node": s.node, "tensor": s.tensor, "dtype": s.dtype} for s in n.inputs],
        "returns": list(n.returns),
        "after": list(n.after),
        "before": list(n.before),
    }
    if n.when:
        data["when"] = [t.to_json() for t in n.when]
    if n.kind != "step":
        data["kind"] = n.kind
    return data


# -------------------------------------------------------------------- building


def critical_path(
    order: Iterable[str],
    after: Callable[[str], Iterable[str]],
    costs: Mapping[str, float] | None = None,
    rank: Mapping[str, int] | None = None,
) -> tuple[list[str], float]:
    """The most expensive dependency chain and its cost (each node costs 1 by default).

    ``order`` is topological and ``after(node)`` gives a node's predecessors; of two
    chains that cost the same, the one ending at the higher ``rank`` (default: later in
    ``order``) wins. ``Pipeline.critical_path`` and ``ExecutionPlan.critical_path`` use it.
    """
    costs = costs or {}
    best: dict[str, tuple[float, str | None]] = {}
    for n in order:
        base, via = max(((best[p][0], p) for p in after(n)), default=(0.0, None))
        best[n] = (base + float(costs.get(n, 1.0)), via)
    if not best:
        return [], 0.0
    rank = rank if rank is not None else {name: i for i, name in enumerate(best)}
    end = max(best, key=lambda name: (best[name][0], rank[name]))
    total, path = best[end][0], []
    node: str | None = end
    while node is not None:
        path.append(node)
        node = best[node][1]
    return path[::-1], total


def gated_ensemble(plan: ExecutionPlan, external: Collection[str] = (), *, streams: bool = False) -> bool:
    """Whether ``plan``'s ensemble form carries step failures as data to a gate
    (:mod:`pipelines.compile.ensemble`) instead of answering with a step's own error.

    It does where an output is declared as ``~flag`` (the gate negates it), where two live
    nodes may run at once (Triton 2.51 breaks when a step fails while a sibling runs), where an
    external model's output would need an output copy (it declares only its own outputs), and
    where one Python step model serves several nodes but takes no input (only a gate can tell
    which node failed: a shared model with an input learns its node from the name that input
    arrives under). ``external`` names the nodes that stand for external models. The ensemble
    compiler lays the ensemble out by this; the local runtime runs every live node of a gated
    ensemble whatever outputs a request asks for, as Triton does, since every output passes
    through the gate (docs/triton_requested_outputs.md). ``streams``: a step of the plan streams;
    its model carries its failures as data, always, so that only a gate can turn them into the
    error response that a client reads (docs/compiled_repository.md, "Streaming steps").
    """
    if streams or any(o.negated for o in plan.outputs):  # only a gate model can negate an output (``~flag``)
        return True
    external = frozenset(external)
    upstream: dict[str, set[str]] = {}
    for node in plan.nodes:  # topological order
        upstream[node.name] = set().union(*(upstream[a] | {a} for a in node.after))
    names = plan.order
    if any(a not in upstream[b] and b not in upstream[a] for i, a in enumerate(names) for b in names[i + 1:]):
        return True
    shared = [m for m in plan.models if len(m.nodes) > 1 and m.nodes[0] not in external]
    if any(not plan.node(m.nodes[0]).inputs for m in shared):
        return True
    for tensor in plan.tensors:
        if tensor.node in external and (len(tensor.outputs) > 1 or (tensor.outputs and tensor.consumers)):
            return True
    return False


def ensemble_refusal(plan: ExecutionPlan, *, what: str = "an ensemble") -> str:
    """Why ``what`` cannot run ``plan``, whose nodes have ``when`` blocks, and what can."""
    blocks = list(dict.fromkeys(t.describe() for t in plan.conditional)) or ["a select"]
    return (
        f"pipeline {plan.pipeline!r}: {what} cannot skip a step, and {blocks[0]}"
        f"{' (and ' + str(len(blocks) - 1) + ' more)' if len(blocks) > 1 else ''} runs its steps only on the "
        "rows where it holds; use the 'bls' or 'fused' form, which run the block per row"
    )


def project(plan: ExecutionPlan, wanted: frozenset[str], position: dict[str, int] | None = None) -> ExecutionPlan:
    """``plan`` cut down to the nodes the outputs ``wanted`` need, with everything derived again.

    The cut is :func:`pipelines.serving.cut_plan`, on the plan's JSON form: the executors inside
    Triton and the local runtime cut with it too (``serving.Schedule``), so no two of them can
    prune differently. ``plan.nodes`` must be in topological order; a node's ``returns`` may only
    shrink. ``position`` orders the nodes of a parallel group (default: plan order).
    """
    return ExecutionPlan.from_json(cut_plan(plan.to_json(), wanted, position))

