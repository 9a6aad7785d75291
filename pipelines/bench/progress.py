"""A one-line progress bar on stderr for the load generator.

On a terminal the line is redrawn in place; elsewhere (CI logs, pytest) only the
finished measurements are written, one line each, so logs stay readable.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 24


class Progress:
    """Shows which measurement runs, its phase, and how far the current window is."""

    def __init__(self, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0

    def update(self, label: str, phase: str, fraction: float, detail: str = "") -> None:
        """Redraw the bar: ``fraction`` of the current phase is done."""
        if not self.live:
            return
        filled = int(round(max(0.0, min(1.0, fraction)) * _WIDTH))
        bar = "█" * filled + "░" * (_WIDTH - filled)
        self._draw(f"{label:<28} {phase:<10} ▕{bar}▏ {detail}")

    def finish(self, label: str, summary: str) -> None:
        """End the current measurement with a permanent line."""
        if not self.enabled:
            return
        if self.live:
            self._draw("")
            self.stream.write("\r")
        self.stream.write(f"{label:<28} {summary}\n")
        self.stream.flush()
        self._last_len = 0

    def note(self, text: str) -> None:
        """A permanent line of its own (server start, errors worth seeing at once)."""
        if not self.enabled:
            return
        if self.live and self._last_len:
            self._draw("")
            self.stream.write("\r")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self, line: str) -> None:
        pad = max(0, self._last_len - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)
