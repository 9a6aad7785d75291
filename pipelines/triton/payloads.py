"""numpy arrays to and from tritonclient's request and result objects, and protobuf answers as
the dicts Triton's HTTP API returns, so both protocols give the same shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from ..errors import InputError

__all__ = ["InferRequest", "infer_inputs", "message_to_dict", "requested_outputs", "result_arrays"]


@dataclass(frozen=True)
class InferRequest:
    """One ``infer`` call, as the blocking and the asyncio clients of either protocol take it:
    they differ only in whether they await the answer."""

    model: str
    inputs: Mapping[str, Any]
    outputs: str | Sequence[str] | None = None

    def http(self) -> dict[str, Any]:
        """tritonclient.http's (or .aio's) ``infer`` arguments: binary tensor data both ways."""
        import tritonclient.http as httpclient

        return {
            "model_name": self.model,
            "inputs": infer_inputs(httpclient, self.inputs, binary=True),
            "outputs": requested_outputs(httpclient, self.outputs, binary=True),
        }

    def grpc(self, limit: float | None) -> dict[str, Any]:
        """tritonclient.grpc's (or .aio's) ``infer`` arguments, given up after ``limit`` seconds."""
        import tritonclient.grpc as grpcclient

        return {
            "model_name": self.model,
            "inputs": infer_inputs(grpcclient, self.inputs, binary=False),
            "outputs": requested_outputs(grpcclient, self.outputs, binary=False),
            "client_timeout": limit,
        }


def requested_outputs(module: Any, outputs: str | Sequence[str] | None, *, binary: bool) -> list[Any] | None:
    """tritonclient's requested outputs for ``outputs`` (None: all of them).

    One name may be given alone, and a name given twice is asked for once, as ``p.run``
    takes them (a bare string is otherwise a sequence of one-letter names).
    """
    if not outputs:
        return None
    names = [outputs] if isinstance(outputs, str) else list(dict.fromkeys(outputs))
    if binary:  # only HTTP takes binary_data; gRPC is always binary
        return [module.InferRequestedOutput(n, binary_data=True) for n in names]
    return [module.InferRequestedOutput(n) for n in names]


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
