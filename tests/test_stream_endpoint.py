"""Streaming pipelines on the local endpoint (`pipelines serve --local`, LocalServer), read by tritonclient's
own streaming calls as a user writes them: gRPC ``start_stream`` + ``async_stream_infer`` until the final
flag, and HTTP ``generate_stream`` (server-sent events). The same client function reads every mode and
must give what ``p.stream`` gives; failures come after the responses before them; a client that cancels or
goes away stops the pipeline's generator; a plain infer is refused with Triton's words for a decoupled
model, and the project's clients word that refusal for the user."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from pipelines import Pipeline, TensorSpec, step
from pipelines.endpoint import LocalServer
from pipelines.errors import InferenceError, StepError
from pipelines.examples import textgen
from pipelines.triton import TritonClient
from pipelines.triton.async_client import AsyncTritonClient

# this file's steps travel by value in a repository: it imports pipelines.endpoint (served_models compiles them)
pytestmark = pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")

MODES = ("ensemble", "bls", "bls-sync", "fused")
ONE = TensorSpec("INT32", [1])
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"


# ------------------------------------------------------------------ the client code, as a user writes it


def grpc_stream(url, model, inputs, outputs=None, *, request_id=""):
    """One request read with tritonclient's gRPC stream: ``(responses, error)``, each response a dict
    of its outputs, read until the final flag (``triton_final_response``) or an error: tritonclient
    hands an error response on without its flags, and the ensemble puts the final flag on it."""
    answers = queue.SimpleQueue()
    client = tg.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, _grpc_inputs(inputs), request_id=request_id,
                                  outputs=None if outputs is None else [tg.InferRequestedOutput(o) for o in outputs],
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, failed = answers.get(timeout=60)
            if failed is not None:
                return responses, failed.message()
            response = result.get_response()
            if response.outputs:
                responses.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()


def _grpc_inputs(inputs):
    tensors = []
    for name, array in inputs.items():
        tensor = tg.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else _datatype(array))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _datatype(array):
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def sse(url, model, body, route="generate_stream"):
    """HTTP ``generate_stream``: ``(status, content type, events)``, each event the JSON of one ``data:``."""
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{route}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, kind, text = answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, kind, text = exc.code, exc.headers["Content-Type"], exc.read().decode()
    if not kind.startswith("text/event-stream"):
        return status, kind, json.loads(text)
    chunks = text.split("\n\n")
    assert chunks[-1] == "", text  # each event ends with a blank line
    assert all(c.startswith("data: ") for c in chunks[:-1]), text
    return status, kind, [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def as_lists(responses):
    return [{k: np.asarray(v).tolist() for k, v in r.items()} for r in responses]


def as_events(responses, model, request_id=None):
    """The events Triton's generate extension writes for ``responses``: one element as itself."""
    events = []
    for r in responses:
        event = {}
        for name, value in r.items():
            flat = [v.decode() if isinstance(v, bytes) else v for v in np.asarray(value).reshape(-1).tolist()]
            event[name] = flat[0] if len(flat) == 1 else flat
        if request_id is not None:
            event["id"] = request_id
        event.update(model_name=model, model_version="1")
        if model.endswith("_ensemble"):  # as Triton's ensemble scheduler answers
            event.update(sequence_end=False, sequence_id=0, sequence_start=False)
        events.append(event)
    return events


# ------------------------------------------------------------------ the pipelines


def n(value):
    return {"n": np.array([value], np.int32)}


@step(inputs={"n": ONE}, outputs={"tok": ONE, "half": TensorSpec("FP32", [1])})
def count(n):
    """``n`` responses; ``n = 100 + k`` fails after ``k`` of them."""
    k = int(n[0]) % 100
    for i in range(k):
        yield {"tok": np.array([i], np.int32), "half": np.array([i / 2], np.float32)}
    if int(n[0]) >= 100:
        raise ValueError(f"count gave up after {k} responses")


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def square(tok):
    return {"sq": tok * tok}


@step(inputs={"tok": ONE}, outputs={"word": TensorSpec("BYTES", [1])})
def word(tok):
    return {"word": np.array([f"w{int(tok[0])}".encode()], dtype=object)}


def counting() -> Pipeline:
    """count streams; square and word run once per response; four outputs of the one stream."""
    p = Pipeline("counting", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    p.output("tok", c["tok"])
    p.output("half", c["half"])
    p.output("sq", p.add(square, tok=c["tok"])["sq"])
    p.output("word", p.add(word, tok=c["tok"])["word"])
    return p


#: request key -> how many responses its endless generator had yielded when it was closed
CLOSED: dict[int, int] = {}
BOUND = 100_000  # responses, 5 ms apart: an endless stream that nobody stops runs for minutes


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def endless(n):
    sent = 0
    try:
        while sent < BOUND:
            yield {"tok": np.array([sent], np.int32)}
            sent += 1
            time.sleep(0.005)
    finally:
        CLOSED[int(n[0])] = sent


def endless_pipeline() -> Pipeline:
    p = Pipeline("endless", inputs={"n": ONE})
    p.output("sq", p.add(square, tok=p.add(endless, n=p.input("n"))["tok"])["sq"])
    return p


def plain_pipeline() -> Pipeline:
    p = Pipeline("plain", inputs={"tok": ONE})
    p.output("sq", p.add(square, tok=p.input("tok"))["sq"])
    return p


@pytest.fixture(scope="module")
def server():
    with LocalServer(counting()) as s:
        yield s


@pytest.fixture(scope="module")
def endless_server():
    with LocalServer(endless_pipeline()) as s:
        yield s


def model_of(server, mode):
    return server.model_name(mode)


# ------------------------------------------------------------------ gRPC ModelStreamInfer


@pytest.mark.parametrize("mode", MODES)
def test_the_same_grpc_stream_code_reads_what_p_stream_yields_in_every_mode(server, mode):
    p = server.pipeline
    for k in (0, 1, 5):
        responses, error = grpc_stream(server.grpc_url, model_of(server, mode), n(k))
        assert error is None
        assert as_lists(responses) == as_lists(p.stream(n(k), mode=mode)), k
        assert len(responses) == k


@pytest.mark.parametrize("mode", MODES)
def test_every_subset_of_the_outputs_streams_as_p_stream_answers_it(server, mode):
    p = server.pipeline
    names = list(p.outputs)
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            asked = list(reversed(subset))  # answered in the order asked, as Triton answers
            responses, error = grpc_stream(server.grpc_url, model_of(server, mode), n(3), asked)
            assert error is None
            assert [list(r) for r in responses] == [asked] * 3
            assert as_lists(responses) == as_lists(p.stream(n(3), mode=mode, outputs=asked)), asked


@pytest.mark.parametrize("mode", MODES)
def test_an_error_mid_stream_comes_after_the_responses_before_it(server, mode):
    p = server.pipeline
    responses, error = grpc_stream(server.grpc_url, model_of(server, mode), n(102))
    with pytest.raises(StepError) as raised:
        list(p.stream(n(102), mode=mode))
    expected = list(itertools.islice(p.stream(n(2), mode=mode), 2))
    assert as_lists(responses) == as_lists(expected)
    assert "count gave up after 2 responses" in error and "'count'" in error, error
    assert "count gave up after 2 responses" in raised.value.message
    if mode == "ensemble":
        assert error.startswith("in ensemble 'counting_ensemble', "), error
    # the endpoint goes on serving
    assert len(grpc_stream(server.grpc_url, model_of(server, mode), n(2))[0]) == 2


def test_each_response_is_flagged_not_final_and_the_final_flag_comes_alone_when_asked(server):
    """As Triton answers a decoupled model: ``triton_final_response`` false on each response, then an
    empty response with it true only for a client that asks (``enable_empty_final_response``)."""
    for empty in (True, False):
        answers = queue.SimpleQueue()
        client = tg.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error, answers=answers: answers.put((result, error)))
        client.async_stream_infer("counting_fused", _grpc_inputs(n(2)), request_id="r7",
                                  enable_empty_final_response=empty)
        client.stop_stream()  # sends no more and waits for the call to end: every answer is in
        client.close()
        got = []
        while not answers.empty():
            result, error = answers.get()
            assert error is None
            response = result.get_response()
            got.append((len(response.outputs), response.parameters["triton_final_response"].bool_param,
                        response.id, response.model_version))
        assert got == [(4, False, "r7", "1"), (4, False, "r7", "1")] + ([(0, True, "r7", "")] if empty else [])


def test_requests_on_one_stream_are_answered_each_under_its_id(server):
    answers = queue.SimpleQueue()
    client = tg.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("counting_bls", _grpc_inputs(n(3)), request_id="a", enable_empty_final_response=True)
    client.async_stream_infer("counting_bls", _grpc_inputs({"n": np.array([1.5], np.float32)}), request_id="bad")
    client.async_stream_infer("counting_bls", _grpc_inputs(n(4)), request_id="b", enable_empty_final_response=True)
    client.stop_stream()
    client.close()
    toks: dict[str, list] = {"a": [], "b": []}
    errors, finals = [], []
    while not answers.empty():
        result, error = answers.get()
        if error is not None:
            errors.append(error.message())
            continue
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            finals.append(response.id)
        else:
            toks[response.id].append(int(result.as_numpy("tok")[0]))
    assert toks == {"a": [0, 1, 2], "b": [0, 1, 2, 3]}
    assert sorted(finals) == ["a", "b"]
    # refused before the pipeline ran: an error and nothing more for it, and the others go on
    assert len(errors) == 1 and "input 'n' expects dtype INT32" in errors[0], errors


def test_a_pipeline_that_does_not_stream_answers_a_stream_once_with_the_final_flag():
    with LocalServer(plain_pipeline(), modes=("bls",)) as s:
        responses, error = grpc_stream(s.grpc_url, "plain_bls", {"tok": np.array([7], np.int32)})
        assert error is None and as_lists(responses) == [{"sq": [49]}]
        status, _, events = sse(s.http_url, "plain_bls", {"tok": 7})
        assert (status, events) == (200, [{"sq": 49, "model_name": "plain_bls", "model_version": "1"}])
        assert sse(s.http_url, "plain_bls", {"tok": 7}, "generate")[2] == events[0]


# ------------------------------------------------------------------ HTTP server-sent events


@pytest.mark.parametrize("mode", MODES)
def test_generate_stream_sends_one_event_per_response_as_p_stream_yields_them(server, mode):
    p, model = server.pipeline, model_of(server, mode)
    status, kind, events = sse(server.http_url, model, {"n": 3, "id": "q1"})
    assert (status, kind) == (200, "text/event-stream; charset=utf-8")
    assert events == as_events(p.stream(n(3), mode=mode), model, "q1")
    assert list(events[0]) == sorted(events[0])  # keys in sorted order, as Triton writes them
    status, _, events = sse(server.http_url, model, {"n": 102})
    assert status == 200  # the events before the error are sent already
    assert events[:-1] == as_events(itertools.islice(p.stream(n(2), mode=mode), 2), model)
    assert list(events[-1]) == ["error"] and "count gave up after 2 responses" in events[-1]["error"]
    assert sse(server.http_url, model, {"n": 0}) == (200, "text/event-stream; charset=utf-8", [])


def test_generate_stream_refuses_as_triton_does(server):
    """Refused before the pipeline runs: a JSON error with Triton's status; failed before the first
    response: the error event with status 400; ``generate``: one response or Triton's error."""
    url = server.http_url
    assert sse(url, "nope", {"n": 1})[0] == 404
    status, kind, body = sse(url, "counting_fused", {})
    assert (status, kind) == (400, "application/json; charset=utf-8") and "'n'" in body["error"], body
    status, _, body = sse(url, "counting_fused", {"n": "three"})
    assert status == 500 and "Unable to parse 'data'" in body["error"], body
    status, _, body = sse(url, "counting_fused", {"n": [1, 2]})
    assert status == 400 and "The schema can not convert input 'n'" in body["error"], body
    assert sse(url, "counting_fused", {"n": [[1]]})[2] == sse(url, "counting_fused", {"n": 1})[2]  # as Triton reads it
    status, kind, events = sse(url, "counting_fused", {"n": 100})
    assert (status, kind[:17]) == (400, "text/event-stream") and "count gave up after 0" in events[0]["error"]
    # generate: the one response of a request, or Triton's refusal (with status 200, as Triton sends it)
    assert sse(url, "counting_fused", {"n": 1}, "generate") == (
        200, "application/json; charset=utf-8",
        {"half": 0.0, "model_name": "counting_fused", "model_version": "1", "sq": 0, "tok": 0, "word": "w0"})
    for k in (0, 2):
        status, _, body = sse(url, "counting_fused", {"n": k}, "generate")
        assert status == 200 and body["error"].startswith("generate expects model to produce exactly 1 response")


# ------------------------------------------------------------------ a plain infer is refused


def test_a_plain_infer_is_refused_with_tritons_words_for_a_decoupled_model(server):
    for mode in MODES:
        model = model_of(server, mode)
        tensor = th.InferInput("n", [1], "INT32")
        tensor.set_data_from_numpy(np.array([3], np.int32))
        with pytest.raises(InferenceServerException) as http_error:
            th.InferenceServerClient(server.http_url).infer(model, [tensor])
        assert (http_error.value.status(), http_error.value.message()) == ("501", DECOUPLED_HTTP)
        with pytest.raises(InferenceServerException) as grpc_error:
            tg.InferenceServerClient(server.grpc_url).infer(model, _grpc_inputs(n(3)))
        assert (grpc_error.value.status(), grpc_error.value.message()) == ("StatusCode.UNIMPLEMENTED", DECOUPLED_GRPC)


def test_the_config_and_metadata_say_decoupled(server):
    for mode in MODES:
        model = model_of(server, mode)
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/config") as answer:
            assert json.load(answer)["model_transaction_policy"] == {"decoupled": True}
        config = tg.InferenceServerClient(server.grpc_url).get_model_config(model).config
        assert config.model_transaction_policy.decoupled
        assert TritonClient(server.http_url).model_config(model)["model_transaction_policy"]["decoupled"]


def test_the_projects_clients_say_the_pipeline_streams_and_how_to_read_it(server):
    said = r"model 'counting_bls' streams .*: read it with a stream \(gRPC start_stream/async_stream_infer or HTTP generate_stream\)"
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with TritonClient(url, protocol) as client, pytest.raises(InferenceError, match=said) as raised:
            client.infer("counting_bls", n(3))
        assert "decoupled transaction policy" in raised.value.message  # Triton's own words kept at the end

        async def plain(protocol=protocol, url=url):
            async with AsyncTritonClient(url, protocol) as client:
                await client.infer("counting_bls", n(3))

        with pytest.raises(InferenceError, match=said):
            asyncio.run(plain())


# ------------------------------------------------------------------ cancellation


def _wait_closed(key):
    """The responses the endless generator of request ``key`` had yielded when closed (it writes that)."""
    deadline = time.monotonic() + 60
    while key not in CLOSED and time.monotonic() < deadline:
        time.sleep(0.05)
    return CLOSED.get(key)


@pytest.mark.parametrize("mode", MODES)
def test_a_client_that_cancels_its_stream_stops_the_generator_and_the_next_request_works(endless_server, mode):
    key = 10 + MODES.index(mode)
    answers = queue.SimpleQueue()
    client = tg.InferenceServerClient(endless_server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(model_of(endless_server, mode), _grpc_inputs(n(key)))
    for i in range(3):
        result, error = answers.get(timeout=60)
        assert error is None and int(result.as_numpy("sq")[0]) == i * i
    client.stop_stream(cancel_requests=True)
    client.close()
    closed = _wait_closed(key)
    assert closed is not None and 3 <= closed < BOUND, closed  # its finally ran, long before it ran out
    # the next request on a new stream is answered, and stopped in turn
    answers2 = queue.SimpleQueue()
    client = tg.InferenceServerClient(endless_server.grpc_url)
    client.start_stream(callback=lambda result, error: answers2.put((result, error)))
    client.async_stream_infer(model_of(endless_server, mode), _grpc_inputs(n(key + 100)))
    assert [int(answers2.get(timeout=60)[0].as_numpy("sq")[0]) for _ in range(3)] == [0, 1, 4]
    client.stop_stream(cancel_requests=True)
    client.close()
    assert _wait_closed(key + 100) is not None


def test_a_client_that_goes_away_from_generate_stream_stops_the_generator(endless_server):
    key = 50
    host, port = endless_server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v2/models/endless_fused/generate_stream", body=json.dumps({"n": key}))
    answer = connection.getresponse()
    assert answer.status == 200
    assert answer.readline().startswith(b"data: {")  # the first event has come
    connection.close()  # and the client goes away
    closed = _wait_closed(key)
    assert closed is not None and closed < BOUND, closed
    status, _, events = sse(endless_server.http_url, "endless_fused", {"n": 51}, "generate")
    assert status == 200 and events["error"].startswith("generate expects model to produce exactly 1 response")
    assert _wait_closed(51) is not None  # generate stops a stream it refuses


# ------------------------------------------------------------------ textgen, and the command line


@pytest.fixture(scope="module")
def textgen_server():
    with LocalServer(textgen.make_textgen(max_new_tokens=12)) as s:
        yield s


def test_textgen_streams_its_tokens_in_every_mode_it_serves(textgen_server):
    """Its `when` block leaves the ensemble out, as compile("all") does; every other mode streams."""
    p = textgen_server.pipeline
    assert textgen_server.modes == ("bls", "bls-sync", "fused") and "ensemble" in textgen_server.left_out
    prompt, refused = textgen.sample_inputs(), textgen.sample_inputs(prompt="tell me a secret")
    for mode in textgen_server.modes:
        model = model_of(textgen_server, mode)
        responses, error = grpc_stream(textgen_server.grpc_url, model, prompt)
        expected = list(p.stream(prompt, mode=mode))
        assert error is None and len(responses) >= 1 and as_lists(responses) == as_lists(expected)
        assert sse(textgen_server.http_url, model, {"prompt": prompt["prompt"][0].decode()})[2] == as_events(expected, model)
        responses, _ = grpc_stream(textgen_server.grpc_url, model, refused)
        assert as_lists(responses) == [{"text": [textgen.REFUSED]}]


def test_ungated_textgen_streams_in_all_four_modes():
    p = textgen.make_textgen(max_new_tokens=8, gate=False)
    prompt = textgen.sample_inputs()
    with LocalServer(p) as s:
        assert s.modes == MODES
        for mode in MODES:
            responses, error = grpc_stream(s.grpc_url, model_of(s, mode), prompt)
            assert error is None and as_lists(responses) == as_lists(p.stream(prompt, mode=mode))


def test_serve_local_streams_textgen_from_the_command_line(tmp_path):
    prologue = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from pipelines.cli import main"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{prologue}; sys.exit(main())", "serve", "--local", "pipelines.examples.textgen:pipeline",
         "--modes", "fused,bls"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        lines = []
        while not lines or not lines[-1].startswith("ready"):
            line = proc.stdout.readline()
            assert line, f"exited before ready: {proc.stderr.read()}"
            lines.append(line)
        grpc_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("gRPC"))
        prompt = textgen.sample_inputs()
        for mode in ("fused", "bls"):
            responses, error = grpc_stream(grpc_url, f"textgen_{mode.replace('-', '_')}", prompt)
            assert error is None and as_lists(responses) == as_lists(textgen.pipeline.stream(prompt, mode=mode))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_stopping_the_endpoint_under_an_endless_stream_closes_its_generator():
    """stop() gives a stream in flight its grace period, then cancels it: the generator is closed."""
    server = LocalServer(endless_pipeline(), modes=("fused",), grpc_port=False).start()
    host, port = server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v2/models/endless_fused/generate_stream", body=json.dumps({"n": 70}))
    assert connection.getresponse().readline().startswith(b"data: {")
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    stopping.join(60)
    connection.close()
    assert not stopping.is_alive() and not server.running
    assert _wait_closed(70) is not None


# ------------------------------------------------------------------ the bundled server, message for message

# A decoupled Python model as Triton's docs write one: N = k streams TOKEN = 0 .. k-1, then the final
# flag alone; N = 100 + k, an error response after the k responses, then the final flag alone. What
# the contract asks of a streaming pipeline's top-level model (docs/endpoint.md), so the local
# endpoint's `gen` pipeline must answer as the server answers it.
_GEN = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            for i in range(n % 100):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TOKEN", np.array([i], np.int32))]))
            if n >= 100:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError("gave up")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@step(inputs={"N": ONE}, outputs={"TOKEN": ONE})
def gen(N):
    for i in range(int(N[0]) % 100):
        yield {"TOKEN": np.array([i], np.int32)}
    if int(N[0]) >= 100:
        raise ValueError("gave up")


def gen_pipeline() -> Pipeline:
    p = Pipeline("gen", inputs={"N": ONE})
    p.output("TOKEN", p.add(gen, N=p.input("N"))["TOKEN"])
    return p


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from tritonclient.grpc import model_config_pb2 as mc

    from pipelines.compile.configs import config_text
    from pipelines.triton import TritonServer

    root = tmp_path_factory.mktemp("decoupled") / "models"
    config = mc.ModelConfig(name="gen", backend="python", max_batch_size=0)
    config.input.add(name="N", data_type=mc.TYPE_INT32, dims=[1])
    config.output.add(name="TOKEN", data_type=mc.TYPE_INT32, dims=[1])
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    config.model_transaction_policy.decoupled = True
    (root / "gen" / "1").mkdir(parents=True)
    (root / "gen" / "config.pbtxt").write_text(config_text(config))
    (root / "gen" / "1" / "model.py").write_text(_GEN)
    with TritonServer(root, exit_timeout=3) as s:
        yield s


def _request(model, value, *, empty=None, request_id="", datatype="INT32", empty_as_text=False):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="N", datatype=datatype, shape=[1])
    request.raw_input_contents.append(np.array([value], np.int32 if datatype == "INT32" else np.float32).tobytes())
    if empty is not None:
        request.parameters["triton_enable_empty_final_response"].bool_param = empty
    if empty_as_text:
        request.parameters["triton_enable_empty_final_response"].string_param = "true"
    return request


def _messages(url, requests, model):
    """Every message of one ModelStreamInfer call that sends ``requests`` and no more, as fields to
    compare: the model's name as ``M``, an error's text as ``E`` (each server words its own)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        got = []
        for message in stub.ModelStreamInfer(iter(requests), timeout=60):
            r = message.infer_response
            got.append({
                "error": "E" if message.error_message else "",
                "model_name": "M" if r.model_name == model else r.model_name,
                "model_version": r.model_version,
                "id": r.id,
                "parameters": {k: v.bool_param for k, v in r.parameters.items()},
                "outputs": [(o.name, o.datatype, list(o.shape)) for o in r.outputs],
                "raw": list(r.raw_output_contents),
            })
        return got


def _sse_raw(url, model, body):
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{body.pop('route', 'generate_stream')}",
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, kind, text = answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, kind, text = exc.code, exc.headers["Content-Type"], exc.read().decode()
    return status, kind.split(";")[0], text.replace(f'"{model}"', '"M"')


@pytest.mark.server
def test_the_endpoint_streams_message_for_message_as_the_bundled_server_streams_a_decoupled_model(triton):
    """The same requests to Triton's `gen` and to each mode of the local `gen` pipeline: the same
    messages (ids, flags, versions, outputs, bytes; the error texts are each server's own)."""
    cases = {
        "responses, then the final flag alone": [_request("MODEL", 3, empty=True, request_id="a")],
        "no final flag unless asked": [_request("MODEL", 2, request_id="b")],
        "nothing but the final flag": [_request("MODEL", 0, empty=True)],
        "nothing at all": [_request("MODEL", 0)],
        "an error after two responses": [_request("MODEL", 102, empty=True, request_id="e")],
        "an error after two, unasked": [_request("MODEL", 102, request_id="e")],
        "refused, and the next one answered": [_request("nope", 1, empty=True, request_id="u"),
                                               _request("MODEL", 1, request_id="g"),
                                               _request("MODEL", 1, datatype="FP32", request_id="d"),
                                               _request("MODEL", 1, empty_as_text=True, request_id="t")],
        "two requests at once": [_request("MODEL", 2, empty=True, request_id="x"),
                                 _request("MODEL", 3, empty=True, request_id="y")],
    }
    with LocalServer(gen_pipeline()) as local:
        for what, requests in cases.items():
            def to(model, requests=requests):
                sent = []
                for r in requests:
                    copy = type(r)()
                    copy.CopyFrom(r)
                    copy.model_name = model if r.model_name == "MODEL" else r.model_name
                    sent.append(copy)
                return sent

            def by_id(messages):  # two requests at once interleave; each one's messages keep their order
                return sorted(messages, key=lambda m: m["id"])

            expected = by_id(_messages(triton.grpc_url, to("gen"), "gen"))
            for mode in ("bls", "bls-sync", "fused"):  # the ensemble's answers as the compiled ensemble's, below
                model = local.model_name(mode)
                assert by_id(_messages(local.grpc_url, to(model), model)) == expected, (what, mode)


@pytest.mark.server
def test_generate_stream_and_a_plain_infer_answer_as_the_bundled_server_answers(triton):
    bodies = [{"N": 3, "id": "q"}, {"N": 0}, {"N": [[2]]}, {"N": 2, "parameters": {"x": 1}, "other": 1},
              {"N": 1, "route": "generate"}, {"N": 2, "route": "generate"}, {"N": 0, "route": "generate"}]
    with LocalServer(gen_pipeline(), modes=("fused", "bls")) as local:
        for body in bodies:
            expected = _sse_raw(triton.http_url, "gen", dict(body))
            for model in local.models:
                assert _sse_raw(local.http_url, model, dict(body)) == expected, (body, model)
        # failures: the same statuses and shapes of body, each server's own words
        for body in ({"N": 101}, {"N": 100}, {}, {"N": "2"}, {"N": [1, 2]}, {"N": [[1, 2]]},
                     {"N": 101, "route": "generate"}):
            t_status, t_kind, t_text = _sse_raw(triton.http_url, "gen", dict(body))
            l_status, l_kind, l_text = _sse_raw(local.http_url, "gen_fused", dict(body))
            assert (l_status, l_kind) == (t_status, t_kind), body
            assert l_text.count('"error"') == t_text.count('"error"') == 1, (body, l_text, t_text)
            assert l_text.split('{"error"')[0] == t_text.split('{"error"')[0], body  # the events before it
        # a plain infer: Triton's own refusal, to the letter, over both protocols
        for protocol in ("http", "grpc"):
            client_module = th if protocol == "http" else tg
            said = []
            for url, model in ((triton.http_url if protocol == "http" else triton.grpc_url, "gen"),
                               (local.http_url if protocol == "http" else local.grpc_url, "gen_fused")):
                tensor = client_module.InferInput("N", [1], "INT32")
                tensor.set_data_from_numpy(np.array([1], np.int32))
                with pytest.raises(InferenceServerException) as refused:
                    client_module.InferenceServerClient(url).infer(model, [tensor])
                said.append((refused.value.status(), refused.value.message()))
            assert said[0] == said[1] == (("501", DECOUPLED_HTTP) if protocol == "http"
                                          else ("StatusCode.UNIMPLEMENTED", DECOUPLED_GRPC))
            # and the project's clients word it for the user, against the server as locally
            with TritonClient(triton.http_url if protocol == "http" else triton.grpc_url, protocol) as client:
                with pytest.raises(InferenceError, match=r"model 'gen' streams .*: read it with a stream"):
                    client.infer("gen", {"N": np.array([1], np.int32)})


@step(inputs={"n": ONE}, outputs={"x": TensorSpec("FP32", [1])})
def to_nan(n):
    yield {"x": np.array([1.5], np.float32)}
    yield {"x": np.array([np.nan], np.float32)}


def test_a_nan_output_streams_over_grpc_and_is_refused_as_json_with_the_way_to_read_it():
    p = Pipeline("nan", inputs={"n": ONE})
    p.output("x", p.add(to_nan, n=p.input("n"))["x"])
    with LocalServer(p, modes=("fused",)) as s:
        responses, error = grpc_stream(s.grpc_url, "nan_fused", n(1))
        assert error is None and responses[0]["x"].tolist() == [1.5] and np.isnan(responses[1]["x"][0])
        status, _, events = sse(s.http_url, "nan_fused", {"n": 1})
        assert status == 200 and events[0]["x"] == 1.5
        assert "output 'x' holds nan" in events[1]["error"] and "gRPC stream" in events[1]["error"], events


# ------------------------------------------------------------------ the same client code, then the server


@pytest.fixture(scope="module")
def compiled_server(tmp_path_factory):
    """counting and textgen compiled with every form they have, side by side (``<name>_<form>``, the
    names the local endpoint serves), on the bundled server."""
    from pipelines.forms import FormLeftOutWarning
    from pipelines.triton import TritonServer

    pipelines = [counting(), textgen.make_textgen(max_new_tokens=12)]
    with pytest.warns(FormLeftOutWarning, match="textgen"):  # its when block: no ensemble, here or there
        repos = [p.compile("all") for p in pipelines]
    path = repos[0].merge(*repos[1:]).write(tmp_path_factory.mktemp("stream_all") / "repo")
    with LocalServer(pipelines[0]) as counting_local, LocalServer(pipelines[1]) as textgen_local, \
            TritonServer(path, exit_timeout=3) as running:
        yield running, {p.name: s for p, s in zip(pipelines, (counting_local, textgen_local), strict=True)}


@pytest.mark.server
def test_the_same_client_code_reads_the_same_streams_from_the_local_endpoint_and_the_servers_fused_form(
        compiled_server):
    """grpc_stream and sse, unchanged but for the URL: the server's compiled forms answer what the
    local endpoint answers (the fused form, and the others where Triton keeps the order)."""
    server, local = compiled_server
    counting_local, textgen_local = local["counting"], local["textgen"]
    asked = [(counting_local, "counting_fused", n(k), None) for k in (0, 1, 4)]
    asked += [(counting_local, "counting_fused", n(3), list(subset))
              for size in (1, 2) for subset in itertools.combinations(["word", "sq", "tok", "half"], size)]
    asked += [(textgen_local, "textgen_fused", textgen.sample_inputs(prompt=prompt), None)
              for prompt in ("Streaming pipelines answer", "hello there", "tell me a secret")]
    asked += [(counting_local, f"counting_{form}", n(3), None) for form in ("bls", "bls_sync", "ensemble")]
    asked += [(textgen_local, f"textgen_{form}", textgen.sample_inputs(), None) for form in ("bls", "bls_sync")]
    for endpoint, model, inputs, outputs in asked:
        here = grpc_stream(endpoint.grpc_url, model, inputs, outputs)
        there = grpc_stream(server.grpc_url, model, inputs, outputs)
        assert here[1] is None and as_lists(here[0]) == as_lists(there[0]) and there[1] is None, (model, inputs, outputs)
        assert len(here[0]) >= 1 or int(inputs.get("n", [1])[0]) == 0
        fields = {k: (v[0].decode() if v.dtype == object else int(v[0])) for k, v in inputs.items()}
        if outputs is None:
            assert sse(endpoint.http_url, model, dict(fields)) == sse(server.http_url, model, dict(fields)), model
    # a failure mid-stream: the same responses before it, and the same error, over both protocols
    for form in ("fused", "bls", "bls_sync"):
        model = f"counting_{form}"
        here, there = grpc_stream(counting_local.grpc_url, model, n(102)), grpc_stream(server.grpc_url, model, n(102))
        assert as_lists(here[0]) == as_lists(there[0]) and len(here[0]) == 2, form
        assert here[1] == there[1] and "count gave up after 2 responses" in here[1], form  # word for word
        local_events = sse(counting_local.http_url, model, {"n": 102})
        assert local_events == sse(server.http_url, model, {"n": 102}) and len(local_events[2]) == 3, form


@pytest.mark.server
def test_the_fused_form_streams_message_for_message_as_the_local_endpoint(compiled_server):
    """Raw ModelStreamInfer messages, ids, flags and bytes, for the same requests to both."""
    server, local = compiled_server
    endpoint = local["counting"]
    for requests in ([_named(3, empty=True, request_id="a")], [_named(2, request_id="b")], [_named(0, empty=True)],
                     [_named(102, empty=True, request_id="e")],
                     [_named(2, empty=True, request_id="x"), _named(3, empty=True, request_id="y")]):
        expected = sorted(_messages(server.grpc_url, requests, "counting_fused"), key=lambda m: m["id"])
        assert sorted(_messages(endpoint.grpc_url, requests, "counting_fused"), key=lambda m: m["id"]) == expected
    for protocol in ("http", "grpc"):
        with TritonClient(server.http_url if protocol == "http" else server.grpc_url, protocol) as client:
            with pytest.raises(InferenceError, match=r"model 'counting_fused' streams .*: read it with a stream"):
                client.infer("counting_fused", n(1))


@pytest.mark.server
def test_the_ensemble_mode_answers_with_the_sequence_parameters_and_ends_on_an_error_as_the_ensemble_form(
        compiled_server):
    """Triton's ensemble scheduler puts sequence_id/start/end on each response and the final flag on an
    error (nothing follows it); where it puts the final flag otherwise is a race, and so is an error
    after responses (it may overtake them), so those are left out."""
    server, local = compiled_server
    endpoint = local["counting"]

    def settled(messages):
        answered = []
        for m in messages:
            final = m["parameters"].pop("triton_final_response")
            if m["outputs"] or m["error"]:  # the final flag alone, or on the last response: either
                pairs = sorted(zip(m["outputs"], m["raw"], strict=True))  # the ensemble's own output order
                m["outputs"], m["raw"] = [p[0] for p in pairs], [p[1] for p in pairs]
                answered.append((m, final if m["error"] else None))
        return answered

    for requests in ([_named(3, empty=True, request_id="a", model="counting_ensemble")],
                     [_named(0, empty=True, model="counting_ensemble")],
                     [_named(100, empty=True, request_id="e", model="counting_ensemble")]):
        expected = settled(_messages(server.grpc_url, requests, "counting_ensemble"))
        assert settled(_messages(endpoint.grpc_url, requests, "counting_ensemble")) == expected, requests
    assert sse(endpoint.http_url, "counting_ensemble", {"n": 2}) == sse(server.http_url, "counting_ensemble", {"n": 2})


def _named(value, *, model="counting_fused", **options):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model, id=options.get("request_id", ""))
    request.inputs.add(name="n", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    if options.get("empty") is not None:
        request.parameters["triton_enable_empty_final_response"].bool_param = options["empty"]
    return request
