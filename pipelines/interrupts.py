"""SIGTERM handled as Ctrl-C, for commands that must unwind (a write, a benchmark) rather than die."""

from __future__ import annotations

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
            raise KeyboardInterrupt
        # Re-sent as SIGINT, so an event loop's own Ctrl-C handling unwinds the run
        # (it cancels the measurement and closes clients before the server stops).
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
