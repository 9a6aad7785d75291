"""A watchdog process that cleans up after a server whose owner died without stopping it.

The owner holds the write end of a pipe whose read end is the watchdog's stdin. However
the owner ends (SIGKILL included, from whatever thread it started the server), the kernel
closes that end, and on EOF the watchdog stops the server's process group, kills what is
left of it, and removes its shared-memory regions and temporary folder. A clean stop says
``done`` first, and the watchdog exits without touching anything. (``PR_SET_PDEATHSIG`` is
not enough: it fires when the thread that started the server ends, not the process.)

Run by path with the standard library only, so it starts fast and imports no package code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

try:
    from .cleanup import live_processes, remove_shm, signal_group
except ImportError:  # run as a script: cleanup.py sits beside this file on sys.path[0]
    from cleanup import live_processes, remove_shm, signal_group  # type: ignore[no-redef]

__all__ = ["Supervisor"]

# How long the orphaned server may take to exit on SIGTERM (finalizing its models) before it is killed.
_ORPHAN_GRACE_S = 5.0


class Supervisor:
    """The owner's side: starts the watchdog, tells it each server process group, and releases it."""

    def __init__(self, *, workdir: Path, shm_prefix: str) -> None:
        read_end, self._write_end = os.pipe()  # not inheritable: no other child holds the owner's end
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-E", "-s", __file__],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the owner's terminal must not kill the watchdog first
            )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        # Through the pipe, not argv: cleanup finds a server's processes by the prefix in their
        # command line, and must not find the watchdog among them.
        self._send(f"workdir {workdir}\nprefix {shm_prefix}\n")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pgid: int) -> None:
        """Clean up process group ``pgid`` too if the owner dies."""
        self._send(f"pgid {pgid}\n")

    def release(self) -> None:
        """The owner cleaned up itself: let the watchdog exit without doing anything."""
        self._send("done\n")
        try:
            os.close(self._write_end)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, line: str) -> None:
        try:
            os.write(self._write_end, line.encode())
        except OSError:
            pass  # the watchdog is gone; nothing more it could do


def _orphaned(workdir: Path, shm_prefix: str, pgids: list[int]) -> None:
    """The owner died: stop its servers, kill what is left, remove shared memory and the temporary folder."""
    marker = shm_prefix.encode()
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + _ORPHAN_GRACE_S
    while any(live_processes(pgid=pgid) for pgid in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # Stubs stay in the server's group; a stub that left it still names our prefix.
        left = {pid for pgid in [*pgids, None] for pid in live_processes(pgid=pgid, marker=marker)} - {os.getpid()}
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    remove_shm(shm_prefix)
    shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    told: dict[str, str] = {}
    pgids: list[int] = []
    for raw in sys.stdin.buffer:
        key, _, value = raw.decode().rstrip("\n").partition(" ")
        if key == "done":
            return 0
        if key == "pgid":
            pgids.append(int(value))
        else:
            told[key] = value
    if "workdir" in told and told.get("prefix"):
        _orphaned(Path(told["workdir"]), told["prefix"], pgids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
