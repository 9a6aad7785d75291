"""Finding and removing what a server leaves: its process group, stubs, shared memory, and servers
whose owner forgot them (stopped at interpreter exit). It imports the standard library only: the
supervisor runs it as a script, beside itself, where no package is importable."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Protocol

__all__ = [
    "SHM_TAG",
    "REGISTRY",
    "kill_server",
    "shutdown_connections",
    "tcp_socket_inodes",
    "live_processes",
    "process_stats",
    "remove_shm",
    "sigint_deferred",
    "signal_group",
    "sweep_orphaned_shm",
]

#: Every shared-memory region and process of ours carries this tag in its name, so
#: cleanup can find exactly ours, and leftovers of an owner that was killed can be told apart.
SHM_TAG = "pipelines-triton"


def signal_group(pgid: int | None, sig: int) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_server(proc: subprocess.Popen[bytes] | None, pgid: int | None, shm_prefix: str) -> None:
    """SIGKILL whatever of a server still runs, wait for it, and remove its shared memory."""
    if proc is not None and proc.poll() is None:
        signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    marker = shm_prefix.encode()
    deadline = time.monotonic() + 10
    while True:
        # Stubs stay in the server's group; a stub that left it still names our prefix.
        left = [pid for pid in live_processes(pgid=pgid, marker=marker) if pid != os.getpid()]
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    remove_shm(shm_prefix)


_ESTABLISHED, LISTEN = "01", "0A"  # TCP states as /proc/net/tcp writes them


def tcp_socket_inodes(*, state: str, ports: set[int], remote: bool) -> set[str]:
    """The sockets (as ``socket:[inode]``, how /proc/PID/fd links read) in TCP ``state`` whose
    local (or ``remote``) port is one of ``ports``."""
    inodes: set[str] = set()
    column = 2 if remote else 1  # rem_address or local_address, each HEXIP:HEXPORT
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # Field 3 is the state, field 9 the socket's inode.
            if len(fields) > 9 and fields[3] == state and int(fields[column].rsplit(":", 1)[1], 16) in ports:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def shutdown_connections(ports: set[int]) -> int:
    """Shut down every TCP connection this process holds to one of ``ports`` on this machine; how many.

    Triton waits up to its whole exit timeout for open HTTP connections before it unloads
    any model, and then exits without finalizing them. A client left open anywhere in the
    process (ours, a user's ``TritonClient(url)``, an asyncio client whose loop is gone)
    would hold it. ``shutdown`` (not ``close``) ends the connection for the server while
    the owner's file descriptor stays valid; its next use fails instead of hanging.
    """
    inodes = tcp_socket_inodes(state=_ESTABLISHED, ports=ports, remote=True)
    done = 0
    if not inodes:
        return done
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{fd}") not in inodes:
                    continue
                sock = socket.socket(fileno=int(fd))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                finally:
                    sock.detach()  # the fd stays its owner's to close
    return done


def process_stats() -> Iterator[tuple[int, list[bytes]]]:
    """Every process's ``/proc/PID/stat`` fields after its command name (``state`` first, then ``ppid``,
    ``pgrp`` ...), by pid; nothing off Linux. The name may hold spaces or parentheses, the fields after its
    last ``)`` cannot; a process that goes away while it is read is left out."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(b")") + 2:].split()


def live_processes(*, pgid: int | None, marker: bytes | None = None) -> list[int]:
    """Running (not zombie) processes in group ``pgid`` or whose command line holds ``marker``."""
    found: list[int] = []
    for pid, fields in process_stats():
        try:
            state, group = fields[0], int(fields[2])
            if state in (b"Z", b"X"):
                continue
            if group == pgid:
                found.append(pid)
                continue
            if marker is None:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker in f.read():
                    found.append(pid)
        except (OSError, ValueError, IndexError):
            continue  # the process went away while we looked
    return found


def remove_shm(prefix: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def sweep_orphaned_shm() -> None:
    """Remove regions left by a server whose owning process was killed outright (SIGKILL)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if not name.startswith(SHM_TAG + "-"):
                continue
            owner = name[len(SHM_TAG) + 1 :].split("-", 1)[0]
            if owner.isdigit() and int(owner) != os.getpid() and not _pid_exists(int(owner)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives during cleanup until cleanup is done, then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class _Registry:
    """Servers still running, stopped at interpreter exit if their owner did not stop them."""

    def __init__(self) -> None:
        self._servers: dict[int, _Stoppable] = {}
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def add(self, server: _Stoppable) -> None:
        with self._lock:
            self._servers[id(server)] = server

    def discard(self, server: _Stoppable) -> None:
        with self._lock:
            self._servers.pop(id(server), None)

    def stop_all(self) -> None:
        with self._lock:
            servers = list(self._servers.values())
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()


REGISTRY = _Registry()
