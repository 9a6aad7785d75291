"""A pipeline draws itself: stages left to right, every edge labelled, nothing cut or overlapping.

The geometry is checked for the yolov5 example, a wider DAG and random DAGs: each label and
title lies inside the canvas, no two labels overlap, no label overlaps a box or is crossed by
an edge, and each box holds its text. The PNGs were also looked at (see docs/declaring.md).
"""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.drawing.diagram import CAPTION_PX, LABEL_PX, PAD_X, TITLE_PX, _label_rows, text_width
from pipelines.examples import basic, yolov5

V = TensorSpec("FP32", [4])


@step(inputs={"x": V}, outputs={"y": V})
def same(x):
    return {"y": x}


@step(inputs={"a": V, "b": V}, outputs={"y": V, "extra_long_output_name": TensorSpec("INT64", [-1, 17, 3])})
def join(a, b):
    return {"y": a + b, "extra_long_output_name": np.zeros((a.shape[0], 1, 17, 3), np.int64)}


@step(inputs={"y": V, "side": TensorSpec("INT64", [-1, 17, 3])}, outputs={"z": V})
def last(y, side):
    return {"z": y}


def wide_pipeline():
    p = Pipeline("wide", inputs={"x": V, "second_input": V}, max_batch_size=4)
    b1 = p.add(same, name="branch_one", x=p.input("x"))
    b2 = p.add(same, name="branch_two_with_a_long_name", x=p.input("x"))
    b3 = p.add(same, name="b3", x=p.input("second_input"))
    b4 = p.add(same, name="b4", x=b1["y"])
    j = p.add(join, a=b4["y"], b=b2["y"])
    j2 = p.add(join, name="join2", a=b3["y"], b=p.input("x"))
    end = p.add(last, y=j["y"], side=j2["extra_long_output_name"])
    p.output("z", end["z"])
    p.output("side_output", j["extra_long_output_name"])
    p.output("early", b3["y"])
    return p


def random_pipeline(seed):
    rng = random.Random(seed)
    p = Pipeline(f"random{seed}", inputs={f"in{i}": V for i in range(rng.randint(1, 3))}, max_batch_size=0)
    refs = [p.input(n) for n in p.inputs]
    for n in range(rng.randint(3, 9)):
        name = "s" * rng.randint(1, 3) + "_" * rng.randint(0, 1) + f"step{n}" + "x" * rng.randint(0, 12)
        if rng.random() < 0.5 or len(refs) < 2:
            node = p.add(same, name=name, x=rng.choice(refs))
        else:
            a, b = rng.sample(refs, 2)
            node = p.add(join, name=name, a=a, b=b)
        refs.append(node["y"])
    for i, ref in enumerate(rng.sample([r for r in refs if not r.is_input], 2)):
        p.output(f"out{i}", ref)
    return p


def _rect_overlap(a, b, slack=0.5):
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


def _text_rect(x, baseline, text, px, anchor="start"):
    w = text_width(text, px)
    x0 = x - w / 2 if anchor == "middle" else x
    return (x0, baseline - 0.8 * px, x0 + w, baseline + 0.25 * px)


def check_layout(d):
    labels = []
    for edge in d.edges:
        name_y, spec_y = _label_rows(edge)
        labels.append((_text_rect(edge.label_x, name_y, edge.name, LABEL_PX), edge))
        labels.append((_text_rect(edge.label_x, spec_y, edge.spec, LABEL_PX), edge))
    boxes = [(b.x, b.y, b.x + b.w, b.y + b.h) for b in d.boxes]
    for rect, edge in labels:
        assert 0 <= rect[0] and rect[2] <= d.width and 0 <= rect[1] and rect[3] <= d.height, edge.name
        for box in boxes:
            assert not _rect_overlap(rect, box), (edge.name, box)
    for i, (a, ea) in enumerate(labels):
        for b, eb in labels[i + 1 :]:
            if ea is not eb:
                assert not _rect_overlap(a, b), (ea.name, eb.name)
    for box in d.boxes:
        assert text_width(box.title, TITLE_PX) <= box.w - 2 * PAD_X + 0.01, box.title
        assert text_width(box.caption, CAPTION_PX) <= box.w - 2 * PAD_X + 0.01, box.caption
        assert box.x + box.w <= d.width and box.y + box.h <= d.height
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not _rect_overlap(a, b, slack=0), (a, b)
    # no line crosses a label that is not its own, and no line runs under a box
    for edge in d.edges:
        for x0, x1, y in edge.runs:
            for rect, owner in labels:
                if owner is not edge and rect[1] < y < rect[3]:
                    assert x1 <= rect[0] or x0 >= rect[2], (edge.name, owner.name)
            for box in boxes:
                if box[1] < y < box[3]:
                    assert x1 <= box[0] + 0.01 or x0 >= box[2] - 0.01, (edge.name, box)
        for (_, x_end, y0), (x_next, _, y1) in zip(edge.runs, edge.runs[1:], strict=False):
            lo, hi = min(y0, y1), max(y0, y1)
            for rect, _ in labels:
                if rect[1] < hi and lo < rect[3]:  # a bend spans this label's rows: it must be beside it
                    assert x_end >= rect[2] - 0.01 or x_next <= rect[0], (edge.name, rect)


@pytest.mark.parametrize(
    "make", [lambda: yolov5.pipeline, wide_pipeline, lambda: basic.diamond, lambda: basic.chain]
    + [lambda seed=seed: random_pipeline(seed) for seed in range(12)],
)
def test_labels_are_whole_and_apart(make):
    p = make()
    d = p.diagram()
    check_layout(d)
    wires = sum(len(n.bindings) for n in p.nodes.values()) + len(p.outputs)
    assert len(d.edges) == wires
    assert {b.title for b in d.boxes} == set(p.nodes) | set(p.inputs) | set(p.outputs)


def test_the_yolov5_diagram_names_every_tensor_with_dtype_and_shape():
    d = yolov5.pipeline.diagram()
    labels = {(e.name, e.spec) for e in d.edges}
    assert ("output0 → candidates", "FP32 [25200, 85]") in labels
    assert ("images", "FP32 [3, 640, 640]") in labels and ("orig_size", "INT32 [2]") in labels
    # stages left to right: each step's column is right of what feeds it
    x = {b.title: b.x for b in d.boxes}
    assert x["image"] < x["letterbox"] < x["detector"] < x["nms"] < x["scale_boxes"]
    assert "max_batch_size 8" in d.header


def test_jupyter_gets_svg_and_png_and_the_svg_is_well_formed(tmp_path):
    p = wide_pipeline()
    bundle = p._repr_mimebundle_()
    assert bundle["text/plain"] == repr(p)
    svg = ET.fromstring(bundle["image/svg+xml"])
    texts = ["".join(t.itertext()) for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "branch_two_with_a_long_name" in texts and "extra_long_output_name → side_output" in texts
    assert bundle["image/png"].startswith(b"\x89PNG")
    path = tmp_path / "wide.png"
    p.diagram().to_png(path)
    assert path.read_bytes() == bundle["image/png"]
    assert p.to_mermaid().startswith("flowchart LR") and p.to_dot().startswith("digraph")


def test_an_unfinished_pipeline_still_draws():
    p = Pipeline("draft", inputs={"x": V})
    p.add(join, a=p.input("x"))  # b is not bound yet
    check_layout(p.diagram())
    assert "image/svg+xml" in p._repr_mimebundle_()


def test_the_width_rule_covers_the_font_as_rendered():
    # The layout measures text as 0.62 em a character; DejaVu Sans Mono (matplotlib's, and the SVG's
    # first choice) must render no wider, bold and italic included.
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    samples = ["output0 → candidates", "FP32 [25200, 85]", "branch_two_with_a_long_name", "WMW_mm__ij|l"]
    for weight, style in (("normal", "normal"), ("bold", "normal"), ("normal", "italic")):
        prop = FontProperties(family="DejaVu Sans Mono", weight=weight, style=style)
        for text in samples:
            rendered = TextPath((0, 0), text, size=LABEL_PX, prop=prop).get_extents().x1
            assert rendered <= text_width(text, LABEL_PX), (text, weight, style)
            assert rendered >= 0.9 * text_width(text, LABEL_PX)  # and not much narrower: boxes stay snug
