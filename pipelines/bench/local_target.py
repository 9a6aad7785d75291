"""The local runtime as a benchmark target: the same load shape (N requests in flight)
against ``LocalRuntime`` in each mode, with the runtime's cost report per measurement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ..graph import Graph

__all__ = ["LocalTarget", "local_target"]


class LocalTarget:
    """One running ``LocalRuntime``; ``infer`` is what the load generator calls."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    async def infer(self, inputs: Mapping[str, Any]) -> Any:
        return await self.runtime.infer(inputs)

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
