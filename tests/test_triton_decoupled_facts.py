"""What Triton 2.51 does with decoupled models (docs/triton_decoupled.md), each fact checked on the
bundled server with hand-written models: a decoupled Python model that streams ``N`` responses,
an ensemble and two BLS models over it, and the clients' streaming calls (gRPC, HTTP SSE)."""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from pipelines.compile.configs import config_text
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

# Streams N = k responses (TOKEN = 0 .. k-1), then the final flag on its own; N = 100 + k sends an
# error response after the k responses, and the final flag apart; N = 200 + k, an error response
# that carries the final flag.
_GEN = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            count, fails = n % 100, n // 100
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TOKEN", np.array([i], np.int32))]))
            error = pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(f"gen failed after {count} responses"))
            if fails == 1:
                sender.send(error)
            if fails == 2:
                sender.send(error, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

_SQUARE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(DELAY)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "SQ", np.square(pb_utils.get_input_tensor_by_name(r, "TOKEN").as_numpy()).astype(np.int32))])
            for r in requests
        ]
"""

# Calls gen with BLS (decoupled=True) and square on each response, forwarding each answer through
# its own response sender; an error response it sees is forwarded as "bls saw: ...".
_BLS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    DEF execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            call = pb_utils.InferenceRequest(
                model_name="gen", requested_output_names=["TOKEN"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "N")])
            for response in AWAITcall.EXEC(decoupled=True):
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError("bls saw: " + response.error().message())))
                    break
                token = pb_utils.get_output_tensor_by_name(response, "TOKEN")
                if token is None:  # the final flag, on an empty response
                    continue
                square = pb_utils.InferenceRequest(model_name="square", requested_output_names=["SQ"], inputs=[token])
                answer = AWAITsquare.EXEC()
                sender.send(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "SQ")]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


# Streams until its request is cancelled (or 200 responses, 5 ms apart), then leaves a mark that
# says which: "endless-<responses>-cancelled" or "endless-<responses>-ran out".
_ENDLESS = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = os.path.join(os.path.dirname(os.path.dirname(args["model_repository"])), "marks")
        os.makedirs(self.marks, exist_ok=True)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sent = 0
            while not sender.is_cancelled() and sent < 200:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TOKEN", np.array([sent], np.int32))]))
                sent += 1
                time.sleep(0.005)
            how = "cancelled" if sender.is_cancelled() else "ran out"
            open(os.path.join(self.marks, f"endless-{sent}-{how}"), "w").close()
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Forwards endless's responses until its own request is cancelled; its mark says how many it
# forwarded and whether the iterator of responses has a cancel().
_BLS_ENDLESS = """
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = os.path.join(os.path.dirname(os.path.dirname(args["model_repository"])), "marks")

    async def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            call = pb_utils.InferenceRequest(
                model_name="endless", requested_output_names=["TOKEN"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "N")])
            forwarded = 0
            responses = await call.async_exec(decoupled=True)
            for response in responses:
                if sender.is_cancelled():
                    has_cancel = hasattr(responses, "cancel")
                    open(os.path.join(self.marks, f"bls-{forwarded}-cancel()-{has_cancel}"), "w").close()
                    break
                token = pb_utils.get_output_tensor_by_name(response, "TOKEN")
                if token is not None:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("SQ", token.as_numpy())]))
                    forwarded += 1
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _python_model(name: str, inputs: str, outputs: str, *, decoupled: bool) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name=inputs, data_type=mc.TYPE_INT32, dims=[1])
    config.output.add(name=outputs, data_type=mc.TYPE_INT32, dims=[1])
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if decoupled:
        config.model_transaction_policy.decoupled = True
    return config


def _ensemble(name: str, square: str, *, decoupled: bool, first_step: str = "gen") -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=0)
    config.input.add(name="N", data_type=mc.TYPE_INT32, dims=[1])
    config.output.add(name="SQ", data_type=mc.TYPE_INT32, dims=[1])
    first = config.ensemble_scheduling.step.add(model_name=first_step, model_version=-1)
    first.input_map["N"] = "N"
    first.output_map["TOKEN"] = "token"
    second = config.ensemble_scheduling.step.add(model_name=square, model_version=-1)
    second.input_map["TOKEN"] = "token"
    second.output_map["SQ"] = "SQ"
    if decoupled:
        config.model_transaction_policy.decoupled = True
    return config


def write_models(root: Path) -> Path:
    models = {
        "gen": (_python_model("gen", "N", "TOKEN", decoupled=True), _GEN),
        "square": (_python_model("square", "TOKEN", "SQ", decoupled=False), _SQUARE.replace("DELAY", "0")),
        "slow_square": (_python_model("slow_square", "TOKEN", "SQ", decoupled=False), _SQUARE.replace("DELAY", "0.3")),
        "bls_async": (_python_model("bls_async", "N", "SQ", decoupled=True),
                      _BLS.replace("DEF", "async def").replace("AWAIT", "await ").replace("EXEC", "async_exec")),
        "bls_sync": (_python_model("bls_sync", "N", "SQ", decoupled=True),
                     _BLS.replace("DEF", "def").replace("AWAIT", "").replace("EXEC", "exec")),
        # a copy of bls_sync for the request that never ends, which holds its one instance
        "bls_stuck": (_python_model("bls_stuck", "N", "SQ", decoupled=True),
                      _BLS.replace("DEF", "def").replace("AWAIT", "").replace("EXEC", "exec")),
        "ens_decoupled": (_ensemble("ens_decoupled", "square", decoupled=True), None),
        "ens_undeclared": (_ensemble("ens_undeclared", "square", decoupled=False), None),
        "ens_slow": (_ensemble("ens_slow", "slow_square", decoupled=True), None),
        # endless has two instances: a stream the ensemble or the BLS model fails to cancel runs on
        # in one, and the next test still finds the other free
        "endless": (_python_model("endless", "N", "TOKEN", decoupled=True), _ENDLESS),
        "ens_endless": (_ensemble("ens_endless", "square", decoupled=True, first_step="endless"), None),
        "bls_endless": (_python_model("bls_endless", "N", "SQ", decoupled=True), _BLS_ENDLESS),
    }
    models["endless"][0].instance_group[0].count = 2
    for name, (config, code) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config_text(config))
        if code is not None:
            (root / name / "1" / "model.py").write_text(code)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_models(tmp_path_factory.mktemp("decoupled") / "models")
    with TritonServer(root, exit_timeout=3) as s:
        yield s


def stream(server: TritonServer, model: str, n: int, output: str = "SQ") -> list[tuple[int | None, bool] | str]:
    """What a gRPC stream client reads for one request: ``(value, final flag)`` per response, or the
    error's text; after an error, whatever else arrives within a second."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensor = grpcclient.InferInput("N", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], np.int32))
    client.async_stream_infer(model, [tensor], enable_empty_final_response=True)
    got: list[tuple[int | None, bool] | str] = []
    wait = 20.0
    try:
        while True:
            result, error = answers.get(timeout=wait)
            if error is not None:
                got.append(str(error))
                wait = 1.0  # an error: see whether anything follows it
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            value = result.as_numpy(output)
            got.append((None if value is None else int(value[0]), final))
            if final:
                break
    except queue.Empty:
        if wait == 20.0:
            raise
    client.stop_stream()
    client.close()
    return got


def generate_stream(server: TritonServer, model: str, n: int, timeout: float = 20.0) -> str:
    """The body of HTTP ``generate_stream`` (server-sent events) for one request."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate_stream", data=json.dumps({"N": n}).encode()
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        return answer.read().decode()


def test_an_ensemble_of_a_decoupled_step_is_decoupled_even_undeclared(server):
    """The ensemble that does not declare it loads, is served as decoupled, and refuses a plain infer
    with the words it has for any decoupled model."""
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("ens_undeclared").config
    assert config.model_transaction_policy.decoupled
    assert [v for v, _ in stream(server, "ens_undeclared", 3)] == [0, 1, 4]
    for model in ("gen", "ens_undeclared", "ens_decoupled", "bls_async"):
        tensor = httpclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([3], np.int32))
        with pytest.raises(InferenceServerException, match=r"HTTP end point doesn't support models with decoupled"):
            httpclient.InferenceServerClient(server.http_url).infer(model, [tensor])
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([3], np.int32))
        with pytest.raises(InferenceServerException, match=r"ModelInfer RPC doesn't support models with decoupled"):
            grpcclient.InferenceServerClient(server.grpc_url).infer(model, [tensor])


def test_an_ensemble_runs_the_next_step_once_per_response_and_flags_the_last(server):
    """One response per response of the decoupled step, then the final flag: on the last response,
    or on an empty one after it (a race between the last response and the step's flag); none
    yielded: one empty final response."""
    for _ in range(5):
        got = stream(server, "ens_decoupled", 3)
        assert got in ([(0, False), (1, False), (4, True)], [(0, False), (1, False), (4, False), (None, True)]), got
    assert stream(server, "ens_decoupled", 0) == [(None, True)]


def test_a_decoupled_python_model_sends_its_final_flag_on_an_empty_response(server):
    assert stream(server, "gen", 3, output="TOKEN") == [(0, False), (1, False), (2, False), (None, True)]
    assert stream(server, "gen", 0, output="TOKEN") == [(None, True)]


def test_an_error_mid_stream_overtakes_an_ensembles_responses_and_ends_the_stream(server):
    """The error goes straight to the client while the responses before it are still in the slow
    next step; they never arrive, and no final flag follows the error."""
    got = stream(server, "ens_slow", 102)
    assert got == ["in ensemble 'ens_slow', gen failed after 2 responses"], got


def test_a_decoupled_models_own_stream_keeps_an_error_in_its_place(server):
    got = stream(server, "gen", 102, output="TOKEN")
    assert got == [(0, False), (1, False), "gen failed after 2 responses", (None, True)], got


@pytest.mark.parametrize("model", ["bls_async", "bls_sync"])
def test_bls_iterates_a_decoupled_model_and_forwards_each_response(server, model):
    """``async_exec(decoupled=True)`` and ``exec(decoupled=True)`` give each response as it comes,
    the final flag on an empty one; the BLS model sends each answer through its response sender."""
    assert stream(server, model, 3) == [(0, False), (1, False), (4, False), (None, True)]
    assert stream(server, model, 0) == [(None, True)]


def test_bls_does_not_see_a_decoupled_models_error_response(server):
    """The error response never reaches the BLS model's iterator: it ends as if the stream were
    whole (the model forwards any error it sees, and none comes)."""
    assert stream(server, "bls_async", 102) == [(0, False), (1, False), (None, True)]


def test_bls_waits_for_ever_on_an_error_that_carries_the_final_flag(server):
    """With the final flag on the error response, the BLS model's iterator never ends: the client
    reads the responses before it, and then nothing."""
    with pytest.raises(TimeoutError):
        generate_stream(server, "bls_stuck", 202, timeout=2.0)


def cancel_after_three(server: TritonServer, model: str) -> list[str]:
    """Read three responses of ``model``, cancel the stream as a client that gives up does, and
    return the marks the models leave once the stream has ended there."""
    marks = Path(server.repository).parent / "marks"
    for mark in marks.glob("*"):
        mark.unlink()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensor = grpcclient.InferInput("N", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    client.async_stream_infer(model, [tensor])
    for _ in range(3):
        answers.get(timeout=20)
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(m.name.startswith("endless-") for m in marks.glob("*")):
        time.sleep(0.05)
    return sorted(m.name for m in marks.glob("*"))


def test_a_cancelled_stream_reaches_a_decoupled_model_called_directly(server):
    """``stop_stream(cancel_requests=True)``: the model's ``response_sender.is_cancelled()`` turns
    true, and it stops before its 200th response: how soon after the three the client read
    depends on the machine's load, so no count of responses in between is asserted."""
    [mark] = cancel_after_three(server, "endless")
    sent, how = mark.split("-")[1:]
    assert how == "cancelled" and int(sent) < 200, mark


def test_an_ensemble_does_not_pass_a_cancellation_on_to_its_decoupled_step(server):
    assert cancel_after_three(server, "ens_endless") == ["endless-200-ran out"]


def test_a_bls_model_sees_its_cancellation_but_cannot_pass_it_on(server):
    """The BLS model's own request is cancelled; the iterator of the model it calls has no
    ``cancel()`` on 2.51, and that model runs to its end."""
    marks = cancel_after_three(server, "bls_endless")
    assert marks[1] == "endless-200-ran out" and marks[0].startswith("bls-") and marks[0].endswith("-cancel()-False"), marks


def test_http_generate_stream_sends_one_event_per_response(server):
    """Each response is one ``data:`` event of JSON; an error is an event ``{"error": ...}``; a stream
    of no response is an empty body; no event marks the end."""
    events = [json.loads(line.removeprefix("data: ")) for line in generate_stream(server, "gen", 3).split("\n\n") if line]
    assert [e["TOKEN"] for e in events] == [0, 1, 2]
    events = [json.loads(line.removeprefix("data: ")) for line in generate_stream(server, "ens_decoupled", 3).split("\n\n") if line]
    assert [e["SQ"] for e in events] == [0, 1, 4]
    body = generate_stream(server, "gen", 102)
    assert body.endswith('data: {"error":"gen failed after 2 responses"}\n\n'), body
    assert generate_stream(server, "gen", 0) == ""


def test_the_docs_state_each_fact_with_its_test():
    text = (Path(__file__).parents[1] / "docs" / "triton_decoupled.md").read_text()
    names = [name for name in globals() if name.startswith("test_") and name != "test_the_docs_state_each_fact_with_its_test"]
    for name in names:
        assert name in text, name
