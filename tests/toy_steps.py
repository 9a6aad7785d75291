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
