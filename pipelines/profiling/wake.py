"""What a hand-off between processes costs once the side that waits for it has waited a while:
the ``wake`` and ``wake_idle`` curves of a profile (docs/simulation.md, "Waking a side that waited").

The probes price every boundary with steps that work
:data:`~pipelines.profiling.probes.BUSY_MS` before they answer; a real step works longer, and the
thread that waits for it goes to sleep and must be woken. So a step model is called directly with
several work times (``wake``), and a second one that sleeps instead, leaving every core idle
(``wake_idle``). Both are read against the working probe's 0.5 ms figure, less what the sleep itself
overslept (a step profile holds that part), and halved: a direct call has two hand-offs that wait
(the server's thread for the stub, the client for the server).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import median
from time import perf_counter, sleep
from typing import Any

import numpy as np

from ..calibration.cost import checked_wake
from ..core.graph import Graph
from ..core.step import step
from ..core.tensor import TensorSpec

__all__ = ["SLEEP_MODEL", "WAITS_MS", "WAKE_MODEL", "checked_wake", "fit_wake", "measure_wake", "sleep_pipeline",
           "wake_pipeline"]

#: The work times of the wake probe, in ms: the probes' own first, to which the others compare.
WAITS_MS = (0.5, 2.0, 5.0, 10.0, 20.0)
#: The hand-offs that wait in a direct call of a step model: the server's for the stub, the client's.
HANDOFFS = 2
#: The wake probes' step models, called directly: one works on a core while the client waits,
#: the other sleeps, so that every core idles (as they do while a step waits on a GPU).
WAKE_MODEL = "probe_wake__waiter"
SLEEP_MODEL = "probe_sleep__sleeper"

MS = TensorSpec("FP64", [1])


@step(inputs={"ms": MS}, outputs={"worked": MS}, name="waiter")
def waiter(ms):
    """Works ``ms`` milliseconds on the CPU (busy, so exactly), then hands ``ms`` back."""
    end = perf_counter() + float(ms.reshape(-1)[0]) / 1e3
    while perf_counter() < end:
        pass
    return {"worked": ms}


@step(inputs={"ms": MS}, outputs={"worked": MS}, name="sleeper")
def sleeper(ms):
    """Sleeps ``ms`` milliseconds, then hands back how many it slept."""
    began = perf_counter()
    sleep(float(ms.reshape(-1)[0]) / 1e3)
    return {"worked": np.full_like(ms, (perf_counter() - began) * 1e3)}


def wake_pipeline() -> Graph:
    """The wake probe that works: one step, whose model the calibration calls directly."""
    p = Graph("probe_wake", inputs={"ms": MS}, max_batch_size=0)
    p.output("worked", p.add(waiter, ms=p.input("ms"))["worked"])
    return p


def sleep_pipeline() -> Graph:
    """The wake probe that sleeps: one step, whose model the calibration calls directly."""
    p = Graph("probe_sleep", inputs={"ms": MS}, max_batch_size=0)
    p.output("worked", p.add(sleeper, ms=p.input("ms"))["worked"])
    return p


def measure_wake(
    infer: Callable[[str, dict[str, Any]], Any],
    *,
    rounds: int,
    requests: int = 3,
    clock: Callable[[], float] = perf_counter,
) -> dict[str, dict[float, list[float]]]:
    """Each probe's requests at each work time, timed: µs beyond the work, by work time in ms, for
    the probe that works (``"busy"``) and the one that sleeps (``"idle"``: beyond the time it says
    it slept, where its answer says). Rounds over every work time, each ``requests`` in a row after
    one untimed (which wakes the stub as the first of a pipeline's requests would), so that a slow
    spell of the machine moves them all alike."""
    over: dict[str, dict[float, list[float]]] = {kind: {ms: [] for ms in WAITS_MS} for kind in ("busy", "idle")}
    for _ in range(rounds):
        for ms in WAITS_MS:
            inputs = {"ms": np.array([ms], np.float64)}
            for kind, model in (("busy", WAKE_MODEL), ("idle", SLEEP_MODEL)):
                infer(model, inputs)
                for _ in range(requests):
                    started = clock()
                    answer = infer(model, inputs)
                    over[kind][ms].append((clock() - started) * 1e6 - _worked_ms(answer, ms) * 1e3)
    return over


def _worked_ms(answer: Any, ms: float) -> float:
    """How long the probe step worked or slept, in ms: what its answer says, or ``ms`` where it says
    nothing (a probe written before it did, or a test's server)."""
    worked = answer.get("worked") if isinstance(answer, dict) else None
    return float(np.asarray(worked).reshape(-1)[0]) if worked is not None else ms


def fit_wake(over: dict[float, Sequence[float]], against: dict[float, Sequence[float]] | None = None
             ) -> tuple[tuple[float, float], ...]:
    """``(waited µs, µs per hand-off)`` points from :func:`measure_wake`'s figures: each work
    time's median above the first one's (``against``'s first, where given: the sleeping probe's
    against the working one's, whose 0.5 ms the boundaries were priced with), over the hand-offs,
    and never below 0 (a wake costs nothing less than the probes' own)."""
    first = median((against or over)[WAITS_MS[0]])
    return tuple((ms * 1e3, max(0.0, (median(over[ms]) - first) / HANDOFFS)) for ms in WAITS_MS)
