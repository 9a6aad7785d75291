"""A pipeline drawn as a diagram: stages left to right, every tensor edge labelled.

Laid out here, with no Graphviz: each column is a topological generation
(pipeline inputs first, outputs last); an edge that skips columns runs through a
channel of its own in each column it crosses, so no edge passes under a box.
Every edge leaves its source on its own row, and its label (name, dtype, shape)
sits on that row in the gap after the column, which is made as wide as the
widest label there; the curves start after the labels. So labels can neither
overlap one another nor be crossed by a curve, by construction. Text is
monospace, whose width is known without a font library (0.6 em a character in
DejaVu Sans Mono, Menlo, Consolas, Courier), so boxes fit their text.

A ``when`` block is a dashed frame around its steps, labelled with its condition
(``when(~check.ok)``), and the condition reaches the block's first step by a
dashed edge.

``Diagram.to_svg()`` needs nothing; ``to_png()`` draws the same geometry with
matplotlib (its bundled DejaVu Sans Mono). Jupyter shows a pipeline through
``Pipeline._repr_mimebundle_``, which gives both. The same graph as Mermaid or DOT
text, for other tools to draw, comes from ``diagram_text.py``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape

if TYPE_CHECKING:
    from ..core.graph import Graph

__all__ = ["Diagram", "diagram"]

# Geometry, in pixels.
FONT = "DejaVu Sans Mono, Menlo, Consolas, 'Liberation Mono', 'Courier New', monospace"
CHAR = 0.62  # advance of a monospace character, in em, with a little room to spare
LABEL_PX, TITLE_PX, CAPTION_PX, HEADER_PX = 12, 13, 11, 13
ROW = 38  # height of one edge row at a box side: the name above the line, dtype and shape below
PAD_X, PAD_Y = 12, 8
ITEM_GAP = 18  # between boxes stacked in one column
LABEL_PAD = 8  # between a column's right side and its labels, and after them
MARGIN = 16
COLORS = {
    "step": ("#dbe8f6", "#4a6f9c"),
    "external": ("#f6e7d3", "#9c6b2e"),
    "input": ("#e3f1df", "#4f8a45"),
    "output": ("#f2e0ef", "#8a4f83"),
}
EDGE, LABEL_INK, TYPE_INK, INK = "#5b6675", "#1f2933", "#5f6b7a", "#1f2933"
FRAME_INK, FRAME_PAD = "#7a5c99", 10  # a when block's frame, and its room around its boxes (per level)


def text_width(text: str, px: float) -> float:
    return len(text) * CHAR * px


@dataclass(frozen=True)
class Box:
    """A drawn item: a step, a pipeline input or output (a pill)."""

    kind: str
    title: str
    caption: str
    x: float
    y: float
    w: float
    h: float


@dataclass(frozen=True)
class Edge:
    """One wire: a polyline of horizontal runs joined by curves, and its label above its first run."""

    runs: tuple[tuple[float, float, float], ...]  # (x_start, x_end, y) horizontal runs, left to right
    name: str
    spec: str
    label_x: float
    label_y: float  # the line the label sits on: name above it, dtype and shape below


@dataclass(frozen=True)
class Frame:
    """A ``when`` block: a dashed rectangle around its steps, its condition written above it."""

    label: str
    x: float
    y: float
    w: float
    h: float


@dataclass(frozen=True)
class Diagram:
    """A laid-out pipeline; ``to_svg()``/``to_png()`` draw it, Jupyter shows it."""

    header: str
    width: float
    height: float
    boxes: tuple[Box, ...]
    edges: tuple[Edge, ...]
    frames: tuple[Frame, ...] = ()
    dashed: tuple[int, ...] = ()  # the edges that carry a when block's condition

    # -------------------------------------------------------------- SVG

    def to_svg(self) -> str:
        w, h = int(self.width + 0.999), int(self.height + 0.999)
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="{FONT}">',
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{EDGE}"/></marker></defs>',
            f'<rect width="{w}" height="{h}" fill="white"/>',
            f'<text x="{MARGIN}" y="{MARGIN + HEADER_PX}" font-size="{HEADER_PX}" fill="{INK}">'
            f"{escape(self.header)}</text>",
        ]
        for frame in self.frames:
            out.append(f'<rect x="{frame.x:.1f}" y="{frame.y:.1f}" width="{frame.w:.1f}" height="{frame.h:.1f}" '
                       f'rx="8" fill="none" stroke="{FRAME_INK}" stroke-width="1.2" stroke-dasharray="6 4"/>')
            out.append(f'<text x="{frame.x + 6:.1f}" y="{frame.y + CAPTION_PX + 2:.1f}" font-size="{CAPTION_PX}" '
                       f'fill="{FRAME_INK}">{escape(frame.label)}</text>')
        for i, edge in enumerate(self.edges):
            dash = ' stroke-dasharray="4 3"' if i in self.dashed else ""
            out.append(f'<path d="{_svg_path(edge.runs)}" fill="none" stroke="{EDGE}" stroke-width="1.3"{dash} '
                       'marker-end="url(#arrow)"/>')
        for edge in self.edges:
            name_y, spec_y = _label_rows(edge)
            out.append(f'<text x="{edge.label_x:.1f}" y="{name_y:.1f}" font-size="{LABEL_PX}" '
                       f'fill="{LABEL_INK}">{escape(edge.name)}</text>')
            out.append(f'<text x="{edge.label_x:.1f}" y="{spec_y:.1f}" font-size="{LABEL_PX}" '
                       f'fill="{TYPE_INK}">{escape(edge.spec)}</text>')
        for box in self.boxes:
            fill, stroke = COLORS[box.kind]
            rx = box.h / 2 if box.kind in ("input", "output") else 6
            out.append(f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" '
                       f'rx="{min(rx, 14):.1f}" fill="{fill}" stroke="{stroke}" stroke-width="1.4"/>')
            cx = box.x + box.w / 2
            title_y, caption_y = _text_rows(box)
            out.append(f'<text x="{cx:.1f}" y="{title_y:.1f}" font-size="{TITLE_PX}" font-weight="bold" '
                       f'text-anchor="middle" fill="{INK}">{escape(box.title)}</text>')
            if box.caption:
                out.append(f'<text x="{cx:.1f}" y="{caption_y:.1f}" font-size="{CAPTION_PX}" font-style="italic" '
                           f'text-anchor="middle" fill="{TYPE_INK}">{escape(box.caption)}</text>')
        out.append("</svg>")
        return "\n".join(out)

    # -------------------------------------------------------------- PNG (matplotlib)

    def to_png(self, path: Any = None, *, scale: float = 1.5) -> bytes:
        """The same drawing as PNG bytes (and written to ``path`` if given); needs matplotlib."""
        # A bare Figure renders through Agg without pyplot, so a notebook's backend is left alone.
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch, PathPatch
        from matplotlib.path import Path

        dpi = 72 * scale  # one diagram pixel is one point, so font sizes carry over as they are
        fig = Figure(figsize=(self.width / 72, self.height / 72), dpi=dpi)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, self.width)
        ax.set_ylim(self.height, 0)
        ax.set_axis_off()
        mono = {"family": "DejaVu Sans Mono"}
        ax.text(MARGIN, MARGIN + HEADER_PX, self.header, fontsize=HEADER_PX, color=INK, va="baseline", **mono)
        for frame in self.frames:
            ax.add_patch(FancyBboxPatch((frame.x, frame.y), frame.w, frame.h, boxstyle="round,pad=0", fill=False,
                                        edgecolor=FRAME_INK, linewidth=1.2, linestyle=(0, (6, 4))))
            ax.text(frame.x + 6, frame.y + CAPTION_PX + 2, frame.label, fontsize=CAPTION_PX, color=FRAME_INK,
                    va="baseline", **mono)
        for i, edge in enumerate(self.edges):
            verts, codes = _mpl_path(edge.runs)
            ax.add_patch(PathPatch(Path(verts, codes), fill=False, edgecolor=EDGE, linewidth=1.3,
                                   linestyle="--" if i in self.dashed else "-"))
            x_end, y_end = edge.runs[-1][1], edge.runs[-1][2]
            ax.add_patch(PathPatch(Path([(x_end - 7, y_end - 3.5), (x_end, y_end), (x_end - 7, y_end + 3.5),
                                         (x_end - 7, y_end - 3.5)], closed=True), facecolor=EDGE, edgecolor=EDGE))
        for edge in self.edges:
            name_y, spec_y = _label_rows(edge)
            ax.text(edge.label_x, name_y, edge.name, fontsize=LABEL_PX, color=LABEL_INK, va="baseline", **mono)
            ax.text(edge.label_x, spec_y, edge.spec, fontsize=LABEL_PX, color=TYPE_INK, va="baseline", **mono)
        for box in self.boxes:
            fill, stroke = COLORS[box.kind]
            rounding = min(box.h / 2, 14) if box.kind in ("input", "output") else 6
            ax.add_patch(FancyBboxPatch((box.x + rounding, box.y + rounding), box.w - 2 * rounding,
                                        box.h - 2 * rounding, boxstyle=f"round,pad={rounding}",
                                        facecolor=fill, edgecolor=stroke, linewidth=1.4))
            cx = box.x + box.w / 2
            title_y, caption_y = _text_rows(box)
            ax.text(cx, title_y, box.title, fontsize=TITLE_PX, weight="bold", ha="center", va="baseline",
                    color=INK, **mono)
            if box.caption:
                ax.text(cx, caption_y, box.caption, fontsize=CAPTION_PX, style="italic", ha="center",
                        va="baseline", color=TYPE_INK, **mono)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
        data = buffer.getvalue()
        if path is not None:
            with open(path, "wb") as f:
                f.write(data)
        return data

    # -------------------------------------------------------------- Jupyter

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"image/svg+xml": self.to_svg(), "text/plain": self.header}
        try:  # a PNG too, for viewers that show no SVG; only when matplotlib is there
            bundle["image/png"] = self.to_png()
        except ImportError:
            pass
        return bundle


def _label_rows(edge: Edge) -> tuple[float, float]:
    """Baselines of an edge's name (above its line) and its dtype and shape (below it)."""
    return edge.label_y - 5, edge.label_y + 5 + LABEL_PX * 0.8


def _text_rows(box: Box) -> tuple[float, float]:
    """Baselines of a box's title and caption, centred together in the box."""
    block = TITLE_PX + (CAPTION_PX + 4 if box.caption else 0)
    top = box.y + (box.h - block) / 2
    return top + TITLE_PX * 0.85, top + TITLE_PX + 4 + CAPTION_PX * 0.85


def _bends(runs: tuple[tuple[float, float, float], ...]):
    """The curves joining consecutive runs: (x0, y0, x1, y1)."""
    for (_, a_end, a_y), (b_start, _, b_y) in zip(runs, runs[1:], strict=False):
        yield a_end, a_y, b_start, b_y


def _svg_path(runs: tuple[tuple[float, float, float], ...]) -> str:
    x, _, y = runs[0]
    parts = [f"M{x:.1f},{y:.1f}"]
    for (_, x_end, y_run), nxt in zip(runs, list(runs[1:]) + [None], strict=True):
        parts.append(f"L{x_end:.1f},{y_run:.1f}")
        if nxt is not None:
            x1, y1 = nxt[0], nxt[2]
            mid = (x_end + x1) / 2
            parts.append(f"C{mid:.1f},{y_run:.1f} {mid:.1f},{y1:.1f} {x1:.1f},{y1:.1f}")
    return " ".join(parts)


def _mpl_path(runs: tuple[tuple[float, float, float], ...]) -> tuple[list, list]:
    from matplotlib.path import Path

    x, _, y = runs[0]
    verts, codes = [(x, y)], [Path.MOVETO]
    for (_, x_end, y_run), nxt in zip(runs, list(runs[1:]) + [None], strict=True):
        verts.append((x_end, y_run))
        codes.append(Path.LINETO)
        if nxt is not None:
            x1, y1 = nxt[0], nxt[2]
            mid = (x_end + x1) / 2
            verts += [(mid, y_run), (mid, y1), (x1, y1)]
            codes += [Path.CURVE4] * 3
    # the arrowhead is drawn on top; stop the line at its base
    verts[-1] = (verts[-1][0] - 6, verts[-1][1])
    return verts, codes


# ------------------------------------------------------------------ layout


@dataclass
class _Item:
    key: tuple[str, str]
    layer: int
    kind: str  # step | external | input | output | channel
    title: str = ""
    caption: str = ""
    w: float = 0.0
    h: float = float(ROW)
    y: float = 0.0
    order: float = 0.0


@dataclass
class _Wire:
    source: tuple[str, str]
    target: tuple[str, str]
    name: str
    spec: str
    path: list[tuple[str, str]]  # items passed through: source, channels..., target
    out_y: float = 0.0


def diagram(p: Graph) -> Diagram:
    """Lay out ``p``: columns of topological generations, labelled edges, nothing overlapping."""
    items: dict[tuple[str, str], _Item] = {}
    wires: list[_Wire] = []
    layer_of: dict[str, int] = {}
    for node_name in p.topological_order():
        node = p.nodes[node_name]
        refs = [*node.bindings.values(), *(c.ref for c in node.when)]
        sources = [ref.node for ref in refs if ref.node is not None]
        layer_of[node_name] = 1 + max((layer_of[s] for s in sources), default=0)
    last = max(layer_of.values(), default=0) + (1 if p.outputs else 0)

    for name in p.inputs:
        items[("input", name)] = _Item(("input", name), 0, "input", name, "input")
    for node_name in p.topological_order():
        node = p.nodes[node_name]
        caption = node.step.name if node.step.name != node_name else ""
        if node.step.is_external:
            ext = node.step.external
            kind = ext.backend or ext.platform or "external"
            caption = f"{caption} · {kind}" if caption else kind
        items[("step", node_name)] = _Item(("step", node_name), layer_of[node_name],
                                           "external" if node.step.is_external else "step", node_name, caption)
    for name in p.outputs:
        items[("output", name)] = _Item(("output", name), last, "output", name, "output")

    for node_name in p.topological_order():
        for input_name, ref in p.nodes[node_name].bindings.items():
            source = ("input", ref.name) if ref.is_input else ("step", ref.node)
            label = ref.name if ref.name == input_name else f"{ref.name} → {input_name}"
            wires.append(_Wire(source, ("step", node_name), label, str(ref.spec), []))
    for name, ref in p.outputs.items():
        label = ref.name if ref.name == name else f"{ref.name} → {name}"
        wires.append(_Wire(("step", ref.node), ("output", name), label, str(ref.spec), []))
    # Each when block: its steps (the innermost blocks too), and its condition's edge to its first step.
    blocks: dict[tuple[Any, ...], list[str]] = {}
    for node_name in p.topological_order():
        when = p.nodes[node_name].when
        for depth in range(1, len(when) + 1):
            blocks.setdefault(tuple(when[:depth]), []).append(node_name)
    dashed = []
    for block, members in blocks.items():
        cond = block[-1]
        source = ("input", cond.ref.name) if cond.ref.is_input else ("step", cond.ref.node)
        dashed.append(len(wires))
        wires.append(_Wire(source, ("step", members[0]), ("~" if cond.negated else "") + cond.ref.name, "when", []))

    # an edge that skips columns gets a channel in each column it crosses
    for i, wire in enumerate(wires):
        a, b = items[wire.source].layer, items[wire.target].layer
        wire.path = [wire.source]
        for layer in range(a + 1, b):
            key = ("channel", f"{i}:{layer}")
            items[key] = _Item(key, layer, "channel")
            wire.path.append(key)
        wire.path.append(wire.target)

    layers: list[list[_Item]] = [[] for _ in range(last + 1)]
    for item in items.values():
        layers[item.layer].append(item)
    _order(layers, wires)

    # sizes: boxes fit their text and their edge rows
    outs: dict[tuple[str, str], list[tuple[_Wire, int]]] = {k: [] for k in items}
    ins: dict[tuple[str, str], list[tuple[_Wire, int]]] = {k: [] for k in items}
    for wire in wires:
        for hop, (u, v) in enumerate(zip(wire.path, wire.path[1:], strict=False)):
            outs[u].append((wire, hop))
            ins[v].append((wire, hop))
    for item in items.values():
        if item.kind == "channel":
            continue
        item.w = max(text_width(item.title, TITLE_PX), text_width(item.caption, CAPTION_PX)) + 2 * PAD_X
        text_h = TITLE_PX + (CAPTION_PX + 4 if item.caption else 0) + 2 * PAD_Y
        item.h = max(text_h, ROW * max(len(outs[item.key]), len(ins[item.key]), 1))

    widths = [max([i.w for i in layer] + [40.0]) for layer in layers]
    label_w = []
    for layer in layers:
        labels = [max(text_width(w.name, LABEL_PX), text_width(w.spec, LABEL_PX)) for it in layer if it.kind != "channel"
                  for w, hop in outs[it.key] if hop == 0]
        label_w.append(max(labels, default=0.0))

    # vertical placement, left to right: each item as near its sources as the items above allow.
    # Segment s of wire i runs from path[s] to path[s + 1]; it leaves at dep[i, s] and arrives at arr[i, s].
    top = MARGIN + HEADER_PX + 18
    index = {id(w): i for i, w in enumerate(wires)}
    dep: dict[tuple[int, int], float] = {}
    arr: dict[tuple[int, int], float] = {}
    for layer in layers:
        layer.sort(key=lambda it: it.order)
        floor = top
        for item in layer:
            incoming = [dep[index[id(w)], s] for w, s in ins[item.key]]
            want = sum(incoming) / len(incoming) - item.h / 2 if incoming else floor
            item.y = max(want, floor)
            floor = item.y + item.h + ITEM_GAP
            # rows: edges in, sorted by where they come from; edges out, sorted by where they go
            arriving = sorted(ins[item.key], key=lambda ws: dep[index[id(ws[0])], ws[1]])
            for r, (w, s) in enumerate(arriving):
                arr[index[id(w)], s] = item.y + item.h * (r + 0.5) / len(arriving)
            leaving = sorted(outs[item.key], key=lambda ws: _target_order(items, ws))
            for r, (w, s) in enumerate(leaving):
                dep[index[id(w)], s] = item.y + item.h * (r + 0.5) / len(leaving)

    # columns: x of each, and the gap after it (labels, then room for the curves)
    xs, x = [], float(MARGIN)
    for n, width in enumerate(widths):
        xs.append(x)
        x += width
        if n < len(widths) - 1:
            rises = [abs(dep[index[id(w)], s] - arr[index[id(w)], s]) for it in layers[n] for w, s in outs[it.key]]
            curve = min(140.0, max(48.0, 0.35 * max(rises, default=0.0)))
            x += LABEL_PAD + label_w[n] + LABEL_PAD + curve
    width = max(x + MARGIN, MARGIN * 2 + text_width(_header(p), HEADER_PX))
    height = max((it.y + it.h for it in items.values()), default=top) + MARGIN

    boxes = []
    for item in items.values():
        if item.kind == "channel":
            continue
        boxes.append(Box(item.kind, item.title, item.caption, xs[item.layer], item.y, widths[item.layer], item.h))

    edges = []
    for i, wire in enumerate(wires):
        runs = []
        for s, key in enumerate(wire.path[:-1]):
            layer = items[key].layer
            start = xs[layer] + (widths[layer] if s == 0 else 0.0)
            end = xs[layer] + widths[layer] + LABEL_PAD + label_w[layer] + LABEL_PAD
            runs.append((start, end, dep[i, s]))
        target = items[wire.target]
        y_in = arr[i, len(wire.path) - 2]
        runs.append((xs[target.layer], xs[target.layer], y_in))
        src_layer = items[wire.source].layer
        edges.append(Edge(tuple(runs), wire.name, wire.spec, xs[src_layer] + widths[src_layer] + LABEL_PAD,
                          runs[0][2]))
    frames = []
    deepest = max((len(b) for b in blocks), default=0)
    for block, members in blocks.items():
        pad = FRAME_PAD * (1 + deepest - len(block))
        inner = [items[("step", m)] for m in members]
        x0 = min(xs[it.layer] for it in inner) - pad
        x1 = max(xs[it.layer] + widths[it.layer] for it in inner) + pad
        y0 = min(it.y for it in inner) - pad - CAPTION_PX - 4  # room for the label above the boxes
        y1 = max(it.y + it.h for it in inner) + pad
        frames.append(Frame(block[-1].describe(), x0, y0, x1 - x0, y1 - y0))
    return Diagram(_header(p), width, height, tuple(boxes), tuple(edges), tuple(frames), tuple(dashed))


def _header(p: Graph) -> str:
    batching = (f"max_batch_size {p.max_batch_size}: shapes leave out the batch dimension"
                if p.batched else "no batching: shapes are whole")
    return f"pipeline {p.name!r} · {len(p.nodes)} steps · {batching}"


def _target_order(items: dict, wire_segment: tuple[_Wire, int]) -> tuple[float, int]:
    wire, s = wire_segment
    return items[wire.path[s + 1]].order, s


def _order(layers: list[list[_Item]], wires: list[_Wire]) -> None:
    """Order each column by the mean position of what feeds it (two barycentre sweeps)."""
    for n, item in enumerate(layers[0]):
        item.order = float(n)
    preds: dict[tuple[str, str], list[tuple[str, str]]] = {}
    succs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for wire in wires:
        for u, v in zip(wire.path, wire.path[1:], strict=False):
            preds.setdefault(v, []).append(u)
            succs.setdefault(u, []).append(v)
    by_key = {item.key: item for layer in layers for item in layer}
    for sweep in range(2):
        for n in range(1, len(layers)):
            for pos, item in enumerate(layers[n]):
                feeders = [by_key[k].order for k in preds.get(item.key, [])]
                item.order = sum(feeders) / len(feeders) + pos * 1e-3 if feeders else float(pos)
            layers[n].sort(key=lambda it: it.order)
            for pos, item in enumerate(layers[n]):
                item.order = float(pos)
        if sweep == 0:  # then pull the first column towards what it feeds
            for pos, item in enumerate(layers[0]):
                fed = [by_key[k].order for k in succs.get(item.key, [])]
                item.order = sum(fed) / len(fed) + pos * 1e-3 if fed else float(pos)
            layers[0].sort(key=lambda it: it.order)
            for pos, item in enumerate(layers[0]):
                item.order = float(pos)
