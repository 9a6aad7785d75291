"""Every error the library raises, under one root: :class:`PipelinesError`.

Each error carries its context (pipeline, step, tensor) as attributes and a
message that says what is wrong, what was expected, and the fix::

    PipelinesError
    ├── DeclarationError            a pipeline was declared or wired wrongly
    │   ├── InvalidNameError        a name breaks Triton's rules or could escape a directory
    │   ├── DtypeMismatchError      the two ends of a wire disagree on dtype
    │   ├── ShapeMismatchError      ... on rank or on a fixed dimension
    │   ├── BatchingMismatchError   a step batches differently from its pipeline
    │   ├── UnknownTensorError      an input or output name the step does not declare
    │   ├── UnboundInputError       a step input that nothing feeds
    │   ├── DuplicateNameError      two steps, or two tensors, share a name
    │   ├── TensorProducedTwiceError a tensor that two wires would produce
    │   ├── CycleError              the wiring loops back on itself
    │   ├── ConditionError          a `when` condition, a branch's tensor or an `otherwise` used wrongly
    │   ├── StepDeclarationError    @step was given something it cannot use
    │   └── TensorSpecError         a datatype or dims that Triton has no name for (also a ValueError)
    ├── CompileError                a pipeline could not become a model repository
    │   ├── NotCompilableError      a form cannot express the pipeline (an ensemble of `when` blocks)
    │   └── RepositoryWriteError    writing the repository to disk failed (nothing was changed)
    ├── InferenceError              a request could not be answered
    │   ├── InputError              the request's tensors do not match the pipeline's inputs
    │   ├── StepError               a step raised or returned something wrong
    │   │   └── StepTimeoutError    a step ran past its timeout
    │   ├── ClientTimeoutError      a client gave up waiting for the server's answer
    │   └── StubDiedError           a model's Python stub process died (retry once it is reloaded)
    ├── ServerError                 the embedded Triton server misbehaved
    │   ├── ServerStartError        it did not become ready (holds the log's tail)
    │   └── ServerDiedError         it exited while in use
    ├── ProfileMismatchError        a server profile measured on another server, Triton or protocol
    ├── ArgumentError               a call got a value it has no meaning for: an unknown form,
    │                               target, device or output, no values, a plan of another format
    │                               (also a ValueError)
    └── NotFoundError               a lookup by name found nothing: a model of a repository, a step
                                    or figure of a report, a measurement (also a KeyError)

The only ``RuntimeError`` left is raised inside a Triton stub by ``serving/lifecycle.py`` and
``serving/sources.py`` (a model whose files are broken); the client sees it as the server's error
response, an :class:`InferenceError`.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "ArgumentError",
    "BatchingMismatchError",
    "ClientTimeoutError",
    "CompileError",
    "ConditionError",
    "CycleError",
    "DeclarationError",
    "DtypeMismatchError",
    "DuplicateNameError",
    "InferenceError",
    "InputError",
    "InvalidNameError",
    "NotCompilableError",
    "NotFoundError",
    "PipelinesError",
    "ProfileMismatchError",
    "RepositoryWriteError",
    "ServerDiedError",
    "ServerError",
    "ServerRestartingError",
    "ServerStartError",
    "ShapeMismatchError",
    "StepDeclarationError",
    "StepError",
    "StepTimeoutError",
    "StubDiedError",
    "TensorProducedTwiceError",
    "TensorSpecError",
    "UnboundInputError",
    "UnknownTensorError",
]


class PipelinesError(Exception):
    """Root of every error raised by ``pipelines``.

    ``pipeline``, ``step`` and ``tensor`` name where the error happened when
    that is known; they are ``None`` otherwise. ``node`` is the name the user
    gave the step in the pipeline, where it is known apart from ``step``.
    """

    def __init__(
        self,
        message: str,
        *,
        pipeline: str | None = None,
        step: str | None = None,
        tensor: str | None = None,
        node: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.pipeline = pipeline
        self.step = step
        self.tensor = tensor
        self.node = node

    def __reduce__(self) -> tuple[Any, ...]:  # keep the context when an error crosses a process or thread boundary
        return _rebuild, (type(self), self.message, self.pipeline, self.step, self.tensor, self.node)


def _rebuild(
    cls: type[PipelinesError], message: str, pipeline: str | None, step: str | None, tensor: str | None,
    node: str | None = None,
) -> PipelinesError:
    return cls(message, pipeline=pipeline, step=step, tensor=tensor, node=node)


class DeclarationError(PipelinesError):
    """A pipeline was declared or wired wrongly; raised by the call that did it."""


class InvalidNameError(DeclarationError):
    """A name breaks Triton's naming rules or could escape a directory."""


class DtypeMismatchError(DeclarationError):
    """The two ends of a wire carry different datatypes."""


class ShapeMismatchError(DeclarationError):
    """The two ends of a wire differ in rank or in a fixed dimension."""


class BatchingMismatchError(DeclarationError):
    """A step batches differently from the pipeline it is added to."""


class UnknownTensorError(DeclarationError):
    """An input or output name that the step or pipeline does not declare."""


class UnboundInputError(DeclarationError):
    """A step input that no wire feeds."""


class DuplicateNameError(DeclarationError):
    """Two steps, two tensors, or two bindings share one name."""


class TensorProducedTwiceError(DeclarationError):
    """A tensor would be produced by two wires; a Triton ensemble forbids it."""


class CycleError(DeclarationError):
    """The wiring loops back on itself, so no step order exists."""


class ConditionError(DeclarationError):
    """A ``when`` block's condition is not BOOL with one element per row, a tensor of a branch
    is read where some rows do not run the branch, or an ``otherwise`` fill does not fit."""


class StepDeclarationError(DeclarationError):
    """``@step`` or ``external_model`` was given something it cannot use."""


class TensorSpecError(DeclarationError, ValueError):
    """A datatype or dims that Triton has no name for; a ``ValueError`` too, as it always was."""


class CompileError(PipelinesError):
    """A pipeline could not be turned into a Triton model repository."""


class NotCompilableError(CompileError):
    """A form cannot express the pipeline: an ensemble cannot skip a step, so a pipeline with
    ``when`` blocks compiles to the BLS and fused forms only."""


class RepositoryWriteError(CompileError):
    """Writing a model repository failed; the target was left as it was."""


class InferenceError(PipelinesError):
    """A request could not be answered."""


class InputError(InferenceError):
    """A request's tensors do not match what the pipeline declares."""


class StepError(InferenceError):
    """A step raised, or returned outputs that break its declaration."""


class StepTimeoutError(StepError):
    """A step ran past its timeout."""


class ClientTimeoutError(InferenceError):
    """A client stopped waiting for the server's answer (its ``timeout=``); nothing says a step hung.

    ``step`` names the model that was asked. The request may still run on the server.
    """


class StubDiedError(InferenceError):
    """The Python stub process of a model died, so Triton could not run the request.

    ``model`` names that model. An embedded :class:`~pipelines.triton.TritonServer` reloads it
    (``reloading`` is then True): retry after a few seconds. A stock Triton 2.51 never does.
    """

    def __init__(self, message: str, *, model: str = "", reloading: bool = False, **context: str | None) -> None:
        super().__init__(message, **context)
        self.model = model
        self.reloading = reloading


class ServerError(PipelinesError):
    """The embedded Triton server failed to start, or stopped while in use."""


class ServerStartError(ServerError):
    """The server did not become ready; the message holds its log's tail."""


class ServerDiedError(ServerError):
    """The server process exited while it was in use."""


class ServerRestartingError(ServerDiedError):
    """The embedded server died on its own and is starting again on the same ports: retry."""


class ProfileMismatchError(PipelinesError):
    """A server profile was measured on another server, Triton version, protocol or machine than
    the one it would predict. ``differences`` names each; the message says how to go on anyway
    (``--allow-mismatch``, ``allow_mismatch=True``) or to recalibrate."""

    def __init__(self, message: str, *, differences: tuple[str, ...] = (), **context: str | None) -> None:
        super().__init__(message, **context)
        self.differences = tuple(differences)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the differences when the error crosses a process boundary
        return _rebuild_mismatch, (self.message, self.differences)


def _rebuild_mismatch(message: str, differences: tuple[str, ...]) -> ProfileMismatchError:
    return ProfileMismatchError(message, differences=differences)


class ArgumentError(PipelinesError, ValueError):
    """A call got a value it has no meaning for; the message lists what it accepts.

    A ``ValueError`` too, so code that caught the ``ValueError`` these calls raised before
    keeps working.
    """


class NotFoundError(PipelinesError, KeyError):
    """A lookup by name found nothing; the message lists the names there are.

    A ``KeyError`` too, as these lookups always were; printed as its message, not quoted.
    """

    __str__ = Exception.__str__  # KeyError's str() would repr() the message


if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup as _BaseExceptionGroup
else:  # Python 3.10: anyio's own backport
    from exceptiongroup import BaseExceptionGroup as _BaseExceptionGroup


def sole_exception(exc: BaseException) -> BaseException:
    """The one exception a task group's wrapper holds (unwrapped through nested ones), or ``exc``.

    A step's error raised inside a task group (the load generator's, a runtime's) comes out
    wrapped in an exception group; callers catch, and users read, the error itself.
    """
    while isinstance(exc, _BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
