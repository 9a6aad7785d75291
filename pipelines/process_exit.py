"""How a process ended, in words: shared by the Triton server's supervision and the local
runtime's step processes, which both report a child that died."""

from __future__ import annotations

import signal

__all__ = ["describe_exit"]


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: its exit code or the signal that killed it."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
