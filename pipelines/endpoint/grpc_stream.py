"""``ModelStreamInfer``: Triton's bidirectional stream, answered as Triton 2.51 answers it.

A client sends requests on one stream (``start_stream`` + ``async_stream_infer``) and reads
the responses of all of them on it, each with the ``id`` of its request. Each request runs on
its own; what each one gets, as the bundled server sends it to a decoupled Python model
(``docs/triton_decoupled.md``, checked in ``tests/test_stream_endpoint.py``):

- one response per response of the pipeline's stream, in order, each with the parameter
  ``triton_final_response`` false; then, if the request asked for it
  (``enable_empty_final_response=True``, parameter ``triton_enable_empty_final_response``),
  an empty response with ``triton_final_response`` true (no ``model_version``, as Triton's);
- a failure mid-stream: a response with ``error_message`` after the responses before it,
  then the empty final response if asked (the ensemble's model: the final flag on the error
  itself, as Triton's ensemble scheduler ends a request with its error);
- the ensemble's model puts Triton's sequence parameters on each response
  (``sequence_id`` 0, ``sequence_start`` and ``sequence_end`` false, or the request's own);
- a request refused before the pipeline runs (unknown model, wrong inputs): ``error_message``
  with an ``infer_response`` that holds only the ``id``, and nothing more;
- a pipeline that does not stream: its one response, with ``triton_final_response`` true.

A client that cancels (``stop_stream(cancel_requests=True)``) or disconnects ends the call:
grpc.aio cancels it, and every request still streaming on it is cancelled, its generators
closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from time import perf_counter_ns
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from ..errors import InputError
from .grpc_messages import decode_request, fill_response, requested_classes
from .service import InferenceService, Timing, batch_rows
from .status import INVALID, Refusal, error_text

__all__ = ["stream_infer"]

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
_END = object()


async def stream_infer(service: InferenceService, requests: AsyncIterator[Any]) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """The messages of one ``ModelStreamInfer`` call, as the requests on it are answered."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    running: set[asyncio.Task] = set()

    async def read() -> None:
        try:
            async for request in requests:
                task = asyncio.ensure_future(_answer(service, request, out.put_nowait))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:  # the client sends no more: answer what it sent, then end the call
                await asyncio.wait(set(running))
        finally:
            out.put_nowait(_END)

    reader = asyncio.ensure_future(read())
    try:
        while (message := await out.get()) is not _END:
            yield message
        await reader  # its error, if reading the requests failed
    finally:
        tasks = [reader, *running]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # each cancelled stream has closed its generators


async def _answer(service: InferenceService, request: Any, send: Any) -> None:
    """Every message for one request, through ``send``."""
    started = perf_counter_ns()
    model = None
    try:
        model = service.model(request.model_name, request.model_version)
        empty_final = _empty_final(request)
        inputs = decode_request(request, model.name)
        classes = requested_classes(request)
    except Exception as exc:
        service.failed(request.model_name, Timing(started, started))
        send(_refused(exc, model, request.id))
        return
    timing = Timing(started, perf_counter_ns())
    streams = model.decoupled
    ensemble = model.mode == "ensemble"
    sent = 0
    try:
        async with aclosing(service.stream(model, inputs, list(classes))) as responses:
            async for outputs in responses:
                response = pb.ModelInferResponse(model_name=model.name, model_version="1", id=request.id)
                response.parameters[FINAL].bool_param = not streams
                if ensemble:
                    _sequence(request, response)
                fill_response(response, service, model, outputs, classes)
                send(pb.ModelStreamInferResponse(infer_response=response))
                sent += 1
    except Exception as exc:
        service.failed(model.name, timing)
        if sent == 0 and _before_the_pipeline(exc):
            send(_refused(exc, model, request.id))
            return
        # an ensemble ends the request with its error: the final flag is on it, and nothing follows
        failed = pb.ModelInferResponse(model_name=model.name, id=request.id)
        failed.parameters[FINAL].bool_param = not streams or ensemble
        send(pb.ModelStreamInferResponse(error_message=error_text(exc, model), infer_response=failed))
        if ensemble:
            return
    else:
        service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=perf_counter_ns() - timing.decoded)
    if streams and empty_final:
        final = pb.ModelInferResponse(model_name=model.name, id=request.id)
        final.parameters[FINAL].bool_param = True
        send(pb.ModelStreamInferResponse(infer_response=final))


def _sequence(request: Any, response: pb.ModelInferResponse) -> None:
    """The sequence parameters Triton's ensemble scheduler puts on each response it sends: the
    request's ``sequence_id`` (0 if none), ``sequence_start`` and ``sequence_end`` (false if none)."""
    for name in ("sequence_id", "sequence_start", "sequence_end"):
        if name in request.parameters:
            response.parameters[name].CopyFrom(request.parameters[name])
        elif name == "sequence_id":
            response.parameters[name].int64_param = 0
        else:
            response.parameters[name].bool_param = False


def _empty_final(request: Any) -> bool:
    """Whether the request asks for the final flag on an empty response of its own."""
    if EMPTY_FINAL not in request.parameters:
        return False
    param = request.parameters[EMPTY_FINAL]
    if param.WhichOneof("parameter_choice") != "bool_param":
        raise Refusal(INVALID, f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param.")
    return param.bool_param


def _before_the_pipeline(exc: BaseException) -> bool:
    """Whether ``exc`` refused the request before any step ran (its inputs do not fit the pipeline)."""
    return isinstance(exc, Refusal) or (isinstance(exc, InputError) and exc.step is None)


def _refused(exc: BaseException, model: Any, request_id: str) -> pb.ModelStreamInferResponse:
    # as Triton refuses a request on a stream: the error, and a response that holds only the id
    return pb.ModelStreamInferResponse(error_message=error_text(exc, model), infer_response=pb.ModelInferResponse(id=request_id))
