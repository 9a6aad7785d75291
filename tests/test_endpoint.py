"""tritonclient, unchanged, against the local endpoint: `pipelines serve --local` and LocalServer.

The answers must equal ``p.run`` in every mode, over HTTP (binary and JSON) and gRPC, for the
yolov5 example and a text pipeline with BYTES, BOOL and INT64 outputs, at batch 1 and 8.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
import tritonclient.http.aio as tha
from tritonclient.utils import InferenceServerException

from pipelines import Pipeline, TensorSpec, step
from pipelines.endpoint import LocalServer
from pipelines.errors import InferenceError, ServerError
from pipelines.examples import text, yolov5
from pipelines.examples.basic import make_chain
from pipelines.forms import FORMS
from pipelines.triton.payloads import message_to_dict

MODES = {name: f.suffix for name, f in FORMS.items()}  # every form the endpoint serves
TEXT = text.pipeline


@pytest.fixture(scope="module")
def text_server():
    with LocalServer(TEXT) as server:
        yield server


@pytest.fixture(scope="module")
def yolo_server():
    with LocalServer(yolov5.pipeline, modes=("ensemble", "bls")) as server:
        yield server


def http_infer(url, model, inputs, *, binary=True, outputs=None, binary_outputs=True):
    client = th.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            t = th.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else _dt(array))
            t.set_data_from_numpy(array, binary_data=binary)
            tensors.append(t)
        wanted = None if outputs is None else [th.InferRequestedOutput(n, binary_data=binary_outputs) for n in outputs]
        result = client.infer(model, tensors, outputs=wanted)
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}, result.get_response()
    finally:
        client.close()


def grpc_infer(url, model, inputs, *, outputs=None):
    client = tg.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            t = tg.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else _dt(array))
            t.set_data_from_numpy(array)
            tensors.append(t)
        wanted = None if outputs is None else [tg.InferRequestedOutput(n) for n in outputs]
        result = client.infer(model, tensors, outputs=wanted)
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    finally:
        client.close()


def _dt(array):
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def assert_same(got, expected):
    assert set(got) == set(expected)
    for name, value in expected.items():
        value = np.asarray(value)
        assert got[name].shape == value.shape, name
        if value.dtype == object:
            # JSON carries BYTES as text: tritonclient gives str there, bytes in binary
            assert [v if isinstance(v, bytes) else v.encode() for v in got[name].ravel()] == list(value.ravel()), name
        else:
            assert got[name].dtype == value.dtype, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)


# ------------------------------------------------------------------ the text pipeline (BYTES, BOOL, INT64)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_http_binary_and_json_answers_equal_p_run(text_server, mode, batch):
    inputs = text.sample_inputs(batch)
    expected = TEXT.run(inputs, mode=mode)
    model = "text" + MODES[mode]
    for binary in (True, False):
        got, response = http_infer(text_server.http_url, model, inputs, binary=binary, outputs=list(TEXT.outputs),
                                   binary_outputs=binary)
        assert_same(got, expected)
        assert response["model_name"] == model
        assert all(("data" in o) != binary for o in response["outputs"])


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_grpc_answers_equal_p_run(text_server, mode, batch):
    inputs = text.sample_inputs(batch)
    assert_same(grpc_infer(text_server.grpc_url, "text" + MODES[mode], inputs), TEXT.run(inputs, mode=mode))


def test_a_subset_of_outputs_over_both_protocols(text_server):
    inputs = text.sample_inputs(3)
    full = TEXT.run(inputs)
    for subset in (["long"], ["loud", "lengths"], ["lengths"]):
        expected = {n: full[n] for n in subset}
        got, _ = http_infer(text_server.http_url, "text_ensemble", inputs, outputs=subset)
        assert_same(got, expected)
        got, _ = http_infer(text_server.http_url, "text_bls", inputs, outputs=subset, binary_outputs=False)
        assert_same(got, expected)
        assert_same(grpc_infer(text_server.grpc_url, "text_bls_sync", inputs, outputs=subset), expected)


def test_binary_data_output_asks_every_output_in_binary(text_server):
    inputs = text.sample_inputs(2)
    header = {
        "inputs": [
            {"name": "text", "shape": [2, 3], "datatype": "BYTES", "data": [w.decode() for w in inputs["text"].ravel()]},
            {"name": "count", "shape": [2, 1], "datatype": "INT64", "data": [[1], [2]]},  # nested data is allowed
        ],
        "outputs": [{"name": "long", "parameters": {"binary_data": False}}, {"name": "lengths"}],
        "parameters": {"binary_data_output": True},
        "id": "req-7",
    }
    request = urllib.request.Request(f"http://{text_server.http_url}/v2/models/text_ensemble/infer",
                                     data=json.dumps(header).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        body, length = r.read(), int(r.headers["Inference-Header-Content-Length"])
    answer = json.loads(body[:length])
    assert answer["id"] == "req-7" and answer["model_name"] == "text_ensemble" and answer["model_version"] == "1"
    long_, lengths = answer["outputs"]
    expected = TEXT.run(inputs)
    assert long_["data"] == expected["long"].ravel().tolist()  # its own binary_data: false wins
    assert lengths["parameters"]["binary_data_size"] == 48 and len(body) == length + 48
    np.testing.assert_array_equal(np.frombuffer(body[length:], "<i8").reshape(2, 3), expected["lengths"])


def test_metadata_config_readiness_and_statistics(text_server):
    client = th.InferenceServerClient(text_server.http_url)
    grpc_client = tg.InferenceServerClient(text_server.grpc_url)
    assert client.is_server_live() and client.is_server_ready() and grpc_client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    repo = TEXT.compile("all")
    for mode, suffix in MODES.items():
        model = "text" + suffix
        assert client.is_model_ready(model) and grpc_client.is_model_ready(model)
        meta = client.get_model_metadata(model)
        assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, -1]},
                                  {"name": "count", "datatype": "INT64", "shape": [-1, 1]}]
        assert [o["datatype"] for o in meta["outputs"]] == ["BYTES", "INT64", "BOOL"]
        assert meta["platform"] == ("ensemble" if mode == "ensemble" else "python")
        assert message_to_dict(grpc_client.get_model_metadata(model)) == meta
        # the config the compiler writes, over both protocols
        assert grpc_client.get_model_config(model).config == repo[model].config
        assert client.get_model_config(model) == message_to_dict(repo[model].config, skip_unset_messages=True)
    assert not client.is_model_ready("nope") and not grpc_client.is_model_ready("text_ensemble", "2")
    assert [m["name"] for m in client.get_model_repository_index()] == sorted("text" + s for s in MODES.values())

    before = client.get_inference_statistics("text_bls")["model_stats"][0]
    http_infer(text_server.http_url, "text_bls", text.sample_inputs(8))
    grpc_infer(text_server.grpc_url, "text_bls", text.sample_inputs(1))
    with pytest.raises(InferenceServerException):
        http_infer(text_server.http_url, "text_bls", {**text.sample_inputs(1), "count": np.array([[-5]])})
    after = message_to_dict(grpc_client.get_inference_statistics("text_bls"))["model_stats"][0]
    assert after["name"] == "text_bls" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 9
    assert after["execution_count"] - before["execution_count"] == 2
    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 2
    assert stats["fail"]["count"] - old["fail"]["count"] == 1
    assert stats["compute_infer"]["ns"] > old["compute_infer"]["ns"]
    assert {b["batch_size"] for b in after["batch_stats"]} >= {1, 8}
    assert after["last_inference"] >= before["last_inference"] > 0 or after["last_inference"] > 0
    everything = {m["name"]: m for m in client.get_inference_statistics()["model_stats"]}
    # the composing step models too, as a server lists them: one per step, shared by the forms
    assert list(everything) == sorted("text" + s for s in MODES.values()) + ["text__measure", "text__shout"]
    shout = client.get_inference_statistics("text__shout")["model_stats"][0]
    assert shout["inference_count"] >= 2 and shout["execution_count"] >= 1
    assert shout["inference_stats"]["compute_infer"]["ns"] > 0
    assert text_server.report("text_bls").requests >= 2  # the runtime's own per-step report is there too
    client.close()
    grpc_client.close()


def test_the_library_client_names_the_failing_step(text_server):
    client = text_server.client("grpc")
    try:
        out = client.infer("text_ensemble", text.sample_inputs(2), outputs=["loud"])
        assert list(out) == ["loud"]
        with pytest.raises(InferenceError) as err:
            client.infer("text_ensemble", {**text.sample_inputs(1), "count": np.array([[-3]])})
        assert err.value.step == "measure" and "count -3 is negative" in str(err.value)
    finally:
        client.close()


def test_raw_binary_request_without_a_json_header():
    chain = make_chain(name="rawchain")
    x = np.arange(4, dtype=np.float32)
    with LocalServer(chain, modes=("ensemble",), grpc_port=False) as server:
        request = urllib.request.Request(
            f"http://{server.http_url}/v2/models/rawchain_ensemble/infer", data=x.tobytes(),
            headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(request) as r:
            body, length = r.read(), int(r.headers["Inference-Header-Content-Length"])
        (out,) = json.loads(body[:length])["outputs"]
        assert out["shape"] == [1, 4] and out["parameters"]["binary_data_size"] == 16
        np.testing.assert_array_equal(np.frombuffer(body[length:], np.float32)[None], chain.run({"x": x[None]})["y"])
        with pytest.raises(ServerError, match="HTTP only"):
            _ = server.grpc_url


# ------------------------------------------------------------------ the yolov5 example


def test_yolov5_over_http_and_grpc_at_batch_1_and_8(yolo_server):
    samples = [yolov5.make_sample(seed, n_objects=3) for seed in range(8)]
    one = {"image": samples[0]["image"][None]}
    eight = {"image": np.stack([s["image"] for s in samples])}
    for inputs in (one, eight):
        for mode in ("ensemble", "bls"):
            expected = yolov5.pipeline.run(inputs, mode=mode)
            got, _ = http_infer(yolo_server.http_url, "yolov5" + MODES[mode], inputs)
            assert_same(got, expected)
            assert_same(grpc_infer(yolo_server.grpc_url, "yolov5" + MODES[mode], inputs), expected)
    got, _ = http_infer(yolo_server.http_url, "yolov5_ensemble", one, binary=False, binary_outputs=False,
                        outputs=["detections"])
    np.testing.assert_allclose(got["detections"], yolov5.pipeline.run(one)["detections"], rtol=1e-6)


# ------------------------------------------------------------------ many clients at once


def _bad_request(i):
    """One of three kinds of malformed request, each unique to ``i`` so its error can be told apart."""
    good = text.sample_inputs(1)
    kind = i % 3
    if kind == 0:  # the step refuses it, naming the value
        return {**good, "count": np.array([[-1 - i]], np.int64)}, f"count {-1 - i} is negative"
    if kind == 1:  # a wrong dim, different for each request
        return {**good, "count": np.zeros((1, i + 2), np.int64)}, f"given [1, {i + 2}]"
    return {"text": good["text"], f"extra_{i}": good["count"]}, f"got input 'extra_{i}'"


def test_200_concurrent_requests_a_third_malformed(text_server):
    async def one(i, http, grpc_):
        bad = i % 3 == 0
        if bad:
            inputs, needle = _bad_request(i // 3)
        else:
            inputs, needle = text.sample_inputs(1 + i % 8), None
            inputs["count"] = inputs["count"] + i
        mode = list(MODES)[i % 3]
        use_http = i % 2 == 0
        module, client = (tha, http) if use_http else (tga, grpc_)
        tensors = []
        for name, array in inputs.items():
            t = module.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else _dt(array))
            t.set_data_from_numpy(array)
            tensors.append(t)
        try:
            result = await client.infer("text" + MODES[mode], tensors)
        except InferenceServerException as exc:
            return i, inputs, mode, None, exc, needle
        return i, inputs, mode, {n: result.as_numpy(n) for n in TEXT.outputs}, None, needle

    async def main():
        http = tha.InferenceServerClient(text_server.http_url, conn_limit=200)
        grpc_ = tga.InferenceServerClient(text_server.grpc_url)
        try:
            return await asyncio.gather(*(one(i, http, grpc_) for i in range(200)))
        finally:
            await http.close()
            await grpc_.close()

    results = asyncio.run(main())
    bad = [r for r in results if r[5] is not None]
    assert len(bad) == 67
    for i, inputs, mode, answer, error, needle in results:
        if needle is None:
            assert error is None, (i, error)
            assert_same(answer, TEXT.run(inputs, mode=mode))
        else:
            assert answer is None, i
            assert needle in error.message(), (i, error.message())
            step_error = needle.startswith("count")
            assert error.status() in (("500", "StatusCode.INTERNAL") if step_error else ("400", "StatusCode.INVALID_ARGUMENT"))


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_local_prints_its_urls_and_stops_on_a_signal(tmp_path, stop):
    # Ctrl-C as a terminal gives it, whether or not the tests' own shell ignores it (a background
    # job), set in the child's Python: a fork with preexec_fn of this process, which serves gRPC,
    # handed the child gRPC's descriptors once, and it died before it was ready ("epoll_wait
    # error: Bad file descriptor"; tests/test_endpoint_hostile.py)
    prologue = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from pipelines.cli import main"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{prologue}; sys.exit(main())", "serve", "--local", "pipelines.examples.text:pipeline"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        lines = []
        while not lines or not lines[-1].startswith("ready"):
            line = proc.stdout.readline()
            assert line, f"exited before ready: {proc.stderr.read()}"
            lines.append(line)
        http_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("HTTP"))
        grpc_url = next(ln.split()[1] for ln in lines if ln.strip().startswith("gRPC"))
        inputs = text.sample_inputs(2)
        assert_same(grpc_infer(grpc_url, "text_bls", inputs), TEXT.run(inputs, mode="bls"))
        got, _ = http_infer(http_url, "text_ensemble", inputs)
        assert_same(got, TEXT.run(inputs))
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
        assert "stopping" in proc.stdout.read()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_port_in_use_is_a_clear_error(text_server):
    from pipelines.errors import ServerStartError

    port = int(text_server.http_url.rsplit(":", 1)[1])
    with pytest.raises(ServerStartError, match=f"cannot listen for HTTP on 127.0.0.1:{port}"):
        LocalServer(TEXT, http_port=port).start()


_STARTED = __import__("threading").Event()


@step(inputs={"x": TensorSpec("FP32", [1])}, outputs={"y": TensorSpec("FP32", [1])})
def slow_step(x):
    _STARTED.set()
    time.sleep(0.5)
    return {"y": x + 1}


def test_stop_lets_requests_in_flight_finish():
    p = Pipeline("slow", inputs={"x": TensorSpec("FP32", [1])}, max_batch_size=4)
    p.output("y", p.add(slow_step, x=p.input("x"))["y"])
    server = LocalServer(p, modes=("ensemble",)).start()
    url = server.http_url
    with ThreadPoolExecutor(2) as pool:
        pending = pool.submit(http_infer, url, "slow_ensemble", {"x": np.ones((1, 1), np.float32)})
        assert _STARTED.wait(30)  # the request is inside the step now
        stopping = pool.submit(server.stop)
        got, _ = pending.result(timeout=30)
        stopping.result(timeout=30)
    np.testing.assert_array_equal(got["y"], [[2.0]])
    assert not server.running
    # its step holds an Event, which no repository can carry: served all the same, with a signature config
    config = server._models["slow_ensemble"].config
    assert "cannot be exported by value" in config.parameters["not_compiled"].string_value
    assert config.platform == "ensemble" and [i.name for i in config.input] == ["x"]
    with pytest.raises(Exception):  # noqa: B017 - nothing listens any more: the connection is refused
        http_infer(url, "slow_ensemble", {"x": np.ones((1, 1), np.float32)})
