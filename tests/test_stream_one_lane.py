"""Which streaming requests a server model runs without a task per once-per-request node
(``stream_run._one_lane``): only those whose nodes can run nowhere but one after another."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, serving, step
from pipelines.compile.models import stream_run
from pipelines.examples import textgen

pytestmark = pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")

ONE = TensorSpec("INT32", [1])


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
    for i in range(int(n[0])):
        yield {"tok": np.array([i], np.int32)}


@step(inputs={"n": ONE}, outputs={"base": ONE})
def prep(n):
    return {"base": n * 10}


@step(inputs={"n": ONE}, outputs={"scale": ONE})
def scale(n):
    return {"scale": n + 1}


@step(inputs={"tok": ONE, "base": ONE, "scale": ONE}, outputs={"sq": ONE})
def mix(tok, base, scale):
    return {"sq": tok * scale + base}


def layout_of(pipeline: Pipeline) -> serving.StreamLayout:
    repo = pipeline.compile("fused")
    data = json.loads(repo.models[pipeline.name].files["1/fused.json"])
    wanted = tuple(out["name"] for out in data["plan"]["outputs"])
    return serving.StreamLayout(serving.Schedule(data["plan"], wanted), data["streams"])


def test_a_chain_of_nodes_before_the_stream_is_one_lane():
    layout = layout_of(textgen.make_textgen(name="chained", gate=False))
    assert layout.in_order == ["tokenize", "decode"]
    assert stream_run._one_lane(layout)


def test_a_step_that_reads_the_stream_whole_runs_beside_it():
    layout = layout_of(textgen.make_textgen(name="gated"))
    assert layout.whole == ["detokenize"]
    assert not stream_run._one_lane(layout)


def test_nodes_that_can_run_side_by_side_are_not_one_lane():
    p = Pipeline("sides", inputs={"n": ONE})
    tok = p.add(count, n=p.input("n"))["tok"]
    base = p.add(prep, n=p.input("n"))["base"]
    factor = p.add(scale, n=p.input("n"))["scale"]
    p.output("sq", p.add(mix, tok=tok, base=base, scale=factor)["sq"])
    layout = layout_of(p)
    assert set(layout.top) == {"count", "prep", "scale"}
    assert not stream_run._one_lane(layout)  # prep and scale wait for nothing: both start at once
