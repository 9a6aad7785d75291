"""A blocking client of a Triton server, local or remote: numpy in, numpy out, errors from
``pipelines.errors``. It speaks HTTP (binary tensor data both ways) or gRPC, with the same dict
shapes for both."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

from ..errors import InferenceError, PipelinesError, ServerError
from .connection import ClientBase, grpc_channel_args, rejected
from .payloads import InferRequest, message_to_dict, result_arrays
from .rejections import explain_rejection

__all__ = ["TritonClient", "infer_refusal", "streams_refusal"]

#: What Triton 2.51 says to a plain infer on a decoupled model (HTTP 501, gRPC UNIMPLEMENTED), as a
#: streaming pipeline's models are (docs/triton_decoupled.md); the local endpoint says the same.
_DECOUPLED = "doesn't support models with decoupled transaction policy"


def streams_refusal(error: InferenceError, model: str) -> InferenceError | None:
    """The user's words for Triton's refusal of a plain infer on a model that streams; ``None``
    if ``error`` is another one."""
    cause = error.__cause__
    said = cause.message() if isinstance(cause, InferenceServerException) else None
    if not said or _DECOUPLED not in said:
        return None
    return InferenceError(
        f"model {model!r} streams (it answers a request many times, and a plain infer takes one answer): read it "
        f"with a stream (gRPC start_stream/async_stream_infer or HTTP generate_stream) [Triton: {said}]",
        pipeline=error.pipeline,
        step=error.step,
    )


def infer_refusal(error: InferenceError, model: str) -> InferenceError | None:
    """What a failed infer raises when the model's config cannot explain it (a model that streams, or
    a failure other than Triton's refusal of the request); ``None`` when the config should be read to
    explain which input was wrong (:func:`~pipelines.triton.rejections.explain_rejection`)."""
    streams = streams_refusal(error, model)
    if streams is not None:
        return streams
    return None if rejected(error) else error


class TritonClient(ClientBase):
    """A blocking client of one Triton server.

    ``timeout`` (seconds) is the default client-side limit for each call; ``None`` waits as
    long as the server takes. Safe to share between threads.
    """

    def _init_connection(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        # tritonclient's HTTP client is gevent-based and neither thread-safe nor able to change
        # its network timeout per call: keep one per (thread, timeout). gRPC channels are shared.
        self._local = threading.local()
        self._http_clients: list[Any] = []
        self._grpc: Any = None
        self._generation = 0  # the server's restarts these connections were made after

    # ---------------------------------------------------------------- plumbing

    def _http(self, timeout: float | None) -> Any:
        clients = getattr(self._local, "clients", None)
        if clients is None or self._local.generation != self._generation:
            clients = self._local.clients = {}
            self._local.generation = self._generation
        client = clients.get(timeout)
        if client is None:
            import tritonclient.http as httpclient

            self._ensure_open()
            client = httpclient.InferenceServerClient(self.url, network_timeout=timeout, connection_timeout=60.0)
            clients[timeout] = client
            with self._lock:
                self._http_clients.append(client)
        return client

    def _grpc_client(self) -> Any:
        if self._grpc is None:
            import tritonclient.grpc as grpcclient

            with self._lock:
                self._ensure_open()
                if self._grpc is None:
                    args = grpc_channel_args(own_subchannel=self._generation > 0)
                    self._grpc = grpcclient.InferenceServerClient(self.url, channel_args=args)
        return self._grpc

    def _ensure_open(self) -> None:
        if self._closed:
            raise ServerError(f"this TritonClient of {self.url} is closed; make a new one")

    def _reconnect_if_restarted(self) -> None:
        """Drop the connections made before the owning server was started again: a gRPC channel
        that failed to connect while it was down keeps failing, "Connection refused", until its
        reconnect backoff (1 s, growing) runs out; its successor gets a subchannel of its own."""
        generation = self._errors.generation()
        if generation == self._generation:
            return
        with self._lock:
            if generation == self._generation:
                return
            self._generation = generation
            stale = [self._grpc] if self._grpc is not None else []
            stale += self._http_clients
            self._grpc, self._http_clients = None, []
        for client in stale:
            with contextlib.suppress(Exception):  # a connection to a dead server may fail to close
                client.close()

    def _call(self, what: str, model: str | None, timeout: float | None, http_call, grpc_call) -> Any:
        self._errors.check()
        self._reconnect_if_restarted()
        generation = self._generation
        try:
            if self.protocol == "http":
                return http_call(self._http(timeout))
            return grpc_call(self._grpc_client(), timeout)
        except PipelinesError:
            raise
        except Exception as exc:
            raise self._errors.translate(exc, what=what, model=model, timeout=timeout, generation=generation) from exc

    # ---------------------------------------------------------------- API

    def infer(
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
        try:
            return self._call(
                "infer on",
                model,
                timeout,
                lambda c: result_arrays(c.infer(**request.http()), "http"),
                lambda c, t: result_arrays(c.infer(**request.grpc(t)), "grpc"),
            )
        except InferenceError as error:
            refusal = infer_refusal(error, model)
            if refusal is not None:
                raise refusal from error.__cause__
            try:
                config = self.model_config(model)
            except PipelinesError:
                raise error from error.__cause__
            raise explain_rejection(error, model=model, inputs=inputs, config=config) from error.__cause__

    def statistics(self, model: str = "") -> dict:
        """Triton's statistics for ``model`` (all models if empty): ``{"model_stats": [...]}``."""
        return self._call(
            "statistics of",
            model or None,
            self.timeout,
            lambda c: c.get_inference_statistics(model_name=model),
            lambda c, t: message_to_dict(c.get_inference_statistics(model_name=model, client_timeout=t)),
        )

    def ready(self, model: str | None = None) -> bool:
        """Whether the server (or ``model`` on it) is ready; ``False`` when it cannot be reached.

        On a server this process owns, a model whose stub died counts as not ready until it is
        reloaded (and the server too, as Triton counts a server ready when all its models are).
        """
        if self._known_broken(model):
            return False
        try:
            answer = bool(self._call("readiness of", model, self.timeout, *self._readiness(model)))
        except (ServerError, InferenceError):
            return False
        return answer and not self._known_broken(model)

    def metadata(self) -> dict:
        """The server's name, version and protocol extensions."""
        return self._call(
            "metadata of",
            None,
            self.timeout,
            lambda c: c.get_server_metadata(),
            lambda c, t: message_to_dict(c.get_server_metadata(client_timeout=t)),
        )

    def model_config(self, model: str) -> dict:
        """The configuration Triton runs ``model`` with, as a dict (auto-completed fields included)."""
        return self._call(
            "config of",
            model,
            self.timeout,
            lambda c: c.get_model_config(model),
            lambda c, t: message_to_dict(c.get_model_config(model, client_timeout=t).config, skip_unset_messages=True),
        )

    def repository_index(self) -> list[dict]:
        """Every model in the repository, loaded or not: name, version, state, reason."""
        index = self._call(
            "repository index of",
            None,
            self.timeout,
            lambda c: list(c.get_model_repository_index()),
            lambda c, t: message_to_dict(c.get_model_repository_index(client_timeout=t))["models"],
        )
        # HTTP leaves out empty fields; give both protocols every key.
        return [
            {
                "name": m.get("name", ""),
                "version": m.get("version", ""),
                "state": m.get("state", ""),
                "reason": m.get("reason", ""),
            }
            for m in index
        ]

    def load_model(self, model: str) -> None:
        """Load or reload ``model`` (the server must run with model_control_mode='explicit')."""
        self._call(
            "load of",
            model,
            self.timeout,
            lambda c: c.load_model(model),
            lambda c, t: c.load_model(model, client_timeout=t),
        )

    def unload_model(self, model: str) -> None:
        self._call(
            "unload of",
            model,
            self.timeout,
            lambda c: c.unload_model(model),
            lambda c, t: c.unload_model(model, client_timeout=t),
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._http_clients = self._http_clients, []
            grpc, self._grpc = self._grpc, None
        for client in clients:
            client.close()
        if grpc is not None:
            grpc.close()

    def close_from_any_thread(self) -> None:
        """:meth:`close`; it is safe from any thread (the server that stops calls it)."""
        self.close()

    def __enter__(self) -> TritonClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TritonClient({self.url!r}, {self.protocol!r})"
