"""The models a local endpoint serves: one per local mode, named as the compiled forms are.

Each answers Triton's metadata, config and statistics in Triton's own protobuf
messages (``tritonclient.grpc.service_pb2``); the HTTP front end prints the same
messages as JSON, so both protocols give one answer.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from ..compile import compile_pipeline
from ..core.graph import Graph
from ..errors import CompileError
from ..forms import FormLeftOutWarning, form

__all__ = ["ModelStatistics", "ServedModel", "served_models"]

VERSION = "1"


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One local mode of a pipeline, served as the model ``name`` (``<pipeline>_<form>``); a
    streaming pipeline's is decoupled (its config says so), as its compiled forms are."""

    name: str
    mode: str
    pipeline: Graph
    config: mc.ModelConfig

    @property
    def in_process(self) -> bool:
        """Whether this form runs its Python steps inside its own model (no composing step models)."""
        return bool(getattr(form(self.mode), "in_process", False))

    @property
    def decoupled(self) -> bool:
        """Whether it answers a request with a stream of responses (a streaming pipeline)."""
        return self.pipeline.streaming

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self.pipeline.outputs)

    def metadata(self) -> pb.ModelMetadataResponse:
        batch = [-1] if self.pipeline.batched else []
        platform = self.config.platform or self.config.backend
        meta = pb.ModelMetadataResponse(name=self.name, versions=[VERSION], platform=platform)
        for name, spec in self.pipeline.inputs.items():
            meta.inputs.add(name=name, datatype=spec.dtype, shape=batch + list(spec.dims))
        for name, spec in self.pipeline.output_specs.items():
            meta.outputs.add(name=name, datatype=spec.dtype, shape=batch + list(spec.dims))
        return meta


def served_models(pipeline: Graph, modes: tuple[str, ...]) -> dict[str, ServedModel]:
    """The served models of ``pipeline``, each with the config ``compile("all")`` writes for it.

    A pipeline that cannot be compiled (a step defined in a notebook that holds a lock
    cannot be pickled into a repository) still serves locally: its models then answer
    with the config's signature only (name, platform or backend, batching, inputs,
    outputs), and the reason is in the config's ``parameters["not_compiled"]``.
    """
    try:
        with warnings.catch_warnings():
            # A form compile("all") leaves out is one this server does not serve: LocalServer says so itself.
            warnings.simplefilter("ignore", FormLeftOutWarning)
            configs = {name: model.config for name, model in compile_pipeline(pipeline.validate(), "all").models.items()}
        why = None
    except CompileError as exc:
        configs, why = {}, exc.message
    models = {}
    for mode in modes:
        name = form(mode).model_name(pipeline.name, side_by_side=True)
        config = configs.get(name) or _signature_config(pipeline, name, mode, why or "not compiled")
        if pipeline.streaming and not config.model_transaction_policy.decoupled:
            # what Triton reports for a model that answers a request many times, as every form of it is
            config = _copy(config)
            config.model_transaction_policy.decoupled = True
        models[name] = ServedModel(name=name, mode=mode, pipeline=pipeline, config=config)
    return models


def _copy(config: mc.ModelConfig) -> mc.ModelConfig:
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    return copy


def _signature_config(pipeline: Graph, name: str, mode: str, why: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, max_batch_size=pipeline.max_batch_size)
    if mode == "ensemble":
        config.platform = "ensemble"
    else:
        config.backend = "python"
    for tensor, spec in pipeline.inputs.items():
        config.input.add(name=tensor, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))
    for tensor, spec in pipeline.output_specs.items():
        config.output.add(name=tensor, data_type=mc.DataType.Value(spec.config_dtype), dims=list(spec.dims))
    config.parameters["not_compiled"].string_value = why
    return config


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass
class ModelStatistics:
    """Triton's per-model counters, kept by the endpoint for one served model.

    Every request is one execution (the local runtime batches inside, per step).
    ``compute_input`` is decoding the request, ``compute_infer`` the local
    runtime's answer, ``compute_output`` encoding the response; ``queue`` stays 0
    because a request waits only inside the runtime, where its report
    (``LocalServer.report(model)``) splits queue from compute per step.
    """

    name: str
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    batches: dict[int, tuple[_Duration, _Duration, _Duration]] = field(default_factory=dict)

    def succeeded(self, *, rows: int, decode_ns: int, infer_ns: int, encode_ns: int, total_ns: int) -> None:
        self.inference_count += rows
        self.execution_count += 1
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.success.add(total_ns)
        self.queue.add(0)
        self.compute_input.add(decode_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(encode_ns)
        per_batch = self.batches.setdefault(rows, (_Duration(), _Duration(), _Duration()))
        for counter, ns in zip(per_batch, (decode_ns, infer_ns, encode_ns), strict=True):
            counter.add(ns)

    def failed(self, total_ns: int) -> None:
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.fail.add(total_ns)

    def message(self) -> pb.ModelStatistics:
        def d(duration: _Duration) -> pb.StatisticDuration:
            return pb.StatisticDuration(count=duration.count, ns=duration.ns)

        stats = pb.ModelStatistics(
            name=self.name,
            version=VERSION,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            inference_stats=pb.InferStatistics(
                success=d(self.success),
                fail=d(self.fail),
                queue=d(self.queue),
                compute_input=d(self.compute_input),
                compute_infer=d(self.compute_infer),
                compute_output=d(self.compute_output),
                cache_hit=pb.StatisticDuration(),
                cache_miss=pb.StatisticDuration(),
            ),
        )
        for rows in sorted(self.batches):
            cin, cinfer, cout = self.batches[rows]
            stats.batch_stats.add(batch_size=rows, compute_input=d(cin), compute_infer=d(cinfer), compute_output=d(cout))
        return stats


def statistics_response(stats: Mapping[str, ModelStatistics], names: list[str]) -> pb.ModelStatisticsResponse:
    return pb.ModelStatisticsResponse(model_stats=[stats[n].message() for n in names])
