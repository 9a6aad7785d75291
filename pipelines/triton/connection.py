"""What both clients share about a connection: the protocol, the URL, and turning what
tritonclient raises into the library's errors (a dead owned server fails fast)."""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from typing import Protocol

from tritonclient.utils import InferenceServerException

from ..errors import (
    ClientTimeoutError,
    InferenceError,
    InputError,
    PipelinesError,
    ServerError,
    StepError,
    StepTimeoutError,
    StubDiedError,
)
from ..serving import parse_error
from .rejections import REJECTED_STATUSES
from .stubs import dead_stub_instance, model_of_instance

__all__ = ["PROTOCOLS", "ClientBase", "ErrorTranslator", "Liveness", "check_protocol", "rejected", "strip_scheme"]

PROTOCOLS = ("http", "grpc")
# The server's own words for a request that a client-side deadline cut short (gRPC).
_DEADLINE = "DEADLINE_EXCEEDED"
# gRPC's status for a server that cannot be reached: a transport failure, not an answer.
_UNAVAILABLE = "UNAVAILABLE"
# What Triton answers for a model while it is being reloaded (or a call that met its dead stub);
# an error in other words, once the model is back, is the model's own (a failing step, a timeout).
_RELOAD_SYMPTOM = re.compile(r"is not ready|not healthy|unknown model|is not found|no available versions|"
                             r"not loaded|unload", re.IGNORECASE)


def grpc_channel_args(*, own_subchannel: bool) -> list[tuple[str, int]] | None:
    """The gRPC channel options of a client: tritonclient's defaults (None), or those on a
    subchannel of its own. gRPC shares subchannels between channels to one address, so a new
    channel to a server started again on the same port would inherit the old one's failed
    connection, "Connection refused" until its reconnect backoff (1 s, growing) ran out."""
    if not own_subchannel:
        return None
    import tritonclient.grpc as grpcclient

    keepalive = grpcclient.KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.use_local_subchannel_pool", 1),
    ]


class Liveness(Protocol):
    """What a client of a server owned by this process calls to fail fast once that server died."""

    def check(self) -> None:
        """Raise ``ServerDiedError`` if the server is gone."""

    def check_after_failure(self) -> None:
        """Like :meth:`check`, but allows a server being killed a moment to finish exiting."""

    def check_serving(self, model: str) -> None:
        """``model``, which the server serves, was answered as unknown or not ready: raise the
        server's death (a dying server answers so for every model it had) if it dies now."""

    def restarted_since(self, generation: int) -> PipelinesError | None:
        """The error for a call begun at ``generation`` that failed while the server was starting
        again after dying, or that has been started again since: retry. None otherwise."""

    def stub_died(self, instance: str) -> bool:
        """A request found ``instance``'s stub dead; whether the server reloads its model."""

    def model_of(self, instance: str) -> str:
        """The model that a stub instance runs."""

    def broken(self, model: str | None) -> str | None:
        """Why ``model`` (None: any model) cannot answer although Triton says it is ready; None if it can."""

    def reloading_models(self) -> dict[str, str]:
        """Each model that fails now, or did a moment ago, because a stub died: the model whose stub died."""

    def unavailable(self) -> Mapping[str, str]:
        """Each model that failed to load when the server started: Triton's reason."""

    def generation(self) -> int:
        """How many times the server was started again after dying; a client reconnects when it changes."""


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ServerError(f"protocol {protocol!r} is not one Triton speaks here; use 'http' or 'grpc'")
    return protocol


def strip_scheme(url: str) -> str:
    # tritonclient wants host:port; accept what users paste from a browser too.
    for scheme in ("http://", "grpc://"):
        if url.startswith(scheme):
            url = url[len(scheme) :]
    return url.rstrip("/")


def rejected(error: InferenceError) -> bool:
    """Whether Triton refused the request itself (HTTP 400, gRPC INVALID_ARGUMENT)."""
    cause = error.__cause__
    return isinstance(cause, InferenceServerException) and (cause.status() or "") in REJECTED_STATUSES


def _is_timeout(exc: BaseException) -> bool:
    # geventhttpclient raises socket.timeout or gevent's Timeout; aiohttp and anyio TimeoutError.
    return isinstance(exc, (socket.timeout, TimeoutError)) or type(exc).__name__ in ("Timeout", "ServerTimeoutError")


def _server_error(text: str, *, model: str | None, suffix: str) -> InferenceError:
    """The library's error for a model's error text: its class, pipeline, node, step and tensor
    read from the wire format that the models write (:class:`pipelines.serving.WireError`).

    ``step`` names the node, as the local runtime's errors do; ``node`` too.
    """
    said = parse_error(text)
    if said is None:
        return InferenceError(f"{text}{suffix}", step=model)
    cls = _WIRE_KINDS.get(said.kind, InferenceError)
    return cls(
        f"{text}{suffix}", pipeline=said.pipeline, node=said.node, step=said.node or said.step, tensor=said.tensor
    )


_WIRE_KINDS = {"InputError": InputError, "StepError": StepError, "StepTimeoutError": StepTimeoutError}


class ErrorTranslator:
    """Turns what tritonclient raises into the library's errors, in one place for both clients."""

    def __init__(self, url: str, protocol: str, liveness: Liveness | None) -> None:
        self.url = url
        self.protocol = protocol
        self.liveness = liveness

    def check(self) -> None:
        if self.liveness is not None:
            self.liveness.check()

    def generation(self) -> int:
        return self.liveness.generation() if self.liveness is not None else 0

    def translate(self, exc: BaseException, *, what: str, model: str | None, timeout: float | None,
                  generation: int | None = None) -> PipelinesError:
        """The library's error for ``exc``, which a call begun at the server's ``generation`` (its
        restarts then) raised."""
        where = f"{self.protocol} {self.url}"
        subject = f"model {model!r}" if model else "the server"
        if self.liveness is not None and generation is not None:
            # A call that met a restart: the new server answers "unknown model" until it has loaded
            # again what the dead one had (on a starved machine a client thread sends the call it
            # checked before the death only once the new server listens). Retry, as any other call.
            restarting = self.liveness.restarted_since(generation)
            if restarting is not None:
                return restarting
        if isinstance(exc, InferenceServerException):
            status = exc.status() or ""
            if _DEADLINE in status:
                return self._timeout(what, subject, model, timeout, where)
            if _UNAVAILABLE not in status:
                # The server's text stays first and intact: it names the failing step.
                status_note = f"status {status}, " if status else ""
                text = exc.message() or ""
                instance = dead_stub_instance(text)
                context = f"{what} {subject}, {status_note}{where}"
                if instance is not None:
                    dead = self.liveness.model_of(instance) if self.liveness else model_of_instance(instance)
                    return self._stub_died(text, context, model, dead=dead, instance=instance)
                reloading = self._reloading(text, model)
                if reloading is not None:
                    return self._stub_died(text, context, model, dead=reloading)
                if self.liveness is not None and model is not None and _RELOAD_SYMPTOM.search(text):
                    self.liveness.check_serving(model)
                suffix = f" ({what} {subject}, {status_note}{where}){self._never_loaded(text, model)}"
                return _server_error(text, model=model, suffix=suffix)
        elif _is_timeout(exc):
            return self._timeout(what, subject, model, timeout, where)
        if self.liveness is not None:
            self.liveness.check_after_failure()
        detail = exc.message() if isinstance(exc, InferenceServerException) else f"{type(exc).__name__}: {exc}"
        return ServerError(
            f"cannot reach the Triton server at {where} ({what} {subject}): {detail}; "
            "check that the server runs and that the URL and protocol are right"
        )

    def _reloading(self, text: str, model: str | None) -> str | None:
        """The model whose reload (after its stub died) made this request fail, if it is one.

        While the owning server reloads a model, Triton answers "unknown model" or "not
        ready" for it and for the ensembles that use it.
        """
        if self.liveness is None:
            return None
        reloading = self.liveness.reloading_models()
        dead = reloading[model] if model in reloading else next(
            (dead for name, dead in reloading.items() if f"'{name}'" in text), None)
        if dead is None:
            return None
        # Until the reload is done every failure is its doing; after it, only the reload's own words are.
        return dead if self.liveness.broken(dead) is not None or _RELOAD_SYMPTOM.search(text) else None

    def _never_loaded(self, text: str, model: str | None) -> str:
        """Why the model that Triton answers "unknown" or "not ready" for (the one asked, or a
        step the text names) failed to load at the server's start, as a sentence; "" if it did not.
        """
        if self.liveness is None or not _RELOAD_SYMPTOM.search(text):
            return ""
        unavailable = self.liveness.unavailable()
        # The model the text names first (a BLS model's step), else the one asked for.
        named = [n for n in unavailable if f"'{n}'" in text and n != model]
        name = named[0] if named else model if model in unavailable else None
        if name is None:
            return ""
        why = unavailable[name].strip().splitlines()[0] if unavailable[name].strip() else "no reason given"
        return (f"; model {name!r} failed to load when the server started: {why} "
                "(the server log has the rest); fix it, then load it or restart the server")

    def _stub_died(
        self, text: str, context: str, model: str | None, *, dead: str, instance: str | None = None
    ) -> StubDiedError:
        if self.liveness is None:
            reloading = False
        elif instance is not None:
            reloading = self.liveness.stub_died(instance)
        else:  # the request met the reload itself
            reloading = True
        if reloading:
            advice = "the server is reloading it, retry in a few seconds"
        else:
            advice = (
                "Triton 2.51 does not restart it and still reports the model READY; "
                "reload the model (explicit model control) or restart the server"
            )
        which = f" (instance {instance})" if instance else ""
        said = parse_error(text)  # a BLS model names the pipeline and the step that met the dead stub
        return StubDiedError(
            f"model {dead!r}'s stub process died{which}; {advice} [Triton: {text}] ({context})",
            model=dead,
            reloading=reloading,
            pipeline=said.pipeline if said else None,
            node=said.node if said else None,
            step=(said.node or said.step) if said else model,
        )

    @staticmethod
    def _timeout(what: str, subject: str, model: str | None, timeout: float | None, where: str) -> ClientTimeoutError:
        limit = f"within {timeout:g} s" if timeout is not None else "in time"
        return ClientTimeoutError(
            f"{what} {subject} got no answer {limit} (client-side timeout, {where}); "
            "pass a larger timeout= if the model is slow, or check the server log",
            step=model,
        )


class ClientBase:
    """What the blocking and the asyncio client share: where they connect, and how they read answers.

    ``ClientClass(url, protocol="http", *, timeout=None)``: ``url`` is ``host:port`` (a scheme
    is dropped), ``protocol`` "http" or "grpc", ``timeout`` the default per-call limit in seconds.
    """

    def __init__(
        self,
        url: str,
        protocol: str = "http",
        *,
        timeout: float | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.url = strip_scheme(url)
        self.protocol = check_protocol(protocol)
        self.timeout = timeout
        self._errors = ErrorTranslator(self.url, self.protocol, liveness)
        self._init_connection()

    def _init_connection(self) -> None:
        """Set up what the subclass holds per connection (nothing is opened before first use)."""

    def _known_broken(self, model: str | None) -> bool:
        # Triton 2.51 keeps a model whose stub died READY (and answers only once its reload
        # is done); the server that owns it knows better, and says so at once.
        liveness = self._errors.liveness
        return liveness is not None and liveness.broken(model) is not None

    @staticmethod
    def _readiness(model: str | None):
        """The readiness call over HTTP and over gRPC (a model's, or the server's)."""
        return (
            lambda c: c.is_model_ready(model) if model else c.is_server_ready(),
            lambda c, t: c.is_model_ready(model, client_timeout=t) if model else c.is_server_ready(client_timeout=t),
        )
