"""The load generator: exactly N requests in flight, a warm-up, then measurement windows.

N workers each send a request, wait for its answer and send the next one, so the
server always holds N requests (perf_analyzer's ``--concurrency-range``). Windows
repeat until the stability rule is met or ``max_trials`` is reached. A request that
fails is counted as an error of the window in which it ended, with its message;
it is never dropped, and its latency is kept out of the percentiles. A request of a streaming
pipeline answers with its :class:`~pipelines.bench.streams.StreamTimes`, which the window keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from ..commands.progress import Progress
from ..errors import PipelinesError, ServerDiedError
from .stability import StabilityRule
from .streams import StreamTimes

__all__ = ["LoadPlan", "LoadResult", "Window", "run_load"]

#: Distinct error messages kept per window; more are counted under one line.
MAX_MESSAGES = 20


@dataclass(frozen=True)
class LoadPlan:
    """How to load one target: ``concurrency`` in flight, windows of ``duration`` seconds or of ``requests`` answers.

    ``warmup`` seconds of load come first and are thrown away. ``timeout``
    bounds one request; a request past it counts as an error.
    """

    concurrency: int
    duration: float | None = 2.0
    requests: int | None = None
    warmup: float = 1.0
    rule: StabilityRule = field(default_factory=StabilityRule)
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if int(self.concurrency) < 1:
            raise PipelinesError(f"concurrency must be >= 1; got {self.concurrency!r}")
        if (self.duration is None) == (self.requests is None):
            raise PipelinesError(
                "a measurement window is either a duration or a number of requests; "
                f"got duration={self.duration!r} and requests={self.requests!r}: give exactly one"
            )
        if self.duration is not None and self.duration <= 0:
            raise PipelinesError(f"window duration must be > 0 seconds; got {self.duration!r}")
        if self.requests is not None and int(self.requests) < 1:
            raise PipelinesError(f"requests per window must be >= 1; got {self.requests!r}")
        if self.warmup < 0:
            raise PipelinesError(f"warm-up must be >= 0 seconds; got {self.warmup!r}")
        if self.timeout <= 0:
            raise PipelinesError(f"request timeout must be > 0 seconds; got {self.timeout!r}")


@dataclass(frozen=True, eq=False)
class Window:
    """What one measurement window saw.

    ``latencies`` are the successful requests' latencies in seconds;
    ``completed_by_sample[i]`` counts the requests (answered or failed) that
    carried input sample ``i``, and ``errors_by_sample[i]`` those that failed. ``streams``
    holds the successful streamed requests' times (a streaming pipeline's; else empty).
    """

    seconds: float
    latencies: np.ndarray
    errors: int
    completed_by_sample: tuple[int, ...]
    errors_by_sample: tuple[int, ...]
    error_messages: Mapping[str, int]
    streams: tuple[StreamTimes, ...] = ()

    @property
    def successes(self) -> int:
        return int(self.latencies.size)

    @property
    def completed(self) -> int:
        return self.successes + self.errors

    @property
    def throughput(self) -> float:
        """Successful inferences per second (requests, not batch items)."""
        return self.successes / self.seconds if self.seconds > 0 else 0.0

    @property
    def avg_latency(self) -> float | None:
        return float(self.latencies.mean()) if self.latencies.size else None

    @classmethod
    def merge(cls, windows: Sequence[Window]) -> Window:
        messages: dict[str, int] = {}
        for w in windows:
            for text, count in w.error_messages.items():
                messages[text] = messages.get(text, 0) + count
        return cls(
            seconds=sum(w.seconds for w in windows),
            latencies=np.concatenate([w.latencies for w in windows]) if windows else np.empty(0),
            errors=sum(w.errors for w in windows),
            completed_by_sample=tuple(int(sum(c)) for c in zip(*(w.completed_by_sample for w in windows), strict=True)),
            errors_by_sample=tuple(int(sum(c)) for c in zip(*(w.errors_by_sample for w in windows), strict=True)),
            error_messages=messages,
            streams=tuple(s for w in windows for s in w.streams),
        )


@dataclass(frozen=True, eq=False)
class LoadResult:
    """All windows of one measurement; the figures come from the last ``used`` of them.

    ``boundaries`` holds what ``on_boundary`` returned before the first window
    and after each one (statistics snapshots), so ``boundaries[-used - 1]`` and
    ``boundaries[-1]`` bracket the windows the figures come from.
    """

    concurrency: int
    windows: tuple[Window, ...]
    used: int
    stable: bool
    boundaries: tuple[Any, ...] = ()

    @property
    def measured(self) -> Window:
        return Window.merge(self.windows[-self.used:])

    @classmethod
    def pooled(cls, loads: Sequence[LoadResult]) -> LoadResult:
        """One target measured in turns (other targets between them) as one measurement: the
        windows each turn used, stable when every turn was. Boundaries stay with the turns."""
        if len(loads) == 1:
            return loads[0]
        windows = tuple(w for load in loads for w in load.windows[-load.used:])
        return cls(concurrency=loads[0].concurrency, windows=windows, used=len(windows),
                   stable=all(load.stable for load in loads))

    @property
    def bracket(self) -> tuple[Any, Any] | None:
        if len(self.boundaries) < self.used + 1:
            return None
        return self.boundaries[-self.used - 1], self.boundaries[-1]


class _Recorder:
    def __init__(self, samples: int, start: float) -> None:
        self.start = start
        self.latencies: list[float] = []
        self.errors = 0
        self.completed = [0] * samples
        self.failed = [0] * samples
        self.messages: dict[str, int] = {}
        self.streams: list[StreamTimes] = []

    @property
    def count(self) -> int:
        return len(self.latencies) + self.errors

    def ok(self, sample: int, latency: float, answer: Any = None) -> None:
        if isinstance(answer, StreamTimes):  # the stream's own clock: from sending to its end
            self.streams.append(answer)
            latency = answer.latency
        self.latencies.append(latency)
        self.completed[sample] += 1

    def fail(self, sample: int, exc: BaseException) -> None:
        self.errors += 1
        self.completed[sample] += 1
        self.failed[sample] += 1
        text = _message(exc)
        if text not in self.messages and len(self.messages) >= MAX_MESSAGES:
            text = "(other errors)"
        self.messages[text] = self.messages.get(text, 0) + 1

    def close(self, end: float) -> Window:
        return Window(
            seconds=end - self.start,
            latencies=np.asarray(self.latencies, dtype=np.float64),
            errors=self.errors,
            completed_by_sample=tuple(self.completed),
            errors_by_sample=tuple(self.failed),
            error_messages=dict(self.messages),
            streams=tuple(self.streams),
        )


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text[:300]


Infer = Callable[[Mapping[str, Any]], Awaitable[Any]]


async def run_load(
    infer: Infer,
    samples: Sequence[Mapping[str, Any]],
    plan: LoadPlan,
    *,
    on_boundary: Callable[[], Awaitable[Any]] | None = None,
    progress: Progress | None = None,
    label: str = "",
) -> LoadResult:
    """Load ``infer`` with ``plan.concurrency`` requests in flight; samples are sent round-robin.

    ``on_boundary`` is awaited before the first window and after each one
    (e.g. to snapshot the server's statistics); its answers come back in
    :attr:`LoadResult.boundaries`.
    """
    if not samples:
        raise PipelinesError(f"{label or 'load'}: no input samples to send; give at least one request")
    progress = progress or Progress(enabled=False)
    rule = plan.rule
    n = len(samples)
    order = itertools.count()
    current = _Recorder(n, perf_counter())
    window_full = anyio.Event()
    filled: list[Window] = []  # windows of N answers, closed by the workers
    counting = False
    stopping = False

    def rotate() -> Window:
        nonlocal current
        now = perf_counter()
        closed = current.close(now)
        current = _Recorder(n, now)
        return closed

    async def worker() -> None:
        nonlocal fatal
        while not stopping:
            sample = next(order) % n
            start = perf_counter()
            try:
                with anyio.fail_after(plan.timeout):
                    answer = await infer(samples[sample])
            except ServerDiedError as exc:  # no later request can be answered: the run ends with it
                fatal = fatal or exc
                scope.cancel()
                return
            except Exception as exc:  # every failure is a counted error, whatever raised it
                current.fail(sample, exc)
                # A request can fail before its first await (a client that knows the server is
                # gone): without a checkpoint the workers would spin and starve everything else.
                await anyio.lowlevel.checkpoint()
            else:
                current.ok(sample, perf_counter() - start, answer)
            # A window of N answers closes on the N-th, exactly; the controller picks it up.
            if counting and current.count >= plan.requests:
                filled.append(rotate())
                window_full.set()

    async def timed(seconds: float, phase: str, detail: Callable[[], str]) -> None:
        start = perf_counter()
        while (elapsed := perf_counter() - start) < seconds:
            progress.update(label, phase, elapsed / seconds, detail())
            await anyio.sleep(min(0.25, seconds - elapsed))

    async def counted(phase: str, detail: Callable[[], str]) -> Window:
        nonlocal window_full
        while True:
            window_full = anyio.Event()  # armed before looking, so a window closing now still wakes us
            if len(filled) > len(windows):
                return filled[len(windows)]
            progress.update(label, phase, current.count / plan.requests, detail())
            with anyio.move_on_after(0.25):
                await window_full.wait()

    windows: list[Window] = []
    boundaries: list[Any] = []

    def detail() -> str:
        elapsed = perf_counter() - current.start
        rate = len(current.latencies) / elapsed if elapsed > 0 else 0.0
        errors = f", {current.errors} errors" if current.errors else ""
        if not (current.latencies or current.errors):  # the window has just begun: no rate to show yet
            return f"window {len(windows) + 1}/{rule.max_trials}"
        return f"window {len(windows) + 1}/{rule.max_trials}: {rate:,.1f} infer/s{errors}"

    fatal: ServerDiedError | None = None
    async with anyio.create_task_group() as tg:
        scope = tg.cancel_scope
        for _ in range(plan.concurrency):
            tg.start_soon(worker)
        if plan.warmup > 0:
            await timed(plan.warmup, "warm-up", lambda: "")
        rotate()  # the warm-up's requests are not measured
        if on_boundary is not None:
            boundaries.append(await on_boundary())
        while True:
            if plan.requests is None:
                await timed(plan.duration, "measuring", detail)
                windows.append(rotate())
            else:
                counting = True
                windows.append(await counted("measuring", detail))
            if on_boundary is not None:
                boundaries.append(await on_boundary())
            if rule.done(windows):
                break
        # Let the requests in flight finish rather than cancel them half-sent; they are not counted.
        stopping = True
    if fatal is not None:
        raise fatal

    used = min(rule.windows, len(windows))
    return LoadResult(
        concurrency=plan.concurrency,
        windows=tuple(windows),
        used=used,
        stable=rule.is_stable(windows),
        boundaries=tuple(boundaries),
    )
