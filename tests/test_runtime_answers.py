"""What a local run answers is what the server answers (tests/test_answers_server.py checks the
server): the caller's own arrays, never the request's; a list a step returns read as numpy reads
it; BYTES as ``bytes`` wherever Triton serialises them."""

from __future__ import annotations

import numpy as np
import pytest
from toy_steps import answers, floats_as_list

from pipelines import Pipeline, StepError
from pipelines.runtime import MODES

N = np.array([[1, 2]], np.int64)
X = np.array([[1.0, 2.0]], np.float32)
S = np.array([[b"hi", b"yo"]], dtype=object)


@pytest.mark.parametrize("mode", MODES)
def test_a_steps_answer_is_the_callers_own_array(mode):
    out = answers().run({"n": N, "x": X, "s": S}, mode=mode)
    same = out["same"]
    assert same.flags.writeable and not np.shares_memory(same, X)
    same += 1  # the caller may write into what it was answered, as into tritonclient's arrays
    np.testing.assert_array_equal(X, [[1.0, 2.0]])


@pytest.mark.parametrize("mode", MODES)
def test_a_list_is_read_as_numpy_reads_it_taken_where_its_dtype_fits(mode):
    out = answers().run({"n": N, "x": X, "s": S}, mode=mode)
    assert out["doubled"].dtype == np.int64
    np.testing.assert_array_equal(out["doubled"], [[2, 4]])


@pytest.mark.parametrize("mode", MODES)
def test_a_list_of_floats_for_an_fp32_output_is_refused_for_its_dtype_as_on_the_server(mode):
    p = Pipeline("floats", inputs={"x": floats_as_list.inputs["x"]}, max_batch_size=4)
    p.output("y", p.add(floats_as_list, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"output 'y' has dtype float64; it declares FP32") as info:
        p.run({"x": X}, mode=mode)
    assert info.value.step == "floats_as_list" and info.value.tensor == "y"


@pytest.mark.parametrize("mode", MODES)
def test_bytes_are_bytes_wherever_triton_serialises_them(mode):
    # str items (and a str input) reach the next model as bytes; inside the fused model,
    # where steps share one Python process, the next step sees what the last one returned.
    out = answers().run({"n": N, "x": X, "s": np.array([["hi", "yo"]])}, mode=mode)
    assert out["shouted"].dtype == object and out["shouted"].tolist() == [[b"hi!", b"yo!"]]
    assert out["kind_in"].tolist() == [[b"bytes", b"bytes"]]
    assert out["kind_next"].tolist() == [[b"str" if mode == "fused" else b"bytes"] * 2]
