"""SIGTERM as Ctrl-C (pipelines.commands.interrupts): where the interrupt lands under an event loop."""

from __future__ import annotations

import signal

import anyio
import pytest

from pipelines.commands.interrupts import sigterm_as_interrupt


@pytest.mark.parametrize("ctrl_c", [signal.SIG_DFL, signal.SIG_IGN], ids=["in-a-terminal", "in-the-background"])
def test_sigterm_stops_an_event_loop_between_steps_never_inside_a_task(ctrl_c):
    # The handler runs at the next bytecode, inside this task's step. A KeyboardInterrupt raised
    # there can land half-way through anyio's cancel-scope bookkeeping (a CI run's bench ended in
    # "Attempted to exit a cancel scope that isn't the current task's current cancel scope");
    # the task must instead finish its step and be cancelled, and the run end in KeyboardInterrupt.
    seen: list[str] = []

    async def measuring() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)
            seen.append("step finished")
            await anyio.sleep(30)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise

    previous = signal.signal(signal.SIGINT, signal.default_int_handler if ctrl_c is signal.SIG_DFL else ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
            anyio.run(measuring)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["step finished", "CancelledError"]


def test_sigterm_outside_an_event_loop_raises_at_once_even_with_ctrl_c_ignored():
    before = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("the interrupt should have been raised by now")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGTERM) is before, "leaving, it gives SIGTERM back its handler"
