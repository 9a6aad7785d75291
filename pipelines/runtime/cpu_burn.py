"""The CPU a server's boundaries burn, burnt beside the local runtime's steps.

A replayed cost is a sleep: it holds the request (and the instance) for as long as the
server's boundary takes, but it leaves the cores to the steps. On the server, those
boundaries burn CPU (the front end parsing a request, a stub copying a tensor into
shared memory, the BLS model's stub making its calls), and the steps' stubs compete
with them for the machine's cores. Measured with yolov5 at concurrency 4 on a 2-core
VM, with each step in a process of its own: the async BLS form's replay ran 36.4
infer/s against the server's 32.0, its costs (a quarter of a request's CPU) spent as
sleeps; docs/server_profiles.md.

:class:`Burners` are processes (one per core) that burn, in CPU time, what each
replayed cost sleeps, fire and forget: the sleep keeps the timing, the burner takes
the core. A burner is handed the cost least busy first. A backlog past a second
(more demand than cores, at a high concurrency) drops what comes next: the server's
cores would be saturated too, and a pipe that filled up would block the event loop.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from multiprocessing.connection import Connection
from time import perf_counter

from .step_process import fork_with_pipe

__all__ = ["Burners"]

_BACKLOG_S = 1.0
_ORPHAN_POLL_S = 0.5


def _burn(conn: Connection, _other: Connection, parent: int) -> None:
    _other.close()
    while True:
        while not conn.poll(_ORPHAN_POLL_S):
            if os.getppid() != parent:
                return
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        (seconds,) = struct.unpack("d", message)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass


class Burners:
    """``count`` processes that burn CPU time on demand (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()  # costs are spent on the event loop and in worker threads
        self._conns: list[Connection] = []
        self._pids: list[int] = []
        self._busy_until: list[float] = []
        self.dropped = 0.0  # seconds of burning let go because of a backlog
        try:
            for _ in range(max(1, count)):
                conn, pid = fork_with_pipe(_burn)
                self._conns.append(conn)
                self._pids.append(pid)
                self._busy_until.append(0.0)
        except BaseException:
            self.close()
            raise

    def burn(self, seconds: float) -> None:
        """Have a burner burn ``seconds`` of CPU time, without waiting for it."""
        if seconds <= 0:
            return
        with self._lock:
            if not self._conns:
                return
            now = perf_counter()
            i = min(range(len(self._busy_until)), key=self._busy_until.__getitem__)
            start = max(now, self._busy_until[i])
            if start - now > _BACKLOG_S:
                self.dropped += seconds
                return
            self._busy_until[i] = start + seconds
            try:
                self._conns[i].send_bytes(struct.pack("d", seconds))
            except OSError:  # a burner that died takes nothing more
                self._busy_until[i] = float("inf")

    def close(self) -> None:
        """Kill the burners (what they had left to burn is moot) and reap them."""
        with self._lock:
            conns, self._conns = self._conns, []
            pids, self._pids = self._pids, []
        for conn in conns:
            conn.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
