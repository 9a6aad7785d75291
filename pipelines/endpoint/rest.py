"""The HTTP/REST front end (KServe v2 with Triton's binary tensor data extension), on aiohttp.

aiohttp parses HTTP; this module only maps routes to :class:`InferenceService`
and turns JSON and binary tensor data into arrays and back. A request whose
binary data follows its JSON says where the JSON ends with
``Inference-Header-Content-Length``; a response does the same when any output
is binary.
"""

from __future__ import annotations

import json
from time import perf_counter_ns
from typing import Any

from aiohttp import web

from ..triton.payloads import message_to_dict
from .service import InferenceService, Timing, batch_rows
from .status import INVALID, PARSE, Refusal, error_text, status_of
from .wire import array_from_bytes, array_from_json, array_to_bytes, array_to_json

__all__ = ["HEADER_LENGTH", "make_app"]

HEADER_LENGTH = "Inference-Header-Content-Length"
_JSON = "application/json"


def make_app(service: InferenceService, *, max_request_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_request_bytes)
    routes = _Routes(service)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_get(prefix, routes.model_metadata)
        app.router.add_get(prefix + "/ready", routes.model_ready)
        app.router.add_get(prefix + "/config", routes.model_config)
        app.router.add_get(prefix + "/stats", routes.model_stats)
        app.router.add_post(prefix + "/infer", routes.infer)
    app.router.add_get("/v2/health/live", routes.live)
    app.router.add_get("/v2/health/ready", routes.ready)
    app.router.add_get("/v2", routes.server_metadata)
    app.router.add_get("/v2/models/stats", routes.all_stats)
    app.router.add_post("/v2/repository/index", routes.repository_index)
    return app


def _error(exc: BaseException, model: Any = None) -> web.Response:
    return web.json_response({"error": error_text(exc, model)}, status=status_of(exc).http)


class _Routes:
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    # ------------------------------------------------------------ health, metadata

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.service.ready else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(message_to_dict(self.service.server_metadata()))

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            model = self.service.model(request.match_info["model"], request.match_info.get("version", ""))
        except Refusal as exc:
            return _error(exc)
        return web.json_response(message_to_dict(model.metadata()))

    async def model_ready(self, request: web.Request) -> web.Response:
        if self.service.model_ready(request.match_info["model"], request.match_info.get("version", "")):
            return web.Response(status=200)
        return web.json_response({"error": "Model version not ready"}, status=400)

    async def model_config(self, request: web.Request) -> web.Response:
        try:
            model = self.service.model(request.match_info["model"], request.match_info.get("version", ""))
        except Refusal as exc:
            return _error(exc)
        return web.json_response(message_to_dict(model.config, skip_unset_messages=True))

    async def model_stats(self, request: web.Request) -> web.Response:
        try:
            stats = self.service.statistics(request.match_info["model"], request.match_info.get("version", ""))
        except Refusal as exc:
            return _error(exc)
        return web.json_response(message_to_dict(stats))

    async def all_stats(self, request: web.Request) -> web.Response:
        return web.json_response(message_to_dict(self.service.statistics()))

    async def repository_index(self, request: web.Request) -> web.Response:
        return web.json_response(
            [{"name": name, "version": "1", "state": "READY"} for name in sorted(self.service.models)]
        )

    # ------------------------------------------------------------ inference

    async def infer(self, request: web.Request) -> web.Response:
        started = perf_counter_ns()
        name = request.match_info["model"]
        model = None
        try:
            model = self.service.model(name, request.match_info.get("version", ""))
            body = await request.read()
            header, inputs = _decode(body, request.headers.get(HEADER_LENGTH), model)
            requested, binary = _requested_outputs(header)
            timing = Timing(started, perf_counter_ns())
            outputs, infer_ns = await self.service.infer(model, inputs, list(requested), timing)
            response = _encode(header, model, outputs, requested, binary)
            self.service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=infer_ns)
            return response
        except Exception as exc:  # every failure is this request's answer; the endpoint keeps serving
            self.service.failed(name, Timing(started, started))
            return _error(exc, model)


def _decode(body: bytes, header_length: str | None, model: Any) -> tuple[dict, dict[str, Any]]:
    """The request's JSON header and its inputs as arrays."""
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise Refusal(INVALID, f"{HEADER_LENGTH} must be an integer; got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise Refusal(
                INVALID, f"{HEADER_LENGTH} is {length} but the request body has only {len(body)} bytes"
            )
        if length == 0:  # the extension's raw request: every output comes back binary
            return {"parameters": {"binary_data_output": True}}, _raw_binary_request(body, model)
        json_part, binary = body[:length], memoryview(body)[length:]
    try:
        header = json.loads(json_part)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refusal(PARSE, f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(header, dict):
        raise Refusal(PARSE, f"Unable to parse 'inputs': the request JSON is a {type(header).__name__}, not an object")
    entries = header.get("inputs")
    if not isinstance(entries, list):
        raise Refusal(PARSE, "Unable to parse 'inputs': expected a list of {name, shape, datatype, data} objects")
    inputs: dict[str, Any] = {}
    offset = 0
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise Refusal(PARSE, f"Unable to parse 'inputs': each input is an object with a 'name'; got {entry!r}")
        name = entry["name"]
        if name in inputs:  # as Triton refuses it; taking the last copy would answer another request
            raise Refusal(INVALID, f"input '{name}' already exists in request", tensor=name)
        params = entry.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise Refusal(
                    INVALID,
                    f"unexpected size for input '{name}', expecting {size} bytes of binary data but "
                    f"{len(binary) - offset} remain for model '{model.name}'",
                    tensor=name,
                )
            inputs[name] = array_from_bytes(
                name, entry.get("datatype"), entry.get("shape"), binary[offset : offset + size], model=model.name
            )
            offset += size
        elif "data" in entry:
            inputs[name] = array_from_json(name, entry.get("datatype"), entry.get("shape"), entry["data"])
        else:
            raise Refusal(INVALID, f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter", tensor=name)
    if offset != len(binary):
        raise Refusal(INVALID, f"unexpected additional input data for model '{model.name}': "
                      f"{len(binary) - offset} bytes beyond the inputs' binary_data_size")
    return header, inputs


def _raw_binary_request(body: bytes, model: Any) -> dict[str, Any]:
    """The binary extension's header-less request: one input, its shape deduced from the size."""
    specs = model.pipeline.inputs
    if len(specs) != 1:
        raise Refusal(INVALID, f"a raw binary request ({HEADER_LENGTH}: 0) needs a model with one input; "
                      f"'{model.name}' has {list(specs)}")
    name, spec = next(iter(specs.items()))
    dims = list(spec.dims)
    variable = [i for i, d in enumerate(dims) if d == -1]
    if spec.dtype == "BYTES" or len(variable) > 1:
        raise Refusal(INVALID, f"a raw binary request cannot deduce the shape of input '{name}' ({spec})")
    fixed = 1
    for d in dims:
        fixed *= d if d != -1 else 1
    itemsize = spec.numpy_dtype.itemsize
    if variable:
        dims[variable[0]] = len(body) // (fixed * itemsize) if fixed else 0
    shape = ([1] if model.pipeline.batched else []) + dims
    return {name: array_from_bytes(name, spec.dtype, shape, memoryview(body), model=model.name)}


def _requested_outputs(header: dict) -> tuple[dict[str, bool | None], bool]:
    """The outputs asked for, each with its own binary_data choice, and the request-wide default."""
    params = header.get("parameters") or {}
    binary_default = bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
    requested: dict[str, bool | None] = {}
    entries = header.get("outputs") or []
    if not isinstance(entries, list):
        raise Refusal(PARSE, "Unable to parse 'outputs': expected a list of {name, parameters} objects")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise Refusal(PARSE, f"Unable to parse 'outputs': each output is an object with a 'name'; got {entry!r}")
        out_params = entry.get("parameters") or {}
        if isinstance(out_params, dict) and out_params.get("classification"):
            raise Refusal(INVALID, f"output '{entry['name']}': the classification extension is not served locally")
        choice = out_params.get("binary_data") if isinstance(out_params, dict) else None
        requested[entry["name"]] = None if choice is None else bool(choice)
    return requested, binary_default


def _encode(
    header: dict, model: Any, outputs: dict[str, Any], requested: dict[str, bool | None], binary_default: bool
) -> web.Response:
    specs = model.pipeline.output_specs
    answer: dict[str, Any] = {}
    if "id" in header:
        answer["id"] = header["id"]
    answer["model_name"] = model.name
    answer["model_version"] = "1"
    entries, chunks = [], []
    for name, array in outputs.items():
        datatype = specs[name].dtype
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        choice = requested.get(name)
        if binary_default if choice is None else choice:
            raw = array_to_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array_to_json(array, datatype, name)
        entries.append(entry)
    answer["outputs"] = entries
    text = json.dumps(answer, separators=(",", ":")).encode()
    if not chunks:
        return web.Response(body=text, content_type=_JSON)
    return web.Response(
        body=b"".join([text, *chunks]),
        headers={HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"},
    )
