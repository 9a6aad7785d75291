"""What both clients share about a connection: the protocol, the URL, and turning what
tritonclient raises into the library's errors (a dead owned server fails fast)."""

from __future__ import annotations

import re
import socket
from typing import Protocol

from tritonclient.utils import InferenceServerException

from ..errors import ClientTimeoutError, InferenceError, PipelinesError, ServerError
from .rejections import REJECTED_STATUSES

__all__ = ["PROTOCOLS", "ErrorTranslator", "Liveness", "check_protocol", "rejected", "strip_scheme"]

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


# The step models and the BLS executor name the failing step as "pipeline 'p' step 's'"
# (a BLS adds "(model 'm')" between them); Triton puts that text in the error it returns.
_STEP_NAMED = re.compile(r"pipeline '([^']+)'(?: \(model '[^']+'\))?:? step '([^']+)'")


def _named_in(text: str, *, default_step: str | None) -> dict[str, str | None]:
    """The pipeline and step an error from the server names, so ``err.step`` is the step, not the model."""
    found = _STEP_NAMED.search(text)
    if found is None:
        return {"step": default_step}
    return {"pipeline": found.group(1), "step": found.group(2)}


class ErrorTranslator:
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
    def _timeout(what: str, subject: str, model: str | None, timeout: float | None, where: str) -> ClientTimeoutError:
        limit = f"within {timeout:g} s" if timeout is not None else "in time"
        return ClientTimeoutError(
            f"{what} {subject} got no answer {limit} (client-side timeout, {where}); "
            "pass a larger timeout= if the model is slow, or check the server log",
            step=model,
        )
