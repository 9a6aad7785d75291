"""Restating a request that Triton refused before any model ran.

Triton's front end checks every request against the model's config, but some of
its words are weak ("batch-size must be <= 4" names no tensor, an empty batch is
reported as a byte-size mismatch). The client compares what it sent with the
model's config and says which tensor is wrong, expected against given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.requests import check_request
from ..core.tensor import TensorSpec
from ..errors import InferenceError, InputError

__all__ = ["REJECTED_STATUSES", "explain_rejection"]

#: How HTTP and gRPC say "the request itself is wrong" (tritonclient's ``status()``).
REJECTED_STATUSES = ("400", "StatusCode.INVALID_ARGUMENT")


def explain_rejection(
    error: InferenceError, *, model: str, inputs: Mapping[str, Any], config: Mapping[str, Any]
) -> InferenceError:
    """An :class:`InputError` naming the faulty tensor, or ``error`` as it was if none is found.

    ``config`` is the model's configuration as :meth:`TritonClient.model_config` returns it.
    Triton's own text is kept at the end, so nothing it said is lost.
    """
    try:
        specs = {
            entry["name"]: TensorSpec(entry["data_type"], entry.get("dims", ()))
            for entry in config.get("input", ())
            # An optional input may be left out; only check it when it is sent.
            if not entry.get("optional") or entry["name"] in inputs
        }
        max_batch_size = int(config.get("max_batch_size", 0))
    except (KeyError, TypeError, ValueError):  # a config this check does not understand: keep Triton's words
        return error
    try:
        check_request(inputs, specs, pipeline=model, max_batch_size=max_batch_size)
    except InputError as found:
        detail = found.message.removeprefix(f"pipeline {model!r}: ")
        return InputError(
            f"model {model!r} refused the request: {detail} [Triton: {error.message}]",
            pipeline=error.pipeline,
            step=error.step,
            tensor=found.tensor,
        )
    return error
