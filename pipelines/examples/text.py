"""A small text pipeline with BYTES, INT64 and BOOL outputs: what a client sees beyond float tensors.

``shout`` upper-cases each string; ``measure`` counts its characters, times ``count``, and
says which are long. ``measure`` refuses a negative count, naming the value, so a bad request
shows which one it was.
"""

from __future__ import annotations

import numpy as np

from ..core.step import step
from ..core.tensor import TensorSpec
from ..pipeline import Pipeline

__all__ = ["make_text", "measure", "pipeline", "sample_inputs", "shout"]


@step(inputs={"text": TensorSpec("BYTES", [-1])}, outputs={"loud": TensorSpec("BYTES", [-1])})
def shout(text):
    return {"loud": np.vectorize(lambda t: t.upper() + b"!", otypes=[object])(text)}


@step(
    inputs={"text": TensorSpec("BYTES", [-1]), "count": TensorSpec("INT64", [1])},
    outputs={"lengths": TensorSpec("INT64", [-1]), "long": TensorSpec("BOOL", [-1])},
)
def measure(text, count):
    if (count < 0).any():
        raise ValueError(f"count {int(count.min())} is negative; counts must be >= 0")
    lengths = np.vectorize(len, otypes=[np.int64])(text) * count
    return {"lengths": lengths, "long": lengths > 6}


def make_text(*, name: str = "text", max_batch_size: int = 8) -> Pipeline:
    p = Pipeline(
        name,
        inputs={"text": TensorSpec("BYTES", [-1]), "count": TensorSpec("INT64", [1])},
        max_batch_size=max_batch_size,
    )
    s = p.add(shout, text=p.input("text"))
    m = p.add(measure, text=p.input("text"), count=p.input("count"))
    p.output("loud", s["loud"])
    p.output("lengths", m["lengths"])
    p.output("long", m["long"])
    return p


def sample_inputs(batch: int = 1) -> dict[str, np.ndarray]:
    """``batch`` rows of three words each, and a count per row."""
    words = [b"a", b"tensor", b"pipelines", b"BLS", b"ensemble", b"ok"]
    text = np.array([[words[(r + i) % len(words)] for i in range(3)] for r in range(batch)], dtype=object)
    return {"text": text, "count": np.arange(1, batch + 1, dtype=np.int64)[:, None]}


pipeline = make_text()
