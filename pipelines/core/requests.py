"""Request validation for the local runtime and the client: the checks of
:mod:`pipelines.serving` (which the models on a server run too, with the same
words), raised as :class:`~pipelines.errors.InputError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import serving
from ..errors import InputError
from ..serving import is_array
from .tensor import TensorSpec

__all__ = ["check_request", "is_array"]


def check_request(
    inputs: Mapping[str, Any],
    specs: Mapping[str, TensorSpec],
    *,
    pipeline: str,
    max_batch_size: int,
    step: str | None = None,
) -> dict[str, Any]:
    """Return the request's arrays, in ``specs`` order, or raise :class:`InputError`.

    See :func:`pipelines.serving.check_request`; the message starts with
    ``pipeline 'p'`` (and ``step 's'`` when given).
    """
    where = f"pipeline {pipeline!r}" + (f" step {step!r}" if step else "")

    def fail(message: str, tensor: str | None) -> InputError:
        return InputError(f"{where}: {message}", pipeline=pipeline, step=step, tensor=tensor)

    return serving.check_request(inputs, specs, max_batch_size=max_batch_size, fail=fail)
