"""Streaming pipelines on the real tritonserver: a streaming step's own decoupled model, called
directly, and the ensemble form of a streaming pipeline, each compared with the local runtime
(``p.stream(inputs, mode="ensemble")``) over gRPC streaming and HTTP ``generate_stream``.

One server for the module, loaded with a few small pipelines compiled to "ensemble".
"""

from __future__ import annotations

import queue
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from pipelines import Pipeline, TensorSpec, step
from pipelines.triton import TritonServer

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")]

ONE = TensorSpec("INT32", [1])


# ----------------------------------------------------------------- the steps


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
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


@step(inputs={"n": ONE}, outputs={"tok": ONE}, timeout=1.0)
def endless(n):
    i = 0
    while True:
        yield {"tok": np.array([i], np.int32)}
        i += 1
        time.sleep(0.01)


def counter(name: str = "cnt") -> Pipeline:
    p = Pipeline(name, inputs={"n": ONE})
    p.output("tok", p.add(count, n=p.input("n"))["tok"])
    return p


def ended(name: str = "endless") -> Pipeline:
    p = Pipeline(name, inputs={"n": ONE})
    p.output("tok", p.add(endless, n=p.input("n"))["tok"])
    return p


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams") / "models"
    for pipeline in (counter(), ended()):
        pipeline.compile("ensemble").write(root, overwrite=True)
    with TritonServer(root, exit_timeout=3) as s:
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
    got = grpc_stream(server, "cnt__count", n(3))
    assert [(int(o["tok"][0]), final) for o, final in got[:-1]] == [(0, False), (1, False), (2, False)]
    assert got[-1] == ({}, True)
    for outputs, _ in got[:-1]:
        assert err_text(outputs["__err__"]) is None and outputs["__err__"].tolist() == [0]
    assert grpc_stream(server, "cnt__count", n(0)) == [({}, True)]


@pytest.mark.parametrize(("value", "said"), [
    (102, r"StepError in pipeline 'cnt', node 'count', step 'count': \(after 2 responses\) raised ValueError: "
          r"count gave up after 2 \(at test_stream_server_ensemble.py:\d+\)"),
    (202, r"StepError in pipeline 'cnt', node 'count', step 'count', tensor 'tok': response 3: output 'tok' has "
          r"dtype float32; it declares INT32"),
    (301, r"StepError in pipeline 'cnt', node 'count', step 'count', tensor 'tok': response 2: output 'tok' has "
          r"shape \[2\]; it declares \[1\]"),
])
def test_the_step_model_carries_a_failure_mid_stream_as_data_then_the_final_flag(server, value, said):
    """Never an error response: the responses before it, one response whose ``__err__`` holds the
    wire error (and stand-ins for the outputs), then the final flag alone."""
    got = grpc_stream(server, "cnt__count", n(value))
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
