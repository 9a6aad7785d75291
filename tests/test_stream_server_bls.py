"""The BLS forms of a streaming pipeline on the real server (Triton 2.51): one repository, one server.

The BLS model (``bls``: ``async_exec(decoupled=True)``; ``bls-sync``: ``exec(decoupled=True)``) is
decoupled. It calls the streaming step's own decoupled model, reads ``__err__`` on each response,
runs that response's steps (side by side, or one after another), and forwards each answer through
its response sender as it comes, then the final flag alone. A ``whole_stream`` step runs in the BLS
model's process. Over gRPC streaming and HTTP server-sent events a client reads what
``p.stream(inputs, mode=<form>)`` yields; a failure is one error response after the responses
before it; a cancelled request stops the BLS model, while the step it calls runs on to its end.
"""

from __future__ import annotations

import itertools
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import stream_steps as ss
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from stream_clients import FINAL, cancel_after, grpc_stream, local, sse_stream, wait_for_mark
from tritonclient.utils import InferenceServerException

from pipelines.compile import ModelRepository
from pipelines.examples import textgen
from pipelines.forms import FORMS, FormLeftOutWarning
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

FORMS_HERE = ("bls", "bls-sync")
PROMPTS = ["Streaming pipelines answer", "hello there", "a longer prompt, with some punctuation!"]


def n(value: int) -> dict[str, np.ndarray]:
    return {"n": np.array([value], np.int32)}


def model(pipeline: str, form: str) -> str:
    return FORMS[form].model_name(pipeline, side_by_side=True)


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def pipelines(marks):
    return {p.name: p for p in (
        ss.chain(), ss.squares(), ss.picky_pipeline(), ss.summed(), ss.three_outputs(), ss.named(), ss.rows(),
        ss.endless(str(marks), tally=True), ss.endless(str(marks), name="endless_timed", timeout=1.0),
        textgen.make_textgen(max_new_tokens=12),
    )}


@pytest.fixture(scope="module")
def server(pipelines, tmp_path_factory):
    models = {}
    for p in pipelines.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FormLeftOutWarning)  # the ensemble cannot run a when block, a whole_stream step
            repo = p.compile("both")  # the BLS forms side by side; the ensemble, where it can, is left unloaded
        models.update({name: repo[name] for name in repo if not name.endswith("_ensemble")})
    path = ModelRepository(models).write(tmp_path_factory.mktemp("stream_bls") / "repo")
    with TritonServer(path, exit_timeout=3) as running:
        yield running


@pytest.mark.parametrize("form", FORMS_HERE)
def test_the_bls_model_and_the_step_it_calls_are_decoupled(server, form):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.get_model_config(model("squares", form)).config.model_transaction_policy.decoupled
    step = client.get_model_config("squares__count").config
    assert step.model_transaction_policy.decoupled and "__err__" in [o.name for o in step.output]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_each_response_streams_over_grpc_as_the_local_runtime_streams_it_then_the_final_flag_alone(server, pipelines, form):
    for name in ("chain", "squares"):
        expected = local(pipelines[name].stream(n(5), mode=form))
        assert len(expected) == 5
        assert grpc_stream(server.grpc_url, model(name, form), n(5)) == [*expected, FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_http_generate_stream_sends_one_event_per_response(server, pipelines, form):
    events = sse_stream(server.http_url, model("chain", form), {"n": 5})
    assert [e["total"] for e in events] == [r["total"][0] for r in local(pipelines["chain"].stream(n(5), mode=form))]
    assert sse_stream(server.http_url, model("chain", form), {"n": 0}) == []


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_stream_that_yields_nothing_gets_only_the_final_response(server, form):
    assert grpc_stream(server.grpc_url, model("chain", form), n(0)) == [FINAL]
    assert grpc_stream(server.grpc_url, model("squares", form), n(0)) == [FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_whole_stream_step_runs_in_the_bls_models_process_and_answers_once(server, form):
    assert grpc_stream(server.grpc_url, model("summed", form), n(5)) == [{"sum": [10]}, FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_textgen_streams_the_local_runtimes_tokens_and_a_refused_prompt_gets_its_one_answer(server, pipelines, form):
    p = pipelines["textgen"]
    for prompt in PROMPTS:
        inputs = textgen.sample_inputs(prompt=prompt)
        expected = local(p.stream(inputs, mode=form))
        assert len(expected) >= 1 and expected == local(p.stream(inputs, mode="fused"))
        assert grpc_stream(server.grpc_url, model("textgen", form), inputs) == [*expected, FINAL]
    events = sse_stream(server.http_url, model("textgen", form), {"prompt": PROMPTS[1]})
    expected = local(p.stream(textgen.sample_inputs(prompt=PROMPTS[1]), mode=form))
    assert [e["text"] for e in events] == [r["text"][0].decode() for r in expected]
    refused = grpc_stream(server.grpc_url, model("textgen", form), textgen.sample_inputs(prompt="tell me a secret"))
    assert refused == [{"text": [textgen.REFUSED]}, FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_an_error_mid_stream_comes_after_the_responses_before_it_and_names_the_node(server, form):
    """The step's model carries the failure in __err__; the BLS model answers it as an error
    response, after the responses before it, then the final flag."""
    for name, key in (("chain", "total"), ("squares", "sq")):
        got = grpc_stream(server.grpc_url, model(name, form), n(102))
        assert got[:2] == [{key: [0]}, {key: [1]}] and got[3] == FINAL and len(got) == 4, got
        assert got[2].startswith(f"StepError in pipeline '{name}', node 'count', step 'count': (after 2 responses) "
                                 "raised ValueError: the model ran out of tokens (at stream_steps.py:"), got[2]
    events = sse_stream(server.http_url, model("chain", form), {"n": 102})
    assert [e.get("total") for e in events[:2]] == [0, 1] and "the model ran out of tokens" in events[2]["error"]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_step_after_the_stream_that_fails_ends_it_naming_itself(server, form):
    got = grpc_stream(server.grpc_url, model("picky", form), n(10))
    assert got[:3] == [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}] and got[4] == FINAL and len(got) == 5, got
    assert got[3].startswith("StepError in pipeline 'picky', node 'picky', step 'picky': raised ValueError: "
                             "three is not welcome"), got[3]


@pytest.mark.parametrize("form", FORMS_HERE)
@pytest.mark.parametrize("k, said", [
    (202, "output 'tok' has dtype float32; it declares INT32"),
    (303, r"output 'tok' has shape [2]; it declares [1]"),
])
def test_a_bad_yield_names_the_node_the_step_the_response_and_the_tensor(server, pipelines, form, k, said):
    got = grpc_stream(server.grpc_url, model("chain", form), n(k))
    responses = k % 100
    assert len(got) == responses + 2 and got[-1] == FINAL, got
    with pytest.raises(Exception) as local_error:
        list(pipelines["chain"].stream(n(k), mode=form))
    # the local runtime's words, but for the number: it counts responses from 0, the servers from 1
    assert got[-2] == str(local_error.value).replace(f"response {responses}:", f"response {responses + 1}:")
    assert got[-2].startswith(
        f"StepError in pipeline 'chain', node 'count', step 'count', tensor 'tok': response {responses + 1}: {said}")


@pytest.mark.parametrize("form", FORMS_HERE)
def test_every_subset_of_outputs_streams_what_the_local_runtime_streams(server, pipelines, form):
    p = pipelines["three_outputs"]
    for size in (1, 2, 3):
        for subset in itertools.combinations(["tok", "sq", "neg"], size):
            expected = local(p.stream(n(3), mode=form, outputs=list(subset)))
            got = grpc_stream(server.grpc_url, model("three_outputs", form), n(3), outputs=list(subset))
            assert got == [*expected, FINAL], subset


@pytest.mark.parametrize("form", FORMS_HERE)
def test_node_names_as_users_write_them_stream_and_are_named_in_errors(server, pipelines, form):
    name = "Named-Stream.v1"
    assert grpc_stream(server.grpc_url, model(name, form), n(3)) == [*local(pipelines[name].stream(n(3), mode=form)), FINAL]
    got = grpc_stream(server.grpc_url, model(name, form), n(5))
    assert "node 'Square-It.B', step 'picky'" in got[-2]
    assert got[:-2] == [{"Total.Out": [0]}, {"Total.Out": [1]}, {"Total.Out": [5]}]
    got = grpc_stream(server.grpc_url, model(name, form), n(101))
    assert "node 'Gen.v2-A', step 'count': (after 1 responses)" in got[-2], got


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_batched_stream_in_a_when_block_streams_its_rows_and_fills_the_others(server, pipelines, form):
    batch = {"n": np.array([[1], [0], [2]], np.int32)}
    got = grpc_stream(server.grpc_url, model("rows", form), batch)
    assert got == [{"sq": [[100], [-1], [400]]}, {"sq": [[121], [-1], [441]]}, {"sq": [[144], [-1], [484]]}, FINAL]
    assert got[:-1] == local(pipelines["rows"].stream(batch, mode=form))
    assert grpc_stream(server.grpc_url, model("rows", form), {"n": np.array([[0], [0]], np.int32)}) == [{"sq": [[-1], [-1]]}, FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_plain_infer_gets_tritons_refusal_for_decoupled_models(server, form):
    tensor = httpclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"doesn't support models with decoupled transaction policy"):
        httpclient.InferenceServerClient(server.http_url).infer(model("chain", form), [tensor])
    tensor = grpcclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"ModelInfer RPC doesn't support models with decoupled"):
        grpcclient.InferenceServerClient(server.grpc_url).infer(model("chain", form), [tensor])


@pytest.mark.parametrize("form", FORMS_HERE)
def test_a_cancelled_request_stops_the_bls_model_while_the_step_it_calls_runs_on(server, marks, form):
    """The client cancels after three responses. The streaming step's model runs to its bound of
    300 tokens (Triton 2.51 cannot cancel a BLS call); the BLS model stops reading it, so the step
    after the stream (which counts its calls) ran for far fewer; the next request streams whole."""
    for mark in [*marks.glob("endless-*"), *marks.glob("tally")]:
        mark.unlink()
    cancel_after(server.grpc_url, model("endless", form), n(300), 3)
    assert wait_for_mark(marks, "endless-") == ["endless-300-ran out"]
    tallied = len((marks / "tally").read_text().split())
    assert 3 <= tallied < 300, tallied
    expected = [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}, {"sq": [9]}, FINAL]
    assert grpc_stream(server.grpc_url, model("endless", form), n(4)) == expected


@pytest.mark.parametrize("form", FORMS_HERE)
def test_the_steps_timeout_bounds_the_whole_stream_of_the_step_it_calls(server, marks, form):
    """Timeout 1 s: the step's model ends a stream that yields on past it (the generator is closed)
    and one stuck inside a response, with the timeout error in __err__; the BLS model answers it
    after the responses before it, and the next request streams whole."""
    for mark in marks.glob("endless-*"):
        mark.unlink()
    name = model("endless_timed", form)
    got = grpc_stream(server.grpc_url, name, n(999))
    assert got[-1] == FINAL and all(isinstance(r, dict) for r in got[:-2]) and len(got) > 3, got[-3:]
    assert got[-2].startswith("StepTimeoutError in pipeline 'endless_timed', node 'gen', step 'Endless': ran past its "
                              "timeout of 1 s"), got[-2]
    [mark] = wait_for_mark(marks, "endless-")
    assert mark.endswith("-closed") and int(mark.split("-")[1]) < 999, mark
    got = grpc_stream(server.grpc_url, name, n(1005))  # stuck for an hour in its third response
    assert got[:2] == [{"sq": [0]}, {"sq": [1]}] and got[3] == FINAL, got
    assert got[2].startswith("StepTimeoutError in pipeline 'endless_timed', node 'gen'"), got[2]
    assert grpc_stream(server.grpc_url, name, n(3)) == [{"sq": [0]}, {"sq": [1]}, {"sq": [4]}, FINAL]


@pytest.mark.parametrize("form", FORMS_HERE)
def test_streams_sent_together_each_get_their_own_responses(server, pipelines, form):
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: grpc_stream(server.grpc_url, model("squares", form), n(k)), [3, 5, 102, 4]))
    expected = {k: local(pipelines["squares"].stream(n(k), mode=form)) for k in (3, 5, 4)}
    assert got[0] == [*expected[3], FINAL] and got[1] == [*expected[5], FINAL] and got[3] == [*expected[4], FINAL]
    assert got[2][:2] == [{"sq": [0]}, {"sq": [1]}] and "ran out of tokens" in got[2][2]


def test_the_docs_state_each_fact_with_its_test():
    text = (Path(__file__).parents[1] / "docs" / "triton_decoupled.md").read_text()
    names = [name for name in globals() if name.startswith("test_") and name != "test_the_docs_state_each_fact_with_its_test"]
    for name in names:
        assert name in text, name
