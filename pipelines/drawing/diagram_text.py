"""The pipeline as text for other tools to draw: a Mermaid flowchart and Graphviz DOT.

``diagram.py`` draws the same graph itself (SVG, PNG); both show a ``when`` block as a
frame around its steps, reached by a dashed edge from its condition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from ..core.tensor_ref import Condition, TensorRef

if TYPE_CHECKING:
    from ..core.graph import Graph

__all__ = ["to_dot", "to_mermaid"]

Block = tuple[Condition, ...]  # a when block: the conditions down to it, outermost first


def to_mermaid(p: Graph) -> str:
    """``p`` as a Mermaid flowchart (renders in GitHub and Jupyter)."""
    nodes = p.nodes
    # Numbered ids, as names that differ only by '-', '_' or '.' would share a sanitised one.
    ids = {n: f"n{i}" for i, n in enumerate(nodes)}
    ins = {n: f"in{i}" for i, n in enumerate(p.inputs)}
    outs = {n: f"out{i}" for i, n in enumerate(p.outputs)}
    lines = ["flowchart LR"]
    for name, spec in p.inputs.items():
        lines.append(f'  {ins[name]}(["{name}<br/>{spec}"])')

    def node_line(name: str, indent: str) -> str:
        step = nodes[name].step
        label = name if step.name == name else f"{name}<br/><i>{step.name}</i>"
        return f'{indent}{ids[name]}["{label}"]'

    blocks = _blocks(p)
    block_ids = {block: f"w{i}" for i, block in enumerate(blocks)}
    lines += [node_line(name, "  ") for name in nodes if not nodes[name].when]
    lines += _nested(blocks, (), lambda block, indent: f'{indent}subgraph {block_ids[block]}["{block[-1].describe()}"]',
                     node_line, lambda indent: f"{indent}end", "  ")
    for name, ref in p.outputs.items():
        lines.append(f'  {outs[name]}(["{name}<br/>{ref.spec}"])')
    for ref, node_name, label in _wires(p, "→"):
        src = ins[ref.name] if ref.is_input else ids[ref.node]
        lines.append(f'  {src} -- "{label}" --> {ids[node_name]}')
    for name, ref in p.outputs.items():
        lines.append(f'  {ids[ref.node]} -- "{ref.name}" --> {outs[name]}')
    for block, wid in block_ids.items():  # the condition's edge, dashed, into its frame
        cond = block[-1]
        src = ins[cond.ref.name] if cond.ref.is_input else ids[cond.ref.node]
        lines.append(f'  {src} -. "{"~" if cond.negated else ""}{cond.ref.name}" .-> {wid}')
    return "\n".join(lines) + "\n"


def to_dot(p: Graph) -> str:
    """``p`` in Graphviz DOT."""
    nodes = p.nodes
    q, nl = _dot_quote, "\n"
    blocks = _blocks(p)
    lines = [f"digraph {q(p.name)} {{", "  rankdir=LR;"] + (["  compound=true;"] if blocks else [])
    for name, spec in p.inputs.items():
        lines.append(f"  {q('input:' + name)} [shape=oval, label={q(name + nl + str(spec))}];")

    def node_line(name: str, indent: str) -> str:
        node = nodes[name]
        label = name if node.step.name == name else f"{name}{nl}({node.step.name})"
        return f"{indent}{q(name)} [shape=box, label={q(label)}];"

    clusters = {block: f"cluster_when_{i}" for i, block in enumerate(blocks)}
    lines += [node_line(name, "  ") for name in nodes if not nodes[name].when]
    lines += _nested(
        blocks, (),
        lambda block, indent: (f"{indent}subgraph {clusters[block]} {{ label={q(block[-1].describe())}; "
                               "style=dashed;"),
        node_line, lambda indent: f"{indent}}}", "  ",
    )
    for name, ref in p.outputs.items():
        lines.append(f"  {q('output:' + name)} [shape=oval, label={q(name + nl + str(ref.spec))}];")
    for ref, node_name, label in _wires(p, "->"):
        src = "input:" + ref.name if ref.is_input else ref.node
        lines.append(f"  {q(src)} -> {q(node_name)} [label={q(label)}];")
    for name, ref in p.outputs.items():
        lines.append(f"  {q(ref.node)} -> {q('output:' + name)} [label={q(ref.name)}];")
    for block, cluster in clusters.items():  # the condition's edge, dashed, into its frame
        cond = block[-1]
        src = "input:" + cond.ref.name if cond.ref.is_input else cond.ref.node
        first = next(iter(n for b, members in blocks.items() if b[:len(block)] == block for n in members))
        label = ("~" if cond.negated else "") + cond.ref.name
        lines.append(f"  {q(src)} -> {q(first)} [label={q(label)}, style=dashed, lhead={cluster}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _wires(p: Graph, arrow: str) -> Iterator[tuple[TensorRef, str, str]]:
    """Each wire into a step: its tensor, the step, and its label (``"y -> x"`` where the names differ)."""
    for node_name, node in p.nodes.items():
        for input_name, ref in node.bindings.items():
            yield ref, node_name, ref.name if ref.name == input_name else f"{ref.name} {arrow} {input_name}"


def _blocks(p: Graph) -> dict[Block, list[str]]:
    """Each ``when`` block and the nodes directly in it, in order."""
    blocks: dict[Block, list[str]] = {}
    for name, node in p.nodes.items():
        when = node.when
        for depth in range(1, len(when) + 1):
            blocks.setdefault(when[:depth], [])
        if when:
            blocks[when].append(name)
    return blocks


def _nested(blocks: Mapping[Block, list[str]], parent: Block, opening: Callable[[Block, str], str],
            node_line: Callable[[str, str], str], closing: Callable[[str], str], indent: str) -> list[str]:
    """The lines of the blocks directly inside ``parent``, each around its nodes and its own blocks."""
    lines = []
    for block, members in blocks.items():
        if len(block) != len(parent) + 1 or block[:-1] != parent:
            continue
        lines.append(opening(block, indent))
        lines += [node_line(name, indent + "  ") for name in members]
        lines += _nested(blocks, block, opening, node_line, closing, indent + "  ")
        lines.append(closing(indent))
    return lines


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
