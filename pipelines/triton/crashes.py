"""A server that dies on its own: what killed it, and whether to start it again.

Triton 2.51 aborts when a Python stub is killed while it holds a mutex it shares with the
server: the next request for that instance throws ``boost::interprocess::lock_exception``,
nothing catches it, and the whole server ends with SIGABRT (measured: about one ``kill -9``
of a stub in thirty under load; docs/triton_server_failures.md). The kernel's OOM killer can
take the server too. Every model is gone with it, not just the step that failed, so the
owning :class:`~pipelines.triton.TritonServer` starts it again on the same ports, with the
same models, a bounded number of times.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["STARTED_AGAIN", "Crash", "CrashBudget", "crash_reason", "fatal_signal"]

# Restarts allowed within the window: a server that keeps dying is broken, not unlucky.
RESTARTS_PER_WINDOW = 3
WINDOW_S = 300.0

# Triton's line when a fatal signal reaches it; it is still tearing down, and answering, after it.
_SIGNAL_LINE = r"Signal \((\d+)\) received"
# What the server's last words say about why it ended (its own lines, before the stack trace).
_LAST_WORDS = re.compile(
    r"terminate called after throwing an instance of '[^']+'|what\(\):\s*\S.*|" + _SIGNAL_LINE
)
#: What the owner notes in the server's log once it has started a dead server again.
STARTED_AGAIN = "started again"


@dataclass(frozen=True)
class Crash:
    """One death of the server process that nobody asked for."""

    pid: int
    exit: str  # how it ended, in words ("killed by SIGABRT")
    why: str  # the log's last words on it ("" when it said nothing: a SIGKILL)
    restarted_in: float | None = None  # seconds from noticing the death to ready again; None: not started again

    def describe(self) -> str:
        return f"pid {self.pid}, {self.exit}" + (f": {self.why}" if self.why else "")


def crash_reason(log_tail: str) -> str:
    """The server's own last words on why it ended, from its log's tail ("" if it said none)."""
    said = [m.group(0).strip() for m in _LAST_WORDS.finditer(log_tail)]
    # The C++ runtime says the exception's type, then what(); the signal line adds nothing to them.
    told = [line for line in said if not line.startswith("Signal")]
    return "; ".join(dict.fromkeys(told or said))


class CrashBudget:
    """How many restarts are left: ``RESTARTS_PER_WINDOW`` in any ``WINDOW_S`` seconds."""

    def __init__(self, restarts: int = RESTARTS_PER_WINDOW, window_s: float = WINDOW_S) -> None:
        self.restarts = restarts
        self.window_s = window_s
        self._spent: deque[float] = deque()
        self._lock = threading.Lock()

    def _drop_old(self, now: float) -> None:
        while self._spent and now - self._spent[0] > self.window_s:
            self._spent.popleft()

    def left(self) -> int:
        with self._lock:
            self._drop_old(time.monotonic())
            return self.restarts - len(self._spent)

    def spend(self) -> bool:
        """Take one restart; False when none is left."""
        with self._lock:
            now = time.monotonic()
            self._drop_old(now)
            if len(self._spent) >= self.restarts:
                return False
            self._spent.append(now)
            return True


def fatal_signal(log_tail: str) -> int | None:
    """The fatal signal the server's log says it received since it last started (the tail read
    back to the owner's last "started again" note), or None."""
    for line in reversed(log_tail.splitlines()):
        if f"pipelines.triton] {STARTED_AGAIN}" in line:
            return None
        found = re.search(_SIGNAL_LINE, line)
        if found is not None:
            return int(found.group(1))
    return None
