"""The gRPC front end: Triton's ``GRPCInferenceService`` on ``grpc.aio``.

The service definition is the one tritonclient ships (``service_pb2_grpc``), so
a ``tritonclient.grpc`` client cannot tell this endpoint from a server by its
messages. Outputs always travel as ``raw_output_contents``, as Triton sends them. A streaming
pipeline answers ``ModelStreamInfer`` (:mod:`.grpc_stream`) and refuses ``ModelInfer`` with
Triton's words for a decoupled model.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator
from time import perf_counter_ns
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from ..freed_memory import glibc_function
from .grpc_messages import decode_request, fill_response, requested_classes
from .grpc_stream import stream_infer
from .service import DECOUPLED_GRPC, InferenceService, Timing, batch_rows
from .status import Refusal, error_text, status_of

__all__ = ["GRPC_OPTIONS", "add_service"]

#: Triton's own limits: messages up to INT32_MAX bytes both ways (``MAX_GRPC_MESSAGE_SIZE`` in its
#: ``src/common.h``), far past gRPC's default of 4 MiB; see docs/endpoint.md.
MAX_GRPC_MESSAGE_SIZE = 2**31 - 1
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
]


#: A request or response this large (bytes) gives the C library's freed memory back to the system after it.
TRIM_AFTER = 32 << 20


_TRIM = glibc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def _trim_soon() -> None:
    """Hand the memory a large message was read and written through back to the system, once it is freed.

    gRPC reads a message in small slices, allocated from the C heap of its threads; freed,
    they stay with the process (glibc returns only the top of a heap), and RSS stays a few
    hundred MB up after a few 100 MB requests. ``malloc_trim`` gives back every free page,
    on a worker thread, a moment after the call ends and again once its answer has surely gone.
    """
    if _TRIM is None:
        return
    loop = asyncio.get_running_loop()
    for delay in (0.05, 1.0):
        loop.call_later(delay, lambda: loop.run_in_executor(None, _TRIM, 0))


def add_service(server: grpc.aio.Server, service: InferenceService) -> None:
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(service), server)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, model: Any = None) -> None:
    await context.abort(status_of(exc).grpc, error_text(exc, model))


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return self.service.server_metadata()

    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        try:
            return self.service.model(request.name, request.version).metadata()
        except Refusal as exc:
            await _abort(context, exc)

    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        try:
            return pb.ModelConfigResponse(config=self.service.model(request.name, request.version).config)
        except Refusal as exc:
            await _abort(context, exc)

    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        try:
            return self.service.statistics(request.name, request.version)
        except Refusal as exc:
            await _abort(context, exc)

    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(name=n, version="1", state="READY")
                    for n in sorted(self.service.models)]
        )

    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        started = perf_counter_ns()
        model = None
        try:
            model = self.service.model(request.model_name, request.model_version)
            self.service.refuse_plain(model, DECOUPLED_GRPC)  # before the inputs, as Triton does
            inputs = decode_request(request, model.name)
            classes = requested_classes(request)
            timing = Timing(started, perf_counter_ns())
            outputs, infer_ns = await self.service.infer(model, inputs, list(classes), timing)
            response = pb.ModelInferResponse(model_name=model.name, model_version="1", id=request.id)
            size = fill_response(response, self.service, model, outputs, classes)
            self.service.finished(model, timing, rows=batch_rows(model, inputs), infer_ns=infer_ns)
            if sum(len(r) for r in request.raw_input_contents) + size > TRIM_AFTER:
                _trim_soon()
            return response
        except Exception as exc:  # every failure is this request's answer; the endpoint keeps serving
            self.service.failed(request.model_name, Timing(started, started))
            await _abort(context, exc, model)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # an async generator, so that grpc.aio cancels it (and its streams) when the client goes away
        async for message in stream_infer(self.service, request_iterator):
            yield message

