"""Shape errors say what a user got wrong: a missing max_batch_size, and dims that leave out the batch."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import InputError, Pipeline, TensorSpec, step

M = TensorSpec("FP32", [2, 3])


@step(inputs={"x": M}, outputs={"y": M})
def same(x):
    return {"y": x}


def one_step(max_batch_size: int) -> Pipeline:
    p = Pipeline(f"shapes_{max_batch_size}", inputs={"x": M}, max_batch_size=max_batch_size)
    p.output("y", p.add(same, x=p.input("x"))["y"])
    return p


def test_a_batch_sent_to_a_pipeline_that_does_not_batch_hints_at_max_batch_size():
    with pytest.raises(InputError, match=r"\[3, 2, 3\].*does not batch \(max_batch_size is 0\).*max_batch_size to batch"):
        one_step(0).run({"x": np.ones((3, 2, 3), np.float32)})


def test_a_rank_too_high_says_the_ranks_differ_and_that_dims_leave_out_the_batch():
    with pytest.raises(InputError, match=r"the ranks differ: the declared dims \[2, 3\] leave out the batch dimension"):
        one_step(4).run({"x": np.ones((3, 2, 3, 1), np.float32)})


def test_a_missing_batch_dimension_still_says_how_to_add_it():
    with pytest.raises(InputError, match=r"batch dimension is missing: send x\[None\] for a batch of one"):
        one_step(4).run({"x": np.ones((2, 3), np.float32)})
