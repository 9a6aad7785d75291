"""A streaming step's responses pulled one at a time, within its timeout: what a model that
serves a generator needs (the step model; docs/compiled_repository.md, "Streaming steps"); and a
stream's responses handed to a ``whole_stream`` step as iterators (:class:`Tee`).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from .lifecycle import StepExited, StepInterrupted

END = object()  # a generator's end, or a whole_stream step's items'


class PastTimeout(Exception):
    """The step's timeout passed before its stream ended."""


class Pull:
    """A step's stream, one item at a time (a generator, an async one, or any iterable), within
    an optional deadline: a sync step past it keeps running in the thread it was waited on in."""

    def __init__(self, stream: Any, limit_s: float, loop_of: Any) -> None:
        self.is_async = inspect.isasyncgen(stream)
        self.stream = stream if self.is_async or hasattr(stream, "__next__") else iter(stream)
        self.deadline = time.monotonic() + limit_s if limit_s else None
        self.loop = loop_of() if self.is_async else None
        self.stuck = False  # abandoned while it ran: it cannot be closed

    def next(self):
        left = None
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PastTimeout
        try:
            if self.is_async:
                return self._next_async(left)
            return next(self.stream, END) if left is None else self._next_in_thread(left)
        except SystemExit as exc:  # told as the step's failure, as a plain step's exit is
            raise StepExited(exc.code) from None
        except KeyboardInterrupt as exc:
            raise StepInterrupted(exc) from None

    def _next_async(self, left):
        call = self.stream.__anext__()
        try:
            return self.loop.run_until_complete(call if left is None else asyncio.wait_for(call, left))
        except StopAsyncIteration:
            return END
        except asyncio.TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise PastTimeout from None
            raise

    def _next_in_thread(self, left):
        box = []
        done = threading.Event()

        def pull():
            try:
                box.append((True, next(self.stream, END)))
            except BaseException as exc:  # handed to the waiting thread, which tells it
                box.append((False, exc))
            finally:
                done.set()

        threading.Thread(target=pull, daemon=True, name="stream-step").start()
        if not done.wait(left):
            self.stuck = True
            raise PastTimeout
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self):
        """Run the generator's ``finally`` blocks (not for one still running in its thread)."""
        if self.stuck:
            return
        try:
            if self.is_async:
                self.loop.run_until_complete(self.stream.aclose())
            elif hasattr(self.stream, "close"):
                self.stream.close()
        except Exception:  # the stream's own failure, if any, was told already
            pass


class Tee:
    """The iterators a whole_stream step reads: one per streamed input, fed from one queue of items
    (each a dict of those inputs for one response, then :data:`END`), so that they advance together."""

    def __init__(self, items: queue.SimpleQueue[Any], names: list[str]) -> None:
        self._items = items
        self._held: dict[str, list[Any]] = {n: [] for n in names}
        self._ended = False

    def of(self, name: str) -> Iterator[Any]:
        held = self._held[name]
        while True:
            if not held and (self._ended or not self._pull()):
                return
            yield held.pop(0)

    def _pull(self) -> bool:
        item = self._items.get()
        if item is END:
            self._ended = True
            return False
        for name, value in item.items():
            if name in self._held:
                self._held[name].append(value)
        return True
