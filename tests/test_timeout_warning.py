"""A step's timeout= compiled into the ensemble, which cannot enforce it, says so in one line."""

from __future__ import annotations

import warnings

import pytest

from pipelines import Pipeline, TensorSpec, TimeoutNotEnforcedWarning, step

V = TensorSpec("FP32", [2])


@step(inputs={"x": V}, outputs={"y": V}, timeout=2.0)
def bounded(x):
    return {"y": x}


def timed() -> Pipeline:
    p = Pipeline("timed", inputs={"x": V}, max_batch_size=2)
    p.output("y", p.add(bounded, name="slow_part", x=p.input("x"))["y"])
    return p


@pytest.mark.parametrize("target", ["ensemble", "both", "all"])
def test_the_ensemble_warns_that_it_cannot_enforce_a_step_timeout(target):
    with pytest.warns(TimeoutNotEnforcedWarning, match=r"'timed': 'slow_part' declare timeout=, which the ensemble"):
        timed().compile(target)


@pytest.mark.parametrize("target", ["bls", "bls-sync", "fused"])
def test_forms_that_enforce_it_say_nothing(target):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeoutNotEnforcedWarning)
        timed().compile(target)
