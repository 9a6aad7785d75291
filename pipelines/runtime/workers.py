"""The worker threads that run sync steps, without ever holding up the process's exit.

A sync step that outlives its timeout cannot be killed: its call is abandoned
and runs on. ``concurrent.futures.ThreadPoolExecutor`` and anyio's worker
threads are joined when the interpreter exits, so one stuck call would keep
the process alive for as long as it hangs. These threads are daemon threads and
nothing joins them; a thread whose call was abandoned leaves the pool when the
call ends, and the pool may start one more thread meanwhile, so a stuck call
never takes a worker away from the instance that replaces it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["StepThreads"]


class StepThreads(concurrent.futures.Executor):
    """At most ``max_workers`` daemon threads, started on demand, for calls that are not abandoned."""

    def __init__(self, max_workers: int, *, name: str = "pipelines-step") -> None:
        self._max = max(1, int(max_workers))
        self._name = name
        self._queue: deque[tuple[concurrent.futures.Future, Callable[..., Any], tuple, dict]] = deque()
        self._cv = threading.Condition()
        self._threads = 0
        self._idle = 0
        self._started = 0
        self._closed = False
        self._local = threading.local()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        start = False
        with self._cv:
            if self._closed:
                raise RuntimeError("the step threads are shut down")
            self._queue.append((future, fn, args, kwargs))
            self._cv.notify()
            # An idle thread may not have woken for the calls queued before this one: start
            # a thread whenever queued calls outnumber the idle threads.
            if len(self._queue) > self._idle and self._threads < self._max:
                self._threads += 1
                self._started += 1
                start = True
        if start:
            threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
        return future

    def abandoned(self) -> None:
        """A running call was abandoned: until its thread retires, one more thread may run."""
        with self._cv:
            self._max += 1
            if len(self._queue) > self._idle and self._threads < self._max:
                self._threads += 1
                self._started += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()

    def retire(self) -> None:
        """On a worker thread whose call was abandoned: leave the pool once the call returns."""
        self._local.abandoned = True

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop taking calls; queued ones are cancelled. Never waits for a running call."""
        with self._cv:
            self._closed = True
            pending = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            self._cv.notify_all()
        for future, *_ in pending:
            future.cancel()

    @property
    def threads(self) -> int:
        """Worker threads alive now (busy, idle or finishing an abandoned call)."""
        with self._cv:
            return self._threads

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if not self._queue:
                    self._threads -= 1
                    return
                future, fn, args, kwargs = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                    # an idle worker must not keep the last answer (a step's tensors) until its next call
                    del result
            del future, fn, args, kwargs
            if getattr(self._local, "abandoned", False):
                self._local.abandoned = False
                with self._cv:
                    self._threads -= 1
                    self._max -= 1
                return
