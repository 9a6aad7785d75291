"""Each response of a streaming pipeline leaves the server when it is made, in every form, on the
real server (Triton 2.51), proved without a clock: the generator yields its first response, then
waits for a file that only the test writes, and only once the client holds that first response.
A form that kept the responses back until the generator ended (a buffer, a thread that pulls the
whole stream, a sender that sends at the end) would never give the client its first response, and
the test would fail after a bound, not hang: the generator gives up waiting and fails too.
"""

from __future__ import annotations

import json
import os
import queue
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from pipelines import Pipeline, TensorSpec, step
from pipelines.triton import TritonServer

# The steps of this file travel by value: it imports what a server need not have (tritonclient.grpc).
pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")]

ONE = TensorSpec("INT32", [1])
FORMS = ("ensemble", "bls", "bls-sync", "fused")
MODELS = {"ensemble": "held_back_ensemble", "bls": "held_back_bls", "bls-sync": "held_back_bls_sync",
          "fused": "held_back_fused"}  # each form's model in a repository of every form ("all")
WAIT_S = 60.0  # how long the generator waits for the file before it fails (a bound, so nothing hangs)


@step(inputs={"n": ONE}, outputs={"tok": ONE}, parameters={"marks": ""})
class HeldBack:
    """Yields ``n``, then waits for the file ``release-<n>`` in its ``marks`` folder (writing
    ``waiting-<n>`` first), then yields ``n + 1``; fails if the file has not come within WAIT_S."""

    def initialize(self, config):
        self.marks = config["parameters"]["marks"]

    def execute(self, n):
        key = int(n[0])
        yield {"tok": np.array([key], np.int32)}
        open(os.path.join(self.marks, f"waiting-{key}"), "w").close()
        release = os.path.join(self.marks, f"release-{key}")
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {release} within {WAIT_S:g} s")
            time.sleep(0.005)
        yield {"tok": np.array([key + 1], np.int32)}


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def square(tok):
    return {"sq": tok * tok}


def held_back(marks: str) -> Pipeline:
    """HeldBack -> square, once per response: a pipeline every form can run."""
    p = Pipeline("held_back", inputs={"n": ONE})
    gen = p.add(HeldBack.with_options(parameters={"marks": marks}), name="gen", n=p.input("n"))
    p.output("sq", p.add(square, tok=gen["tok"])["sq"])
    return p


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def server(marks, tmp_path_factory):
    path = held_back(str(marks)).compile("all").write(tmp_path_factory.mktemp("promptness") / "repo")
    with TritonServer(path, exit_timeout=3) as running:
        yield running


@pytest.mark.parametrize("form", FORMS)
def test_the_first_response_reaches_the_client_while_the_generator_still_runs(server, marks, form):
    key = 10 * (FORMS.index(form) + 1)  # a key, and so a release file, of each form's own
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    release = marks / f"release-{key}"
    try:
        tensor = grpcclient.InferInput("n", [1], "INT32")
        tensor.set_data_from_numpy(np.array([key], np.int32))
        client.async_stream_infer(MODELS[form], [tensor], enable_empty_final_response=True)

        def read(answer):
            result, error = answer
            assert error is None, f"{form}: {error}"
            response = result.get_response()
            value = int(result.as_numpy("sq")[0]) if response.outputs else None
            return value, response.parameters["triton_final_response"].bool_param

        try:
            first = answers.get(timeout=WAIT_S / 2)
        except queue.Empty:
            pytest.fail(f"{form}: no first response within {WAIT_S / 2:g} s while the generator waited after it: "
                        "the form held it back")
        assert not release.exists()  # the generator cannot have gone past its first response
        assert read(first) == (key * key, False)
        release.touch()
        rest = [read(answers.get(timeout=WAIT_S))]
        while not rest[-1][1]:
            rest.append(read(answers.get(timeout=WAIT_S)))
        # The second response, then the final flag on it or alone (an ensemble may send either).
        assert [value for value, _ in rest if value is not None] == [(key + 1) ** 2]
    finally:
        release.touch()  # a failed test leaves no generator waiting on the server
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("form", FORMS)
def test_http_generate_stream_sends_the_first_event_while_the_generator_still_runs(server, marks, form):
    """The same over HTTP server-sent events: the first event can be read before the file exists."""
    key = 10 * (FORMS.index(form) + 1) + 5
    release = marks / f"release-{key}"
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODELS[form]}/generate_stream",
                                     data=json.dumps({"n": key}).encode())
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S / 2) as answer:
            try:
                first = _next_event(answer)
            except TimeoutError:
                pytest.fail(f"{form}: no first event within {WAIT_S / 2:g} s while the generator waited after it")
            assert not release.exists()
            assert first == {**first, "sq": key * key}
            release.touch()
            events = [first]
            while (event := _next_event(answer)) is not None:
                events.append(event)
        assert [e["sq"] for e in events] == [key * key, (key + 1) ** 2]
    finally:
        release.touch()


def _next_event(answer):
    """The next server-sent event's JSON, read line by line as it comes; ``None`` at the end."""
    while True:
        line = answer.readline()
        if not line:
            return None
        if line.startswith(b"data: "):
            return json.loads(line[len(b"data: "):])
