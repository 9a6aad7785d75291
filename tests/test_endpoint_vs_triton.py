"""The local endpoint against the bundled real tritonserver: one client, two servers, equal answers;
every bad request refused with the same status over HTTP and gRPC."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from pipelines import Pipeline, TensorSpec, step
from pipelines.endpoint import LocalServer
from pipelines.errors import PipelinesError
from pipelines.examples import text
from pipelines.forms import FORMS
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

P = text.pipeline
MODELS = tuple(f.model_name("text", side_by_side=True) for f in FORMS.values())  # every form


HALF_SPEC = TensorSpec("FP16", [-1])


@step(inputs={"x": HALF_SPEC}, outputs={"h": HALF_SPEC})
def third(x):
    return {"h": (x / 3).astype(np.float16)}


@step(inputs={"x": TensorSpec("FP32", [-1])}, outputs={"y": TensorSpec("FP32", [-1]), "n": TensorSpec("INT32", [-1])})
def scale(x):
    return {"y": x * 1, "n": (x * 10).astype(np.int32)}


def scaling():
    """FP32 and INT32 outputs, for the classification extension's "value:index" strings."""
    p = Pipeline("flt", inputs={"x": TensorSpec("FP32", [-1])}, max_batch_size=4)
    s = p.add(scale, x=p.input("x"))
    p.output("y", s["y"])
    p.output("n", s["n"])
    return p


def half_pipeline():
    """FP16, which Triton's HTTP front end carries only as binary data."""
    p = Pipeline("half", inputs={"x": HALF_SPEC}, max_batch_size=4)
    p.output("h", p.add(third, x=p.input("x"))["h"])
    return p


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repo = tmp_path_factory.mktemp("endpoint") / "model_repository"
    P.compile("all").merge(half_pipeline().compile("all")).merge(scaling().compile("all")).write(repo)
    with TritonServer(repo) as real, LocalServer(P) as local:
        yield {"triton": real, "local": local}


@pytest.fixture(scope="module")
def flt_local():
    with LocalServer(scaling()) as local:
        yield local


@pytest.fixture(scope="module")
def half_local():
    with LocalServer(half_pipeline(), grpc_port=False) as local:
        yield local


def ask(url, protocol, model, inputs, outputs=None, *, binary=True):
    """Client code as a user writes it: tritonclient only, nothing from this library."""
    module = th if protocol == "http" else tg
    client = module.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            tensor = module.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                       else np_to_triton_dtype(array.dtype))
            if protocol == "http":
                tensor.set_data_from_numpy(array, binary_data=binary)
            else:
                tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        if outputs is None:
            wanted = None
        elif protocol == "http":
            wanted = [module.InferRequestedOutput(n, binary_data=binary) for n in outputs]
        else:
            wanted = [module.InferRequestedOutput(n) for n in outputs]
        result = client.infer(model, tensors, outputs=wanted)
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if protocol == "http" else [o.name for o in response.outputs]
        return {name: result.as_numpy(name) for name in names}
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "http-json", "grpc"])
def test_one_client_two_servers_equal_answers(servers, protocol):
    binary = protocol != "http-json"
    protocol = protocol.removesuffix("-json")
    for batch in (1, 8):
        inputs = text.sample_inputs(batch)
        for model in MODELS:
            for outputs in ((None, ["long", "loud"]) if binary else (list(P.outputs), ["lengths"])):
                answers = {}
                for which, server in servers.items():
                    url = server.http_url if protocol == "http" else server.grpc_url
                    answers[which] = ask(url, protocol, model, inputs, outputs, binary=binary)
                real, local = answers["triton"], answers["local"]
                assert set(real) == set(local) == set(outputs or P.outputs)
                for name in real:
                    assert real[name].dtype == local[name].dtype and real[name].shape == local[name].shape
                    assert real[name].tolist() == local[name].tolist(), (model, name)


# ------------------------------------------------------------------ bad requests, raw HTTP


def _good_json():
    return [
        {"name": "text", "shape": [1, 2], "datatype": "BYTES", "data": ["ab", "cdefgh"]},
        {"name": "count", "shape": [1, 1], "datatype": "INT64", "data": [2]},
    ]


def _count(**overrides):
    return [_good_json()[0], {**_good_json()[1], **overrides}]


def _binary_count(extra: bytes):
    header = {"inputs": [_good_json()[0], {"name": "count", "shape": [1, 1], "datatype": "INT64",
                                           "parameters": {"binary_data_size": 8}}]}
    return json.dumps(header).encode(), extra


def _binary_count_sized(size):
    header = {"inputs": [_good_json()[0], {"name": "count", "shape": [1, 1], "datatype": "INT64",
                                           "parameters": {"binary_data_size": size}}]}
    return json.dumps(header).encode(), b"\x01" * 8


# (what is wrong, method, path, body or header dict, binary tail, the tensor the local text must name)
HTTP_CASES = [
    ("unknown model", "POST", "/v2/models/nope/infer", {"inputs": _good_json()}, b"", None),
    ("metadata of unknown model", "GET", "/v2/models/nope", None, b"", None),
    ("config of unknown model", "GET", "/v2/models/nope/config", None, b"", None),
    ("ready of unknown model", "GET", "/v2/models/nope/ready", None, b"", None),
    ("unknown version", "GET", "/v2/models/text_bls/versions/2/ready", None, b"", None),
    ("missing input", "POST", "/v2/models/text_ensemble/infer", {"inputs": _good_json()[:1]}, b"", "count"),
    ("extra input", "POST", "/v2/models/text_bls/infer",
     {"inputs": _good_json() + [{"name": "extra", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}, b"", "extra"),
    ("input given twice", "POST", "/v2/models/text_ensemble/infer", {"inputs": _good_json() + _good_json()[1:]}, b"",
     "count"),
    ("wrong datatype", "POST", "/v2/models/text_ensemble/infer", {"inputs": _count(datatype="FP32")}, b"", "count"),
    ("unknown datatype", "POST", "/v2/models/text_ensemble/infer", {"inputs": _count(datatype="WAT")}, b"", "count"),
    ("wrong dims", "POST", "/v2/models/text_bls_sync/infer", {"inputs": _count(shape=[1, 2], data=[1, 2])}, b"",
     "count"),
    ("batch too large", "POST", "/v2/models/text_ensemble/infer",
     {"inputs": [{"name": "text", "shape": [9, 1], "datatype": "BYTES", "data": ["a"] * 9},
                 {"name": "count", "shape": [9, 1], "datatype": "INT64", "data": [1] * 9}]}, b"", "text"),
    ("unknown output", "POST", "/v2/models/text_ensemble/infer",
     {"inputs": _good_json(), "outputs": [{"name": "nope"}]}, b"", "nope"),
    ("binary data too short", "POST", "/v2/models/text_ensemble/infer", *_binary_count(b"\x01" * 7), "count"),
    ("binary data left over", "POST", "/v2/models/text_ensemble/infer", *_binary_count(b"\x01" * 10), None),
    ("not JSON", "POST", "/v2/models/text_ensemble/infer", b"{not json", b"", None),
    ("JSON that is not a request", "POST", "/v2/models/text_ensemble/infer", b"[1, 2]", b"", None),
    ("data that does not fit its shape", "POST", "/v2/models/text_ensemble/infer",
     {"inputs": _count(data=[1, 2])}, b"", "count"),
    ("a step fails (ensemble)", "POST", "/v2/models/text_ensemble/infer", {"inputs": _count(data=[-1])}, b"", None),
    ("a step fails (bls)", "POST", "/v2/models/text_bls/infer", {"inputs": _count(data=[-1])}, b"", None),
    ("a step fails (bls_sync)", "POST", "/v2/models/text_bls_sync/infer", {"inputs": _count(data=[-1])}, b"", None),
    # hostile clients (issue 43)
    ("unserved route", "GET", "/v2/nope", None, b"", None),
    ("unserved route at the root", "GET", "/", None, b"", None),
    ("a version that is no number", "GET", "/v2/models/text_bls/versions/x", None, b"", None),
    ("wrong method", "POST", "/v2/health/live", b"", b"", None),
    ("JSON true as INT64", "POST", "/v2/models/text_ensemble/infer", {"inputs": _count(data=[True])}, b"", "count"),
    ("binary_data_size true", "POST", "/v2/models/text_ensemble/infer", *_binary_count_sized(True), "count"),
    ("binary_data_size a string", "POST", "/v2/models/text_ensemble/infer", *_binary_count_sized("8"), "count"),
    ("unknown version, infer", "POST", "/v2/models/text_bls/versions/2/infer", {"inputs": _good_json()}, b"", None),
    ("unknown version, metadata", "GET", "/v2/models/text_bls/versions/2", None, b"", None),
    ("unknown version, stats", "GET", "/v2/models/text_bls/versions/2/stats", None, b"", None),
    ("class count true", "POST", "/v2/models/text_bls/infer",
     {"inputs": _good_json(), "outputs": [{"name": "lengths", "parameters": {"classification": True}}]}, b"", "lengths"),
    ("class count of a BOOL output", "POST", "/v2/models/text_bls/infer",
     {"inputs": _good_json(), "outputs": [{"name": "long", "parameters": {"classification": 1}}]}, b"", None),
]


def _http(url, method, path, body, tail):
    data = None
    headers = {"Content-Type": "application/json"}
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if tail:
            headers["Inference-Header-Content-Length"] = str(len(data))
        data += tail
    request = urllib.request.Request(f"http://{url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize(("json_in", "json_out"), [(True, False), (False, True), (True, True)])
def test_half_floats_as_json_are_refused_as_the_real_server_refuses_them(servers, half_local, json_in, json_out):
    """Client code that works against the endpoint works against the server: FP16 as JSON fails on both."""
    x = np.array([[1.0, 2.0]], np.float16)
    said = {}
    for which, server in (("triton", servers["triton"]), ("half", half_local)):
        with pytest.raises(InferenceServerException) as caught:
            _half_as(server.http_url, x, json_in, json_out)
        said[which] = (caught.value.status(), caught.value.message())
    assert said["half"] == said["triton"]
    way = "receiving FP16 data via JSON" if json_in else "sending FP16 data via JSON"
    assert said["half"][1].startswith(way), said
    got = ask(half_local.http_url, "http", "half_bls", {"x": x}, ["h"])  # binary data works on both
    np.testing.assert_array_equal(got["h"], ask(servers["triton"].http_url, "http", "half_bls", {"x": x}, ["h"])["h"])


def _half_as(url, x, json_in, json_out):
    client = th.InferenceServerClient(url)
    try:
        tensor = th.InferInput("x", list(x.shape), "FP16")
        tensor.set_data_from_numpy(x, binary_data=not json_in)
        return client.infer("half_bls", [tensor], outputs=[th.InferRequestedOutput("h", binary_data=not json_out)])
    finally:
        client.close()


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_a_bad_http_request_gets_the_real_servers_status(servers, case):
    what, method, path, body, tail, tensor = case
    real_status, _ = _http(servers["triton"].http_url, method, path, body, tail)
    local_status, local_body = _http(servers["local"].http_url, method, path, body, tail)
    assert local_status == real_status, what
    assert real_status >= 400
    error = json.loads(local_body)
    assert list(error) == ["error"] and error["error"]
    if tensor is not None:
        assert f"'{tensor}'" in error["error"] or f" {tensor}" in error["error"], error
    if what in ("unknown version, infer", "unknown version, metadata"):
        assert "'text_bls' version 2 is not found" in error["error"]  # Triton's words, the version named
    if what.startswith("a step fails"):
        assert "step 'measure'" in error["error"] and "count -1 is negative" in error["error"]
        assert error == json.loads(_http(servers["triton"].http_url, method, path, body, tail)[1])


# ------------------------------------------------------------------ bad requests, gRPC


def _grpc_case(kind):
    good = text.sample_inputs(1)
    model, outputs = "text_ensemble", None
    if kind == "unknown model":
        model = "nope"
    elif kind == "missing input":
        good = {"text": good["text"]}
    elif kind == "wrong datatype":
        good["count"] = good["count"].astype(np.float32)
    elif kind == "wrong dims":
        good["count"] = np.zeros((1, 2), np.int64)
    elif kind == "batch too large":
        good = text.sample_inputs(9)
    elif kind == "unknown output":
        outputs = ["nope"]
    elif kind.startswith("a step fails"):
        good["count"] = -good["count"]
        model = kind.split("(")[1].rstrip(")")
    return model, good, outputs


GRPC_CASES = ["unknown model", "missing input", "wrong datatype", "wrong dims", "batch too large", "unknown output",
              "a step fails (text_ensemble)", "a step fails (text_bls)"]


@pytest.mark.parametrize("kind", GRPC_CASES)
def test_a_bad_grpc_request_gets_the_real_servers_status(servers, kind):
    model, inputs, outputs = _grpc_case(kind)
    errors = {}
    for which, server in servers.items():
        with pytest.raises(InferenceServerException) as err:
            ask(server.grpc_url, "grpc", model, inputs, outputs)
        errors[which] = err.value
    assert errors["local"].status() == errors["triton"].status(), (kind, errors)
    if kind.startswith("a step fails"):
        assert "step 'measure'" in errors["local"].message()
        assert errors["local"].message() == errors["triton"].message()  # "in ensemble '...', " included


def test_model_metadata_matches_the_real_server(servers):
    for protocol in ("http", "grpc"):
        answers = {}
        for which, server in servers.items():
            module = th if protocol == "http" else tg
            client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
            answers[which] = [client.get_model_metadata(m, as_json=True) if protocol == "grpc"
                              else client.get_model_metadata(m) for m in MODELS]
            client.close()
        assert answers["local"] == answers["triton"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_library_client_reads_the_same_error_from_both(servers, protocol):
    good = text.sample_inputs(1)
    cases = [
        ("text_ensemble", {**good, "count": np.array([[-4]], np.int64)}),
        ("text_bls_sync", {**good, "count": np.array([[-4]], np.int64)}),
        ("text_bls", {"text": good["text"]}),
        ("text_ensemble", {**good, "count": good["count"].astype(np.float32)}),
    ]
    for model, inputs in cases:
        seen = {}
        for which, server in servers.items():
            client = server.client(protocol)
            try:
                with pytest.raises(PipelinesError) as err:
                    client.infer(model, inputs)
            finally:
                client.close()
            e = err.value
            seen[which] = (type(e).__name__, e.pipeline, getattr(e, "node", None), e.step, e.tensor)
        assert seen["local"] == seen["triton"], (model, seen)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", MODELS)
def test_a_subset_of_outputs_runs_what_its_form_runs_on_both(servers, protocol, model):
    # 'loud' needs only shout: a count that makes measure fail does not matter when 'loud' alone is asked
    # of a BLS model; the ensemble is gated (shout and measure run side by side), so it runs measure
    # all the same and fails the request with its error, on both
    inputs = {**text.sample_inputs(2), "count": np.array([[-1], [-2]], np.int64)}
    answers = {}
    for which, server in servers.items():
        url = server.http_url if protocol == "http" else server.grpc_url
        try:
            answers[which] = ask(url, protocol, model, inputs, ["loud"])["loud"].tolist()
        except InferenceServerException as exc:
            answers[which] = (exc.status(), exc.message())
    assert answers["local"] == answers["triton"], answers


# ------------------------------------------------------------------ hostile clients (issue 43), both servers


def _raw_grpc(url, request):
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        try:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return [(o.name, o.datatype, list(o.shape)) for o in response.outputs], list(response.raw_output_contents)


def _flt_request(model, x, *, classes=(), raw=True, typed=False, version=""):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model, model_version=version)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    if raw:
        request.raw_input_contents.append(x.tobytes())
    if typed:
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    for name, count in classes:
        output = request.outputs.add(name=name)
        if count is not None:
            output.parameters["classification"].int64_param = count
    return request


X = np.array([[0.5, 0.25, 0.125], [3, 1.5, 2]], np.float32)


def _by_name(answer):
    outputs, contents = answer
    return {name: (datatype, shape, raw) for (name, datatype, shape), raw in zip(outputs, contents, strict=True)}


@pytest.mark.parametrize("model", ["flt_bls", "flt_ensemble", "flt_fused"])
def test_class_count_answers_as_the_real_server_over_http_and_grpc(servers, flt_local, model):
    for count in (1, 2, 5):
        # gRPC: the same outputs, datatypes, shapes and bytes ("0.500000:0" ...)
        request = _flt_request(model, X, classes=[("y", count), ("n", count)])
        real, local = (_by_name(_raw_grpc(s.grpc_url, request)) for s in (servers["triton"], flt_local))
        assert local == real, (count, local, real)  # by name: a real ensemble answers in its own order
        # HTTP, JSON and binary outputs
        body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": X.ravel().tolist()}],
                "outputs": [{"name": "y", "parameters": {"classification": count}},
                            {"name": "n", "parameters": {"classification": count, "binary_data": True}}]}
        answers = {}
        for which, url in (("triton", servers["triton"].http_url), ("local", flt_local.http_url)):
            status, raw = _http(url, "POST", f"/v2/models/{model}/infer", body, b"")
            assert status == 200, raw
            answers[which] = raw
        real, local = answers["triton"], answers["local"]
        real_outputs = {o["name"]: o for o in json.loads(real[: real.index(b"}]}") + 3])["outputs"]}
        local_outputs = {o["name"]: o for o in json.loads(local[: local.index(b"}]}") + 3])["outputs"]}
        assert local_outputs == real_outputs
        assert local.endswith(real[-real_outputs["n"]["parameters"]["binary_data_size"]:])


def test_grpc_refusals_match_the_real_server(servers, flt_local):
    cases = {
        "raw and typed contents together": _flt_request("flt_bls", X, raw=True, typed=True),
        "an unknown version": _flt_request("flt_bls", X, version="2"),
        "a version that is no number": _flt_request("flt_bls", X, version="x"),
        "a class count of 0": _flt_request("flt_bls", X, classes=[("y", 0)]),
    }
    for what, request in cases.items():
        real, local = _raw_grpc(servers["triton"].grpc_url, request), _raw_grpc(flt_local.grpc_url, request)
        assert local[0] == real[0], (what, local, real)  # the same status code
    assert "contents field must not be specified when using raw_input_contents for 'x'" in _raw_grpc(
        flt_local.grpc_url, cases["raw and typed contents together"])[1]
    assert "'flt_bls' version 2 is not found" in _raw_grpc(flt_local.grpc_url, cases["an unknown version"])[1]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_asked_twice_is_answered_once_on_both(servers, flt_local, protocol):
    answers = {}
    for which, server in (("triton", servers["triton"]), ("local", flt_local)):
        if protocol == "grpc":
            answers[which] = _raw_grpc(server.grpc_url, _flt_request("flt_bls", X, classes=[("y", None), ("y", None)]))
        else:
            body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": X.ravel().tolist()}],
                    "outputs": [{"name": "y"}, {"name": "y"}]}
            answers[which] = json.loads(_http(server.http_url, "POST", "/v2/models/flt_bls/infer", body, b"")[1])
    assert answers["local"] == answers["triton"]


def test_nan_in_json_is_where_the_endpoint_differs_on_purpose(servers, flt_local):
    """Triton 2.51 takes ``NaN`` in JSON data and writes NaN back as JSON no strict parser reads;
    the endpoint refuses both, with the way to send such values (binary data). docs/endpoint.md says so."""
    raw = b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[NaN,1]}]}'
    real = _http(servers["triton"].http_url, "POST", "/v2/models/flt_bls/infer", raw, b"")
    local = _http(flt_local.http_url, "POST", "/v2/models/flt_bls/infer", raw, b"")
    assert real[0] == 200 and b"NaN" in real[1]
    with pytest.raises(ValueError):
        json.loads(real[1], parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert local[0] == 500 and "NaN is not valid JSON" in json.loads(local[1])["error"]
