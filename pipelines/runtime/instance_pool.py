"""A step model's instances: the free ones, the FIFO queue of requests waiting for one,
and the fresh instance built in place of one that a stuck call abandoned (when, and why:
:mod:`pipelines.runtime.instances`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..core.step import StepInstance
from ..errors import StepError

__all__ = ["InstancePool", "Lease"]


class Lease:
    """One instance lent out by a pool; ``abandoned`` once a stuck thread holds it for good,
    ``held`` while a call past its timeout still runs on it (it comes back when the call returns)."""

    __slots__ = ("instance", "index", "abandoned", "held", "isolated")

    def __init__(self, instance: StepInstance, index: int = 0, *, isolated: bool = False) -> None:
        self.instance = instance
        self.index = index  # its place in the instance group (the config's instance index)
        self.abandoned = False
        self.held = False
        self.isolated = isolated  # in a process of its own (a ProcessInstance)


class _Waiter:
    __slots__ = ("event", "lease")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.lease: Lease | None = None


class InstancePool:
    """A model's free instances and its FIFO queue of requests waiting for one.

    Taking a free instance does not yield to the event loop, which keeps a
    chain of cheap steps cheap; only a request that must wait parks on an event.
    """

    def __init__(
        self,
        leases: list[Lease],
        *,
        renew: Callable[[int], Lease] | None = None,
        pipeline: str | None = None,
        step: str | None = None,
    ) -> None:
        self._free = list(reversed(leases))
        self._waiters: deque[_Waiter] = deque()
        self._renew = renew  # builds a fresh instance for an index (runs initialize())
        self._pipeline, self._step = pipeline, step
        self._alive = len(leases)  # instances not abandoned, plus those being built
        self.renewed = 0  # instances built in place of abandoned ones
        self.renew_error: BaseException | None = None
        self.closed = False

    def try_acquire(self) -> Lease | None:
        if self._free and not self._waiters:
            return self._free.pop()
        return None

    def try_acquire_peek(self) -> bool:
        """Whether an instance is free now (without taking it)."""
        return bool(self._free)

    async def acquire(self) -> Lease:
        lease = self.try_acquire()
        if lease is not None:
            return lease
        if self._alive == 0 and self.renew_error is not None:
            error = self.renew_error
            raise StepError(
                f"pipeline {self._pipeline!r} step {self._step!r}: every instance was abandoned by a call that "
                f"ran past the step's timeout, and initialize() failed for a fresh one: "
                f"{type(error).__name__}: {error}",
                pipeline=self._pipeline,
                step=self._step,
            ) from error
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.lease is not None:  # handed an instance just as we were cancelled: pass it on
                self.give_back(waiter.lease)
            else:
                self._waiters.remove(waiter)
            raise
        if waiter.lease is None:  # woken because no instance is left
            return await self.acquire()
        return waiter.lease

    def give_back(self, lease: Lease) -> None:
        """Return an instance, unless a stuck thread holds it (a fresh one replaces it, or it comes
        back itself when the call returns)."""
        if lease.abandoned or lease.held:
            return
        if self.closed:
            lease.instance.finalize()
            return
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.lease = lease
            waiter.event.set()
        else:
            self._free.append(lease)

    def replace(self, lease: Lease) -> None:
        """On the event loop: ``lease`` was abandoned; build a fresh instance in its place.

        ``initialize()`` may take seconds (weights), so it runs on a daemon thread
        of its own; requests wait for the fresh instance as for a busy one.
        """
        self._alive -= 1
        if self._renew is None or self.closed:
            return
        self._alive += 1
        self._build(lease.index, self._arrived)

    def _build(self, index: int, arrived: Callable[[Lease | None, BaseException | None], None]) -> None:
        """Build an instance for ``index`` on a daemon thread of its own (``initialize()`` may take
        seconds: weights), then hand it to ``arrived`` on the event loop."""
        renew, token = self._renew, anyio.lowlevel.current_token()
        assert renew is not None

        def build() -> None:
            fresh, error = None, None
            try:
                fresh = renew(index)
            except BaseException as exc:  # handed to the event loop, which reports it
                error = exc
            try:
                anyio.from_thread.run_sync(arrived, fresh, error, token=token)
            except Exception:  # the event loop is gone: nobody will use the instance
                if fresh is not None:
                    fresh.instance.finalize()

        threading.Thread(target=build, name=f"pipelines-renew-{self._step}", daemon=True).start()

    def _arrived(self, fresh: Lease | None, error: BaseException | None) -> None:
        if fresh is None:
            self._alive -= 1
            self.renew_error = error
            if self._alive == 0:  # nothing will ever serve the waiters: fail them now
                for waiter in self._waiters:
                    waiter.event.set()
            return
        self.renewed += 1
        self.give_back(fresh)

    def close(self) -> list[BaseException]:
        """Finalize the instances that are free; busy ones are finalized when they come back."""
        self.closed = True
        errors: list[BaseException] = []
        for lease in self._free:
            try:
                lease.instance.finalize()
            except Exception as exc:  # keep finalizing the others; the caller reports the first
                errors.append(exc)
        self._free.clear()
        return errors
