"""One error wire format, end to end on the real tritonserver: every way a step can fail
reaches the HTTP and gRPC clients, in every form, as the same error class with the same
pipeline, node (the name the user gave), step and reason; and the local runtime says the
same reason in its own error."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, StepError, TensorSpec, step
from pipelines.forms import FORMS
from pipelines.serving import parse_error
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

F2 = TensorSpec("FP32", [2])

# marker in x[0, 0] -> (what the step does, the reason every client must read, the tensor named)
FAILURES = {
    "raises": (11.0, "raised ZeroDivisionError: division by zero", None),
    "wrong_dtype": (12.0, "output 'y' has dtype float64; it declares FP32 (float32); cast it before returning", "y"),
    "wrong_shape": (13.0, "output 'y' has shape [1, 1]; it declares [1, 2] (-1 is any size)", "y"),
    "wrong_batch": (14.0, "output 'y' has shape [2, 2]; expected the batch dimension 1 first, then [2]", "y"),
    "missing_output": (15.0, "did not return output(s) ['y']; it returned ['z']", "y"),
    "not_a_dict": (16.0, "returned list; expected a dict with outputs ['y']", None),
    "undeclared_output": (17.0, "returned undeclared output(s) ['z']; it declares ['y']", "z"),
}


def fails_on_marker(x):
    marker = float(x[0, 0])
    if marker == 11.0:
        return 1 / 0
    if marker == 12.0:
        return {"y": x.astype(np.float64)}
    if marker == 13.0:
        return {"y": x[:, :1]}
    if marker == 14.0:
        return {"y": np.concatenate([x, x])}
    if marker == 15.0:
        return {"z": x}
    if marker == 16.0:
        return [x, x]
    if marker == 17.0:
        return {"y": x, "z": x}
    return {"y": x + 1}


def contract() -> Pipeline:
    inner = step(fails_on_marker, name="inner", inputs={"x": F2}, outputs={"y": F2})
    p = Pipeline("wire", inputs={"x": F2}, max_batch_size=4)
    p.output("y", p.add(inner, name="culprit", x=p.input("x"))["y"])
    return p


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("wire") / "models"
    contract().compile("all").write(root)
    with TritonServer(root) as s:
        yield s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_step_failure_reaches_every_client_with_one_pipeline_node_step_and_reason(server, protocol):
    with server.client(protocol, timeout=60) as client:
        for case, (marker, reason, tensor) in FAILURES.items():
            for form in FORMS.values():
                model = form.model_name("wire", side_by_side=True)
                with pytest.raises(InferenceError) as caught:
                    client.infer(model, {"x": np.full((1, 2), marker, np.float32)})
                err = caught.value
                where = f"{case} in {model} over {protocol}: {err}"
                assert type(err) is StepError, where
                assert (err.pipeline, err.node, err.step, err.tensor) == ("wire", "culprit", "culprit", tensor), where
                said = parse_error(str(err))
                assert said is not None and (said.node, said.step) == ("culprit", "inner"), where
                assert said.reason.startswith(reason + " ("), where  # then the client's own words
            # The server goes on answering.
            ok = client.infer(model, {"x": np.zeros((1, 2), np.float32)})
            np.testing.assert_array_equal(ok["y"], np.ones((1, 2), np.float32))


def test_the_local_runtime_says_the_same_reasons():
    p = contract()
    for case, (marker, reason, _) in FAILURES.items():
        with pytest.raises(StepError) as caught:
            p.run({"x": np.full((1, 2), marker, np.float32)})
        assert reason in str(caught.value), (case, str(caught.value))
        err = caught.value
        assert (err.pipeline, err.node, err.step) == ("wire", "culprit", "culprit"), case


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_raising_step_is_placed_at_its_file_and_line_alike_locally_and_in_every_form(server, protocol):
    x = np.full((1, 2), FAILURES["raises"][0], np.float32)
    with pytest.raises(StepError) as local:
        contract().run({"x": x})
    said_here = parse_error(str(local.value))
    assert said_here is not None and re.fullmatch(
        r"raised ZeroDivisionError: division by zero \(at test_error_wire_server\.py:\d+\)", said_here.reason)
    with server.client(protocol, timeout=60) as client:
        for form in FORMS.values():
            with pytest.raises(StepError) as remote:
                client.infer(form.model_name("wire", side_by_side=True), {"x": x})
            said = parse_error(str(remote.value))
            assert said.reason.startswith(said_here.reason + " ("), (form.name, said.reason)
