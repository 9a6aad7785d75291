"""SIGTERM handled as Ctrl-C, for commands that must unwind (a write, a benchmark) rather than die."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sigterm_as_interrupt"]


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does.

    A killed write then discards its staging directory and a benchmark keeps its
    finished levels, where the default SIGTERM ends the process on the spot.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # Ctrl-C is ignored here (a job started in the background, nohup): SIGTERM still stops the run.
            _interrupt_between_steps()
            return
        # Re-sent as SIGINT, so an event loop's own Ctrl-C handling unwinds the run
        # (it cancels the measurement and closes clients before the server stops).
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def _interrupt_between_steps() -> None:
    """KeyboardInterrupt now, or, under a running event loop, from the loop's next callback.

    A signal handler runs between any two bytecodes: raised there, the interrupt can land inside
    a task's step, half-way through anyio's cancel-scope bookkeeping ("Attempted to exit a cancel
    scope that isn't the current task's current cancel scope"). Raised from a callback of the
    loop's own, it leaves the loop between steps, and closing the loop then cancels every task
    so that each unwinds what it opened, as Ctrl-C does where the loop handles SIGINT itself.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_raise_keyboard_interrupt)  # thread-safe: it also wakes a sleeping loop
