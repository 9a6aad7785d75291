"""The local runtime as a benchmark target: the same load shape (N requests in flight)
against ``LocalRuntime`` in each mode, with the runtime's cost report per measurement. A
streaming pipeline is streamed (``LocalRuntime.stream``), each response timed as it is delivered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from time import perf_counter
from typing import Any

from ..core.graph import Graph
from .streams import StreamTimes

__all__ = ["LocalTarget", "local_target"]


class LocalTarget:
    """One running ``LocalRuntime``; ``infer`` is what the load generator calls: the answer, or
    for a streaming pipeline the request's :class:`StreamTimes`."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.streaming = bool(runtime.pipeline.streaming)

    async def infer(self, inputs: Mapping[str, Any]) -> Any:
        if self.streaming:
            return await self.stream(inputs)
        return await self.runtime.infer(inputs)

    async def stream(self, inputs: Mapping[str, Any], *, keep: bool = False) -> StreamTimes:
        """Stream one request; ``keep``: with the responses' outputs too."""
        times: list[float] = []
        answers: list[Mapping[str, Any]] = []

        def deliver(response: Mapping[str, Any]) -> None:
            times.append(perf_counter())  # called on the runtime's loop as the response is answered
            if keep:
                answers.append(response)

        sent = perf_counter()
        await self.runtime.stream(inputs, deliver)
        return StreamTimes(sent, tuple(times), perf_counter(), tuple(answers))

    def reset(self) -> None:
        """Start the cost report afresh, so it covers only the measured windows."""
        reset = getattr(self.runtime, "reset_report", None)
        if reset is not None:
            reset()

    def report(self) -> dict[str, Any]:
        return self.runtime.report().to_dict()


@asynccontextmanager
async def local_target(
    pipeline: Graph, mode: str, *, server_copies: bool = True, isolation: str = "thread"
) -> AsyncIterator[LocalTarget]:
    """Start the local runtime in ``mode`` (a form of :data:`pipelines.forms.FORMS`); it
    executes the pipeline, and predicts no server."""
    from ..runtime.local import LocalRuntime

    async with LocalRuntime(pipeline, mode=mode, server_copies=server_copies, isolation=isolation) as runtime:
        yield LocalTarget(runtime)
