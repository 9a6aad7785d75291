"""How long commands (bench, calibrate, predict's step profiles, advise --verify) show progress.

On a terminal one line is redrawn in place. Elsewhere (a pipe, a CI log, nohup) each stage
gets a permanent line when it starts, and a long stage one more every :data:`HEARTBEAT_S`
seconds, so that a log never sits silent for minutes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import monotonic
from typing import TextIO

__all__ = ["HEARTBEAT_S", "Progress", "counted_stages"]

_WIDTH = 24

#: Without a terminal, a stage that lasts longer than this is said again, with how far it is.
HEARTBEAT_S = 30.0


class Progress:
    """Shows which stage runs, and how far it is.

    ``update(label, phase, fraction, detail)`` as work goes on; ``finish(label, summary)``
    ends a stage with a permanent line; ``note(text)`` is a permanent line of its own. A stage
    is one ``(label, phase)``: without a terminal, its first update is written as a line.
    """

    def __init__(self, *, stream: TextIO | None = None, enabled: bool = True,
                 clock: Callable[[], float] = monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._last_len = 0
        self._stage: tuple[str, str] | None = None
        self._said_at = 0.0

    def update(self, label: str, phase: str, fraction: float, detail: str = "") -> None:
        """``fraction`` of the current stage is done: redraw the bar, or (no terminal) say a new stage."""
        if not self.enabled:
            return
        fraction = max(0.0, min(1.0, fraction))
        if self.live:
            filled = int(round(fraction * _WIDTH))
            bar = "█" * filled + "░" * (_WIDTH - filled)
            self._draw(f"{label:<28} {phase:<10} ▕{bar}▏ {detail}")
            return
        now = self._clock()
        if (label, phase) == self._stage and now - self._said_at < HEARTBEAT_S:
            return
        self._stage, self._said_at = (label, phase), now
        done = f"  {fraction:.0%}" if fraction >= 0.005 else ""  # a stage just begun shows no 0 %
        self._line(f"{label:<28} {phase}{done}" + (f"  {detail}" if detail else ""))

    def finish(self, label: str, summary: str) -> None:
        """End the current stage with a permanent line."""
        if not self.enabled:
            return
        self._stage = None
        self._line(f"{label:<28} {summary}")

    def note(self, text: str) -> None:
        """A permanent line of its own (server start, errors worth seeing at once)."""
        if not self.enabled:
            return
        self._line(text)

    def _line(self, text: str) -> None:
        if self.live and self._last_len:
            self._draw("")
            self.stream.write("\r")
            self._last_len = 0
        self.stream.write(text.rstrip() + "\n")
        self.stream.flush()

    def _draw(self, line: str) -> None:
        pad = max(0, self._last_len - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)


def counted_stages(progress: Progress, label: str, unit: str) -> Callable[..., None]:
    """A ``progress(done, total[, name])`` callback (predict's step profiles, advise's search)
    drawn on ``progress``: each ``name`` is a stage of its own, a line without a terminal."""

    def tick(done: int, total: int, name: str = "") -> None:
        progress.update(label, name or unit, done / total if total else 1.0, f"{done}/{total} {unit}")

    return tick
