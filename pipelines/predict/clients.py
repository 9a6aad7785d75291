"""The simulated clients and what they measure. Closed loop as perf_analyzer (each client sends its next request when
its answer arrives) or open loop (Poisson arrivals from a seeded RNG, so a run repeats exactly). Clients never stop: the
run ends at the last measured answer, so every measured request saw the full load, never the tail of a draining run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass

import simpy

__all__ = ["Meter", "Snapshot", "closed_loop", "open_loop"]

#: One request's way through the server, from being sent to its answer: a SimPy process body.
Request = Callable[[], Generator[simpy.Event, object, None]]


@dataclass(frozen=True)
class Snapshot:
    """The counters at one moment: the time, the core-µs spent, each model's instance-µs."""

    at_us: float
    core_us: float
    instance_us: Mapping[str, float]


class Meter:
    """Counts answers in the order they arrive: the first ``warmup`` are not measured, the next ``requests`` are
    (their ``latencies``). It snapshots the counters where the measured window opens (the last warm-up answer, or the
    start) and closes (the last measured answer; ``done`` succeeds). ``answers``, the throughput's count, runs from
    after the instant the window opens to the end of the instant it closes: a batch's answers arrive in one instant,
    and counting the window by answers alone would take some of them with no time to it."""

    def __init__(self, env: simpy.Environment, *, warmup: int, requests: int, snapshot: Callable[[], Snapshot]) -> None:
        self.env = env
        self.done = env.event()
        self.latencies: list[float] = []
        self.answers = 0
        self.start = snapshot()
        self.end = self.start
        self._warmup = warmup
        self._last = warmup + requests
        self._answered = 0
        self._snapshot = snapshot

    def answered(self, latency_us: float) -> None:
        self._answered += 1
        count = self._answered
        if count <= self._warmup:
            if count == self._warmup:
                self.start = self._snapshot()
            return
        now = self.env.now
        if now > self.start.at_us and (count <= self._last or now == self.end.at_us):
            self.answers += 1
        if count <= self._last:
            self.latencies.append(latency_us)
            if count == self._last:
                self.end = self._snapshot()
                self.done.succeed()


def _one_request(env: simpy.Environment, meter: Meter, request: Request) -> Generator[simpy.Event, object, None]:
    sent = env.now
    yield from request()
    meter.answered(env.now - sent)


def closed_loop(env: simpy.Environment, meter: Meter, request: Request, *, concurrency: int) -> None:
    """``concurrency`` clients, each sending its next request as soon as it has the answer."""

    def client() -> Generator[simpy.Event, object, None]:
        while True:
            yield from _one_request(env, meter, request)

    for _ in range(concurrency):
        env.process(client())


def open_loop(env: simpy.Environment, meter: Meter, request: Request, *, rate: float, seed: int, limit: int) -> None:
    """Requests arriving at ``rate`` per second on average, independently (exponential gaps), ``limit`` of them: a
    rate beyond what the server can answer would otherwise pile up requests without end before the measured ones are
    answered."""
    draw = random.Random(seed).expovariate
    per_us = rate / 1e6

    def arrivals() -> Generator[simpy.Event, object, None]:
        for _ in range(limit):
            yield env.timeout(draw(per_us))
            env.process(_one_request(env, meter, request))

    env.process(arrivals())
