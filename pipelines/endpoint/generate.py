"""Triton's generate extension: ``POST /v2/models/<model>/generate`` and ``generate_stream``.

The request is one JSON object: each input by name (a string, a number, or a list of them:
its length is the config's element count, or its one variable dim), and optionally ``id``
(echoed in each answer) and ``parameters`` (not read). Each answer is one JSON object: the
outputs by name (a tensor of one element as that element, any other as a flat list),
``model_name``, ``model_version``, ``id`` if given, and from the ensemble's model
``sequence_id``/``sequence_start``/``sequence_end``, keys in sorted order.
``generate_stream`` sends each response as a server-sent event (``data: {...}`` and a blank
line), an error as ``data: {"error": "..."}``, and ends the body with the stream;
``generate`` answers a request that has exactly one response.

All of it as the bundled Triton 2.51 answers (``docs/triton_decoupled.md``, "HTTP server-sent
events"; ``tests/test_stream_endpoint.py`` compares the two), including its statuses: a
request refused before the pipeline runs is a JSON error with its usual status; a failure
before the first response is an event with status 400; after it, status 200 (the events
before it are already sent); ``generate`` of a stream of other than one response (a failure
after the first counts as one more), status 200 with Triton's error. One difference, as for
``infer``: an output holding NaN or Infinity is refused (JSON has neither), where Triton writes
``NaN``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from contextlib import aclosing
from time import perf_counter_ns
from typing import Any

import numpy as np
from aiohttp import web

from ..errors import InputError
from .models import ServedModel
from .service import InferenceService, Timing, batch_rows
from .status import INVALID, PARSE, Refusal, error_text, status_of
from .wire import array_from_json

__all__ = ["ONE_RESPONSE", "generate", "generate_stream", "generate_inputs"]

#: Triton's answer to ``generate`` on a stream of other than one response (2.51's words).
ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                "generates various number of responses")
_EVENTS = "text/event-stream; charset=utf-8"
_FAILED_FIRST = 400  # the status of a stream whose first answer is its failure, as Triton sends it


def generate_inputs(body: bytes | memoryview, model: ServedModel) -> tuple[dict[str, Any], str | None]:
    """The request's inputs as arrays, and its ``id``; refused as Triton refuses a body it cannot read."""
    try:
        fields = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refusal(PARSE, f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(fields, dict):
        raise Refusal(PARSE, f"failed to parse the request JSON buffer: a generate request is one JSON object of "
                      f"inputs by name; got a {type(fields).__name__}")
    request_id = fields.get("id")
    inputs = {}
    for name, spec in model.pipeline.inputs.items():
        if name in fields:  # one left out is named by the pipeline's own check, as any missing input
            inputs[name] = _input(name, spec, fields[name], model)
    return inputs, None if request_id is None else str(request_id)


def _input(name: str, spec: Any, value: Any, model: ServedModel) -> np.ndarray:
    """One input, shaped as Triton shapes it: a list's length (a value: 1) must be the config's
    element count, or its one variable dim; the elements are then read however nested."""
    length = len(value) if isinstance(value, list) else 1
    dims = list(spec.dims)
    if all(d >= 0 for d in dims) and math.prod(dims) == length:
        shape = dims
    elif dims == [-1]:
        shape = [length]
    else:
        raise Refusal(INVALID, f"The schema can not convert input '{name}' to tensor with proper shape (model "
                      f"'{model.name}' takes {spec.dtype} {dims}: give a list of its {math.prod(dims)} elements)"
                      if all(d >= 0 for d in dims) else
                      f"The schema can not convert input '{name}' to tensor with proper shape (model "
                      f"'{model.name}' takes {spec.dtype} {dims}, of more than one variable dim: send it to infer)",
                      tensor=name)
    items = _flat(value)
    if len(items) != math.prod(shape):
        raise Refusal(PARSE, f"Unable to parse 'data': Shape does not match true shape of 'data' field (input "
                      f"'{name}': {len(items)} elements for shape {shape})", tensor=name)
    if model.pipeline.batched:
        shape = [1, *shape]
    return array_from_json(name, spec.dtype, shape, items)


def _flat(value: Any) -> list:
    if not isinstance(value, list):
        return [value]
    return [leaf for item in value for leaf in _flat(item)]


def answer_json(
    model: ServedModel, outputs: Mapping[str, np.ndarray], request_id: str | None
) -> str:
    """One response as Triton's generate extension writes it."""
    answer: dict[str, Any] = {name: _value(name, array, model.pipeline.output_specs[name].dtype)
                              for name, array in outputs.items()}
    if request_id is not None:
        answer["id"] = request_id
    answer["model_name"] = model.name
    answer["model_version"] = "1"
    if model.mode == "ensemble":  # the sequence parameters Triton's ensemble scheduler puts on each response
        answer.update(sequence_end=False, sequence_id=0, sequence_start=False)
    return json.dumps(answer, separators=(",", ":"), sort_keys=True)


def _value(name: str, array: np.ndarray, datatype: str) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        # as infer does (docs/endpoint.md): JSON has no NaN or Infinity, though Triton writes them
        raise Refusal(INVALID, f"output '{name}' holds {flat[~np.isfinite(flat)][0]} ({datatype}), which JSON "
                      "cannot carry (it has no NaN or Infinity); read this model with a gRPC stream "
                      "(start_stream/async_stream_infer), which carries its bytes", tensor=name)
    if datatype == "BYTES":
        values = [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v) for v in flat]
    elif datatype in ("FP16", "BF16"):
        values = flat.astype(np.float32).tolist()
    else:
        values = flat.tolist()
    return values[0] if len(values) == 1 else values


def _error_json(exc: BaseException, model: ServedModel) -> str:
    return json.dumps({"error": error_text(exc, model)}, separators=(",", ":"))


def _json(answer: str, status: int = 200) -> web.Response:
    return web.Response(text=answer, status=status, content_type="application/json")


def _before_the_pipeline(exc: BaseException) -> bool:
    return isinstance(exc, Refusal) or (isinstance(exc, InputError) and exc.step is None)


async def generate_stream(
    service: InferenceService, request: web.Request, model: ServedModel, body: memoryview, started: int
) -> web.StreamResponse:
    """Answer ``generate_stream``: one event per response, as they come."""
    try:
        inputs, request_id = generate_inputs(body, model)
    except Refusal as exc:
        service.failed(model.name, Timing(started, started))
        return _json(_error_json(exc, model), exc.status.http)
    timing = Timing(started, perf_counter_ns())
    events: web.StreamResponse | None = None

    async def opened(status: int = 200) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"Content-Type": _EVENTS})
        await response.prepare(request)
        return response

    try:
        async with aclosing(service.stream(model, inputs, [])) as responses:
            async for outputs in responses:
                events = events or await opened()
                # a client gone away fails this write, which ends the stream and closes its generators
                await events.write(f"data: {answer_json(model, outputs, request_id)}\n\n".encode())
    except ConnectionError:
        service.failed(model.name, timing)
        return events or web.Response()
    except Exception as exc:
        service.failed(model.name, timing)
        if events is None and _before_the_pipeline(exc):
            return _json(_error_json(exc, model), status_of(exc).http)
        events = events or await opened(_FAILED_FIRST)
        await events.write(f"data: {_error_json(exc, model)}\n\n".encode())
    else:
        service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=perf_counter_ns() - timing.decoded)
    events = events or await opened()  # a stream of no response: an empty body
    await events.write_eof()
    return events


async def generate(
    service: InferenceService, request: web.Request, model: ServedModel, body: memoryview, started: int
) -> web.Response:
    """Answer ``generate``: the one response of a request. Anything after it (another response, a
    failure) refuses the whole, as Triton refuses it, and stops the stream there."""
    answers: list[dict[str, np.ndarray]] = []
    failed_after = False
    try:
        inputs, request_id = generate_inputs(body, model)
        timing = Timing(started, perf_counter_ns())
        async with aclosing(service.stream(model, inputs, [])) as responses:
            async for outputs in responses:
                answers.append(outputs)
                if len(answers) > 1:
                    break
    except Exception as exc:
        if not answers:
            service.failed(model.name, Timing(started, started))
            return _json(_error_json(exc, model), status_of(exc).http if _before_the_pipeline(exc) else _FAILED_FIRST)
        failed_after = True  # a failure after the first response is one more answer
    if len(answers) != 1 or failed_after:
        service.failed(model.name, timing)
        return _json(json.dumps({"error": ONE_RESPONSE}, separators=(",", ":")))
    service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=perf_counter_ns() - timing.decoded)
    return _json(answer_json(model, answers[0], request_id))
