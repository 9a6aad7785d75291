"""Unit-testing a step (docs/declaring.md, "Unit-test a step"): ``step.fn`` is the function or
class as written, ``step(**inputs)`` calls it as a runtime does, and a one-step pipeline's
``run`` checks what it returns against the declared specs.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import Pipeline, StepError, TensorSpec, external_model, step

ROW = TensorSpec("FP32", [4])


def _double(x):
    return {"y": x * 2}


double = step(_double, name="double", inputs={"x": ROW}, outputs={"y": ROW})


@step(inputs={"x": ROW}, outputs={"y": ROW, "n": TensorSpec("INT64", [1])})
def as_tuple(x):
    return x + 1, np.full((len(x), 1), len(x))


@step(inputs={"x": ROW}, outputs={"y": ROW})
class Scaled:
    def initialize(self, config):
        self.factor = 3.0

    def execute(self, x):
        return {"y": x * self.factor}


def test_fn_is_the_function_as_written():
    assert double.fn is _double and double.impl is _double
    x = np.ones((2, 4), np.float32)
    assert double.fn(x=x)["y"].tolist() == [[2.0] * 4] * 2
    y, n = as_tuple.fn(x=x)  # what the function returns, not read into outputs
    assert n.tolist() == [[2], [2]]


def test_calling_the_step_runs_it_as_a_runtime_does():
    x = np.ones((2, 4), np.float32)
    assert sorted(as_tuple(x=x)) == ["n", "y"]  # a tuple read as the outputs, in declared order
    assert Scaled.fn.__name__ == "Scaled"
    assert Scaled(x=x)["y"].tolist() == [[3.0] * 4] * 2  # initialize() ran first


def test_a_one_step_pipeline_checks_what_the_step_returns():
    @step(inputs={"x": ROW}, outputs={"y": ROW})
    def wrong(x):
        return {"y": x.astype(np.float64)}

    assert wrong.fn(x=np.ones((1, 4), np.float32))["y"].dtype == np.float64
    p = Pipeline("one", inputs={"x": ROW}, max_batch_size=4)
    p.output("y", p.add(wrong, x=p.input("x"))["y"])
    with pytest.raises(StepError, match="FP32"):
        p.run({"x": np.ones((1, 4), np.float32)}, mode="bls")


def test_an_external_models_fn_is_its_stand_in():
    with_stand_in = external_model("det", inputs={"x": ROW}, outputs={"y": ROW}, backend="onnxruntime",
                                   stand_in=_double)
    assert with_stand_in.fn is _double
    without = external_model("det2", inputs={"x": ROW}, outputs={"y": ROW}, backend="onnxruntime")
    assert without.fn is None
