"""Small pipelines for tests and benchmarks: a chain and a diamond of steps
that cost a chosen number of milliseconds, like models of known latency.

``chain`` and ``diamond`` are ready to use (``pipelines graph
pipelines.examples.basic:diamond``); ``make_chain`` and ``make_diamond`` build
variants.
"""

from __future__ import annotations

import time

from ..core.step import step
from ..core.tensor import TensorSpec
from ..pipeline import Pipeline

__all__ = ["Work", "add", "chain", "diamond", "make_chain", "make_diamond"]

VECTOR = TensorSpec("FP32", [-1])


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
class Work:
    """Stands for a model: sleeps ``ms`` milliseconds (a parameter), then scales by ``scale``.

    Sleeping releases the GIL, as real inference in a native library does, so
    branches that run at the same time really overlap.
    """

    def initialize(self, config):
        params = config.get("parameters", {})
        self.seconds = float(params.get("ms", 0)) / 1000.0
        self.scale = float(params.get("scale", 1))

    def execute(self, x):
        if self.seconds:
            time.sleep(self.seconds)
        return {"y": (x * self.scale).astype(x.dtype, copy=False)}


@step(inputs={"a": VECTOR, "b": VECTOR}, outputs={"y": VECTOR})
def add(a, b):
    return {"y": a + b}


def _work(ms: float, scale: float):
    return Work.with_options(parameters={"ms": ms, "scale": scale})


def make_chain(*, steps: int = 3, ms: float = 0.0, name: str = "chain", max_batch_size: int = 8) -> Pipeline:
    """``x -> work_0 -> work_1 -> ... -> y``; each step scales by 2."""
    p = Pipeline(name, inputs={"x": VECTOR}, max_batch_size=max_batch_size)
    ref = p.input("x")
    for i in range(steps):
        ref = p.add(_work(ms, 2.0), name=f"work_{i}", x=ref)["y"]
    p.output("y", ref)
    return p


def make_diamond(*, ms: float = 20.0, branches: int = 2, name: str = "diamond", max_batch_size: int = 8) -> Pipeline:
    """``x`` fans out to ``branches`` independent steps of ``ms`` each, joined by sums.

    Run in parallel, the latency approaches one branch (the critical path);
    one after another, it is ``branches`` times that.
    """
    p = Pipeline(name, inputs={"x": VECTOR}, max_batch_size=max_batch_size)
    refs = [p.add(_work(ms, float(i + 1)), name=f"branch_{i}", x=p.input("x"))["y"] for i in range(branches)]
    total = refs[0]
    for i, ref in enumerate(refs[1:]):
        total = p.add(add, name=f"join_{i}", a=total, b=ref)["y"]
    p.output("y", total)
    return p


chain = make_chain()
diamond = make_diamond()
