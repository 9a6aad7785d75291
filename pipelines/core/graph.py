"""``Graph``: the typed DAG of steps, checked wire by wire as it is built.

Every wire is checked when it is made (names, dtypes, dims, batching), so a
mistake fails at the line that made it. The validated graph is what both the
compilers and the local runtime read; neither reaches back into the other.

The graph keeps the state; its helpers live by role: ``tensor_ref.py`` and
``node.py`` (the handles it gives out), ``wiring.py`` and ``fills.py`` (the checks).
It knows nothing of what it becomes: the user's :class:`~pipelines.Pipeline`
(``pipeline.py``, at the top of the package) is this graph with ``compile``, ``run``,
``stream``, ``predict``, ``advise`` and its drawings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, TypeVar, cast

import networkx as nx
import numpy as np

from ..errors import (
    CycleError,
    DeclarationError,
    DtypeMismatchError,
    DuplicateNameError,
    StepDeclarationError,
    TensorProducedTwiceError,
    UnknownTensorError,
)
from .fills import UNSET, fill_for
from .names import check_name
from .node import Node
from .plan import Fill, critical_path
from .step import Step
from .tensor import TensorSpec
from .tensor_ref import Condition, TensorRef
from .wiring import as_ref, check_batching, check_bound, check_condition, check_select, check_wire

# Condition, Node and TensorRef are defined beside this module and imported from here too.
__all__ = ["Condition", "Graph", "Node", "TensorRef"]

_G = TypeVar("_G", bound="Graph")


class Graph:
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
        self._graph: nx.DiGraph[str] = nx.DiGraph()
        self._order_index: dict[str, int] = {}
        self._when_stack: list[Condition] = []  # the open `with p.when(...)` blocks, outermost first
        self._when: dict[str, tuple[Condition, ...]] = {}  # node -> the conditions it runs under
        self._selects: set[str] = set()
        self._fills: dict[str, Fill] = {}  # output -> its otherwise=
        self._stream_in: dict[str, str] = {}  # node -> the streaming node whose responses reach it
        self._negated: set[str] = set()  # outputs given as ~flag

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
        check_batching(self, step, node_name)
        node = Node(self, node_name, step)
        when = tuple(self._when_stack)
        checked = {k: check_wire(self, node, k, v, when=when) for k, v in bindings.items()}
        stream = None
        for input_name, ref in checked.items():  # before the node is placed: a refused wire leaves no trace
            stream = self._stream_wire(node, input_name, ref, stream)
        self._place(node, when)
        for input_name, ref in checked.items():
            self._connect(node, input_name, ref)
        return node

    def bind(self, node: Node | str, **bindings: Any) -> Node:
        """Wire inputs of a node that were left unbound at :meth:`add`."""
        node = self._node(node)
        for input_name, value in bindings.items():
            ref = check_wire(self, node, input_name, value, when=node.when)
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

    def output(self, name: str, ref: TensorRef | Condition, *, otherwise: Any = UNSET) -> TensorRef:
        """Expose ``ref`` as the pipeline output ``name``.

        ``ref`` may be ``~flag``, a BOOL tensor negated: the output is its element-wise *not*
        (every form negates it as it answers; the ensemble in its gate model).
        ``otherwise``: for a tensor of a ``when`` block, what the rows that did not run the
        block get: a scalar, or an array of the output's dims (``b""`` or bytes for BYTES).
        """
        check_name(name, what="pipeline output", tensor=True, pipeline=self.name)
        negated = isinstance(ref, Condition) and ref.negated
        if isinstance(ref, Condition):
            ref = ref.ref
        ref = as_ref(self, ref, f"output {name!r}")
        if negated and ref.spec.dtype != "BOOL":
            raise DtypeMismatchError(
                f"pipeline {self.name!r}: output {name!r} was given ~{ref.qualname}, but {ref.describe()} is "
                f"{ref.spec.dtype}; ~ negates a BOOL tensor only, so compare it in a step that outputs BOOL",
                pipeline=self.name, step=ref.node, tensor=ref.qualname,
            )
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
        if ref.node is None:  # a pipeline input
            raise DeclarationError(
                f"pipeline {self.name!r}: output {name!r} would be pipeline input {ref.name!r} itself; "
                "a Triton ensemble cannot pass an input straight through, so add a step that produces it",
                pipeline=self.name, tensor=name,
            )
        check_bound(self, nx.ancestors(self._graph, ref.node) | {ref.node}, why=f"output {name!r}")
        fill = fill_for(self, name, ref, otherwise)
        self._outputs[name] = ref
        if fill is not None:
            self._fills[name] = fill
        if negated:
            self._negated.add(name)
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
        cond = check_condition(self, condition, "when", when=tuple(self._when_stack))
        self._check_once_per_request(cond.ref, "a when condition")
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
        context = tuple(self._when_stack)
        cond = check_condition(self, condition, "select", when=context)
        self._check_once_per_request(cond.ref, "a select's condition")
        then, other = check_select(self, cond, then, otherwise, when=context)
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
        self._place(node, context)
        self._selects.add(node_name)
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
    def negated_outputs(self) -> frozenset[str]:
        """The outputs declared as ``~flag``: each answers the element-wise *not* of its tensor."""
        return frozenset(self._negated)

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

    # ------------------------------------------------------------------ streams

    @property
    def streaming(self) -> bool:
        """Whether some step streams (a generator step): ``p.stream`` yields its responses."""
        return any(node.step.streaming for node in self._nodes.values())

    def stream_of(self, node: Node | str) -> str | None:
        """The streaming node once per response of which ``node`` runs; ``None``: once per request.

        A streaming step and a step that reads a stream whole run once per request; the steps
        a stream feeds run once per response.
        """
        node = self._node(node)
        return None if node.step.streaming or node.step.whole_stream else self._stream_in.get(node.name)

    def stream_from(self, node: Node | str) -> str | None:
        """The stream ``node``'s outputs belong to: itself if it streams, ``None`` if once per request."""
        node = self._node(node)
        if node.step.streaming:
            return node.name
        return None if node.step.whole_stream else self._stream_in.get(node.name)

    def stream_input(self, node: Node | str) -> str | None:
        """The stream that feeds ``node`` (read whole, by a ``whole_stream`` step), or ``None``."""
        return self._stream_in.get(self._node(node).name)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes[n] for n in self.topological_order())

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r}: {len(self._nodes)} steps, inputs {list(self.inputs)}, "
            f"outputs {list(self._outputs)}, max_batch_size={self.max_batch_size}>"
        )

    def validate(self: _G) -> _G:
        """Check that the pipeline is complete: every input bound, at least one output."""
        check_bound(self, self._nodes, why="this pipeline to compile or run")
        if not self._outputs:
            raise DeclarationError(
                f"pipeline {self.name!r} has no outputs; declare one with p.output('name', node['out'])",
                pipeline=self.name,
            )
        self._check_streams()
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

    def _free_name(self, base: str) -> str:
        name, i = base, 2
        while name in self._nodes:
            name, i = f"{base}_{i}", i + 1
        return name

    def _place(self, node: Node, when: tuple[Condition, ...]) -> None:
        """Make ``node`` a step of this pipeline, inside the ``when`` blocks ``when``, with nothing wired yet."""
        if when:
            self._when[node.name] = when
        self._nodes[node.name] = node
        self._bindings[node.name] = {}
        self._order_index[node.name] = len(self._order_index)
        self._graph.add_node(node.name)

    def _check_once_per_request(self, ref: TensorRef, what: str) -> None:
        stream = None if ref.node is None else self.stream_from(ref.node)
        if stream is not None:
            raise DeclarationError(
                f"pipeline {self.name!r}: {what} {ref.describe()} changes with each response of streaming "
                f"step {stream!r}; a condition is read once per request, so compute it from tensors that are "
                "not streamed (the pipeline's inputs, or a step fed by them)",
                pipeline=self.name, tensor=ref.name,
            )

    def _stream_wire(self, node: Node, input_name: str, ref: TensorRef, other: str | None) -> str | None:
        """The stream that reaches ``node`` once ``ref`` feeds it (``other``: the one that did before);
        a stream the step cannot take is refused, at the line that wires it (docs/running_locally.md)."""
        arriving = None if ref.node is None else self.stream_from(ref.node)
        if arriving is None:
            return other
        where = f"pipeline {self.name!r}: step {node.name!r} input {input_name!r}"
        step = node.step
        if step.streaming and not step.whole_stream:
            raise DeclarationError(
                f"{where} would take the stream of {arriving!r} ({ref.describe()}), and {node.name!r} streams "
                "itself: a stream of streams has no order to answer in. Declare it @step(..., whole_stream=True) "
                "to read the stream as an iterator and yield from it",
                pipeline=self.name, step=node.name, tensor=input_name,
            )
        if other is not None and other != arriving:
            raise DeclarationError(
                f"{where} would join the stream of {arriving!r} ({ref.describe()}) to the stream of {other!r} "
                "that already feeds it; two streams have no common response to pair (their lengths and pace "
                f"differ), so feed {node.name!r} from one stream, or read one of them whole in a "
                "whole_stream step first",
                pipeline=self.name, step=node.name, tensor=input_name,
            )
        return arriving

    def _check_streams(self) -> None:
        """What only a complete pipeline shows: a whole_stream step with no stream, outputs that stream apart."""
        # Again in order: an input bound later (p.bind) may have brought a stream to steps wired before.
        self._stream_in = {}
        for name in self.topological_order():
            stream = None
            for input_name, ref in self._bindings[name].items():
                stream = self._stream_wire(self._nodes[name], input_name, ref, stream)
            if stream is not None:
                self._stream_in[name] = stream
        for node in self._nodes.values():
            if node.step.whole_stream and node.name not in self._stream_in:
                raise DeclarationError(
                    f"pipeline {self.name!r}: step {node.name!r} is declared whole_stream=True, but no stream "
                    "feeds it; wire one of its inputs to a streaming step's output, or drop whole_stream",
                    pipeline=self.name, step=node.name,
                )
        # An output is a step's, never an input (output() refuses one): its node is a name.
        levels = {name: self.stream_from(cast(str, ref.node)) for name, ref in self._outputs.items()}
        if len(set(levels.values())) > 1:
            said = ", ".join(
                f"{name!r} ({'once per request' if s is None else f'once per response of {s!r}'})"
                for name, s in levels.items()
            )
            raise DeclarationError(
                f"pipeline {self.name!r}: its outputs are answered at different paces: {said}; a response "
                "carries every output, so output tensors of one stream only (pass a once-per-request tensor "
                "through a step of the stream to send it with each response)",
                pipeline=self.name,
            )

    def _connect(self, node: Node, input_name: str, ref: TensorRef) -> None:
        stream = self._stream_wire(node, input_name, ref, self._stream_in.get(node.name))
        if stream is not None:
            self._stream_in[node.name] = stream
        self._bindings[node.name][input_name] = ref
        if ref.node is not None:
            if self._graph.has_edge(ref.node, node.name):
                self._graph.edges[ref.node, node.name]["tensors"].append((ref.name, input_name))
            else:
                self._graph.add_edge(ref.node, node.name, tensors=[(ref.name, input_name)])


def _select_rows(condition: Any, then: Any, otherwise: Any) -> dict[str, Any]:
    """A select over every row, as plain Python (the executors merge the rows themselves)."""
    mask = np.asarray(condition, dtype=bool).reshape((-1,) + (1,) * (np.ndim(then) - 1))
    return {"output": np.where(mask, then, otherwise)}
