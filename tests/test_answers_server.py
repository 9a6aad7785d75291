"""The server answers what the local runtime answers (tests/test_runtime_answers.py): lists read
as numpy reads them, BYTES as ``bytes`` past every serialisation, str only between the fused
model's own steps; and a list of floats for an FP32 output refused in the same words."""

from __future__ import annotations

import numpy as np
import pytest
from toy_steps import answers, floats_as_list

from pipelines import InferenceError, Pipeline
from pipelines.forms import model_name
from pipelines.runtime import MODES

pytestmark = pytest.mark.server

REQUEST = {
    "n": np.array([[1, 2]], np.int64),
    "x": np.array([[1.0, 2.0]], np.float32),
    "s": np.array([[b"hi", b"yo"]], dtype=object),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from pipelines.triton import TritonServer

    root = tmp_path_factory.mktemp("answers") / "repo"
    answers().compile("all").write(root)
    floats = Pipeline("floats", inputs={"x": floats_as_list.inputs["x"]}, max_batch_size=4)
    floats.output("y", floats.add(floats_as_list, x=floats.input("x"))["y"])
    floats.compile("all").write(root)
    with TritonServer(root) as server:
        yield server


@pytest.mark.parametrize("mode", MODES)
def test_each_form_answers_what_its_local_mode_answers(served, mode):
    local = answers().run(REQUEST, mode=mode)
    remote = served.client().infer(model_name("answers", mode), REQUEST)
    assert sorted(remote) == sorted(local)
    for name, value in local.items():
        assert remote[name].dtype == value.dtype, name
        assert remote[name].tolist() == value.tolist(), name
    assert remote["kind_next"].tolist() == [[b"str" if mode == "fused" else b"bytes"] * 2]


@pytest.mark.parametrize("mode", MODES)
def test_a_list_of_floats_for_fp32_is_refused_by_its_dtype_on_the_server_too(served, mode):
    with pytest.raises(InferenceError, match=r"output 'y' has dtype float64; it declares FP32") as info:
        served.client().infer(model_name("floats", mode), {"x": REQUEST["x"]})
    assert info.value.step == "floats_as_list" and info.value.tensor == "y"
