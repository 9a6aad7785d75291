"""What the tests of a replayed server profile share: a profile of chosen costs, and a step
body that keeps a core busy."""

from __future__ import annotations

import time

from pipelines.calibration import Cost, Profile
from pipelines.calibration.profile import BOUNDARIES


def flat_profile(cpu_count: int = 2, **costs: Cost) -> Profile:
    """A profile whose boundaries cost nothing but ``costs``, from a machine of ``cpu_count`` cores
    (its lanes, too)."""
    return Profile(costs={**{k: Cost(0.0, 0.0) for k in BOUNDARIES}, **costs}, server_version="2.51.0",
                   protocol="http", machine={"cpu": "test cpu", "cpu_count": cpu_count},
                   date="2026-01-01T00:00:00+00:00")


def burn_cpu(seconds: float) -> None:
    """Keep this thread's core busy for ``seconds`` of its CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
