"""Pipelines whose speed depends on how their models are configured, not on their code:
the prediction's check (``benchmarks/prediction.py``) and ``pipelines advise`` use them.

- ``twin``: a slow step served by two instances, between two quick ones;
- ``batched``: a slow step with Triton's dynamic batcher, between two quick ones;
- ``fixed``: a slow step that costs the same per call whatever the batch size (a model that
  pads every batch to its largest, say), declared with one instance and no batching: the
  configuration a newcomer deploys, and the one ``advise`` should improve on.

The slow steps sleep (as native inference does, releasing the GIL), so the cost of a call
is known and does not depend on the machine's cores.
"""

from __future__ import annotations

import time

import numpy as np

from ..core.step import DynamicBatching, step
from ..core.tensor import TensorSpec
from ..pipeline import Pipeline

__all__ = ["Slow", "batched", "fixed", "make_slow_chain", "sample_inputs", "twin"]

VECTOR = TensorSpec("FP32", [64])


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR}, parameters={"ms": 10})
class Slow:
    """Sleeps ``ms`` milliseconds per call, whatever the batch size, then adds one."""

    def initialize(self, config):
        self.seconds = float(config.get("parameters", {}).get("ms", 10)) / 1000.0

    def execute(self, x):
        time.sleep(self.seconds)
        return {"y": x + np.float32(1)}


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def prepare(x):
    return {"y": x * np.float32(2)}


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR})
def finish(x):
    return {"y": np.tanh(x)}


def make_slow_chain(name: str, *, ms: float = 10.0, **options) -> Pipeline:
    """``x -> prepare -> slow (ms per call; options: its model options) -> finish -> y``."""
    p = Pipeline(name, inputs={"x": VECTOR}, max_batch_size=8)
    ref = p.add(prepare, x=p.input("x"))["y"]
    ref = p.add(Slow.with_options(parameters={"ms": ms}, **options), name="slow", x=ref)["y"]
    p.output("y", p.add(finish, x=ref)["y"])
    return p


def sample_inputs(batch: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((batch, 64)).astype(np.float32)} for _ in range(4)]


twin = make_slow_chain("twin", ms=10.0, instance_count=2)
batched = make_slow_chain("batched", ms=10.0, dynamic_batching=DynamicBatching(max_queue_delay_us=500))
fixed = make_slow_chain("fixed", ms=20.0)
