"""An asyncio client of a Triton server (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``),
with the same calls, answers and errors as :class:`~pipelines.triton.client.TritonClient`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InferenceError, PipelinesError, ServerError
from .client import infer_refusal
from .connection import ClientBase, grpc_channel_args
from .payloads import InferRequest, message_to_dict, result_arrays
from .rejections import explain_rejection

__all__ = ["COMPRESSIONS", "AsyncTritonClient", "infer_headers"]

#: What ``compression`` may name: the algorithms Triton's HTTP and gRPC endpoints both take.
COMPRESSIONS = ("gzip", "deflate")


def infer_headers(compression: str | None) -> dict[str, str]:
    """The HTTP headers every request carries, for ``compression`` (None: none).

    aiohttp, under ``tritonclient.http.aio``, asks for ``gzip, deflate, br`` unless told
    otherwise, and Triton then compresses every response: about 12.5 ms of CPU per 256 KiB
    on a small machine, which tritonclient's blocking client and perf_analyzer never pay
    (they send no ``Accept-Encoding``). ``identity`` is the header's own word for none.
    """
    return {"Accept-Encoding": compression or "identity"}


def _check_compression(compression: str | None) -> str | None:
    if compression is not None and compression not in COMPRESSIONS:
        raise PipelinesError(
            f"compression must be one of {', '.join(COMPRESSIONS)} (or none); got {compression!r}"
        )
    return compression


class AsyncTritonClient(ClientBase):
    """An asyncio client of one Triton server (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``).

    Made anywhere, it connects on first use inside the running event loop. Use it from one
    loop; many concurrent ``infer`` calls share its connections (no limit on their number).

    Requests and responses travel uncompressed, as with the blocking client and perf_analyzer,
    unless ``compression`` ("gzip" or "deflate") asks for both to be compressed.
    """

    def __init__(self, url: str, protocol: str = "http", *, compression: str | None = None, **options: Any) -> None:
        self.compression = _check_compression(compression)
        super().__init__(url, protocol, **options)

    def _init_connection(self) -> None:
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._generation = 0  # the server's restarts this connection was made after

    def _headers(self) -> dict[str, str]:
        return infer_headers(self.compression)  # a new dict each call: tritonclient adds to it

    def _get(self) -> Any:
        if self._closed:
            raise ServerError(f"this AsyncTritonClient of {self.url} is closed; make a new one")
        if self._client is None:
            self._loop = asyncio.get_running_loop()
            if self.protocol == "http":
                import tritonclient.http.aio as aiohttpclient

                # conn_timeout caps every request in aiohttp; per-call limits come from anyio instead.
                self._client = aiohttpclient.InferenceServerClient(self.url, conn_limit=0, conn_timeout=None)
            else:
                import tritonclient.grpc.aio as aiogrpcclient

                args = grpc_channel_args(own_subchannel=self._generation > 0)
                self._client = aiogrpcclient.InferenceServerClient(self.url, channel_args=args)
        return self._client

    async def _call(self, what: str, model: str | None, timeout: float | None, http_call, grpc_call) -> Any:
        import anyio

        self._errors.check()
        generation = self._errors.generation()
        if generation != self._generation:  # made before the owning server was started again (client.py)
            self._generation = generation
            stale, self._client = self._client, None
            if stale is not None:
                with contextlib.suppress(Exception):
                    await stale.close()
        try:
            client = self._get()
            if self.protocol == "http":
                if timeout is None:
                    return await http_call(client)
                with anyio.fail_after(timeout):
                    return await http_call(client)
            return await grpc_call(client, timeout)
        except PipelinesError:
            raise
        except Exception as exc:
            raise self._errors.translate(exc, what=what, model=model, timeout=timeout, generation=generation) from exc

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: str | Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on numpy ``inputs``; return its outputs (all of them, or those named)."""
        timeout = self.timeout if timeout is None else timeout
        request = InferRequest(model, inputs, outputs)

        compression = self.compression

        async def over_http(c: Any) -> dict[str, np.ndarray]:
            answer = await c.infer(**request.http(), headers=self._headers(),
                                   request_compression_algorithm=compression)
            return result_arrays(answer, "http")

        async def over_grpc(c: Any, t: float | None) -> dict[str, np.ndarray]:
            return result_arrays(await c.infer(**request.grpc(t), compression_algorithm=compression), "grpc")

        try:
            return await self._call("infer on", model, timeout, over_http, over_grpc)
        except InferenceError as error:
            refusal = infer_refusal(error, model)
            if refusal is not None:
                raise refusal from error.__cause__
            try:
                config = await self.model_config(model)
            except PipelinesError:
                raise error from error.__cause__
            raise explain_rejection(error, model=model, inputs=inputs, config=config) from error.__cause__

    async def statistics(self, model: str = "") -> dict:
        async def over_grpc(c: Any, t: float | None) -> dict:
            return message_to_dict(await c.get_inference_statistics(model_name=model, client_timeout=t))

        return await self._call(
            "statistics of",
            model or None,
            self.timeout,
            lambda c: c.get_inference_statistics(model_name=model, headers=self._headers()),
            over_grpc,
        )

    async def ready(self, model: str | None = None) -> bool:
        """Whether the server (or ``model`` on it) is ready; ``False`` when it cannot be reached.

        On a server this process owns, a model whose stub died counts as not ready until it is
        reloaded (and the server too, as Triton counts a server ready when all its models are).
        """
        if self._known_broken(model):
            return False
        def over_http(c: Any) -> Any:
            headers = self._headers()
            return c.is_model_ready(model, headers=headers) if model else c.is_server_ready(headers=headers)

        try:
            answer = bool(await self._call("readiness of", model, self.timeout, over_http, self._readiness(model)[1]))
        except (ServerError, InferenceError):
            return False
        return answer and not self._known_broken(model)

    async def metadata(self) -> dict:
        async def over_grpc(c: Any, t: float | None) -> dict:
            return message_to_dict(await c.get_server_metadata(client_timeout=t))

        return await self._call("metadata of", None, self.timeout, lambda c: c.get_server_metadata(headers=self._headers()), over_grpc)

    async def model_config(self, model: str) -> dict:
        async def over_grpc(c: Any, t: float | None) -> dict:
            return message_to_dict((await c.get_model_config(model, client_timeout=t)).config, skip_unset_messages=True)

        return await self._call("config of", model, self.timeout, lambda c: c.get_model_config(model, headers=self._headers()),
                                over_grpc)

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def close_from_any_thread(self, timeout: float = 2.0) -> None:
        """Close from outside the client's event loop (the server that stops calls it).

        On its loop if that loop still runs in another thread; otherwise it is only marked
        closed, and the server shuts its connections down (``cleanup.shutdown_connections``).
        """
        self._closed = True
        loop = self._loop
        if self._client is None or loop is None or not loop.is_running() or asyncio._get_running_loop() is loop:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.close(), loop).result(timeout)

    async def __aenter__(self) -> AsyncTritonClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        extra = f", compression={self.compression!r}" if self.compression else ""
        return f"AsyncTritonClient({self.url!r}, {self.protocol!r}{extra})"
