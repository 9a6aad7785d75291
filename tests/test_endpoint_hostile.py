"""The local endpoint under hostile clients: oversized bodies, a stop while requests run, odd JSON,
mixed gRPC contents, the classification extension, and unserved routes. Each case a client can
send, the endpoint answers clearly and keeps serving; ``test_endpoint_vs_triton.py`` checks the
same requests against the bundled Triton server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from pipelines import Pipeline, TensorSpec, step
from pipelines.endpoint import LocalServer
from pipelines.endpoint.local_endpoint import DEFAULT_MAX_INPUT_SIZE
from pipelines.errors import ServerError

VECTOR = TensorSpec("FP32", [-1])


@step(inputs={"x": VECTOR}, outputs={"y": VECTOR, "n": TensorSpec("INT32", [-1])})
def scale(x):
    return {"y": x * 1, "n": (np.where(np.isfinite(x), x, 0) * 10).astype(np.int32)}


def scaling(name="flt", max_batch_size=4):
    p = Pipeline(name, inputs={"x": VECTOR}, max_batch_size=max_batch_size)
    s = p.add(scale, x=p.input("x"))
    p.output("y", s["y"])
    p.output("n", s["n"])
    return p


@pytest.fixture(scope="module")
def server():
    with LocalServer(scaling(), modes=("bls", "ensemble"), http_max_input_size=1 << 20) as s:
        yield s


def post(url, path, body=None, *, raw=None, headers=None, method="POST"):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"http://{url}{path}", data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def binary_request(x, **parameters):
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes, **parameters}}]}).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def x_json(data, shape=(1, 2)):
    return {"inputs": [{"name": "x", "shape": list(shape), "datatype": "FP32", "data": data}]}


# ------------------------------------------------------------------ the body-size limit


def test_the_default_limit_is_tritons_64_mib():
    assert DEFAULT_MAX_INPUT_SIZE == 64 * 2**20
    assert LocalServer(scaling()).http_max_input_size == DEFAULT_MAX_INPUT_SIZE
    for bad in (0, -1, True, 1.5, "64MB"):
        with pytest.raises(ServerError, match=r"http_max_input_size .* bytes >= 1"):
            LocalServer(scaling(), http_max_input_size=bad)


def test_an_oversized_request_is_refused_naming_both_sizes_and_the_flag_and_serving_goes_on(server):
    x = np.ones((1, 300_000), np.float32)  # 1.2 MB of binary data, past the 1 MiB limit
    body, headers = binary_request(x)
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=body, headers=headers)
    assert status == 400
    error = json.loads(answer)["error"]
    assert f"request body of {len(body)} bytes exceeds the maximum allowed value of {1 << 20} bytes" in error
    assert "--http-max-input-size" in error and "http_max_input_size" in error
    # tritonclient sees the same words, and the next request is answered
    client = th.InferenceServerClient(server.http_url)
    try:
        tensor = th.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="exceeds the maximum allowed value"):
            client.infer("flt_bls", [tensor])
        small = np.arange(4, dtype=np.float32)[None]
        tensor = th.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(small)
        np.testing.assert_array_equal(client.infer("flt_bls", [tensor]).as_numpy("y"), small)
    finally:
        client.close()


def test_a_chunked_body_past_the_limit_is_refused_too(server):
    import http.client

    host, port = server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        chunks = (b'{"inputs": [' + b" " * 100_000 for _ in range(12))  # 1.2 MB, no Content-Length
        connection.request("POST", "/v2/models/flt_bls/infer", body=chunks, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 400
        assert f"more than {1 << 20} bytes" in json.loads(response.read())["error"]
    finally:
        connection.close()


def test_a_body_just_under_the_limit_is_answered(server):
    x = np.arange(260_000, dtype=np.float32)[None]  # 1,040,000 bytes and a short header: under 1 MiB
    body, headers = binary_request(x)
    assert len(body) < 1 << 20
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=body, headers=headers)
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["shape"] == [1, 260_000]


def test_binary_inputs_are_views_of_the_request_body_not_copies():
    from pipelines.endpoint.wire import array_from_bytes

    body = np.zeros(4096 + 64, np.uint8)
    view = memoryview(body)[64:]
    x = array_from_bytes("x", "FP32", [1, 1024], view, model="m")
    assert np.shares_memory(x, body) and x.flags.aligned
    odd = array_from_bytes("x", "FP32", [1, 1023], memoryview(body)[65:65 + 4092], model="m")
    assert odd.flags.aligned and not np.shares_memory(odd, body)  # misaligned: copied, so numpy runs at speed


# ------------------------------------------------------------------ stopping while requests run


_SLOW_STARTED = threading.Event()


@step(inputs={"x": TensorSpec("FP32", [1])}, outputs={"y": TensorSpec("FP32", [1])})
def slow_step(x):
    _SLOW_STARTED.set()
    time.sleep(1.5)
    return {"y": x + 1}


@step(inputs={"x": TensorSpec("FP32", [1])}, outputs={"y": TensorSpec("FP32", [1])})
async def slow_async_step(x):
    import anyio

    _SLOW_STARTED.set()
    await anyio.sleep(1.5)
    return {"y": x + 1}


def slow_pipeline(step_=slow_step):
    p = Pipeline("slow", inputs={"x": TensorSpec("FP32", [1])}, max_batch_size=4)
    p.output("y", p.add(step_, x=p.input("x"))["y"])
    return p


def _http_ask(url, model="slow_bls"):
    client = th.InferenceServerClient(url, network_timeout=30)
    try:
        tensor = th.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
        return client.infer(model, [tensor]).as_numpy("y")
    finally:
        client.close()


def _grpc_ask(url, model="slow_bls"):
    client = tg.InferenceServerClient(url)
    try:
        tensor = tg.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
        return client.infer(model, [tensor], client_timeout=30).as_numpy("y")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stop_lets_a_slow_request_in_flight_finish(protocol):
    ask = _http_ask if protocol == "http" else _grpc_ask
    server = LocalServer(slow_pipeline(), modes=("bls",)).start()
    url = server.http_url if protocol == "http" else server.grpc_url
    _SLOW_STARTED.clear()
    with ThreadPoolExecutor(2) as pool:
        pending = pool.submit(ask, url)
        assert _SLOW_STARTED.wait(30)  # inside the 1.5 s step now
        stopping = pool.submit(server.stop)
        stopping.result(timeout=30)
        # stop did not cut the request in flight: its answer comes, whole (a cut one is an
        # error); the client may read it a moment after stop returns, so no ordering is asked
        np.testing.assert_array_equal(pending.result(timeout=30), [[2.0]])
    assert not server.running


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_while_stopping_new_requests_are_refused_and_the_one_in_flight_finishes(protocol):
    # an async step leaves the endpoint's loop free while it runs, so the stop is under way meanwhile
    ask = _http_ask if protocol == "http" else _grpc_ask
    server = LocalServer(slow_pipeline(slow_async_step), modes=("bls",)).start()
    url = server.http_url if protocol == "http" else server.grpc_url
    _SLOW_STARTED.clear()
    with ThreadPoolExecutor(2) as pool:
        pending = pool.submit(ask, url)
        assert _SLOW_STARTED.wait(30)
        time.sleep(0.2)
        stopping = pool.submit(server.stop)
        time.sleep(0.3)
        assert not pending.done()
        with pytest.raises(Exception):  # noqa: B017 - refused: HTTP's listener is closed; gRPC answers UNAVAILABLE
            ask(url)
        assert not pending.done()  # refused at once, while the one in flight still runs: not served after it
        np.testing.assert_array_equal(pending.result(timeout=30), [[2.0]])
        stopping.result(timeout=30)
    assert not server.running


def _serve_local(script, cwd, *args):
    """``pipelines serve --local script:pipeline`` in a process of its own; the process and its two URLs."""
    # SIGINT as a shell gives it to a foreground process, set in the child's Python rather than by
    # preexec_fn: a fork in a process that serves gRPC (this module's endpoint) may hand the child
    # gRPC's descriptors, and its own server then fails on them.
    prologue = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from pipelines.cli import main"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{prologue}; sys.exit(main())", "serve", "--local", f"{script}:pipeline", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )
    lines = []
    while not lines or not lines[-1].startswith("ready"):
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"exited before ready: {proc.stderr.read()}")
        lines.append(line)
    http_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("HTTP"))
    grpc_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("gRPC"))
    return proc, http_url, grpc_url


def _rss_kib(pid):
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return int(status["VmRSS"].split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_memory_returns_to_its_baseline_after_large_requests_over_both_protocols(tmp_path):
    script = tmp_path / "reduce.py"
    script.write_text(
        "from pipelines import Pipeline, TensorSpec, step\n"
        "@step(inputs={'x': TensorSpec('FP32', [-1])}, outputs={'total': TensorSpec('FP32', [1])})\n"
        "def total(x):\n"
        "    return {'total': x.sum(axis=1, keepdims=True)}\n"
        "pipeline = Pipeline('reduce', inputs={'x': TensorSpec('FP32', [-1])}, max_batch_size=1)\n"
        "pipeline.output('total', pipeline.add(total, x=pipeline.input('x'))['total'])\n"
    )
    proc, http_url, grpc_url = _serve_local(script, tmp_path, "--http-max-input-size", str(65 << 20))
    try:
        clients = {"http": (th, http_url), "grpc": (tg, grpc_url)}

        def ask(protocol, x):
            module, url = clients[protocol]
            client = module.InferenceServerClient(url)
            try:
                tensor = module.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                return client.infer("reduce_bls", [tensor]).as_numpy("total")
            finally:
                client.close()

        for protocol in clients:  # warm: the first request's imports and pools
            ask(protocol, np.ones((1, 16), np.float32))
        baseline = _rss_kib(proc.pid)
        large = np.ones((1, (64 << 20) // 4), np.float32)  # 64 MiB
        for protocol in clients:
            for _ in range(3):
                np.testing.assert_array_equal(ask(protocol, large), [[large.shape[1]]])
        # The endpoint hands the freed memory back a moment after a large call (malloc_trim, 0.05 s
        # and 1 s later); without one heap, gRPC's threads kept 90 to 160 MB of 3 x 100 MiB for good.
        deadline = time.monotonic() + 20
        while (kept_mib := (_rss_kib(proc.pid) - baseline) / 1024) >= 24 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kept_mib < 24, f"the endpoint kept {kept_mib:.0f} MiB after six 64 MiB requests"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_lets_requests_in_flight_finish_over_both_protocols(tmp_path, stop):
    script = tmp_path / "slow.py"
    script.write_text(
        "import time, uuid, pathlib\n"
        "from pipelines import Pipeline, TensorSpec, step\n"
        "@step(inputs={'x': TensorSpec('FP32', [1])}, outputs={'y': TensorSpec('FP32', [1])}, instance_count=2)\n"
        "def slow_step(x):\n"
        "    pathlib.Path(f'started-{uuid.uuid4().hex}').touch()  # the test's barrier: this call is in flight\n"
        "    time.sleep(1.5)\n"
        "    return {'y': x + 1}\n"
        "pipeline = Pipeline('slow', inputs={'x': TensorSpec('FP32', [1])}, max_batch_size=4)\n"
        "pipeline.output('y', pipeline.add(slow_step, x=pipeline.input('x'))['y'])\n"
    )
    proc, http_url, grpc_url = _serve_local(script, tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            over_http = pool.submit(_http_ask, http_url)
            over_grpc = pool.submit(_grpc_ask, grpc_url)
            deadline = time.monotonic() + 30
            while len(list(tmp_path.glob("started-*"))) < 2:  # both inside the 1.5 s step, one instance each
                assert time.monotonic() < deadline, "the two requests never reached the step"
                time.sleep(0.01)
            proc.send_signal(stop)
            np.testing.assert_array_equal(over_http.result(timeout=30), [[2.0]])
            np.testing.assert_array_equal(over_grpc.result(timeout=30), [[2.0]])
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ------------------------------------------------------------------ JSON a client should not send


def test_json_true_is_no_fp32_value(server):
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", x_json([True, 2.0]))
    assert status == 500  # Triton's status for data it cannot parse
    error = json.loads(answer)["error"]
    assert "input 'x'" in error and "FP32 takes JSON integer or number elements; got true/false" in error


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_nan_and_infinity_are_refused_in_json_input(server, literal):
    raw = b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[' + literal + b',1]}]}'
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=raw)
    assert status == 500
    error = json.loads(answer)["error"]
    assert ("is not valid JSON" in error) if literal != b"1e999" else ("too large to be stored in a double" in error)


def test_an_output_holding_nan_is_never_written_as_invalid_json(server):
    x = np.array([[np.nan, 1.0]], np.float32)
    body, headers = binary_request(x)
    header_length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:header_length])
    header["outputs"] = [{"name": "y", "parameters": {"binary_data": False}}]
    text = json.dumps(header).encode()
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=text + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(text))})
    assert status == 400
    error = json.loads(answer)["error"]  # the answer itself parses as strict JSON
    assert "output 'y' holds nan" in error and "binary_data" in error
    # asked as binary data, the NaN comes back as it is
    header["outputs"] = [{"name": "y", "parameters": {"binary_data": True}}]
    text = json.dumps(header).encode()
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=text + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(text))})
    assert status == 200
    assert np.isnan(np.frombuffer(answer[-8:], np.float32)[0])


@pytest.mark.parametrize("size", [True, "8", 8.0, -8])
def test_binary_data_size_must_be_a_whole_number(server, size):
    body, headers = binary_request(np.ones((1, 2), np.float32), binary_data_size=size)
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", raw=body, headers=headers)
    assert status == 500
    error = json.loads(answer)["error"]
    assert "Unable to parse 'binary_data_size' of input 'x'" in error and json.dumps(size) in error


def test_an_output_asked_twice_is_answered_once_as_triton_answers_it(server):
    body = {**x_json([1.0, 2.0]), "outputs": [{"name": "y"}, {"name": "y"}]}
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", body)
    assert status == 200
    assert [o["name"] for o in json.loads(answer)["outputs"]] == ["y"]


# ------------------------------------------------------------------ routes and versions


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v2/nope", 404), ("GET", "/", 404), ("GET", "/v2/models/flt_bls/versions/x", 404),
    ("POST", "/v2/health/live", 405),
])
def test_an_unserved_route_answers_json(server, method, path, status):
    got, answer = post(server.http_url, path, method=method, raw=b"" if method == "POST" else None)
    assert got == status
    error = json.loads(answer)["error"]
    assert error.startswith("Not Found" if status == 404 else "Method Not Allowed")
    assert path in error


def test_a_wrong_version_is_named(server):
    status, answer = post(server.http_url, "/v2/models/flt_bls/versions/2/infer", x_json([1.0, 2.0]))
    assert status == 404
    assert "'flt_bls' version 2 is not found" in json.loads(answer)["error"]
    status, answer = post(server.http_url, "/v2/models/flt_bls/versions/2/stats", method="GET")
    assert status == 400 and "version 2" in json.loads(answer)["error"]
    client = tg.InferenceServerClient(server.grpc_url)
    try:
        for version, words in (("2", "version 2 is not found"), ("x", "version string 'x'")):
            with pytest.raises(InferenceServerException, match=words):
                client.get_model_metadata("flt_bls", version)
    finally:
        client.close()


# ------------------------------------------------------------------ gRPC


def _grpc_request(x, *, raw=True, typed=False):
    request = pb.ModelInferRequest(model_name="flt_bls")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    if raw:
        request.raw_input_contents.append(x.tobytes())
    if typed:
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return request


def _grpc_call(url, request):
    with grpc.insecure_channel(url) as channel:
        return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def test_raw_and_typed_contents_together_are_refused(server):
    x = np.ones((1, 2), np.float32)
    with pytest.raises(grpc.RpcError) as err:
        _grpc_call(server.grpc_url, _grpc_request(x, raw=True, typed=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "contents field must not be specified when using raw_input_contents for 'x'" in err.value.details()
    for raw, typed in ((True, False), (False, True)):  # either one alone is answered
        response = _grpc_call(server.grpc_url, _grpc_request(x, raw=raw, typed=typed))
        assert [o.name for o in response.outputs] == ["y", "n"]


# ------------------------------------------------------------------ the classification extension


def test_class_count_answers_top_k_value_index_strings_over_both_protocols(server):
    x = np.array([[0.5, 0.25, 0.125], [3, 1.5, 2]], np.float32)
    expected_y = [[b"0.500000:0", b"0.250000:1"], [b"3.000000:0", b"2.000000:2"]]
    expected_n = [[b"5:0", b"2:1"], [b"30:0", b"20:2"]]
    http = th.InferenceServerClient(server.http_url)
    grpc_client = tg.InferenceServerClient(server.grpc_url)
    try:
        for module, client in ((th, http), (tg, grpc_client)):
            tensor = module.InferInput("x", [2, 3], "FP32")
            tensor.set_data_from_numpy(x)
            outputs = [module.InferRequestedOutput("y", class_count=2), module.InferRequestedOutput("n", class_count=2)]
            result = client.infer("flt_bls", [tensor], outputs=outputs)
            assert result.as_numpy("y").tolist() == expected_y
            assert result.as_numpy("n").tolist() == expected_n
        # k past the row's size is the row's size; class_count=0 asks for the tensor itself
        body = {**x_json([1.0, 2.0, 3.0], shape=(1, 3)), "outputs": [
            {"name": "y", "parameters": {"classification": 5}}, {"name": "n", "parameters": {"classification": 0}}]}
        status, answer = post(server.http_url, "/v2/models/flt_ensemble/infer", body)
        y, n = json.loads(answer)["outputs"]
        assert (y["datatype"], y["shape"], y["data"]) == ("BYTES", [1, 3], ["3.000000:2", "2.000000:1", "1.000000:0"])
        assert (n["datatype"], n["data"]) == ("INT32", [10, 20, 30])
    finally:
        http.close()
        grpc_client.close()


def test_class_count_on_a_model_without_batching_ranks_the_whole_tensor():
    with LocalServer(scaling("flat", max_batch_size=0), modes=("bls",), grpc_port=False) as flat:
        body = {**x_json([0.5, 0.25, 2.125], shape=(3,)), "outputs": [{"name": "y", "parameters": {"classification": 2}}]}
        status, answer = post(flat.http_url, "/v2/models/flat_bls/infer", body)
    (y,) = json.loads(answer)["outputs"]
    assert status == 200 and y["shape"] == [2] and y["data"] == ["2.125000:2", "0.500000:0"]


@pytest.mark.parametrize("count", [True, -1, "2", 1.5])
def test_a_class_count_that_is_no_whole_number_is_refused(server, count):
    body = {**x_json([1.0, 2.0]), "outputs": [{"name": "y", "parameters": {"classification": count}}]}
    status, answer = post(server.http_url, "/v2/models/flt_bls/infer", body)
    assert status == 500
    assert "Unable to set 'classification' of output 'y'" in json.loads(answer)["error"]


def test_class_count_on_a_non_numeric_output_is_refused_on_both_protocols():
    from pipelines.examples import text

    with LocalServer(text.pipeline, modes=("bls",)) as s:
        inputs = text.sample_inputs(1)
        for module, url in ((th, s.http_url), (tg, s.grpc_url)):
            client = module.InferenceServerClient(url)
            try:
                tensors = []
                for name, array in inputs.items():
                    tensor = module.InferInput(name, list(array.shape), "BYTES" if name == "text" else "INT64")
                    tensor.set_data_from_numpy(array)
                    tensors.append(tensor)
                for output, datatype in (("loud", "BYTES"), ("long", "BOOL")):
                    with pytest.raises(InferenceServerException,
                                       match=f"class result not available for output due to unsupported type "
                                             f"'{datatype}'"):
                        client.infer("text_bls", tensors, outputs=[module.InferRequestedOutput(output, class_count=1)])
                assert "classification" in (client.get_server_metadata()["extensions"] if module is th
                                            else client.get_server_metadata().extensions)
            finally:
                client.close()
