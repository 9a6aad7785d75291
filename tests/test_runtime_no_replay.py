"""The local runtime executes a pipeline and predicts no server: a ``profile=`` from before,
when it replayed a server's costs, is refused with what replaced it (a simulation)."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import ArgumentError, Pipeline, PipelinesError, TensorSpec, step
from pipelines.runtime import LocalRuntime, run_many

V = TensorSpec("FP32", [-1])
REPLACED = (r"the local runtime no longer replays server profiles; predict the server with "
            r"p\.predict\(profile, concurrency=\.\.\.\) or `pipelines predict MODULE:ATTR --profile FILE`")


@step(inputs={"x": V}, outputs={"y": V})
def double(x):
    return {"y": x * 2}


def pipeline() -> Pipeline:
    p = Pipeline("doubled", inputs={"x": V})
    p.output("y", p.add(double, x=p.input("x"))["y"])
    return p


@pytest.mark.parametrize("call", [
    lambda p: LocalRuntime(p, "bls", profile="profile.json"),
    lambda p: p.run({"x": np.ones(2, np.float32)}, mode="fused", profile="profile.json"),
    lambda p: run_many(p, [{"x": np.ones(2, np.float32)}], profile={"costs": {}}),
])
def test_a_profile_is_refused_with_what_replaced_the_replay(call):
    with pytest.raises(ArgumentError, match=REPLACED) as caught:
        call(pipeline())
    assert isinstance(caught.value, PipelinesError) and isinstance(caught.value, ValueError)
    assert caught.value.pipeline == "doubled"


def test_without_a_profile_it_runs_as_it_always_did():
    out = pipeline().run({"x": np.arange(3, dtype=np.float32)}, profile=None)
    np.testing.assert_array_equal(out["y"], [0, 2, 4])
