"""gRPC messages <-> arrays: a ``ModelInferRequest``'s inputs, a ``ModelInferResponse``'s outputs.

Shared by ``ModelInfer`` and ``ModelStreamInfer``. Outputs always travel as
``raw_output_contents``, as Triton sends them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from .classification import grpc_class_count
from .models import ServedModel
from .service import InferenceService
from .status import INVALID, Refusal
from .wire import array_from_bytes, array_from_contents, array_to_bytes

__all__ = ["decode_request", "fill_response", "requested_classes"]


def requested_classes(request: Any) -> dict[str, int]:
    """The outputs asked for, each with its class count (0: the tensor itself).

    A name asked twice is answered once, as Triton answers it (the last asking wins).
    """
    return {o.name: grpc_class_count(o.name, o.parameters) for o in request.outputs}


def fill_response(
    response: pb.ModelInferResponse,
    service: InferenceService,
    model: ServedModel,
    outputs: Mapping[str, np.ndarray],
    classes: Mapping[str, int],
) -> int:
    """Add ``outputs`` to ``response`` as raw contents; returns the bytes added."""
    size = 0
    for name, (array, datatype) in service.answer(model, outputs, classes).items():
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        raw = bytes(array_to_bytes(array, datatype))
        response.raw_output_contents.append(raw)
        size += len(raw)
    return size


def decode_request(request: Any, model: str) -> dict[str, Any]:
    """The request's inputs as arrays (raw ones: views of the message's bytes)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise Refusal(
            INVALID,
            f"expected {len(request.inputs)} raw_input_contents (one per input) but got {len(raw)} "
            f"for model '{model}'",
        )
    inputs = {}
    for i, tensor in enumerate(request.inputs):
        if raw and tensor.contents.ListFields():
            raise Refusal(INVALID, f"contents field must not be specified when using raw_input_contents for "
                          f"'{tensor.name}' for model '{model}': send each input's data one way, all raw or all "
                          "typed", tensor=tensor.name)
        if raw:
            inputs[tensor.name] = array_from_bytes(tensor.name, tensor.datatype, list(tensor.shape), raw[i], model=model)
        else:
            inputs[tensor.name] = array_from_contents(
                tensor.name, tensor.datatype, list(tensor.shape), tensor.contents, model=model
            )
    return inputs
