"""A Triton server as a benchmark target: one top-level model (``<name>_ensemble``,
``_bls`` or ``_bls_sync``) called through tritonclient's asyncio client, and the
server's statistics snapshots that give the per-model breakdown. A streaming pipeline's model
is streamed over gRPC (:class:`StreamingServerTarget`).
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import Any

import numpy as np

from ..errors import InferenceError, InputError, PipelinesError, ServerDiedError
from ..forms import form as _form
from ..triton.statistics import ModelCounters, parse_statistics
from .streams import StreamTimes

__all__ = ["ServerTarget", "StreamingServerTarget", "check_streaming_settings", "model_name", "stream_request"]


def model_name(pipeline: str, form: str) -> str:
    """The top-level model of ``form`` in a repository compiled with ``"all"`` (forms side by side)."""
    return _form(form).model_name(pipeline, side_by_side=True)


class ServerTarget:
    """Calls ``model`` with the shared async client; snapshots statistics with ``stats_client``."""

    streaming = False

    def __init__(self, client: Any, stats_client: Any, model: str, *, timeout: float | None = None) -> None:
        self.client = client
        self.stats_client = stats_client
        self.model = model
        self.timeout = timeout

    async def infer(self, inputs: Mapping[str, Any]) -> Any:
        return await self.client.infer(self.model, inputs, timeout=self.timeout)

    async def snapshot(self) -> dict[tuple[str, str], ModelCounters]:
        """Every model's cumulative counters now (the composing models' too)."""
        stats = self.stats_client.statistics()
        if hasattr(stats, "__await__"):
            stats = await stats
        return parse_statistics(stats)


class StreamingServerTarget(ServerTarget):
    """Streams ``model`` (decoupled: a streaming pipeline's top-level model) over gRPC, one
    ``ModelStreamInfer`` call per request on one shared channel, as a client of a streaming
    model does; each request answers with its :class:`StreamTimes`. Statistics as for
    :class:`ServerTarget`, through ``stats_client``.

    The request asks for Triton's empty final response (``triton_enable_empty_final_response``):
    a top-level model may send its final flag alone, after its last response, and without that
    empty response the client could not tell that the stream had ended. tritonclient's
    ``grpc.aio`` ``stream_infer`` cannot ask for it (its ``parameters`` refuse ``triton_`` names),
    so the call is made on tritonclient's own gRPC stub. Nothing is compressed, as the
    bench's other requests are not.
    """

    streaming = True

    def __init__(self, url: str, stats_client: Any, model: str, specs: Mapping[str, Any], *,
                 timeout: float | None = None) -> None:
        super().__init__(None, stats_client, model, timeout=timeout)
        self.url = url
        self.specs = dict(specs)
        self._stub: Any = None
        self._channel: Any = None

    async def infer(self, inputs: Mapping[str, Any]) -> StreamTimes:
        return await self.stream(inputs)

    async def stream(self, inputs: Mapping[str, Any], *, keep: bool = False) -> StreamTimes:
        """Stream one request to its final flag; ``keep``: with the responses' outputs too.
        An error response fails the request (``InferenceError``), after which nothing is read."""
        import grpc
        from tritonclient.grpc import InferResult

        request = stream_request(self.model, inputs, self.specs)
        stub = self._connect()
        times: list[float] = []
        answers: list[Mapping[str, Any]] = []
        sent = perf_counter()
        call = stub.ModelStreamInfer(compression=grpc.Compression.NoCompression)
        try:
            try:
                await call.write(request)
                while True:
                    message = await call.read()
                    now = perf_counter()
                    if message is grpc.aio.EOF:
                        raise InferenceError(f"model {self.model!r}: its stream ended before the final response "
                                             f"({len(times)} responses; gRPC {self.url})", step=self.model)
                    if message.error_message:
                        raise InferenceError(f"{message.error_message} (stream of model {self.model!r} after "
                                             f"{len(times)} responses, gRPC {self.url})", step=self.model)
                    response = message.infer_response
                    if response.outputs:  # the final flag may come on the last response, or alone
                        times.append(now)
                        if keep:
                            result = InferResult(response)
                            answers.append({o.name: result.as_numpy(o.name) for o in response.outputs})
                    if response.parameters["triton_final_response"].bool_param:
                        break
                await call.done_writing()  # the request's stream is whole: the call may end
            except grpc.aio.AioRpcError as exc:
                await self._check_server(exc)
                raise InferenceError(f"model {self.model!r}: stream failed, status {exc.code().name}: "
                                     f"{exc.details()} (gRPC {self.url})", step=self.model) from None
        finally:
            if not call.done():
                call.cancel()
        return StreamTimes(sent, tuple(times), now, tuple(answers))

    def _connect(self) -> Any:
        if self._stub is None:
            import grpc
            import tritonclient.grpc as grpcclient
            from tritonclient.grpc import service_pb2_grpc

            size = grpcclient.MAX_GRPC_MESSAGE_SIZE
            self._channel = grpc.aio.insecure_channel(self.url, options=[
                ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)])
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def _check_server(self, exc: Any) -> None:
        """A call the transport failed: raise the server's death (which ends the run) if it died."""
        import grpc

        if exc.code() == grpc.StatusCode.UNAVAILABLE and self.stats_client is not None:
            try:
                await self.stats_client.metadata()
            except ServerDiedError:
                raise
            except PipelinesError:
                pass

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


def stream_request(model: str, inputs: Mapping[str, Any], specs: Mapping[str, Any]) -> Any:
    """The gRPC ``ModelInferRequest`` of one streamed request: ``inputs`` (numpy) as raw contents,
    typed as the pipeline declares them (``specs``: name -> TensorSpec), and the empty final
    response asked for."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, value in inputs.items():
        array = np.asarray(value)
        spec = specs.get(name)
        if array.dtype.kind == "U":  # BYTES carry bytes; str goes as UTF-8
            array = np.char.encode(array, "utf-8").astype(object)
        datatype = spec.dtype if spec is not None else ("BYTES" if array.dtype.kind in "OS" else np_to_triton_dtype(array.dtype))
        if datatype is None:
            raise InputError(f"input {name!r} has numpy dtype {array.dtype}, which has no Triton datatype", tensor=name)
        if datatype == "BYTES":
            serialized = serialize_byte_tensor(array.astype(object))
            content = serialized.item() if serialized.size else b""
        else:
            content = np.ascontiguousarray(array.astype(spec.numpy_dtype, copy=False) if spec else array).tobytes()
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(content)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def check_streaming_settings(pipeline: Any, settings: Any) -> None:
    """Refuse, before anything starts, what the bench cannot measure of a streaming pipeline on a
    server: a remote server reached over HTTP (streams go over gRPC), compressed streams."""
    if not pipeline.streaming or not settings.on_server:
        return
    if settings.url is not None and settings.protocol != "grpc":
        raise PipelinesError(
            f"pipeline {pipeline.name!r} streams, and the bench streams it over gRPC (ModelStreamInfer): "
            f"give the server's gRPC address and --protocol grpc (--url {settings.url} is taken as HTTP)",
            pipeline=pipeline.name,
        )
    if settings.compression is not None:
        raise PipelinesError(
            f"pipeline {pipeline.name!r} streams, and the bench measures its streams uncompressed: "
            f"drop --compression {settings.compression}",
            pipeline=pipeline.name,
        )
