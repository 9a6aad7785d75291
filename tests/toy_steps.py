"""Tiny steps that tests wire into pipelines of every shape (the output-subset and plan tests)."""

from __future__ import annotations

from pipelines import TensorSpec, step

V = TensorSpec("FP32", [-1])


@step(inputs={"x": V}, outputs={"y": V})
def inc(x):
    return {"y": x + 1}


@step(inputs={"x": V}, outputs={"y": V})
def twice(x):
    return {"y": x * 2}


@step(inputs={"a": V, "b": V}, outputs={"y": V})
def add(a, b):
    return {"y": a + b}


@step(inputs={"x": V}, outputs={"lo": V, "hi": V})
def split(x):
    return {"lo": x - 1, "hi": x * 10}


@step(inputs={"x": V}, outputs={"y": V})
def explode(x):
    raise RuntimeError("a dead node must not run")


# Steps whose results the server reshapes on its way: a list, str BYTES, the input itself
# (tests/test_runtime_answers.py, test_answers_server.py).
N = TensorSpec("INT64", [-1])
B = TensorSpec("BYTES", [-1])


@step(inputs={"x": N}, outputs={"y": N})
def as_list(x):
    return {"y": (x * 2).tolist()}


@step(inputs={"x": V}, outputs={"y": V})
def floats_as_list(x):
    return {"y": x.tolist()}


@step(inputs={"x": V}, outputs={"y": V})
def same(x):
    return {"y": x}


@step(inputs={"s": B}, outputs={"t": B})
def shout(s):
    return {"t": [[item.decode() + "!" for item in row] for row in s.tolist()]}


@step(inputs={"t": B}, outputs={"kind": B})
def kinds(t):
    return {"kind": [[type(item).__name__.encode() for item in row] for row in t.tolist()]}


def answers():
    """Every reshaping step above in one pipeline (INT64 ``n``, FP32 ``x``, BYTES ``s``)."""
    from pipelines import Pipeline

    p = Pipeline("answers", inputs={"n": N, "x": V, "s": B}, max_batch_size=4)
    p.output("doubled", p.add(as_list, x=p.input("n"))["y"])
    p.output("same", p.add(same, name="answers", x=p.input("x"))["y"])  # a node named like its pipeline
    shouted = p.add(shout, s=p.input("s"))
    p.output("shouted", shouted["t"])
    p.output("kind_next", p.add(kinds, name="kind_next", t=shouted["t"])["kind"])
    p.output("kind_in", p.add(kinds, name="kind_in", t=p.input("s"))["kind"])
    return p
