"""Handing one execution to a worker thread and back: what a round trip costs here, and the
hand-over itself, which the event loop may give up on (a timeout, a cancelled request) while
the thread still runs. The timeouts' rules are in :mod:`pipelines.runtime.instances`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from time import perf_counter
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from .instance_pool import InstancePool, Lease
from .workers import StepThreads

__all__ = ["ThreadCall", "running_asyncio_loop", "thread_hop_cost", "wait_for_future"]

_hop_cost: float | None = None


async def thread_hop_cost() -> float:
    """What one round trip to a worker thread costs here, in seconds (measured once per process).

    It varies tenfold between machines (tens of µs to half a millisecond on a
    busy VM), so the inline rule compares step times with this, not a constant.
    """
    global _hop_cost
    if _hop_cost is None:

        def nothing() -> None:
            return None

        samples = []
        for _ in range(9):
            t = perf_counter()
            await anyio.to_thread.run_sync(nothing)
            samples.append(perf_counter() - t)
        _hop_cost = min(max(sorted(samples)[len(samples) // 2], 20e-6), 1e-3)
    return _hop_cost


async def wait_for_future(future: concurrent.futures.Future) -> Any:
    """Await a worker thread's future under any anyio backend (asyncio has run_in_executor)."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    loop_thread = threading.get_ident()

    def wake(_: concurrent.futures.Future) -> None:
        if threading.get_ident() == loop_thread:
            done.set()
            return
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except Exception:  # the event loop is gone: nobody waits
            pass

    future.add_done_callback(wake)
    await done.wait()
    return future.result()


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, or None under another backend (trio)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ThreadCall:
    """The hand-over of one execution between a worker thread and the event loop.

    The awaiting side may be cancelled before the thread starts (then the call
    never runs and the loop keeps the instance), while it runs (then the call is
    abandoned and the thread gives the instance back when it ends), or after it
    ended (then the loop gives it back). A lock makes those three cases exclusive.
    """

    __slots__ = ("lock", "state", "lease", "pool", "threads", "keep", "token")

    def __init__(self, lease: Lease, pool: InstancePool, threads: StepThreads, *, keep: bool = False) -> None:
        self.lock = threading.Lock()
        self.state = "pending"  # -> "running" -> "finished" | "abandoned"; or "pending" -> "dropped"
        self.lease = lease
        self.pool = pool
        self.threads = threads
        # keep: a call past its timeout keeps its instance until it returns, as a Triton step model
        # does with the call a BLS model gave up on; else a fresh instance takes its place at once.
        self.keep = keep
        self.token = anyio.lowlevel.current_token()

    def begin(self) -> bool:  # on the worker thread: may the call run?
        with self.lock:
            if self.state == "dropped":
                return False
            self.state = "running"
            return True

    def end(self) -> None:  # on the worker thread
        with self.lock:
            late = self.state == "abandoned"
            self.state = "finished"
        if not late:
            return
        self.threads.retire()
        if self.keep:  # the instance served the stuck call to its end: it takes requests again
            self.lease.held = False
            try:
                anyio.from_thread.run_sync(self.pool.give_back, self.lease, token=self.token)
            except Exception:  # the event loop is gone: nobody will use the instance
                self.lease.instance.finalize()
            return
        # A fresh instance already took this one's place: this thread leaves the pool,
        # and the stuck instance is finalized, as Triton does when it unloads a model.
        try:
            self.lease.instance.finalize()
        except Exception:  # nobody is left to tell; the call's caller has had its timeout error
            pass

    def cancel(self) -> None:  # on the event loop, when the awaiting side was cancelled
        with self.lock:
            if self.state == "pending":
                self.state = "dropped"
                return
            if self.state != "running":
                return
            self.state = "abandoned"
            if self.keep:
                self.lease.held = True
            else:
                self.lease.abandoned = True
        self.threads.abandoned()
        if self.keep:
            return
        abandon = getattr(self.lease.instance, "abandon", None)
        if abandon is not None:  # a step's process can be killed, where a thread cannot
            abandon()
        self.pool.replace(self.lease)
