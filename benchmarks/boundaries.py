"""Pipelines whose cost on a server is mostly its boundaries, for ``benchmarks/prediction.py``:

- ``large``: a 16-float request grows to a 4 MiB tensor, which two steps pass on,
  and which shrinks back to a sum; moving those 4 MiB between processes is most of
  its latency (the server's costs per byte);
- ``chain10``: ten small steps (1 ms each) one after another (the fixed cost of
  each step boundary).
"""

from __future__ import annotations

import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.examples.basic import make_chain

__all__ = ["MIB_FLOATS", "chain10", "large", "make_large", "sample_inputs"]

MIB_FLOATS = 1 << 18  # floats in 1 MiB
VECTOR = TensorSpec("FP32", [-1])


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR}, parameters={"mib": 4})
class Expand:
    """Tiles the request up to ``mib`` MiB."""

    def initialize(self, config):
        self.n = int(config.get("parameters", {}).get("mib", 4)) * MIB_FLOATS

    def execute(self, x):
        reps = -(-self.n // x.shape[-1])
        return {"y": np.tile(x, (1, reps))[:, : self.n]}


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def scale(x):
    return {"y": x * np.float32(0.5)}


@step(inputs={"x": VECTOR}, outputs={"y": TensorSpec("FP32", [1])})
def total(x):
    return {"y": x.sum(axis=-1, keepdims=True, dtype=np.float32)}


def make_large(*, mib: int = 4, name: str = "large") -> Pipeline:
    """``x (16 floats) -> expand (mib MiB) -> scale -> scale -> total (1 float)``."""
    p = Pipeline(name, inputs={"x": VECTOR}, max_batch_size=8)
    ref = p.add(Expand.with_options(parameters={"mib": mib}), name="expand", x=p.input("x"))["y"]
    ref = p.add(scale, name="scale_0", x=ref)["y"]
    ref = p.add(scale, name="scale_1", x=ref)["y"]
    p.output("y", p.add(total, x=ref)["y"])
    return p


def sample_inputs(batch: int = 1) -> list[dict[str, np.ndarray]]:
    """Requests for both pipelines: 16 floats."""
    return [{"x": np.arange(16, dtype=np.float32)[None].repeat(batch, 0)}]


large = make_large()
chain10 = make_chain(steps=10, ms=1.0, name="chain10")
