"""How the endpoint refuses a request: the HTTP status and gRPC code a Triton server uses.

Observed on the bundled tritonserver 2.51 (``tests/test_endpoint_vs_triton.py`` checks
each against it; ``docs/triton_statuses.md`` lists them):

- an unknown model: HTTP 404, gRPC ``NOT_FOUND``;
- a request that does not match the model (inputs missing or extra, dtype, shape,
  batch size, binary sizes, unknown outputs): HTTP 400, gRPC ``INVALID_ARGUMENT``;
- a body that is not the protocol's JSON, or ``data`` that does not fit its shape:
  HTTP 500 (Triton answers those as internal errors), gRPC ``INVALID_ARGUMENT``;
- a step that fails: HTTP 500, gRPC ``INTERNAL``;
- a plain (non-streaming) infer on a decoupled model, which a streaming pipeline's is:
  HTTP 501, gRPC ``UNIMPLEMENTED`` (``docs/triton_decoupled.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from ..errors import InferenceError, InputError, PipelinesError
from ..serving import WireError, parse_error

if TYPE_CHECKING:
    from .models import ServedModel

__all__ = [
    "INTERNAL",
    "INVALID",
    "NOT_FOUND",
    "PARSE",
    "UNSUPPORTED",
    "Refusal",
    "Status",
    "error_text",
    "status_of",
]

# The local runtime opens its messages with where it happened; the wire format says that in its own fields.
_WHERE = re.compile(r"^pipeline '[^']*'(?: step '[^']*')?:? ")


@dataclass(frozen=True)
class Status:
    """One kind of refusal, as each protocol says it."""

    http: int
    grpc: grpc.StatusCode


NOT_FOUND = Status(404, grpc.StatusCode.NOT_FOUND)
INVALID = Status(400, grpc.StatusCode.INVALID_ARGUMENT)
PARSE = Status(500, grpc.StatusCode.INVALID_ARGUMENT)
INTERNAL = Status(500, grpc.StatusCode.INTERNAL)
UNSUPPORTED = Status(501, grpc.StatusCode.UNIMPLEMENTED)


class Refusal(InferenceError):
    """A request the endpoint refused before the pipeline ran, with the status to answer it with."""

    def __init__(self, status: Status, message: str, **context: str | None) -> None:
        super().__init__(message, **context)
        self.status = status

    def __reduce__(self):
        return _rebuild, (self.status, self.message, self.pipeline, self.step, self.tensor)


def _rebuild(status, message, pipeline, step, tensor):
    return Refusal(status, message, pipeline=pipeline, step=step, tensor=tensor)


def status_of(error: BaseException) -> Status:
    """The status of any error answering a request: the request's fault, or the server's."""
    if isinstance(error, Refusal):
        return error.status
    if isinstance(error, InputError):
        return INVALID
    if isinstance(error, PipelinesError):
        return INTERNAL
    return INTERNAL


def error_text(error: BaseException, model: ServedModel | None = None) -> str:
    """The text ``model`` (the served model that answered) answers ``error`` with, as its compiled form would.

    What Triton's front end refuses (an unknown model, an undecodable body, a request
    that does not fit the model's inputs) keeps plain words, as Triton's own are; an
    error raised at a step is written in the models' wire format
    (:class:`pipelines.serving.WireError`). So :class:`~pipelines.triton.TritonClient`
    reads back the same class, node, step and tensor from both. Triton's ensemble
    scheduler opens a composing model's error with ``in ensemble '<name>', ``; the
    ensemble mode's model does too.
    """
    if not isinstance(error, PipelinesError):
        return f"{type(error).__name__}: {error}"
    node = getattr(error, "node", None) or error.step
    if isinstance(error, Refusal) or error.pipeline is None or (isinstance(error, InputError) and node is None):
        return error.message
    pipeline = model.pipeline if model is not None else None
    step = None
    if node is not None and pipeline is not None and node in pipeline.nodes:
        step = pipeline.nodes[node].step.name
    said = parse_error(error.message)
    if said is not None and said.pipeline == error.pipeline:  # the runtime's step errors read as the wire already
        text = error.message
    else:
        reason = _WHERE.sub("", error.message, count=1)
        text = WireError(type(error).__name__, error.pipeline, reason, node=node, step=step, tensor=error.tensor).text()
    return f"in ensemble '{model.name}', {text}" if model is not None and model.mode == "ensemble" else text
