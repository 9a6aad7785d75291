"""The fused form of a streaming pipeline on the real server (Triton 2.51): one repository, one server.

The fused model is decoupled; the generator runs in its process, pulled one response at a time,
and each response goes out of the response sender through the steps after it. Over gRPC streaming
and HTTP server-sent events a client reads what ``p.stream(inputs, mode="fused")`` yields, then
the final flag alone; a failure is one error response after the responses before it; a client
that cancels stops the generator; the step's timeout bounds a generator that never ends.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import stream_steps as ss
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from stream_clients import FINAL, cancel_after, grpc_stream, local, sse_stream, wait_for_mark
from tritonclient.utils import InferenceServerException

from pipelines.examples import textgen
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

FORM = "fused"
PROMPTS = ["Streaming pipelines answer", "hello there", "a longer prompt, with some punctuation!"]


def n(value: int) -> dict[str, np.ndarray]:
    return {"n": np.array([value], np.int32)}


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def pipelines(marks):
    return {p.name: p for p in (
        ss.chain(), ss.squares(), ss.picky_pipeline(), ss.summed(), ss.three_outputs(), ss.named(), ss.rows(),
        ss.endless(str(marks)), ss.endless(str(marks), name="endless_timed", timeout=1.0),
        textgen.make_textgen(max_new_tokens=12),
    )}


@pytest.fixture(scope="module")
def server(pipelines, tmp_path_factory):
    repos = [p.compile(FORM) for p in pipelines.values()]
    path = repos[0].merge(*repos[1:]).write(tmp_path_factory.mktemp("stream_fused") / "repo")
    with TritonServer(path, exit_timeout=3) as running:
        yield running


def test_the_fused_model_of_a_streaming_pipeline_is_decoupled(server):
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("chain").config
    assert config.model_transaction_policy.decoupled


def test_each_response_streams_over_grpc_as_the_local_runtime_streams_it_then_the_final_flag_alone(server, pipelines):
    p = pipelines["chain"]
    expected = local(p.stream(n(5), mode=FORM))
    assert [r["total"] for r in expected] == [[0], [1], [5], [14], [30]]
    assert grpc_stream(server.grpc_url, "chain", n(5)) == [*expected, FINAL]
    assert grpc_stream(server.grpc_url, "squares", n(4)) == [*local(pipelines["squares"].stream(n(4), mode=FORM)), FINAL]


def test_http_generate_stream_sends_one_event_per_response(server, pipelines):
    events = sse_stream(server.http_url, "chain", {"n": 5})
    assert [e["total"] for e in events] == [r["total"][0] for r in local(pipelines["chain"].stream(n(5), mode=FORM))]
    assert sse_stream(server.http_url, "chain", {"n": 0}) == []


def test_a_stream_that_yields_nothing_gets_only_the_final_response(server):
    assert grpc_stream(server.grpc_url, "chain", n(0)) == [FINAL]
    assert grpc_stream(server.grpc_url, "squares", n(0)) == [FINAL]


def test_a_whole_stream_step_that_answers_once_gives_one_response(server):
    assert grpc_stream(server.grpc_url, "summed", n(5)) == [{"sum": [10]}, FINAL]


def test_textgen_streams_the_local_runtimes_tokens_and_a_refused_prompt_gets_its_one_answer(server, pipelines):
    p = pipelines["textgen"]
    for prompt in PROMPTS:
        inputs = textgen.sample_inputs(prompt=prompt)
        expected = local(p.stream(inputs, mode=FORM))
        assert len(expected) >= 1
        assert grpc_stream(server.grpc_url, "textgen", inputs) == [*expected, FINAL]
    events = sse_stream(server.http_url, "textgen", {"prompt": PROMPTS[1]})
    assert [e["text"] for e in events] == [r["text"][0].decode() for r in local(p.stream(textgen.sample_inputs(prompt=PROMPTS[1]), mode=FORM))]
    refused = grpc_stream(server.grpc_url, "textgen", textgen.sample_inputs(prompt="tell me a secret"))
    assert refused == [{"text": [textgen.REFUSED]}, FINAL]


def test_an_error_mid_stream_comes_after_the_responses_before_it_and_names_the_node(server, pipelines):
    got = grpc_stream(server.grpc_url, "chain", n(102))
    assert got[:2] == [{"total": [0]}, {"total": [1]}] and got[3] == FINAL and len(got) == 4, got
    assert got[2].startswith("StepError in pipeline 'chain', node 'count', step 'count': (after 2 responses) "
                             "raised ValueError: the model ran out of tokens (at stream_steps.py:"), got[2]
    events = sse_stream(server.http_url, "chain", {"n": 102})
    assert [e.get("total") for e in events[:2]] == [0, 1] and "the model ran out of tokens" in events[2]["error"]


def test_a_step_after_the_stream_that_fails_ends_it_naming_itself(server):
    got = grpc_stream(server.grpc_url, "picky", n(10))
    assert got[:3] == [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}] and got[4] == FINAL and len(got) == 5, got
    assert got[3].startswith("StepError in pipeline 'picky', node 'picky', step 'picky': raised ValueError: "
                             "three is not welcome"), got[3]


@pytest.mark.parametrize("k, said", [
    (202, "output 'tok' has dtype float32; it declares INT32"),
    (303, r"output 'tok' has shape [2]; it declares [1]"),
])
def test_a_bad_yield_names_the_node_the_step_the_response_and_the_tensor_as_the_local_runtime_does(server, pipelines, k, said):
    got = grpc_stream(server.grpc_url, "chain", n(k))
    responses = k % 100
    assert len(got) == responses + 2 and got[-1] == FINAL, got
    with pytest.raises(Exception) as local_error:
        list(pipelines["chain"].stream(n(k), mode=FORM))
    # the local runtime's words, but for the number: it counts responses from 0, the servers from 1
    assert got[-2] == str(local_error.value).replace(f"response {responses}:", f"response {responses + 1}:")
    assert got[-2].startswith(
        f"StepError in pipeline 'chain', node 'count', step 'count', tensor 'tok': response {responses + 1}: {said}")


def test_a_yield_that_misses_an_output_is_named_too(server):
    got = grpc_stream(server.grpc_url, "squares", n(401))
    assert got[0] == {"sq": [0]} and got[2] == FINAL, got
    assert got[1].startswith("StepError in pipeline 'squares', node 'count', step 'count', tensor 'tok': response 2: "), got


def test_every_subset_of_outputs_streams_what_the_local_runtime_streams(server, pipelines):
    p = pipelines["three_outputs"]
    names = ["tok", "sq", "neg"]
    for size in (1, 2, 3):
        for subset in itertools.combinations(names, size):
            expected = local(p.stream(n(3), mode=FORM, outputs=list(subset)))
            assert grpc_stream(server.grpc_url, "three_outputs", n(3), outputs=list(subset)) == [*expected, FINAL], subset


def test_node_names_as_users_write_them_stream_and_are_named_in_errors(server, pipelines):
    p = pipelines["Named-Stream.v1"]
    assert grpc_stream(server.grpc_url, "Named-Stream.v1", n(3)) == [*local(p.stream(n(3), mode=FORM)), FINAL]
    got = grpc_stream(server.grpc_url, "Named-Stream.v1", n(5))
    assert "node 'Square-It.B', step 'picky'" in got[-2] and got[:-2] == [{"Total.Out": [0]}, {"Total.Out": [1]}, {"Total.Out": [5]}]
    got = grpc_stream(server.grpc_url, "Named-Stream.v1", n(101))
    assert "node 'Gen.v2-A', step 'count': (after 1 responses)" in got[-2], got


def test_a_batched_stream_in_a_when_block_streams_its_rows_and_fills_the_others(server, pipelines):
    batch = {"n": np.array([[1], [0], [2]], np.int32)}
    got = grpc_stream(server.grpc_url, "rows", batch)
    assert got == [{"sq": [[100], [-1], [400]]}, {"sq": [[121], [-1], [441]]}, {"sq": [[144], [-1], [484]]}, FINAL]
    assert got[:-1] == local(pipelines["rows"].stream(batch, mode=FORM))
    assert grpc_stream(server.grpc_url, "rows", {"n": np.array([[0], [0]], np.int32)}) == [{"sq": [[-1], [-1]]}, FINAL]


def test_a_plain_infer_gets_tritons_refusal_for_decoupled_models(server):
    tensor = httpclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"doesn't support models with decoupled transaction policy"):
        httpclient.InferenceServerClient(server.http_url).infer("chain", [tensor])
    tensor = grpcclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"ModelInfer RPC doesn't support models with decoupled"):
        grpcclient.InferenceServerClient(server.grpc_url).infer("chain", [tensor])


def test_a_cancelled_stream_stops_the_generator_and_the_next_request_is_answered(server, marks):
    """The client cancels after three responses; the generator, bounded at 900 tokens, is closed
    (its GeneratorExit and finally run) well before them, and the next request streams whole."""
    for mark in marks.glob("endless-*"):
        mark.unlink()
    cancel_after(server.grpc_url, "endless", n(900), 3)
    [mark] = wait_for_mark(marks, "endless-")
    sent, how = mark.split("-")[1:]
    assert how == "closed" and 2 <= int(sent) < 900, mark  # closed at a yield: the third's, or one soon after
    assert grpc_stream(server.grpc_url, "endless", n(4)) == [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}, {"sq": [9]}, FINAL]


def test_the_steps_timeout_bounds_a_generator_that_never_ends(server, marks):
    """Timeout 1 s: a generator that yields on past it is closed (its finally runs) after the
    responses it gave, with the step's timeout error; one stuck inside a response is left to its
    thread, and a fresh instance answers the next request."""
    for mark in marks.glob("endless-*"):
        mark.unlink()
    got = grpc_stream(server.grpc_url, "endless_timed", n(999))
    assert got[-1] == FINAL and all(isinstance(r, dict) for r in got[:-2]) and len(got) > 3, got[-3:]
    assert got[-2].startswith("StepTimeoutError in pipeline 'endless_timed', node 'gen', step 'Endless': ran past its "
                              "timeout of 1 s"), got[-2]
    [mark] = wait_for_mark(marks, "endless-")
    assert mark.endswith("-closed") and int(mark.split("-")[1]) < 999, mark
    got = grpc_stream(server.grpc_url, "endless_timed", n(1005))  # stuck for an hour in its third response
    assert got[:2] == [{"sq": [0]}, {"sq": [1]}] and got[3] == FINAL, got
    assert got[2].startswith("StepTimeoutError in pipeline 'endless_timed', node 'gen'") and "fresh instance" in got[2]
    assert grpc_stream(server.grpc_url, "endless_timed", n(3)) == [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}, FINAL]


def test_streams_sent_together_each_get_their_own_responses(server, pipelines):
    """Requests that arrive together stream one after another in the one instance, each whole."""
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: grpc_stream(server.grpc_url, "chain", n(k)), [3, 5, 102, 4]))
    expected = {k: local(pipelines["chain"].stream(n(k), mode=FORM)) for k in (3, 5, 4)}
    assert got[0] == [*expected[3], FINAL] and got[1] == [*expected[5], FINAL] and got[3] == [*expected[4], FINAL]
    assert got[2][:2] == [{"total": [0]}, {"total": [1]}] and "ran out of tokens" in got[2][2]
