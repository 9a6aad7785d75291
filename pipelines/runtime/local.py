"""Run a pipeline locally in one call, blocking: one request (:func:`run_pipeline`), one stream
of responses (:func:`stream_pipeline`) or many requests (:func:`run_many`), each in a fresh
:class:`~pipelines.runtime.local_runtime.LocalRuntime` on an event loop of its own. The runtime
itself, and what each mode stands for, are in :mod:`pipelines.runtime.local_runtime`; its names
are importable from here too, as they were before it moved.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import anyio

from ..blocking import run_blocking
from ..core.graph import Graph
from ..errors import InferenceError, PipelinesError
from .local_runtime import MODES, LocalRuntime
from .report import Report

__all__ = ["MODES", "LocalRuntime", "run_many", "run_pipeline", "stream_pipeline"]


def run_pipeline(
    pipeline: Graph,
    inputs: Mapping[str, Any],
    *,
    mode: str = "ensemble",
    outputs: Iterable[str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run one request in a fresh :class:`LocalRuntime` and return its outputs (blocking).

    ``outputs``: answer only these (only the steps they need run). Inside a
    running event loop (Jupyter), it runs on a worker thread with its own loop.
    """

    runtime = LocalRuntime(pipeline, mode, **options)  # here, so a warning points at the caller

    async def main() -> dict[str, Any]:
        async with runtime as rt:
            return await rt.infer(inputs, outputs)

    return run_blocking(main)


def stream_pipeline(
    pipeline: Graph,
    inputs: Mapping[str, Any],
    *,
    mode: str = "ensemble",
    outputs: Iterable[str] | None = None,
    **options: Any,
) -> Iterator[dict[str, Any]]:
    """Run one request in a fresh :class:`LocalRuntime` and yield its responses as they come.

    The runtime runs on an event loop of its own, in a thread, so this works in a script and
    in Jupyter alike. Closing the generator early (``break``, ``close()``) cancels the request:
    the pipeline's generators are closed and the runtime shuts down before ``close()`` returns.
    """
    runtime = LocalRuntime(pipeline, mode, **options)  # here, so a warning or a wrong mode points at the caller
    return _streamed(runtime, inputs, outputs)


def _streamed(runtime: LocalRuntime, inputs: Mapping[str, Any], outputs: Iterable[str] | None) -> Iterator[Any]:
    answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
    ended = object()

    async def main() -> None:
        try:
            async with runtime as rt:
                await rt.stream(inputs, answers.put, outputs)
        finally:
            answers.put(ended)

    with anyio.from_thread.start_blocking_portal() as portal:
        future = portal.start_task_soon(main)
        try:
            while (answer := answers.get()) is not ended:
                yield answer
            future.result()  # the stream's error, after the responses before it
        finally:
            if not future.done():
                future.cancel()
                concurrent.futures.wait([future])


def run_many(
    pipeline: Graph,
    requests: Iterable[Mapping[str, Any]],
    *,
    mode: str = "ensemble",
    concurrency: int = 8,
    return_exceptions: bool = False,
    outputs: Iterable[str] | None = None,
    **options: Any,
) -> tuple[list[Any], Report]:
    """Answer many requests, ``concurrency`` at a time, in one runtime (blocking).

    Returns the outputs in request order and the aggregated report. With
    ``return_exceptions=True`` a failed request's slot holds its error instead of raising.
    ``outputs``: every request asks for only these.
    """
    wanted = None if outputs is None else ([outputs] if isinstance(outputs, str) else list(outputs))
    requests = list(requests)
    if concurrency < 1:
        raise InferenceError(
            f"pipeline {pipeline.name!r}: concurrency must be >= 1; got {concurrency}", pipeline=pipeline.name
        )

    runtime = LocalRuntime(pipeline, mode, **options)  # here, so a warning points at the caller

    async def main() -> tuple[list[Any], Report]:
        results: list[Any] = [None] * len(requests)
        errors: list[BaseException] = []
        async with runtime as rt:
            limit = anyio.Semaphore(concurrency)

            async def one(i: int) -> None:
                async with limit:
                    try:
                        results[i] = await rt.infer(requests[i], wanted)
                    except PipelinesError as exc:
                        results[i] = exc
                        errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            report = rt.report()
        if errors and not return_exceptions:
            raise errors[0]
        return results, report

    return run_blocking(main)
