"""``Pipeline``: the typed DAG of steps, checked wire by wire as it is built.

Every wire is checked when it is made (names, dtypes, dims, batching), so a
mistake fails at the line that made it. The validated graph is what both the
compilers and the local runtime read; neither reaches back into the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np

from .errors import (
    BatchingMismatchError,
    ConditionError,
    CycleError,
    DeclarationError,
    DtypeMismatchError,
    DuplicateNameError,
    ShapeMismatchError,
    StepDeclarationError,
    TensorProducedTwiceError,
    UnboundInputError,
    UnknownTensorError,
)
from .names import check_name
from .plan import Fill, critical_path
from .step import Step
from .tensor import TensorSpec

if TYPE_CHECKING:
    from .compile.repository import ModelRepository
    from .diagram import Diagram

__all__ = ["Condition", "Node", "Pipeline", "TensorRef"]

_UNSET: Any = object()


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


@dataclass(frozen=True, eq=False)
class Node:
    """One use of a step in a pipeline, under its own name. ``node["out"]`` is a typed reference."""

    pipeline: Pipeline
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


class Pipeline:
    """A typed DAG of steps with named inputs and outputs.

    ``max_batch_size > 0`` means every tensor has a leading batch dimension that
    the dims leave out, as in Triton's configs.
    """

    def __init__(
        self,
        name: str,
        *,
        inputs: Mapping[str, TensorSpec],
        max_batch_size: int = 0,
    ) -> None:
        self.name = check_name(name, what="pipeline")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 0:
            raise DeclarationError(
                f"pipeline {name!r}: max_batch_size must be an int >= 0 (0 = no batching); got {max_batch_size!r}",
                pipeline=name,
            )
        self.max_batch_size = max_batch_size
        if not isinstance(inputs, Mapping) or not inputs:
            raise DeclarationError(
                f"pipeline {name!r}: inputs must be a non-empty dict of name -> TensorSpec",
                pipeline=name,
            )
        specs = {}
        for tname, spec in inputs.items():
            check_name(tname, what="pipeline input", tensor=True, pipeline=name)
            if not isinstance(spec, TensorSpec):
                raise DeclarationError(
                    f"pipeline {name!r}: input {tname!r} must be a TensorSpec; got {spec!r}",
                    pipeline=name, tensor=tname,
                )
            specs[tname] = spec
        self.inputs: Mapping[str, TensorSpec] = MappingProxyType(specs)
        self._nodes: dict[str, Node] = {}
        self._bindings: dict[str, dict[str, TensorRef]] = {}
        self._outputs: dict[str, TensorRef] = {}
        self._graph = nx.DiGraph()
        self._order_index: dict[str, int] = {}
        self._when_stack: list[Condition] = []  # the open `with p.when(...)` blocks, outermost first
        self._when: dict[str, tuple[Condition, ...]] = {}  # node -> the conditions it runs under
        self._selects: set[str] = set()
        self._fills: dict[str, Fill] = {}  # output -> its otherwise=

    # ------------------------------------------------------------------ building

    def input(self, name: str) -> TensorRef:
        """A reference to the pipeline input ``name``."""
        spec = self.inputs.get(name)
        if spec is None:
            raise UnknownTensorError(
                f"pipeline {self.name!r} has no input {name!r}; its inputs are {list(self.inputs)}",
                pipeline=self.name, tensor=name,
            )
        return TensorRef(self.name, None, name, spec)

    def add(self, step: Step, name: str | None = None, **bindings: Any) -> Node:
        """Add ``step`` as a node named ``name`` (default: the step's name) and wire its inputs.

        Each binding ``input=ref`` is checked now. Inputs may be left unbound and
        wired later with :meth:`bind`, but not at ``output``, ``compile`` or ``run``.
        """
        if not isinstance(step, Step):
            raise StepDeclarationError(
                f"pipeline {self.name!r}: {step!r} is not a step; decorate it with @step(inputs=..., outputs=...)",
                pipeline=self.name,
            )
        node_name = check_name(name if name is not None else step.name, what="step", pipeline=self.name)
        if node_name in self._nodes:
            raise DuplicateNameError(
                f"pipeline {self.name!r} already has a step named {node_name!r}; "
                f"add it again under another name: p.add(step, name='{node_name}2', ...)",
                pipeline=self.name, step=node_name,
            )
        self._check_batching(step, node_name)
        node = Node(self, node_name, step)
        when = tuple(self._when_stack)
        checked = {k: self._check_wire(node, k, v, when=when) for k, v in bindings.items()}
        if when:
            self._when[node_name] = when
        self._nodes[node_name] = node
        self._bindings[node_name] = {}
        self._order_index[node_name] = len(self._order_index)
        self._graph.add_node(node_name)
        for input_name, ref in checked.items():
            self._connect(node, input_name, ref)
        return node

    def bind(self, node: Node | str, **bindings: Any) -> Node:
        """Wire inputs of a node that were left unbound at :meth:`add`."""
        node = self._node(node)
        for input_name, value in bindings.items():
            ref = self._check_wire(node, input_name, value, when=node.when)
            bound = self._bindings[node.name].get(input_name)
            if bound is not None:
                raise DuplicateNameError(
                    f"pipeline {self.name!r}: step {node.name!r} input {input_name!r} is already bound to "
                    f"{bound.describe()}; an input takes exactly one tensor",
                    pipeline=self.name, step=node.name, tensor=input_name,
                )
            if ref.node is not None and (
                ref.node == node.name or nx.has_path(self._graph, node.name, ref.node)
            ):
                path = [node.name] if ref.node == node.name else nx.shortest_path(self._graph, node.name, ref.node)
                cycle = " -> ".join(path + [node.name])
                raise CycleError(
                    f"pipeline {self.name!r}: feeding {ref.describe()} into step {node.name!r} input "
                    f"{input_name!r} would make a cycle ({cycle}); a pipeline must be acyclic",
                    pipeline=self.name, step=node.name, tensor=input_name,
                )
            self._connect(node, input_name, ref)
        return node

    def output(self, name: str, ref: TensorRef, *, otherwise: Any = _UNSET) -> TensorRef:
        """Expose ``ref`` as the pipeline output ``name``.

        ``otherwise``: for a tensor of a ``when`` block, what the rows that did not run the
        block get: a scalar, or an array of the output's dims (``b""`` or bytes for BYTES).
        """
        check_name(name, what="pipeline output", tensor=True, pipeline=self.name)
        ref = self._as_ref(ref, f"output {name!r}")
        if name in self._outputs:
            raise TensorProducedTwiceError(
                f"pipeline {self.name!r}: output {name!r} is already produced by "
                f"{self._outputs[name].describe()}; a tensor can be produced only once, "
                "so give this output another name",
                pipeline=self.name, tensor=name,
            )
        if name in self.inputs:
            raise DuplicateNameError(
                f"pipeline {self.name!r}: output {name!r} has the name of a pipeline input; "
                "inputs and outputs share one namespace in Triton, so rename the output",
                pipeline=self.name, tensor=name,
            )
        if ref.is_input:
            raise DeclarationError(
                f"pipeline {self.name!r}: output {name!r} would be pipeline input {ref.name!r} itself; "
                "a Triton ensemble cannot pass an input straight through, so add a step that produces it",
                pipeline=self.name, tensor=name,
            )
        self._check_bound(nx.ancestors(self._graph, ref.node) | {ref.node}, why=f"output {name!r}")
        fill = self._fill(name, ref, otherwise)
        self._outputs[name] = ref
        if fill is not None:
            self._fills[name] = fill
        return ref

    # ---------------------------------------------------------------- conditions

    @contextmanager
    def when(self, condition: TensorRef | Condition) -> Iterator[Condition]:
        """Steps added in this block run only on the rows where ``condition`` holds.

        ``condition`` is a BOOL tensor with one element per row (dims ``[1]``), or ``~it``.
        A batched request of *n* rows runs the block's steps once, on its *k* true rows; at
        *k* = 0 none of them is called. Nested blocks combine with *and*. A tensor made in
        the block reaches the rest of the pipeline only through ``p.output(...,
        otherwise=...)`` or :meth:`select`.
        """
        cond = self._condition(condition, "when")
        self._when_stack.append(cond)
        try:
            yield cond
        finally:
            self._when_stack.pop()

    def select(
        self, condition: TensorRef | Condition, *, then: TensorRef, otherwise: TensorRef, name: str | None = None
    ) -> TensorRef:
        """Merge two branches row by row: ``then``'s row where ``condition`` holds, ``otherwise``'s elsewhere.

        ``then`` may come from a ``when(condition)`` block, ``otherwise`` from a
        ``when(~condition)`` block; both sides have one spec. The merge is a node (named
        ``name``, default ``"select"``) that the executors do themselves, with no model.
        """
        cond = self._condition(condition, "select")
        what = f"select({cond.describe()[5:-1]})"
        then = self._as_ref(then, f"{what} then=")
        other = self._as_ref(otherwise, f"{what} otherwise=")
        head = f"pipeline {self.name!r}: {what} merges then={then.describe()} and otherwise={other.describe()}"
        if then.spec.dtype != other.spec.dtype:
            raise DtypeMismatchError(
                f"{head}, whose dtypes differ; both sides of a select must have one spec, so cast one of them",
                pipeline=self.name, tensor=other.qualname,
            )
        if then.spec.dims != other.spec.dims:
            raise ShapeMismatchError(
                f"{head}, whose dims differ; both sides of a select must have one spec, so reshape one of them",
                pipeline=self.name, tensor=other.qualname,
            )
        if -1 in then.spec.dims:
            raise ConditionError(
                f"{head}, whose dims {list(then.spec.dims)} have a variable size: rows of the two sides may "
                "differ in it and no padding can be defined; declare fixed dims, or expose each side as an "
                "output of its own with otherwise=",
                pipeline=self.name, tensor=then.qualname,
            )
        context = tuple(self._when_stack)
        for side, ref, holds in (("then", then, cond), ("otherwise", other, ~cond)):
            self._check_reach(ref, (*context, holds), f"{what} {side}=")
        node_name = check_name(name if name is not None else self._free_name("select"), what="step", pipeline=self.name)
        if node_name in self._nodes:
            raise DuplicateNameError(
                f"pipeline {self.name!r} already has a step named {node_name!r}; give the select another "
                f"name: p.select(..., name='{node_name}2')",
                pipeline=self.name, step=node_name,
            )
        spec = then.spec
        merge = Step(
            name="select",
            inputs={"condition": TensorSpec("BOOL", [1]), "then": spec, "otherwise": spec},
            outputs={"output": spec},
            impl=_select_rows,
        )
        node = Node(self, node_name, merge)
        self._nodes[node_name] = node
        self._bindings[node_name] = {}
        self._order_index[node_name] = len(self._order_index)
        self._graph.add_node(node_name)
        self._selects.add(node_name)
        if context:
            self._when[node_name] = context
        if cond.negated:  # the executors merge by the condition as it is: swap the sides instead
            then, other = other, then
        for input_name, ref in (("condition", cond.ref), ("then", then), ("otherwise", other)):
            self._connect(node, input_name, ref)
        return node["output"]

    @property
    def fills(self) -> Mapping[str, Fill]:
        """Each output of a ``when`` block and its ``otherwise=`` fill."""
        return MappingProxyType(self._fills)

    @property
    def conditional(self) -> bool:
        """Whether some step runs in a ``when`` block (the ensemble form cannot express it)."""
        return bool(self._when) or bool(self._selects)

    # ---------------------------------------------------------------- inspection

    @property
    def nodes(self) -> Mapping[str, Node]:
        return MappingProxyType(self._nodes)

    @property
    def outputs(self) -> Mapping[str, TensorRef]:
        return MappingProxyType(self._outputs)

    @property
    def output_specs(self) -> dict[str, TensorSpec]:
        return {name: ref.spec for name, ref in self._outputs.items()}

    @property
    def graph(self) -> nx.DiGraph:
        """A copy of the step graph; edges carry ``tensors``: the (output, input) pairs they wire."""
        return self._graph.copy()

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes[n] for n in self.topological_order())

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return (
            f"<Pipeline {self.name!r}: {len(self._nodes)} steps, inputs {list(self.inputs)}, "
            f"outputs {list(self._outputs)}, max_batch_size={self.max_batch_size}>"
        )

    def validate(self) -> Pipeline:
        """Check that the pipeline is complete: every input bound, at least one output."""
        self._check_bound(self._nodes, why="this pipeline to compile or run")
        if not self._outputs:
            raise DeclarationError(
                f"pipeline {self.name!r} has no outputs; declare one with p.output('name', node['out'])",
                pipeline=self.name,
            )
        return self

    def topological_order(self) -> list[str]:
        """Node names, each after every node it depends on; ties keep declaration order."""
        return list(nx.lexicographical_topological_sort(self._graph, key=self._order_index.__getitem__))

    def parallel_groups(self) -> list[list[str]]:
        """Generations of nodes: the nodes of one group depend on none of the others in it."""
        return [
            sorted(gen, key=self._order_index.__getitem__)
            for gen in nx.topological_generations(self._graph)
        ]

    def critical_path(self, costs: Mapping[str, float] | None = None) -> tuple[list[str], float]:
        """The most expensive dependency chain and its cost (each node costs 1 by default)."""
        return critical_path(self.topological_order(), self._graph.predecessors, costs, self._order_index)

    def to_mermaid(self) -> str:
        """The graph as a Mermaid flowchart (renders in GitHub and Jupyter)."""
        # Numbered ids, as names that differ only by '-', '_' or '.' would share a sanitised one.
        ids = {n: f"n{i}" for i, n in enumerate(self._nodes)}
        ins = {n: f"in{i}" for i, n in enumerate(self.inputs)}
        outs = {n: f"out{i}" for i, n in enumerate(self._outputs)}
        lines = ["flowchart LR"]
        for name, spec in self.inputs.items():
            lines.append(f'  {ins[name]}(["{name}<br/>{spec}"])')
        def node_line(name: str, indent: str) -> str:
            step = self._nodes[name].step
            label = name if step.name == name else f"{name}<br/><i>{step.name}</i>"
            return f'{indent}{ids[name]}["{label}"]'

        blocks = self._blocks()
        block_ids = {block: f"w{i}" for i, block in enumerate(blocks)}
        lines += [node_line(name, "  ") for name in self._nodes if not self._when.get(name)]
        lines += self._nested(blocks, (), lambda block, indent: f'{indent}subgraph {block_ids[block]}["{block[-1].describe()}"]',
                              node_line, lambda indent: f"{indent}end", "  ")
        for name, ref in self._outputs.items():
            lines.append(f'  {outs[name]}(["{name}<br/>{ref.spec}"])')
        for node_name in self._nodes:
            for input_name, ref in self._bindings[node_name].items():
                src = ins[ref.name] if ref.is_input else ids[ref.node]
                label = ref.name if ref.name == input_name else f"{ref.name} → {input_name}"
                lines.append(f'  {src} -- "{label}" --> {ids[node_name]}')
        for name, ref in self._outputs.items():
            lines.append(f'  {ids[ref.node]} -- "{ref.name}" --> {outs[name]}')
        for block, wid in block_ids.items():  # the condition's edge, dashed, into its frame
            cond = block[-1]
            src = ins[cond.ref.name] if cond.ref.is_input else ids[cond.ref.node]
            lines.append(f'  {src} -. "{"~" if cond.negated else ""}{cond.ref.name}" .-> {wid}')
        return "\n".join(lines) + "\n"

    def _blocks(self) -> dict[tuple[Condition, ...], list[str]]:
        """Each ``when`` block (the conditions down to it) and the nodes directly in it, in order."""
        blocks: dict[tuple[Condition, ...], list[str]] = {}
        for name in self._nodes:
            when = self._when.get(name, ())
            for depth in range(1, len(when) + 1):
                blocks.setdefault(when[:depth], [])
            if when:
                blocks[when].append(name)
        return blocks

    @staticmethod
    def _nested(blocks: Mapping[tuple[Condition, ...], list[str]], parent: tuple[Condition, ...],
                opening: Any, node_line: Any, closing: Any, indent: str) -> list[str]:
        """The lines of the blocks directly inside ``parent``, each around its nodes and its own blocks."""
        lines = []
        for block, members in blocks.items():
            if len(block) != len(parent) + 1 or block[:-1] != parent:
                continue
            lines.append(opening(block, indent))
            lines += [node_line(name, indent + "  ") for name in members]
            lines += Pipeline._nested(blocks, block, opening, node_line, closing, indent + "  ")
            lines.append(closing(indent))
        return lines

    def diagram(self) -> Diagram:
        """The pipeline drawn: stages left to right, each edge labelled with name, dtype and shape.

        ``.to_svg()`` needs nothing; ``.to_png(path)`` needs matplotlib. Jupyter shows a
        pipeline this way by itself (``_repr_mimebundle_``).
        """
        from .diagram import diagram

        return diagram(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle = self.diagram()._repr_mimebundle_(include, exclude)
        bundle["text/plain"] = repr(self)
        return bundle

    def to_dot(self) -> str:
        """The graph in Graphviz DOT."""
        q, nl = _dot_quote, "\n"
        blocks = self._blocks()
        lines = [f"digraph {q(self.name)} {{", "  rankdir=LR;"] + (["  compound=true;"] if blocks else [])
        for name, spec in self.inputs.items():
            lines.append(f"  {q('input:' + name)} [shape=oval, label={q(name + nl + str(spec))}];")

        def node_line(name: str, indent: str) -> str:
            node = self._nodes[name]
            label = name if node.step.name == name else f"{name}{nl}({node.step.name})"
            return f"{indent}{q(name)} [shape=box, label={q(label)}];"

        clusters = {block: f"cluster_when_{i}" for i, block in enumerate(blocks)}
        lines += [node_line(name, "  ") for name in self._nodes if not self._when.get(name)]
        lines += self._nested(
            blocks, (),
            lambda block, indent: (f"{indent}subgraph {clusters[block]} {{ label={q(block[-1].describe())}; "
                                   "style=dashed;"),
            node_line, lambda indent: f"{indent}}}", "  ",
        )
        for name, ref in self._outputs.items():
            lines.append(f"  {q('output:' + name)} [shape=oval, label={q(name + nl + str(ref.spec))}];")
        for node_name in self._nodes:
            for input_name, ref in self._bindings[node_name].items():
                src = "input:" + ref.name if ref.is_input else ref.node
                label = ref.name if ref.name == input_name else f"{ref.name} -> {input_name}"
                lines.append(f"  {q(src)} -> {q(node_name)} [label={q(label)}];")
        for name, ref in self._outputs.items():
            lines.append(f"  {q(ref.node)} -> {q('output:' + name)} [label={q(ref.name)}];")
        for block, cluster in clusters.items():  # the condition's edge, dashed, into its frame
            cond = block[-1]
            src = "input:" + cond.ref.name if cond.ref.is_input else cond.ref.node
            first = next(iter(n for b, members in blocks.items() if b[:len(block)] == block for n in members))
            label = ("~" if cond.negated else "") + cond.ref.name
            lines.append(f"  {q(src)} -> {q(first)} [label={q(label)}, style=dashed, lhead={cluster}];")
        lines.append("}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------- running

    def compile(self, target: str = "both", **options: Any) -> ModelRepository:
        """Compile to an in-memory Triton model repository: ``"ensemble"``, ``"bls"``, ``"bls-sync"`` or ``"both"``.

        ``options`` go to :func:`pipelines.compile.compile_pipeline` (e.g. ``bls_instance_count``).
        """
        self.validate()
        from .compile import compile_pipeline

        return compile_pipeline(self, target, **options)

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        mode: str = "ensemble",
        outputs: Iterable[str] | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Run once in the local runtime (blocking; works inside Jupyter's running loop too).

        ``outputs``: answer only these, running only the steps they need (as tritonclient asks).
        """
        self.validate()
        from .runtime.local import run_pipeline

        return run_pipeline(self, inputs, mode=mode, outputs=outputs, **options)

    def predict(
        self,
        profile: Any,
        concurrency: Iterable[int] | int | None = (1, 4, 16),
        forms: Iterable[str] | None = None,
        **options: Any,
    ) -> Any:
        """Predict each form's latency and throughput on the server ``profile`` measured
        (``pipelines calibrate``), by simulation: a :class:`~pipelines.predict.Prediction`
        table. ``options`` go to :func:`pipelines.predict.predict` (``rate``, ``inputs``,
        ``costs``, ``cores``, ``allow_mismatch``...)."""
        self.validate()
        from .predict import predict

        return predict(self, profile, concurrency, forms, **options)

    def advise(self, profile: Any, **options: Any) -> Any:
        """Search forms, instance counts and batching for the fastest configuration on the
        server ``profile`` measured: an :class:`~pipelines.predict.Advice`, best first.
        ``options`` go to :func:`pipelines.predict.advise` (``concurrency``, ``rate``,
        ``p95_ms``, ``cores``...)."""
        self.validate()
        from .predict import advise

        return advise(self, profile, **options)

    # ------------------------------------------------------------------ internal

    def _node(self, node: Node | str) -> Node:
        name = node.name if isinstance(node, Node) else node
        found = self._nodes.get(name)
        if found is None or (isinstance(node, Node) and found is not node):
            raise UnknownTensorError(
                f"pipeline {self.name!r} has no step {name!r}; its steps are {list(self._nodes)}",
                pipeline=self.name, step=name,
            )
        return found

    def _as_ref(self, value: Any, where: str) -> TensorRef:
        if isinstance(value, Node):
            if len(value.step.outputs) != 1:
                raise UnknownTensorError(
                    f"pipeline {self.name!r}: {where} was given step {value.name!r} itself, which has "
                    f"outputs {list(value.step.outputs)}; pick one, e.g. {value.name}[{next(iter(value.step.outputs))!r}]",
                    pipeline=self.name, step=value.name,
                )
            value = value[next(iter(value.step.outputs))]
        if not isinstance(value, TensorRef):
            raise DeclarationError(
                f"pipeline {self.name!r}: {where} was given {value!r}; expected a tensor reference "
                "such as p.input('x') or node['y']",
                pipeline=self.name,
            )
        known = (
            value.pipeline == self.name
            and (
                (value.node is None and value.name in self.inputs)
                or (value.node in self._nodes and value.name in self._nodes[value.node].step.outputs)
            )
        )
        if not known:
            raise UnknownTensorError(
                f"pipeline {self.name!r}: {where} was given {value.describe()}, which belongs to "
                f"{'pipeline ' + repr(value.pipeline) if value.pipeline != self.name else 'no step of this pipeline'}; "
                "wire tensors of this pipeline only",
                pipeline=self.name, tensor=value.qualname,
            )
        return value

    def _check_wire(self, node: Node, input_name: str, value: Any, *, when: tuple[Condition, ...] = ()) -> TensorRef:
        expected = node.step.inputs.get(input_name)
        if expected is None:
            raise UnknownTensorError(
                f"pipeline {self.name!r}: step {node.name!r} has no input {input_name!r}; "
                f"its inputs are {list(node.step.inputs)}",
                pipeline=self.name, step=node.name, tensor=input_name,
            )
        ref = self._as_ref(value, f"step {node.name!r} input {input_name!r}")
        head = f"pipeline {self.name!r}: step {node.name!r} input {input_name!r} expects {expected}"
        if ref.spec.dtype != expected.dtype:
            raise DtypeMismatchError(
                f"{head} but {ref.qualname!r} is {ref.spec}; cast it or change the step's declared dtype",
                pipeline=self.name, step=node.name, tensor=input_name,
            )
        if not expected.dims_compatible(ref.spec):
            why = "rank" if expected.rank != ref.spec.rank else "dims"
            raise ShapeMismatchError(
                f"{head} but {ref.qualname!r} is {ref.spec}; the {why} differ "
                "(-1 matches any size), so reshape it or change the step's declared dims",
                pipeline=self.name, step=node.name, tensor=input_name,
            )
        self._check_reach(ref, when, f"step {node.name!r} input {input_name!r}")
        return ref

    def _terms(self, ref: TensorRef) -> tuple[Condition, ...]:
        """The conditions under which ``ref`` exists: its producer's ``when`` blocks."""
        return () if ref.node is None else self._when.get(ref.node, ())

    def _check_reach(self, ref: TensorRef, when: tuple[Condition, ...], where: str) -> None:
        """Refuse a read of ``ref`` where some rows may not have run the block that makes it."""
        missing = [c for c in self._terms(ref) if c not in when]
        if missing:
            here = " and ".join(c.describe() for c in when) if when else "every row"
            raise ConditionError(
                f"pipeline {self.name!r}: {where} reads {ref.describe()}, which step {ref.node!r} makes only "
                f"in {missing[0].describe()}, but it is read for {here}; read it inside that block, expose "
                f"it with p.output(..., otherwise=...), or merge it with p.select(...)",
                pipeline=self.name, step=ref.node, tensor=ref.qualname,
            )

    def _condition(self, value: Any, what: str) -> Condition:
        """``value`` as a checked condition: a BOOL tensor with one element per row, readable here."""
        cond = value if isinstance(value, Condition) else Condition(self._as_ref(value, f"{what}(...)"))
        ref = self._as_ref(cond.ref, f"{what}(...)")
        head = f"pipeline {self.name!r}: {cond.describe() if what == 'when' else what + '(...)'} needs a condition"
        one = "dims [1] (one element per row)" if self.batched else "shape [1] (max_batch_size is 0)"
        if ref.spec.dtype != "BOOL":
            raise DtypeMismatchError(
                f"{head} of BOOL {one}, but {ref.describe()} is {ref.spec.dtype}; compute it in a step "
                "that outputs TensorSpec('BOOL', [1])",
                pipeline=self.name, step=ref.node, tensor=ref.qualname,
            )
        if ref.spec.dims != (1,):
            raise ShapeMismatchError(
                f"{head} of BOOL {one}, but {ref.describe()} has dims {list(ref.spec.dims)}; reduce it to "
                "one element per row in a step that outputs TensorSpec('BOOL', [1])",
                pipeline=self.name, step=ref.node, tensor=ref.qualname,
            )
        self._check_reach(ref, tuple(self._when_stack), f"{what}(...)")
        return Condition(ref, cond.negated)

    def _fill(self, name: str, ref: TensorRef, otherwise: Any) -> Fill | None:
        """``otherwise`` checked against output ``name`` (``ref``) and held as plan data."""
        when = self._terms(ref)
        if not when:
            if otherwise is not _UNSET:
                raise ConditionError(
                    f"pipeline {self.name!r}: output {name!r} was given otherwise=, but {ref.describe()} is "
                    "made for every row (in no when block); drop otherwise=",
                    pipeline=self.name, step=ref.node, tensor=name,
                )
            return None
        block = when[-1].describe()
        if otherwise is _UNSET:
            raise ConditionError(
                f"pipeline {self.name!r}: output {name!r} is {ref.describe()}, which step {ref.node!r} makes only "
                f"in {block}; say what the other rows get: p.output({name!r}, ..., otherwise=0), or merge "
                "it with p.select(...)",
                pipeline=self.name, step=ref.node, tensor=name,
            )
        spec = ref.spec
        head = f"pipeline {self.name!r}: output {name!r} ({spec}, made in {block}) got otherwise={otherwise!r}"
        if spec.dtype == "BYTES":
            array = np.asarray(otherwise, dtype=object)
            items = array.reshape(-1).tolist()
            if not all(isinstance(x, (bytes, str)) for x in items):
                raise ConditionError(
                    f"{head}; a BYTES output is filled with bytes, such as otherwise=b''",
                    pipeline=self.name, step=ref.node, tensor=name,
                )
            data = tuple((x.encode() if isinstance(x, str) else x).decode("latin-1") for x in items)
        elif spec.dtype == "BF16":
            raise ConditionError(
                f"{head}; a BF16 output cannot be filled (numpy has no BF16); expose it as FP32 instead",
                pipeline=self.name, step=ref.node, tensor=name,
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
                    pipeline=self.name, step=ref.node, tensor=name,
                )
            data = tuple(cast.reshape(-1).tolist())
        if array.ndim:
            if -1 in spec.dims:
                raise ConditionError(
                    f"{head} of shape {list(array.shape)}, but the output's dims {list(spec.dims)} have a variable "
                    "size, so the rows the branch ran may differ from it; give a scalar, which takes the "
                    "branch's size",
                    pipeline=self.name, step=ref.node, tensor=name,
                )
            if tuple(array.shape) != spec.dims:
                raise ConditionError(
                    f"{head} of shape {list(array.shape)}; give a scalar, or an array of the output's dims "
                    f"{list(spec.dims)} (without the batch dimension)",
                    pipeline=self.name, step=ref.node, tensor=name,
                )
        return Fill(spec.dtype, spec.dims, tuple(array.shape), data)

    def _free_name(self, base: str) -> str:
        name, i = base, 2
        while name in self._nodes:
            name, i = f"{base}_{i}", i + 1
        return name

    def _connect(self, node: Node, input_name: str, ref: TensorRef) -> None:
        self._bindings[node.name][input_name] = ref
        if ref.node is not None:
            if self._graph.has_edge(ref.node, node.name):
                self._graph.edges[ref.node, node.name]["tensors"].append((ref.name, input_name))
            else:
                self._graph.add_edge(ref.node, node.name, tensors=[(ref.name, input_name)])

    def _check_batching(self, step: Step, node_name: str) -> None:
        own = step.options.max_batch_size
        if own is None:
            return
        p = self.max_batch_size
        head = f"pipeline {self.name!r}: step {node_name!r} has max_batch_size {own} but the pipeline has {p}"
        if (own == 0) != (p == 0):
            fix = (
                "a batching pipeline needs batching steps: drop the step's max_batch_size so it follows the pipeline"
                if p else "a non-batching pipeline needs non-batching steps: set the step's max_batch_size to 0"
            )
            raise BatchingMismatchError(f"{head}; {fix}", pipeline=self.name, step=node_name)
        if own < p:
            raise BatchingMismatchError(
                f"{head}; Triton rejects an ensemble whose batch exceeds a composing model's, "
                f"so raise the step's max_batch_size to at least {p} or lower the pipeline's",
                pipeline=self.name, step=node_name,
            )

    def _check_bound(self, node_names: Any, *, why: str) -> None:
        for n in sorted(node_names, key=self._order_index.__getitem__):
            missing = self._nodes[n].unbound
            if missing:
                raise UnboundInputError(
                    f"pipeline {self.name!r}: step {n!r} input {missing[0]!r} "
                    f"({self._nodes[n].step.inputs[missing[0]]}) is not bound, which {why} needs; "
                    f"wire it with p.bind({n!r}, {missing[0]}=...) or in p.add(...)",
                    pipeline=self.name, step=n, tensor=missing[0],
                )


def _select_rows(condition: Any, then: Any, otherwise: Any) -> dict[str, Any]:
    """A select over every row, as plain Python (the executors merge the rows themselves)."""
    mask = np.asarray(condition, dtype=bool).reshape((-1,) + (1,) * (np.ndim(then) - 1))
    return {"output": np.where(mask, then, otherwise)}


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
