"""The embedded server's log file: its tail, why a start failed, which models failed to load, and
this package's own notes (a stub reloaded, a restart) written in among Triton's lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path

__all__ = ["ServerLog"]

log = logging.getLogger("pipelines.triton")

_ERROR_LINE = re.compile(r"E\d{4} |error:", re.IGNORECASE)
# Triton's log lines for a model it could not load, or refused before loading (2.51 wording).
_LOAD_FAILURE = re.compile(
    r"(?:failed to (?:load|poll) model|Poll failed for model directory|failed to load) '(?P<name>[^']+)'"
    r"(?: version \d+)?: (?P<why>.*?)\"?$"
)


class ServerLog:
    """The log of the server for ``repository``; ``path`` is None until a process is launched."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self.path: Path | None = None

    def tail(self, n_lines: int = 50) -> str:
        """The last ``n_lines`` lines of the server's log ('' before it starts)."""
        if self.path is None or not self.path.exists():
            return ""
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * max(n_lines, 1)))  # enough for typical lines, without reading a large log
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def failure(self, n_lines: int = 50) -> str:
        """The part of the log that says why start-up failed: error lines first, then the tail."""
        if self.path is None or not self.path.exists():
            return "--- log tail ---\n(no log)"
        lines = self.path.read_text("utf-8", "replace").splitlines()
        usage = next((i for i, line in enumerate(lines) if line.startswith("Usage: tritonserver")), None)
        if usage is not None:  # a bad argument: the reason precedes a long usage text that says nothing more
            return "--- log ---\n" + "\n".join(lines[:usage])
        tail = lines[-n_lines:]
        errors = [line for line in lines[:-n_lines] if _ERROR_LINE.match(line)][-10:]
        head = "--- errors in the log ---\n" + "\n".join(errors) + "\n" if errors else ""
        return head + "--- log tail ---\n" + "\n".join(tail)

    def load_failures(self) -> dict[str, str]:
        """Each model the server's log says failed to load, with the log's reason (the first line)."""
        try:
            text = self.path.read_text("utf-8", "replace") if self.path is not None else ""
        except OSError:
            return {}
        found: dict[str, str] = {}
        for line in text.splitlines():
            match = _LOAD_FAILURE.search(line) if _ERROR_LINE.match(line) else None
            if match is not None:
                found.setdefault(match["name"], match["why"].strip())
        return found

    def note(self, line: str) -> None:
        """Say something in the server's log (and Python's logging), in Triton's line format."""
        log.warning("Triton server for %s: %s", self.repository, line)
        if self.path is None:
            return
        now = time.time()
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
        with contextlib.suppress(OSError), open(self.path, "a") as f:
            f.write(f"W{stamp} {os.getpid()} pipelines.triton] {line}\n")
