"""Streaming pipelines on the real tritonserver: a streaming step's own decoupled model, called
directly, and the ensemble form of a streaming pipeline, compared with the local runtime
(``p.stream(inputs, mode="ensemble")``) over gRPC streaming and HTTP ``generate_stream``.

One server for the module: a plain pipeline is written into the repository first, then a few
small streaming pipelines are compiled to "ensemble" into it beside it.
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pipelines import Pipeline, PipelinesError, TensorSpec, step
from pipelines.examples import textgen
from pipelines.triton import TritonServer
from pipelines.triton.model_state import ModelsUnavailableWarning

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")]

ONE = TensorSpec("INT32", [1])


# ----------------------------------------------------------------- the steps


def responses(n):
    """``n % 100`` responses (0, 1, ...); then, by ``n // 100``: 1 raises, 2 yields a float, 3 a wrong shape."""
    k, then = int(n[0]) % 100, int(n[0]) // 100
    for i in range(k):
        yield {"tok": np.array([i], np.int32)}
    if then == 1:
        raise ValueError(f"count gave up after {k}")
    if then == 2:
        yield {"tok": np.array([1.5], np.float32)}
    if then == 3:
        yield {"tok": np.array([1, 2], np.int32)}


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
    yield from responses(n)


@step(inputs={"n": ONE}, outputs={"tok": ONE}, name="count")
async def count_async(n):
    """``count`` as an async generator."""
    for answer in responses(n):
        yield answer


@step(inputs={"n": ONE}, outputs={"tok": ONE}, timeout=1.0)
def endless(n):
    i = 0
    while True:
        yield {"tok": np.array([i], np.int32)}
        i += 1
        time.sleep(0.01)


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def picky(tok):
    if int(tok[0]) == 3:
        raise ValueError("three is not welcome")
    return {"sq": tok * tok}


@step(inputs={"n": ONE}, outputs={"base": ONE})
def prep(n):
    if int(n[0]) == 55:
        raise ValueError("prep refuses 55")
    return {"base": n * 10}


@step(inputs={"tok": ONE, "base": ONE}, outputs={"sq": ONE, "tok": ONE})
def plus(tok, base):
    return {"sq": tok + base, "tok": tok}


def chained(name: str, after) -> Pipeline:
    p = Pipeline(name, inputs={"n": ONE})
    p.output("sq", p.add(after, tok=p.add(count, n=p.input("n"))["tok"])["sq"])
    return p


def beside() -> Pipeline:
    """A step once per response that reads a step's output made once per request beside the stream."""
    p = Pipeline("beside", inputs={"n": ONE})
    base = p.add(prep, n=p.input("n"))["base"]
    p.output("sq", p.add(plus, tok=p.add(count, n=p.input("n"))["tok"], base=base)["sq"])
    return p


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count_rows(n):
    """A batch's stream: ``max(n)`` responses, each row's token the same."""
    for i in range(int(n.max())):
        yield {"tok": np.full(n.shape, i, np.int32)}


def direct() -> Pipeline:
    """A batching pipeline whose step once per response reads a pipeline input."""
    p = Pipeline("direct", inputs={"n": ONE}, max_batch_size=4)
    p.output("sq", p.add(plus, tok=p.add(count_rows, n=p.input("n"))["tok"], base=p.input("n"))["sq"])
    return p


def odd() -> Pipeline:
    """Names users give (dots, dashes, capitals); outputs that feed a step and are exposed twice;
    an async generator."""
    p = Pipeline("Odd.Stream-1", inputs={"n": ONE})
    gen = p.add(count_async, name="Gen.v2-X", n=p.input("n"))
    both = p.add(plus, name="Plus-1.b", tok=gen["tok"], base=gen["tok"])
    p.output("Tok.out", gen["tok"])
    p.output("tok-again", gen["tok"])
    p.output("SQ", both["sq"])
    p.output("passed", both["tok"])
    return p


@step(inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])})
def halve(x):
    return {"y": x / 2}


def plain() -> Pipeline:
    p = Pipeline("plain", inputs={"x": TensorSpec("FP32", [2])})
    p.output("y", p.add(halve, x=p.input("x"))["y"])
    return p


def ended(name: str = "endless") -> Pipeline:
    p = Pipeline(name, inputs={"n": ONE})
    p.output("tok", p.add(endless, n=p.input("n"))["tok"])
    return p


TEXTGEN = textgen.make_textgen(name="textgen_ungated", max_new_tokens=6, gate=False)
STREAMING = {p.name: p for p in (ended(), chained("picky", picky), beside(), direct(), odd(), TEXTGEN)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams") / "models"
    plain().compile("ensemble").write(root)  # a repository that holds another pipeline's models already
    for pipeline in STREAMING.values():
        pipeline.compile("ensemble").write(root)
    _uncarried(root)
    with pytest.warns(ModelsUnavailableWarning, match="direct_uncarried"), TritonServer(root, exit_timeout=3) as s:
        yield s


# ----------------------------------------------------------------- clients


def grpc_stream(server: TritonServer, model: str, inputs: dict[str, np.ndarray], outputs=None, wait: float = 30.0):
    """What a gRPC stream client reads for one request: per response ``(outputs, final flag)``, or
    the error's text; after an error, whatever else arrives within a second."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else
                                       {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}[value.dtype])
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    asked = None if outputs is None else [grpcclient.InferRequestedOutput(o) for o in outputs]
    client.async_stream_infer(model, tensors, outputs=asked, enable_empty_final_response=True)
    got: list = []
    try:
        while True:
            result, error = answers.get(timeout=wait)
            if error is not None:
                got.append(str(error))
                wait = 1.0  # an error: see whether anything follows it
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            got.append(({o.name: result.as_numpy(o.name) for o in response.outputs}, final))
            if final:
                break
    except queue.Empty:
        if wait != 1.0:
            raise
    client.stop_stream()
    client.close()
    return got


def err_text(err: np.ndarray) -> str | None:
    """The failure an ``__err__`` output carries (a flag byte, then UTF-8 text), or ``None``."""
    row = err.reshape(-1)
    return None if row.size == 0 or row[0] == 0 else row[1:].tobytes().decode()


def n(value: int) -> dict[str, np.ndarray]:
    return {"n": np.array([value], np.int32)}


# ----------------------------------------------------------------- the streaming step's own model


def test_the_step_model_sends_one_response_per_yield_then_the_final_flag_alone(server):
    got = grpc_stream(server, "picky__count", n(3))
    assert [(int(o["tok"][0]), final) for o, final in got[:-1]] == [(0, False), (1, False), (2, False)]
    assert got[-1] == ({}, True)
    for outputs, _ in got[:-1]:
        assert err_text(outputs["__err__"]) is None and outputs["__err__"].tolist() == [0]
    assert grpc_stream(server, "picky__count", n(0)) == [({}, True)]


@pytest.mark.parametrize(("value", "said"), [
    (102, r"StepError in pipeline 'picky', node 'count', step 'count': \(after 2 responses\) raised ValueError: "
          r"count gave up after 2 \(at test_stream_server_ensemble.py:\d+\)"),
    (202, r"StepError in pipeline 'picky', node 'count', step 'count', tensor 'tok': response 3: output 'tok' has "
          r"dtype float32; it declares INT32"),
    (301, r"StepError in pipeline 'picky', node 'count', step 'count', tensor 'tok': response 2: output 'tok' has "
          r"shape \[2\]; it declares \[1\]"),
])
def test_the_step_model_carries_a_failure_mid_stream_as_data_then_the_final_flag(server, value, said):
    """Never an error response: the responses before it, one response whose ``__err__`` holds the
    wire error (and stand-ins for the outputs), then the final flag alone."""
    got = grpc_stream(server, "picky__count", n(value))
    before = value % 100
    assert all(isinstance(answer, tuple) for answer in got), got
    assert [int(o["tok"][0]) for o, _ in got[:before]] == list(range(before))
    failure, final = got[before]
    assert not final and failure["tok"].tolist() == [0]
    assert re.fullmatch(said + ".*", err_text(failure["__err__"]), re.S), err_text(failure["__err__"])
    assert got[before + 1:] == [({}, True)]


def test_the_step_model_ends_a_stream_past_the_steps_timeout(server):
    got = grpc_stream(server, "endless__endless", n(0))
    *responses, (failure, final), last = got
    assert len(responses) > 3 and [int(o["tok"][0]) for o, _ in responses] == list(range(len(responses)))
    text = err_text(failure["__err__"])
    assert text.startswith("StepTimeoutError in pipeline 'endless', node 'endless', step 'endless': ran past its "
                           f"timeout of 1 s after {len(responses)} responses"), text
    assert not final and last == ({}, True)


def _uncarried(root: Path) -> None:
    """``direct_uncarried``: the ensemble of ``direct`` with the step after the stream reading the
    pipeline input itself instead of its carry, as a hand-written ensemble would."""
    from pipelines.compile.configs import config_text, parse_config

    config = parse_config((root / "direct" / "config.pbtxt").read_text())
    config.name = "direct_uncarried"
    for step_ in config.ensemble_scheduling.step:
        for key in [k for k in step_.input_map if k.startswith("__carry_in_")]:
            del step_.input_map[key]
        for key in [k for k in step_.output_map if k.startswith("__carry_")]:
            del step_.output_map[key]
        if "base" in step_.input_map:
            step_.input_map["base"] = "n"
    (root / "direct_uncarried" / "1").mkdir(parents=True)
    (root / "direct_uncarried" / "config.pbtxt").write_text(config_text(config))


def answers(got) -> list:
    """A stream as read (:func:`grpc_stream`), each response's outputs as lists, the final flag
    dropped (on the last response, or alone after it: a race in Triton's ensemble)."""
    out = []
    for answer in got:
        if isinstance(answer, str):
            out.append(answer)
        elif answer[0]:
            out.append({name: value.tolist() for name, value in answer[0].items()})
    return out


def local(pipeline: Pipeline, inputs, outputs=None) -> list:
    """What the local runtime streams in the ensemble's mode, in :func:`answers`' terms."""
    out = []
    try:
        for response in pipeline.stream(inputs, mode="ensemble", outputs=outputs):
            out.append({name: np.asarray(value).tolist() for name, value in response.items()})
    except PipelinesError as exc:
        out.append(exc)
    return out


def sse(server: TritonServer, model: str, body: dict) -> tuple[int, list[dict]]:
    """HTTP ``generate_stream``: the status and the events' JSON (an error first comes with status 400)."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, [json.loads(event.removeprefix("data: ")) for event in text.split("\n\n") if event]


# ----------------------------------------------------------------- the ensemble

CASES = [("picky", n(3)), ("beside", n(3)), ("direct", {"n": np.array([[3], [1]], np.int32)}), ("Odd.Stream-1", n(3)),
         ("textgen_ungated", textgen.sample_inputs())]


@pytest.mark.parametrize(("model", "inputs"), CASES, ids=[c[0] for c in CASES])
def test_the_ensemble_streams_what_the_local_runtime_streams_over_grpc_and_sse(server, model, inputs):
    expected = local(STREAMING[model], inputs)
    assert len(expected) >= 2
    assert answers(grpc_stream(server, model, inputs)) == expected
    if STREAMING[model].max_batch_size:
        return  # generate_stream takes one value a tensor, and the pipeline a batch
    body = {name: value.reshape(-1).tolist() if value.dtype != object else value[0].decode() for name, value in inputs.items()}
    status, events = sse(server, model, body)
    assert status == 200
    scalars = [{k: v if isinstance(v, list) else [v] for k, v in e.items() if not k.startswith(("model_", "sequence_"))}
               for e in events]
    assert [{k: [x.encode() if isinstance(x, str) else x for x in v] for k, v in e.items()} for e in scalars] == expected


def test_an_empty_stream_gets_only_the_final_response(server):
    for model in ("picky", "Odd.Stream-1", "beside"):
        assert grpc_stream(server, model, n(0)) == [({}, True)]
        assert sse(server, model, {"n": 0}) == (200, [])
        assert local(STREAMING[model], n(0)) == []


FAILURES = [
    ("picky", 103, 3, r"StepError in pipeline 'picky', node 'count', step 'count': \(after 3 responses\) raised ValueError: "
                   r"count gave up after 3 \(at test_stream_server_ensemble.py:\d+\)"),
    ("picky", 202, 2, r"StepError in pipeline 'picky', node 'count', step 'count', tensor 'tok': response 3: output 'tok' has "
                   r"dtype float32; it declares INT32 \(int32\); cast it before returning"),
    ("Odd.Stream-1", 301, 1, r"StepError in pipeline 'Odd.Stream-1', node 'Gen.v2-X', step 'count', tensor 'tok': "
                             r"response 2: output 'tok' "
                    r"has shape \[2\]; it declares \[1\] \(-1 is any size\)"),
    ("picky", 6, 3, r"StepError in pipeline 'picky', node 'picky', step 'picky': raised ValueError: three is not "
                    r"welcome \(at test_stream_server_ensemble.py:\d+\)"),
    ("beside", 102, 2, r"StepError in pipeline 'beside', node 'count', step 'count': \(after 2 responses\) raised"),
    ("beside", 55, 0, r"StepError in pipeline 'beside', node 'prep', step 'prep': raised ValueError: prep refuses 55"),
]


@pytest.mark.parametrize(("model", "value", "before", "said"), FAILURES, ids=[f"{f[0]}-{f[1]}" for f in FAILURES])
def test_a_failure_is_an_error_response_after_the_responses_before_it_naming_node_step_tensor_and_response(
        server, model, value, before, said):
    """Over gRPC: the responses before it, then the error, and nothing after it (no final flag);
    over SSE the same events, with status 400 where the error comes first."""
    expected = local(STREAMING[model], n(value))
    assert isinstance(expected[-1], PipelinesError) and len(expected) == before + 1
    got = answers(grpc_stream(server, model, n(value)))
    assert got[:-1] == expected[:-1]
    assert re.fullmatch(f"in ensemble '{re.escape(model)}', {said}.*", got[-1], re.S), got[-1]
    status, events = sse(server, model, {"n": value})
    assert status == (400 if before == 0 else 200)
    assert len(events) == before + 1 and re.fullmatch(f"in ensemble '{re.escape(model)}', {said}.*", events[-1]["error"])


def test_every_subset_of_the_outputs_streams_as_the_local_runtime_does(server):
    pipeline = STREAMING["Odd.Stream-1"]
    names = list(pipeline.outputs)
    for size in range(1, len(names) + 1):
        for subset in combinations(names, size):
            expected = local(pipeline, n(3), outputs=list(subset))
            assert answers(grpc_stream(server, pipeline.name, n(3), outputs=subset)) == expected, subset


def test_a_plain_infer_is_refused_with_tritons_decoupled_error(server):
    tensor = httpclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"HTTP end point doesn't support models with decoupled"):
        httpclient.InferenceServerClient(server.http_url).infer("picky", [tensor])
    tensor = grpcclient.InferInput("n", [1], "INT32")
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match=r"ModelInfer RPC doesn't support models with decoupled"):
        grpcclient.InferenceServerClient(server.grpc_url).infer("picky", [tensor])


def test_the_plain_pipeline_already_in_the_repository_still_answers(server):
    tensor = httpclient.InferInput("x", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[2, 4]], np.float32))
    # a batching pipeline (max_batch_size 0 by default: the shape is the tensor's own)
    tensor = httpclient.InferInput("x", [2], "FP32")
    tensor.set_data_from_numpy(np.array([2, 4], np.float32))
    result = httpclient.InferenceServerClient(server.http_url).infer("plain", [tensor])
    assert result.as_numpy("y").tolist() == [1, 2]


def test_an_ensemble_of_a_never_ending_stream_ends_at_the_streaming_steps_timeout(server):
    """Triton's ensemble has no per-step timeout, but the streaming step's own model ends its
    stream after the step's ``timeout``: the gate turns that into the ensemble's error response."""
    got = answers(grpc_stream(server, "endless", n(0)))
    assert len(got) > 3 and [r["tok"] for r in got[:-1]] == [[i] for i in range(len(got) - 1)]
    assert got[-1].startswith("in ensemble 'endless', StepTimeoutError in pipeline 'endless', node 'endless', step "
                              f"'endless': ran past its timeout of 1 s after {len(got) - 1} responses"), got[-1]


# ----------------------------------------------------------------- Triton facts (docs/triton_decoupled.md)


def test_triton_refuses_an_ensemble_step_fed_by_a_stream_and_by_the_request(server):
    """Hand-wired, the step after the stream reads the pipeline input itself: Triton does not load
    the ensemble. Compiled, it reads the input's carry from the streaming step, and loads."""
    assert "direct_uncarried" in server.unavailable and "direct" not in server.unavailable
    assert ("in ensemble direct_uncarried, step of model 'direct_uncarried' receives inputs originated from "
            "different decoupled models") in server.log_tail(2000)


def test_a_gates_error_response_ends_the_ensembles_stream_after_the_responses_before_it(server):
    """The failure travels as data to the gate with its response, behind the responses before it
    (each step after the stream has one instance, whose queue keeps their order); the gate's error
    response reaches the client last, and nothing follows it: no final flag, and no response the
    generator made after it (picky fails at 3 of 6)."""
    for _ in range(3):
        got = grpc_stream(server, "picky", n(6))
        assert [o["sq"].tolist() for o, _ in got[:3]] == [[0], [1], [4]] and all(not final for _, final in got[:3])
        assert len(got) == 4 and isinstance(got[3], str), got


def test_generate_stream_answers_an_error_before_any_response_with_status_400(server):
    assert sse(server, "beside", {"n": 55})[0] == 400
    assert sse(server, "beside", {"n": 102})[0] == 200


def test_the_docs_state_each_fact_with_its_test():
    text = (Path(__file__).parents[1] / "docs" / "triton_decoupled.md").read_text()
    for name in ("test_triton_refuses_an_ensemble_step_fed_by_a_stream_and_by_the_request",
                 "test_a_gates_error_response_ends_the_ensembles_stream_after_the_responses_before_it",
                 "test_generate_stream_answers_an_error_before_any_response_with_status_400",
                 "test_an_ensemble_of_a_never_ending_stream_ends_at_the_streaming_steps_timeout"):
        assert name in text, name
