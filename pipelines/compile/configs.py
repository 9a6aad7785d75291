"""Small builders of ``model_config_pb2.ModelConfig`` parts, and the one printer.

Every ``config.pbtxt`` is printed here from the protobuf with
``google.protobuf.text_format``; ``max_batch_size: 0`` is written out because
proto3 would drop it and Triton needs it for non-batching models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..core.step_options import ParameterValue, parameter_text
from ..core.tensor import TensorSpec

__all__ = ["add_io", "config_text", "parse_config", "set_parameters", "top_level_python_config"]


def add_io(config: mc.ModelConfig, inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec]) -> None:
    """Declare inputs and outputs in declaration order."""
    for name, spec in inputs.items():
        config.input.add(name=name, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))
    for name, spec in outputs.items():
        config.output.add(name=name, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))


def top_level_python_config(pipeline: Any, name: str, instance_count: int) -> mc.ModelConfig:
    """A Python model serving the whole ``pipeline`` (the BLS and fused forms): its inputs and
    outputs, ``instance_count`` CPU instances, and dynamic batching when the pipeline batches."""
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=pipeline.max_batch_size)
    add_io(config, pipeline.inputs, pipeline.output_specs)
    config.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    if pipeline.max_batch_size > 0:
        config.dynamic_batching.SetInParent()
    return config


def set_parameters(config: mc.ModelConfig, parameters: Mapping[str, ParameterValue]) -> None:
    """Triton holds every parameter as a ``string_value``; step.json keeps its type for ``initialize``."""
    for key, value in parameters.items():
        config.parameters[key].string_value = parameter_text(value)


def config_text(config: mc.ModelConfig) -> str:
    """``config.pbtxt`` text: identity first, ``max_batch_size`` always, then the rest."""
    head = mc.ModelConfig(name=config.name, platform=config.platform, backend=config.backend)
    rest = mc.ModelConfig()
    rest.CopyFrom(config)
    for field in ("name", "platform", "backend", "max_batch_size"):
        rest.ClearField(field)
    return (
        text_format.MessageToString(head)
        + f"max_batch_size: {int(config.max_batch_size)}\n"
        + text_format.MessageToString(rest)
    )


def parse_config(text: str) -> mc.ModelConfig:
    """Parse ``config.pbtxt`` text back into a message (unknown fields are rejected)."""
    return text_format.Parse(text, mc.ModelConfig())
