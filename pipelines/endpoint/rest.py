"""The HTTP/REST front end (KServe v2 with Triton's binary tensor data extension), on aiohttp.

aiohttp parses HTTP; this module only maps routes to :class:`InferenceService`
and turns JSON and binary tensor data into arrays and back. A request whose
binary data follows its JSON says where the JSON ends with
``Inference-Header-Content-Length``; a response does the same when any output
is binary.

A body is read once, into one buffer sized by its ``Content-Length`` (refused
unread past ``--http-max-input-size``), and binary inputs are numpy views of
that buffer; binary outputs are written from the arrays' own memory. So a large
request costs about its own size, not a multiple of it (``docs/endpoint.md``).

A streaming pipeline answers ``generate_stream`` (server-sent events, :mod:`.generate`) and
refuses ``infer`` with Triton's words for a decoupled model (501).
"""

from __future__ import annotations

import json
from time import perf_counter_ns
from typing import Any

import numpy as np
from aiohttp import web

from ..triton.payloads import message_to_dict
from .classification import http_class_count
from .generate import generate, generate_stream
from .service import DECOUPLED_HTTP, InferenceService, Timing, batch_rows
from .status import INVALID, PARSE, Refusal, error_text, status_of
from .wire import array_from_bytes, array_from_json, array_to_bytes, array_to_json

__all__ = ["DEFAULT_MAX_INPUT_SIZE", "HEADER_LENGTH", "make_app"]

HEADER_LENGTH = "Inference-Header-Content-Length"
#: Triton's default for ``--http-max-input-size``: 64 MiB (``HTTP_DEFAULT_MAX_INPUT_SIZE`` in its
#: ``src/common.h``; docs/endpoint.md says where it comes from).
DEFAULT_MAX_INPUT_SIZE = 1 << 26
_JSON = "application/json"
_ALIGN = 64  # binary tensor data starts this aligned in the body's buffer (a cache line, more than any dtype needs)
_WRITE = 1 << 20  # a response's binary data goes out in slices this large, so the transport never copies it whole


def make_app(service: InferenceService, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE) -> web.Application:
    app = web.Application(client_max_size=max_input_size, middlewares=[_json_errors])
    routes = _Routes(service, max_input_size)
    # a version is digits, as Triton's routes take it: /versions/x is an unserved route there too
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"):
        app.router.add_get(prefix, routes.model_metadata)
        app.router.add_get(prefix + "/ready", routes.model_ready)
        app.router.add_get(prefix + "/config", routes.model_config)
        app.router.add_get(prefix + "/stats", routes.model_stats)
        app.router.add_post(prefix + "/infer", routes.infer)
        app.router.add_post(prefix + "/generate", routes.generate)
        app.router.add_post(prefix + "/generate_stream", routes.generate_stream)
    app.router.add_get("/v2/health/live", routes.live)
    app.router.add_get("/v2/health/ready", routes.ready)
    app.router.add_get("/v2", routes.server_metadata)
    app.router.add_get("/v2/models/stats", routes.all_stats)
    app.router.add_post("/v2/repository/index", routes.repository_index)
    return app


def _error(exc: BaseException, model: Any = None) -> web.Response:
    return web.json_response({"error": error_text(exc, model)}, status=status_of(exc).http)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unserved route or method is answered as Triton answers it: ``{"error": "Not Found"}``, not plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.reason
        if exc.status == 404:
            reason += (f": this endpoint serves no {request.method} {request.path}; it serves Triton's /v2 routes "
                       "(health, metadata, models/<name>[/versions/1][/ready|config|stats|infer|generate|generate_stream], "
                       "models/stats, repository/index)")
        elif exc.status == 405:
            reason += f": {request.path} does not take {request.method}"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response({"error": reason}, status=exc.status, headers=headers)


class _Routes:
    def __init__(self, service: InferenceService, max_input_size: int) -> None:
        self.service = service
        self.max_input_size = max_input_size

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

    async def infer(self, request: web.Request) -> web.StreamResponse:
        started = perf_counter_ns()
        name = request.match_info["model"]
        model = None
        try:
            model = self.service.model(name, request.match_info.get("version", ""))
            self.service.refuse_plain(model, DECOUPLED_HTTP)  # unread, as Triton refuses it
            header_length = _header_length(request.headers.get(HEADER_LENGTH))
            body = await _read_body(request, self.max_input_size, header_length)
            header, inputs = _decode(body, header_length, model)
            del body  # the inputs hold what they need of it
            requested, classes, binary = _requested_outputs(header)
            timing = Timing(started, perf_counter_ns())
            outputs, infer_ns = await self.service.infer(model, inputs, list(requested), timing)
            answer = self.service.answer(model, outputs, classes)
            del outputs
            response = await _send(request, header, model, answer, requested, binary)
            self.service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=infer_ns)
            return response
        except Exception as exc:  # every failure is this request's answer; the endpoint keeps serving
            self.service.failed(name, Timing(started, started))
            return _error(exc, model)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, generate)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, generate_stream)

    async def _generate(self, request: web.Request, answer: Any) -> web.StreamResponse:
        """Triton's generate extension (:mod:`.generate`), for any pipeline, streaming or not."""
        started = perf_counter_ns()
        name = request.match_info["model"]
        model = None
        try:
            model = self.service.model(name, request.match_info.get("version", ""))
            body = await _read_body(request, self.max_input_size, None)
        except Exception as exc:
            self.service.failed(name, Timing(started, started))
            return _error(exc, model)
        return await answer(self.service, request, model, body, started)


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        length = -1
    if length < 0:
        raise Refusal(INVALID, f"{HEADER_LENGTH} must be a whole number of bytes >= 0; got {value!r}")
    return length


def _too_large(size: str, limit: int) -> Refusal:
    # Triton's words ("exceeds the maximum allowed value ... Use --http-max-input-size"), with the sizes and the fix
    return Refusal(INVALID, f"the request body of {size} bytes exceeds the maximum allowed value of {limit} bytes "
                   f"({limit / (1 << 20):g} MiB). Use --http-max-input-size to increase the limit "
                   "(LocalServer(http_max_input_size=...) in Python), or send the tensors over gRPC")


async def _read_body(request: web.Request, limit: int, header_length: int | None) -> memoryview:
    """The body, read once into one buffer: refused unread when its declared size is past ``limit``.

    The buffer is sized by ``Content-Length`` and placed so that the binary data after the
    JSON header starts aligned, so the inputs can be views of it. A chunked body (no
    length) is gathered chunk by chunk, and refused as soon as it passes ``limit``.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(f"{declared}", limit)  # unread: aiohttp reads and drops it, then the client reads this
    if declared is None:
        chunks, total = [], 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            if total > limit:
                raise _too_large(f"more than {limit}", limit)
            chunks.append(chunk)
        return memoryview(b"".join(chunks))
    buffer = np.empty(declared + _ALIGN, np.uint8)
    pad = -(buffer.ctypes.data + (header_length or 0)) % _ALIGN
    body = memoryview(buffer)[pad : pad + declared]
    filled = 0
    while filled < declared:
        chunk = await request.content.readany()
        if not chunk:
            raise Refusal(INVALID, f"the request body ended after {filled} of its {declared} bytes (Content-Length)")
        body[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return body


def _no_constant(name: str) -> Any:
    raise Refusal(PARSE, f"failed to parse the request JSON buffer: {name} is not valid JSON (RFC 8259 has no "
                  "NaN or Infinity); send non-finite values as binary data")


def _decode(body: memoryview, header_length: int | None, model: Any) -> tuple[dict, dict[str, Any]]:
    """The request's JSON header and its inputs as arrays (binary ones: views of ``body``)."""
    if header_length is None:
        json_part, binary = body, body[len(body) :]
    else:
        if header_length > len(body):
            raise Refusal(
                INVALID, f"{HEADER_LENGTH} is {header_length} but the request body has only {len(body)} bytes"
            )
        if header_length == 0:  # the extension's raw request: every output comes back binary
            return {"parameters": {"binary_data_output": True}}, _raw_binary_request(body, model)
        json_part, binary = body[:header_length], body[header_length:]
    try:
        header = json.loads(bytes(json_part), parse_constant=_no_constant)
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
            if type(size) is not int or size < 0:  # JSON true is no size, nor is "32" (Triton: 500, these words)
                raise Refusal(PARSE, f"Unable to parse 'binary_data_size' of input '{name}': expected a whole "
                              f"number of bytes >= 0; got {json.dumps(size)}", tensor=name)
            if offset + size > len(binary):
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


def _raw_binary_request(body: memoryview, model: Any) -> dict[str, Any]:
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
    return {name: array_from_bytes(name, spec.dtype, shape, body, model=model.name)}


def _requested_outputs(header: dict) -> tuple[dict[str, bool | None], dict[str, int], bool]:
    """The outputs asked for, each with its own binary_data choice; their class counts; the request-wide default.

    A name asked twice is answered once, as Triton answers it (the last asking wins).
    """
    params = header.get("parameters") or {}
    binary_default = bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
    requested: dict[str, bool | None] = {}
    classes: dict[str, int] = {}
    entries = header.get("outputs") or []
    if not isinstance(entries, list):
        raise Refusal(PARSE, "Unable to parse 'outputs': expected a list of {name, parameters} objects")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise Refusal(PARSE, f"Unable to parse 'outputs': each output is an object with a 'name'; got {entry!r}")
        name = entry["name"]
        out_params = entry.get("parameters") or {}
        classes[name] = http_class_count(name, out_params)
        choice = out_params.get("binary_data") if isinstance(out_params, dict) else None
        requested[name] = None if choice is None else bool(choice)
    return requested, classes, binary_default


async def _send(
    request: web.Request,
    header: dict,
    model: Any,
    answer: dict[str, tuple[Any, str]],
    requested: dict[str, bool | None],
    binary_default: bool,
) -> web.StreamResponse:
    """The response: JSON, then each binary output straight from its array's memory."""
    body: dict[str, Any] = {}
    if "id" in header:
        body["id"] = header["id"]
    body["model_name"] = model.name
    body["model_version"] = "1"
    entries, chunks = [], []
    for name, (array, datatype) in answer.items():
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        choice = requested.get(name)
        if binary_default if choice is None else choice:
            raw = memoryview(array_to_bytes(array, datatype))
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array_to_json(array, datatype, name)
        entries.append(entry)
    body["outputs"] = entries
    text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return web.Response(body=text, content_type=_JSON)
    response = web.StreamResponse(headers={HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"})
    response.content_length = len(text) + sum(len(c) for c in chunks)
    await response.prepare(request)
    await response.write(text)
    for chunk in chunks:
        for start in range(0, len(chunk), _WRITE):
            await response.write(chunk[start : start + _WRITE])
    await response.write_eof()
    return response
