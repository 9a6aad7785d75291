"""``Pipeline``: the typed DAG of steps, checked wire by wire as it is built.

Every wire is checked when it is made (names, dtypes, dims, batching), so a
mistake fails at the line that made it. The validated graph is what both the
compilers and the local runtime read; neither reaches back into the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import networkx as nx

from .errors import (
    BatchingMismatchError,
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
from .plan import critical_path
from .step import Step
from .tensor import TensorSpec

if TYPE_CHECKING:
    from .compile.repository import ModelRepository
    from .diagram import Diagram

__all__ = ["Node", "Pipeline", "TensorRef"]


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
        checked = {k: self._check_wire(node, k, v) for k, v in bindings.items()}
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
            ref = self._check_wire(node, input_name, value)
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

    def output(self, name: str, ref: TensorRef) -> TensorRef:
        """Expose ``ref`` as the pipeline output ``name``."""
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
        self._outputs[name] = ref
        return ref

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
        for name in self._nodes:
            step = self._nodes[name].step
            label = name if step.name == name else f"{name}<br/><i>{step.name}</i>"
            lines.append(f'  {ids[name]}["{label}"]')
        for name, ref in self._outputs.items():
            lines.append(f'  {outs[name]}(["{name}<br/>{ref.spec}"])')
        for node_name in self._nodes:
            for input_name, ref in self._bindings[node_name].items():
                src = ins[ref.name] if ref.is_input else ids[ref.node]
                label = ref.name if ref.name == input_name else f"{ref.name} → {input_name}"
                lines.append(f'  {src} -- "{label}" --> {ids[node_name]}')
        for name, ref in self._outputs.items():
            lines.append(f'  {ids[ref.node]} -- "{ref.name}" --> {outs[name]}')
        return "\n".join(lines) + "\n"

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
        lines = [f"digraph {q(self.name)} {{", "  rankdir=LR;"]
        for name, spec in self.inputs.items():
            lines.append(f"  {q('input:' + name)} [shape=oval, label={q(name + nl + str(spec))}];")
        for name, node in self._nodes.items():
            label = name if node.step.name == name else f"{name}{nl}({node.step.name})"
            lines.append(f"  {q(name)} [shape=box, label={q(label)}];")
        for name, ref in self._outputs.items():
            lines.append(f"  {q('output:' + name)} [shape=oval, label={q(name + nl + str(ref.spec))}];")
        for node_name in self._nodes:
            for input_name, ref in self._bindings[node_name].items():
                src = "input:" + ref.name if ref.is_input else ref.node
                label = ref.name if ref.name == input_name else f"{ref.name} -> {input_name}"
                lines.append(f"  {q(src)} -> {q(node_name)} [label={q(label)}];")
        for name, ref in self._outputs.items():
            lines.append(f"  {q(ref.node)} -> {q('output:' + name)} [label={q(ref.name)}];")
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

    def _check_wire(self, node: Node, input_name: str, value: Any) -> TensorRef:
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
        return ref

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


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
