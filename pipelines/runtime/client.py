"""Clients of a Triton server, local or remote: numpy in, numpy out, errors from ``pipelines.errors``.

:class:`TritonClient` blocks; :class:`AsyncTritonClient` is for asyncio (the load generator).
Both speak HTTP (binary tensor data both ways) or gRPC, and return the same dict shapes for both.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from ..errors import InferenceError, InputError, PipelinesError, ServerError, StepTimeoutError
from .rejections import REJECTED_STATUSES, explain_rejection

__all__ = ["AsyncTritonClient", "Liveness", "TritonClient", "infer_inputs", "message_to_dict"]

PROTOCOLS = ("http", "grpc")
# The server's own words for a request that a client-side deadline cut short (gRPC).
_DEADLINE = "DEADLINE_EXCEEDED"
# gRPC's status for a server that cannot be reached: a transport failure, not an answer.
_UNAVAILABLE = "UNAVAILABLE"


class Liveness(Protocol):
    """What a client of a server owned by this process calls to fail fast once that server died."""

    def check(self) -> None:
        """Raise ``ServerDiedError`` if the server is gone."""

    def check_after_failure(self) -> None:
        """Like :meth:`check`, but allows a server being killed a moment to finish exiting."""


def _check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ServerError(f"protocol {protocol!r} is not one Triton speaks here; use 'http' or 'grpc'")
    return protocol


def _strip_scheme(url: str) -> str:
    # tritonclient wants host:port; accept what users paste from a browser too.
    for scheme in ("http://", "grpc://"):
        if url.startswith(scheme):
            url = url[len(scheme) :]
    return url.rstrip("/")


def requested_outputs(module: Any, outputs: Sequence[str] | None, *, binary: bool) -> list[Any] | None:
    """tritonclient's requested outputs for ``outputs`` (None: all of them)."""
    if not outputs:
        return None
    if binary:  # only HTTP takes binary_data; gRPC is always binary
        return [module.InferRequestedOutput(n, binary_data=True) for n in outputs]
    return [module.InferRequestedOutput(n) for n in outputs]


def result_arrays(result: Any, protocol: str) -> dict[str, np.ndarray]:
    """Every output of an infer result, as numpy arrays by name."""
    return {name: result.as_numpy(name) for name in _output_names(result, protocol)}


def infer_inputs(module: Any, inputs: Mapping[str, Any], *, binary: bool) -> list[Any]:
    """``InferInput`` objects of tritonclient ``module`` (http or grpc) for numpy ``inputs``."""
    built = []
    for name, value in inputs.items():
        array = np.asarray(value)
        if array.dtype.kind == "U":  # Triton BYTES carry bytes; str is encoded as UTF-8
            array = np.char.encode(array, "utf-8").astype(object)
        if array.dtype.kind in "OS":
            datatype = "BYTES"
        else:
            datatype = np_to_triton_dtype(array.dtype)
        if datatype is None:
            raise InputError(
                f"input {name!r} has numpy dtype {array.dtype}, which has no Triton datatype; "
                "convert it to a numeric, bool or bytes (object) array",
                tensor=name,
            )
        tensor = module.InferInput(name, list(array.shape), datatype)
        try:
            if binary:
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
        except InferenceServerException as exc:
            raise InputError(
                f"input {name!r} ({datatype}, shape {list(array.shape)}): {exc.message()}", tensor=name
            ) from None
        built.append(tensor)
    return built


def message_to_dict(message: Any, *, skip_unset_messages: bool = False) -> dict:
    """A protobuf message as the dict Triton's HTTP API returns for it.

    Unlike ``MessageToDict`` it keeps int64 as int and prints scalars left at their
    default, so the gRPC and HTTP answers have the same shape. Triton's HTTP model
    config leaves out sub-messages that are not set: ``skip_unset_messages`` does too.
    """
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != field.name:
            continue
        if (
            skip_unset_messages
            and field.message_type is not None
            and not _is_repeated(field)
            and not message.HasField(field.name)
        ):
            continue
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {key: _field_value(value_field, item, skip_unset_messages) for key, item in value.items()}
        elif _is_repeated(field):
            out[field.name] = [_field_value(field, item, skip_unset_messages) for item in value]
        else:
            out[field.name] = _field_value(field, value, skip_unset_messages)
    return out


def _is_repeated(field: Any) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28 deprecates `label`
    if isinstance(is_repeated, bool):
        return is_repeated
    return field.label == field.LABEL_REPEATED


def _field_value(field: Any, value: Any, skip_unset_messages: bool = False) -> Any:
    if field.message_type is not None:
        return message_to_dict(value, skip_unset_messages=skip_unset_messages)
    if field.enum_type is not None:
        named = field.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    return value


def _output_names(result: Any, protocol: str) -> list[str]:
    response = result.get_response()
    if protocol == "http":
        return [output["name"] for output in response.get("outputs", [])]
    return [output.name for output in response.outputs]


def _rejected(error: InferenceError) -> bool:
    """Whether Triton refused the request itself (HTTP 400, gRPC INVALID_ARGUMENT)."""
    cause = error.__cause__
    return isinstance(cause, InferenceServerException) and (cause.status() or "") in REJECTED_STATUSES


def _is_timeout(exc: BaseException) -> bool:
    # geventhttpclient raises socket.timeout or gevent's Timeout; aiohttp and anyio TimeoutError.
    return isinstance(exc, (socket.timeout, TimeoutError)) or type(exc).__name__ in ("Timeout", "ServerTimeoutError")


# The step models and the BLS executor name the failing step as "pipeline 'p' step 's'"
# (a BLS adds "(model 'm')" between them); Triton puts that text in the error it returns.
_STEP_NAMED = re.compile(r"pipeline '([^']+)'(?: \(model '[^']+'\))?:? step '([^']+)'")


def _named_in(text: str, *, default_step: str | None) -> dict[str, str | None]:
    """The pipeline and step an error from the server names, so ``err.step`` is the step, not the model."""
    found = _STEP_NAMED.search(text)
    if found is None:
        return {"step": default_step}
    return {"pipeline": found.group(1), "step": found.group(2)}


class _Errors:
    """Turns what tritonclient raises into the library's errors, in one place for both clients."""

    def __init__(self, url: str, protocol: str, liveness: Liveness | None) -> None:
        self.url = url
        self.protocol = protocol
        self.liveness = liveness

    def check(self) -> None:
        if self.liveness is not None:
            self.liveness.check()

    def translate(self, exc: BaseException, *, what: str, model: str | None, timeout: float | None) -> PipelinesError:
        where = f"{self.protocol} {self.url}"
        subject = f"model {model!r}" if model else "the server"
        if isinstance(exc, InferenceServerException):
            status = exc.status() or ""
            if _DEADLINE in status:
                return self._timeout(what, subject, model, timeout, where)
            if _UNAVAILABLE not in status:
                # The server's text stays first and intact: it names the failing step.
                status_note = f"status {status}, " if status else ""
                text = exc.message() or ""
                return InferenceError(
                    f"{text} ({what} {subject}, {status_note}{where})",
                    **_named_in(text, default_step=model),
                )
        elif _is_timeout(exc):
            return self._timeout(what, subject, model, timeout, where)
        if self.liveness is not None:
            self.liveness.check_after_failure()
        detail = exc.message() if isinstance(exc, InferenceServerException) else f"{type(exc).__name__}: {exc}"
        return ServerError(
            f"cannot reach the Triton server at {where} ({what} {subject}): {detail}; "
            "check that the server runs and that the URL and protocol are right"
        )

    @staticmethod
    def _timeout(what: str, subject: str, model: str | None, timeout: float | None, where: str) -> StepTimeoutError:
        limit = f"within {timeout:g} s" if timeout is not None else "in time"
        return StepTimeoutError(
            f"{what} {subject} got no answer {limit} (client-side timeout, {where}); "
            "pass a larger timeout= if the model is slow, or check the server log",
            step=model,
        )


class TritonClient:
    """A blocking client of one Triton server.

    ``timeout`` (seconds) is the default client-side limit for each call; ``None`` waits as
    long as the server takes. Safe to share between threads.
    """

    def __init__(
        self,
        url: str,
        protocol: str = "http",
        *,
        timeout: float | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.url = _strip_scheme(url)
        self.protocol = _check_protocol(protocol)
        self.timeout = timeout
        self._errors = _Errors(self.url, self.protocol, liveness)
        self._lock = threading.Lock()
        self._closed = False
        # tritonclient's HTTP client is gevent-based and neither thread-safe nor able to change
        # its network timeout per call: keep one per (thread, timeout). gRPC channels are shared.
        self._local = threading.local()
        self._http_clients: list[Any] = []
        self._grpc: Any = None

    # ---------------------------------------------------------------- plumbing

    def _http(self, timeout: float | None) -> Any:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
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
                    self._grpc = grpcclient.InferenceServerClient(self.url)
        return self._grpc

    def _ensure_open(self) -> None:
        if self._closed:
            raise ServerError(f"this TritonClient of {self.url} is closed; make a new one")

    def _call(self, what: str, model: str | None, timeout: float | None, http_call, grpc_call) -> Any:
        self._errors.check()
        try:
            if self.protocol == "http":
                return http_call(self._http(timeout))
            return grpc_call(self._grpc_client(), timeout)
        except PipelinesError:
            raise
        except Exception as exc:
            raise self._errors.translate(exc, what=what, model=model, timeout=timeout) from exc

    # ---------------------------------------------------------------- API

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on numpy ``inputs``; return its outputs (all of them, or those named)."""
        timeout = self.timeout if timeout is None else timeout

        def over_http(client: Any) -> dict[str, np.ndarray]:
            import tritonclient.http as httpclient

            requested = requested_outputs(httpclient, outputs, binary=True)
            result = client.infer(model, infer_inputs(httpclient, inputs, binary=True), outputs=requested)
            return result_arrays(result, "http")

        def over_grpc(client: Any, limit: float | None) -> dict[str, np.ndarray]:
            import tritonclient.grpc as grpcclient

            requested = requested_outputs(grpcclient, outputs, binary=False)
            result = client.infer(
                model, infer_inputs(grpcclient, inputs, binary=False), outputs=requested, client_timeout=limit
            )
            return result_arrays(result, "grpc")

        try:
            return self._call("infer on", model, timeout, over_http, over_grpc)
        except InferenceError as error:
            if not _rejected(error):
                raise
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
        """Whether the server (or ``model`` on it) is ready; ``False`` when it cannot be reached."""
        try:
            return bool(
                self._call(
                    "readiness of",
                    model,
                    self.timeout,
                    lambda c: c.is_model_ready(model) if model else c.is_server_ready(),
                    lambda c, t: (
                        c.is_model_ready(model, client_timeout=t) if model else c.is_server_ready(client_timeout=t)
                    ),
                )
            )
        except (ServerError, InferenceError):
            return False

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

    def __enter__(self) -> TritonClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TritonClient({self.url!r}, {self.protocol!r})"


class AsyncTritonClient:
    """An asyncio client of one Triton server (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``).

    Made anywhere, it connects on first use inside the running event loop. Use it from one
    loop; many concurrent ``infer`` calls share its connections (no limit on their number).
    """

    def __init__(
        self,
        url: str,
        protocol: str = "http",
        *,
        timeout: float | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.url = _strip_scheme(url)
        self.protocol = _check_protocol(protocol)
        self.timeout = timeout
        self._errors = _Errors(self.url, self.protocol, liveness)
        self._client: Any = None
        self._closed = False

    def _get(self) -> Any:
        if self._closed:
            raise ServerError(f"this AsyncTritonClient of {self.url} is closed; make a new one")
        if self._client is None:
            if self.protocol == "http":
                import tritonclient.http.aio as aiohttpclient

                # conn_timeout caps every request in aiohttp; per-call limits come from anyio instead.
                self._client = aiohttpclient.InferenceServerClient(self.url, conn_limit=0, conn_timeout=None)
            else:
                import tritonclient.grpc.aio as aiogrpcclient

                self._client = aiogrpcclient.InferenceServerClient(self.url)
        return self._client

    async def _call(self, what: str, model: str | None, timeout: float | None, http_call, grpc_call) -> Any:
        import anyio

        self._errors.check()
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
            raise self._errors.translate(exc, what=what, model=model, timeout=timeout) from exc

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on numpy ``inputs``; return its outputs (all of them, or those named)."""
        timeout = self.timeout if timeout is None else timeout

        async def over_http(client: Any) -> dict[str, np.ndarray]:
            import tritonclient.http as httpclient

            requested = requested_outputs(httpclient, outputs, binary=True)
            result = await client.infer(model, infer_inputs(httpclient, inputs, binary=True), outputs=requested)
            return result_arrays(result, "http")

        async def over_grpc(client: Any, limit: float | None) -> dict[str, np.ndarray]:
            import tritonclient.grpc as grpcclient

            requested = requested_outputs(grpcclient, outputs, binary=False)
            result = await client.infer(
                model, infer_inputs(grpcclient, inputs, binary=False), outputs=requested, client_timeout=limit
            )
            return result_arrays(result, "grpc")

        try:
            return await self._call("infer on", model, timeout, over_http, over_grpc)
        except InferenceError as error:
            if not _rejected(error):
                raise
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
            lambda c: c.get_inference_statistics(model_name=model),
            over_grpc,
        )

    async def ready(self, model: str | None = None) -> bool:
        try:
            return bool(
                await self._call(
                    "readiness of",
                    model,
                    self.timeout,
                    lambda c: c.is_model_ready(model) if model else c.is_server_ready(),
                    lambda c, t: (
                        c.is_model_ready(model, client_timeout=t) if model else c.is_server_ready(client_timeout=t)
                    ),
                )
            )
        except (ServerError, InferenceError):
            return False

    async def metadata(self) -> dict:
        async def over_grpc(c: Any, t: float | None) -> dict:
            return message_to_dict(await c.get_server_metadata(client_timeout=t))

        return await self._call("metadata of", None, self.timeout, lambda c: c.get_server_metadata(), over_grpc)

    async def model_config(self, model: str) -> dict:
        async def over_grpc(c: Any, t: float | None) -> dict:
            return message_to_dict((await c.get_model_config(model, client_timeout=t)).config, skip_unset_messages=True)

        return await self._call("config of", model, self.timeout, lambda c: c.get_model_config(model), over_grpc)

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def __aenter__(self) -> AsyncTritonClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncTritonClient({self.url!r}, {self.protocol!r})"
