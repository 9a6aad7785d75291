"""What the endpoint answers, whichever protocol asked: the protocol-free core.

The HTTP and gRPC front ends decode a request into numpy arrays, hand them to
:meth:`InferenceService.infer`, and encode what comes back; readiness,
metadata, config and statistics come from here as Triton's protobuf messages.
Everything runs on the endpoint's one event loop, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ..core.planning import plan_of
from ..errors import InferenceError
from ..runtime.local import LocalRuntime
from ..runtime.report import Report
from .classification import classify
from .models import VERSION, ModelStatistics, ServedModel, statistics_response
from .status import INVALID, NOT_FOUND, UNSUPPORTED, Refusal

__all__ = ["DECOUPLED_GRPC", "DECOUPLED_HTTP", "EXTENSIONS", "InferenceService", "Timing"]

SERVER_NAME = "pipelines-local"
#: The protocol extensions this endpoint implements (Triton lists its own in the same field).
EXTENSIONS = ("classification", "binary_tensor_data", "model_configuration", "statistics")
#: Triton 2.51's refusal of a plain infer on a decoupled model, word for word (docs/triton_decoupled.md).
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"
_END = object()  # a stream's last item: it ended


@dataclass(frozen=True)
class Timing:
    """When a request arrived and when its inputs were decoded (``perf_counter_ns``)."""

    started: int
    decoded: int


class InferenceService:
    """The served models, their open runtimes and their statistics."""

    def __init__(self, models: Mapping[str, ServedModel], runtimes: Mapping[str, LocalRuntime], version: str) -> None:
        self.models = dict(models)
        self.runtimes = dict(runtimes)
        self.version = version
        self.stats = {name: ModelStatistics(name) for name in self.models}
        pipeline = next(iter(self.models.values())).pipeline
        #: composing step model -> the nodes that call it, as compiled
        self.composing = {m.name: tuple(m.nodes) for m in plan_of(pipeline, warn=False).models}
        self.ready = False
        self._streams: set[asyncio.Task] = set()  # the requests streaming now, each its runtime call

    # ------------------------------------------------------------ look-ups

    def model(self, name: str, version: str = "") -> ServedModel:
        """The served model ``name``; ``version`` empty or ``"1"`` (each model has that one version)."""
        model = self.models.get(name)
        if model is None:
            known = ", ".join(self.models)
            raise Refusal(NOT_FOUND, f"Request for unknown model: '{name}' is not found (this endpoint serves {known})")
        if version not in ("", VERSION):
            if not version.isdigit() or int(version) < 1:
                raise Refusal(INVALID, f"failed to get model version from specified version string '{version}', "
                              "version should be an integral value > 0")
            raise Refusal(NOT_FOUND, f"Request for unknown model: '{name}' version {version} is not found "
                          f"(this endpoint serves version {VERSION} of each model)")
        return model

    def model_ready(self, name: str, version: str = "") -> bool:
        return self.ready and name in self.models and version in ("", "1")

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.version, extensions=list(EXTENSIONS))

    def statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        """Triton's statistics: of one model, or of every model, the composing step models included."""
        if name in self.composing and version in ("", "1"):
            return pb.ModelStatisticsResponse(model_stats=[self._composing_statistics(name)])
        if name:
            model = self.model(name)
            if version not in ("", VERSION):  # Triton's status and words for a model that is there
                raise Refusal(INVALID, f"requested model version is not available for model '{name}' "
                              f"(version {version} asked; this endpoint serves version {VERSION})")
            return statistics_response(self.stats, [model.name])
        response = statistics_response(self.stats, sorted(self.models))
        for step_model in sorted(self.composing):
            response.model_stats.append(self._composing_statistics(step_model))
        return response

    def _composing_statistics(self, name: str) -> pb.ModelStatistics:
        """A composing step model's counters, from the runtimes' cost reports.

        On a server one step model serves every form, so its counters add up the
        modes that call it (not the in-process ones, whose steps are no separate
        model). ``inference_count`` counts requests, ``execution_count`` calls of
        the step's function (fewer when dynamic batching merged requests); queue,
        compute (``compute_infer``) and the runtime's overhead around the step, taking
        its inputs and keeping its outputs (``compute_output``), are the reports'
        means times the requests.
        """
        nodes = self.composing[name]
        requests = executions = queue_ns = compute_ns = overhead_ns = 0
        for model_name, runtime in self.runtimes.items():
            if self.models[model_name].in_process:
                continue
            for cost in runtime.report().steps:
                if cost.step in nodes and cost.calls:
                    requests += cost.calls
                    executions += cost.batches
                    queue_ns += round(cost.queue_wait_us * 1e3 * cost.calls)
                    compute_ns += round(cost.compute_us * 1e3 * cost.calls)
                    overhead_ns += round(cost.overhead_us * 1e3 * cost.calls)

        def d(ns: int) -> pb.StatisticDuration:
            return pb.StatisticDuration(count=requests, ns=ns)

        return pb.ModelStatistics(
            name=name,
            version="1",
            inference_count=requests,
            execution_count=executions,
            inference_stats=pb.InferStatistics(
                success=d(queue_ns + compute_ns + overhead_ns),
                fail=pb.StatisticDuration(),
                queue=d(queue_ns),
                compute_input=d(0),
                compute_infer=d(compute_ns),
                compute_output=d(overhead_ns),
                cache_hit=pb.StatisticDuration(),
                cache_miss=pb.StatisticDuration(),
            ),
        )

    def report(self, name: str) -> Report:
        """The local runtime's cost report for model ``name``: per-step queue and compute, copies."""
        return self.runtimes[self.model(name).name].report()

    # ------------------------------------------------------------ inference

    def check_outputs(self, model: ServedModel, requested: Sequence[str]) -> None:
        for name in requested:
            if name not in model.pipeline.outputs:
                raise Refusal(
                    INVALID,
                    f"unexpected inference output '{name}' for model '{model.name}'; "
                    f"its outputs are {list(model.output_names)}",
                    pipeline=model.pipeline.name,
                    tensor=name,
                )

    async def infer(
        self,
        model: ServedModel,
        inputs: Mapping[str, Any],
        requested: Sequence[str],
        timing: Timing,
    ) -> tuple[dict[str, np.ndarray], int]:
        """The requested outputs in the order asked (all, in the model's order, when none are named).

        Returns the outputs and the time the runtime took (ns); call
        :meth:`finished` or :meth:`failed` once the answer is encoded.
        """
        self.check_outputs(model, requested)
        outputs = await self.runtimes[model.name].infer(inputs, list(requested) or None)  # only the steps they need
        infer_ns = perf_counter_ns() - timing.decoded
        wanted = dict.fromkeys(requested or model.output_names)
        return {name: np.asarray(outputs[name]) for name in wanted}, infer_ns

    def refuse_plain(self, model: ServedModel, words: str) -> None:
        """Refuse a plain infer on a streaming pipeline, as Triton refuses one on a decoupled model."""
        if model.decoupled:
            raise Refusal(UNSUPPORTED, words, pipeline=model.pipeline.name)

    async def stream(
        self, model: ServedModel, inputs: Mapping[str, Any], requested: Sequence[str]
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """Each response of one request as it comes: the requested outputs in the order asked (all,
        in the model's order, when none are named); a pipeline that does not stream answers once.

        A failure is raised after the responses before it. Closing the iterator early (the client
        cancelled or went away) cancels the request: the pipeline's generators are closed (their
        ``finally`` runs) before ``aclose()`` returns, once the call each one is in returns.
        """
        self.check_outputs(model, requested)
        wanted = list(dict.fromkeys(requested or model.output_names))
        runtime = self.runtimes[model.name]
        answers: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: a slow client holds responses, as Triton does

        async def run() -> None:
            try:
                if model.decoupled:
                    await runtime.stream(inputs, answers.put_nowait, list(requested) or None)
                else:
                    answers.put_nowait(await runtime.infer(inputs, list(requested) or None))
            except asyncio.CancelledError:  # the reader went away, or the endpoint stops (cancel_streams)
                answers.put_nowait(InferenceError(
                    f"pipeline {model.pipeline.name!r}: the endpoint stopped while this request streamed "
                    "(its grace period ran out); its generators are closed", pipeline=model.pipeline.name))
                raise
            except Exception as exc:  # after the responses before it, in the queue's order
                answers.put_nowait(exc)
            else:
                answers.put_nowait(_END)

        task = asyncio.ensure_future(run())
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        try:
            while (item := await answers.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield {name: np.asarray(item[name]) for name in wanted}
        finally:
            if not task.done():
                task.cancel()
            await asyncio.wait([task])  # the generators' close() has run when the task ends

    async def cancel_streams(self, timeout: float) -> None:
        """Cancel every request still streaming, and wait up to ``timeout`` s for its generators to close.

        The endpoint's stop calls it once the grace period is over: aiohttp leaves a handler that
        still writes events running past its shutdown timeout, and the runtimes must not close under it.
        """
        tasks = list(self._streams)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def answer(
        self, model: ServedModel, outputs: Mapping[str, np.ndarray], classes: Mapping[str, int]
    ) -> dict[str, tuple[np.ndarray, str]]:
        """Each output with its datatype on the wire: its own, or BYTES top-k where ``classes`` asks for it."""
        specs = model.pipeline.output_specs
        answer = {}
        for name, array in outputs.items():
            count = classes.get(name, 0)
            if count:
                answer[name] = classify(name, array, specs[name].dtype, count, batched=model.pipeline.batched), "BYTES"
            else:
                answer[name] = array, specs[name].dtype
        return answer

    def finished(self, model: ServedModel, timing: Timing, *, rows: int, infer_ns: int) -> None:
        now = perf_counter_ns()
        decode_ns = timing.decoded - timing.started
        self.stats[model.name].succeeded(
            rows=rows,
            decode_ns=decode_ns,
            infer_ns=infer_ns,
            encode_ns=max(0, now - timing.decoded - infer_ns),
            total_ns=now - timing.started,
        )

    def failed(self, model_name: str, timing: Timing) -> None:
        stats = self.stats.get(model_name)
        if stats is not None:
            stats.failed(perf_counter_ns() - timing.started)


def batch_rows(model: ServedModel, inputs: Mapping[str, Any]) -> int:
    """The request's batch size as Triton counts it: rows of a batching model, else 1."""
    if not model.pipeline.batched or not inputs:
        return 1
    first = next(iter(inputs.values()))
    return int(first.shape[0]) if getattr(first, "ndim", 0) else 1
