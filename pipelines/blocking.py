"""Run an async function to completion from blocking code, in a script or in Jupyter alike.

Jupyter's cell already runs an event loop in this thread, which cannot be re-entered:
there the function runs on a worker thread with a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

__all__ = ["run_blocking"]

T = TypeVar("T")


def run_blocking(main: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(main)``, or the same on a worker thread when a loop already runs here."""
    if not _loop_running():
        # Outside an `except RuntimeError` block: an error of the run must not be chained to
        # "no running event loop" in every traceback.
        return anyio.run(main)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipelines-run") as pool:
        return pool.submit(anyio.run, main).result()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
