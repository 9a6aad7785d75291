"""A server profile: what each kind of boundary costs on one Triton server, at each probe size
and as a fixed cost plus a cost per byte, each with its confidence interval, and where and when it
was measured. JSON in, JSON out; a file with a cost that is no time, or missing, is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..commands.output_paths import replace_text
from ..errors import PipelinesError, ProfileMismatchError
from .cost import BOUNDARIES, MIB, Cost, checked_wake, cost_from_json
from .noise import MachineNoise, round_disagreement

__all__ = [
    "BOUNDARIES",
    "MIB",
    "STAND_INS",
    "Cost",
    "Point",
    "Profile",
    "ProfileMismatchWarning",
    "default_lanes",
    "load_profile",
]

#: Boundaries a profile may lack (profiles written before they were measured): what stands in for them.
# In order: a stand-in may itself stand in.
STAND_INS = {"ensemble": None, "bls_model": "stub", "bls_sync_call": "bls_call", "bls_sync_model": "bls_model",
             "fused_model": "bls_model", "fused_step": None, "ensemble_stub": "stub", "bls_stub": "stub",
             "bls_sync_stub": "bls_stub", "ensemble_gate": None}
_FORMAT = 1


class ProfileMismatchWarning(UserWarning):
    """A profile is used to predict a server other than the one it was measured on."""


@dataclass(frozen=True)
class Point:
    """One boundary's cost as one probe measured it (for the plot): bytes crossing, µs."""

    boundary: str
    nbytes: int
    cost_us: float
    probe: str


@dataclass(frozen=True)
class Profile:
    """The fitted costs of one server, measured over one protocol on one machine.

    ``costs`` maps each of :data:`BOUNDARIES` to its :class:`Cost`; ``points``
    are the per-probe figures the fit went through (kept for the plot).

    ``lanes`` is how many requests' boundary work the server does at once: its
    throughput on a probe at high concurrency over its throughput at concurrency
    1, at least 1 and at most the machine's cores: the server burns CPU on its
    cores for every boundary, so what predicts it shares that many among the
    requests in flight. A profile saved without it (older ones) gets the machine's usable
    cores as recorded (``usable_cpus``, else ``cpu_count``), or 1 where neither is.

    ``lanes_by_size`` is the same ratio measured at each of a few tensor sizes,
    ``(bytes, lanes)`` by size: large copies compete for the memory bus as well as the cores, so
    the server works on fewer 4 MiB boundaries at once than on 1 KiB ones
    (docs/server_profiles.md). :meth:`lanes_at` reads it; a profile without it has
    ``lanes`` at every size.

    ``rounds`` is how many rounds over every probe the calibration measured, and
    ``round_samples`` each probe's figures in each round, ``(kind, steps, bytes, round,
    latency µs, stub µs, of which in, BLS hold µs, steps' hold µs, reader µs)``: the costs are the
    fit of their medians over the rounds, and each cost's intervals (``ci_level``, 0.95)
    a bootstrap over the rounds (:func:`pipelines.profiling.fit.fit_rounds`). Older
    profiles have none (0, ``()``).

    ``wake`` is what a hand-off between processes costs beyond the boundaries' figures once
    the side that waits for it has waited a while: ``(waited µs, µs)`` points, from probes
    whose step works that long (:mod:`pipelines.profiling.wake`). A thread that waits
    long enough sleeps, and its core idles; waking them takes longer the longer they slept.
    ``wake_idle`` is the same where every core idled that long (a step that sleeps, or waits
    on a GPU). Profiles without them (older ones) price no wake.

    ``round_request_us`` is what each request of a fused model's round adds to the time the round
    holds its instance, beyond the first and beyond its bytes (its request read, its answer made):
    the slope of a fused probe's hold over the rows of its rounds
    (:func:`pipelines.profiling.measure.measure_rounds`). Profiles without it (older ones) price 0.

    ``noise`` is how steady the machine was while it was calibrated (:class:`~pipelines.calibration.noise.MachineNoise`):
    a profile calibrated on a busy machine is still used, and every table it feeds says so. ``None`` (older
    profiles): unknown.
    """

    costs: Mapping[str, Cost]
    server_version: str | None
    protocol: str
    machine: Mapping[str, Any]
    date: str
    url: str | None = None
    points: tuple[Point, ...] = ()
    # per probe: (kind, steps, tensor bytes, median latency µs, stub µs per execution or None,
    # of which on the way in or None[, a BLS probe's BLS model's hold µs or None[, a grown BLS
    # probe's step models' hold µs or None]]): the medians over the rounds the fit went through
    samples: tuple[tuple, ...] = ()
    lanes: float | None = None  # None: the machine's cores (see above)
    lanes_by_size: tuple[tuple[int, float], ...] = ()
    rounds: int = 0
    round_samples: tuple[tuple, ...] = ()
    ci_level: float = 0.95
    wake: tuple[tuple[float, float], ...] = ()
    wake_idle: tuple[tuple[float, float], ...] = ()
    round_request_us: float = 0.0
    noise: MachineNoise | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "grpc"):
            raise PipelinesError(f"a profile's protocol is 'http' or 'grpc'; got {self.protocol!r}")
        for name, cost in self.costs.items():
            if name not in BOUNDARIES:
                raise PipelinesError(f"costs.{name} is no boundary a profile prices; the boundaries are "
                                     f"{', '.join(BOUNDARIES)}")
            if not isinstance(cost, Cost):
                raise PipelinesError(f"costs.{name} is a {type(cost).__name__}, not a Cost")
        object.__setattr__(self, "costs", with_stand_ins(self.costs))
        missing = [b for b in BOUNDARIES if b not in self.costs]
        if missing:
            raise PipelinesError(f"costs.{missing[0]} is missing; a profile needs a cost for every boundary "
                                 f"(missing: {', '.join(missing)})")
        lanes = self.lanes if self.lanes is not None else default_lanes(self.machine)
        if not isinstance(lanes, (int, float)) or isinstance(lanes, bool) or not lanes >= 1:
            raise PipelinesError(f"a profile's lanes is a number >= 1 (requests the server works on at once); "
                                 f"got {lanes!r}")
        object.__setattr__(self, "lanes", float(lanes))
        by_size = tuple(sorted((int(n), float(v)) for n, v in self.lanes_by_size))
        if any(n < 1 or not v >= 1 for n, v in by_size) or len({n for n, _ in by_size}) != len(by_size):
            raise PipelinesError(f"a profile's lanes_by_size is (bytes >= 1, lanes >= 1) pairs, one per size; "
                                 f"got {self.lanes_by_size!r}")
        if not (isinstance(self.rounds, int) and self.rounds >= 0):
            raise PipelinesError(f"a profile's rounds is a whole number >= 0; got {self.rounds!r}")
        if not (isinstance(self.ci_level, float) and 0 < self.ci_level < 1):
            raise PipelinesError(f"a profile's ci_level is a fraction between 0 and 1; got {self.ci_level!r}")
        if isinstance(self.round_request_us, bool) or not (isinstance(self.round_request_us, (int, float))
                                                            and math.isfinite(self.round_request_us)
                                                            and self.round_request_us >= 0):
            raise PipelinesError(f"a profile's round_request_us is µs >= 0 (each request of a fused round beyond "
                                 f"the first); got {self.round_request_us!r}")
        object.__setattr__(self, "round_request_us", float(self.round_request_us))
        if self.noise is not None and not isinstance(self.noise, MachineNoise):
            raise PipelinesError(f"a profile's noise is a MachineNoise or None; got {type(self.noise).__name__}")
        object.__setattr__(self, "lanes_by_size", by_size)
        object.__setattr__(self, "wake", checked_wake(self.wake))
        object.__setattr__(self, "wake_idle", checked_wake(self.wake_idle))
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))
        object.__setattr__(self, "machine", MappingProxyType(dict(self.machine)))

    def window_spread(self) -> float | None:
        """How far the server's own figures moved from one measuring window to the next: the noise record's (its
        throughput over the calibration's lanes windows), else its probes' disagreement over the calibration's rounds
        (read off ``round_samples``, in profiles written before the record); None where unknown."""
        if self.noise is not None and self.noise.disagreement is not None:
            return self.noise.disagreement
        return round_disagreement(self.round_samples)

    def cost(self, boundary: str) -> Cost:
        return self.costs[boundary]

    def lanes_at(self, nbytes: int) -> float:
        """The lanes for boundary work on ``nbytes``: ``lanes_by_size`` between its sizes
        (straight in the logarithm of the bytes), its first or last beyond them, or ``lanes``
        where the profile has none by size."""
        by_size = self.lanes_by_size
        if not by_size:
            return float(self.lanes)
        sizes = [math.log(n) for n, _ in by_size]
        return float(np.interp(math.log(max(1, nbytes)), sizes, [v for _, v in by_size]))

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON data (lists, not tuples), as :meth:`save` writes it."""
        return _as_json_data({
            "format": _FORMAT,
            "server_version": self.server_version,
            "protocol": self.protocol,
            "url": self.url,
            "machine": dict(self.machine),
            "date": self.date,
            "costs": {name: asdict(cost) for name, cost in self.costs.items()},
            "points": [asdict(p) for p in self.points],
            "samples": [list(s) for s in self.samples],
            "lanes": self.lanes,
            "lanes_by_size": [list(p) for p in self.lanes_by_size],
            "rounds": self.rounds,
            "ci_level": self.ci_level,
            "round_samples": [list(s) for s in self.round_samples],
            "wake": [list(p) for p in self.wake],
            "wake_idle": [list(p) for p in self.wake_idle],
            "round_request_us": self.round_request_us,
            "noise": None if self.noise is None else self.noise.to_dict(),
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """The profile ``data`` holds (as :meth:`to_dict` wrote it, or an older one); a cost that is
        missing, negative, NaN or not a number is refused with its field's name."""
        try:
            if data.get("format") != _FORMAT:
                raise PipelinesError(f"profile format {data.get('format')!r}; this version reads format {_FORMAT}")
            if not isinstance(data.get("costs"), Mapping):
                raise PipelinesError("not a server profile: costs is missing (each boundary's figures, "
                                     "as 'pipelines calibrate --out' writes them)")
            costs = data["costs"]
            for name in BOUNDARIES:  # the boundaries every profile has priced: nothing stands in for them
                if name not in costs and name not in STAND_INS:
                    raise PipelinesError(f"costs.{name} is missing; a profile prices every boundary "
                                         f"({', '.join(BOUNDARIES)}): run 'pipelines calibrate' for a whole one")
            return cls(
                costs={name: cost_from_json(name, c) for name, c in costs.items()},
                server_version=data.get("server_version"),
                protocol=str(data["protocol"]),
                machine=dict(data.get("machine") or {}),
                date=str(data["date"]),
                url=data.get("url"),
                points=tuple(
                    Point(str(p["boundary"]), int(p["nbytes"]), float(p["cost_us"]), str(p["probe"]))
                    for p in data.get("points", ())
                ),
                samples=tuple(
                    (str(s[0]), int(s[1]), int(s[2]), float(s[3]), *(None if v is None else float(v) for v in s[4:9]))
                    for s in data.get("samples", ())
                ),
                lanes=None if data.get("lanes") is None else float(data["lanes"]),
                lanes_by_size=tuple((int(n), float(v)) for n, v in data.get("lanes_by_size", ())),
                rounds=int(data.get("rounds", 0)),
                round_samples=tuple(
                    (str(s[0]), int(s[1]), int(s[2]), int(s[3]), *(None if v is None else float(v) for v in s[4:10]))
                    for s in data.get("round_samples", ())
                ),
                ci_level=float(data.get("ci_level", 0.95)),
                wake=tuple((float(w), float(us)) for w, us in data.get("wake", ())),
                wake_idle=tuple((float(w), float(us)) for w, us in data.get("wake_idle", ())),
                round_request_us=data.get("round_request_us", 0.0),
                noise=MachineNoise.from_dict(data.get("noise")),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            what = f"{exc.args[0]} is missing" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise PipelinesError(f"not a server profile: {what}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON; a save that fails leaves an earlier profile there whole."""
        return replace_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PipelinesError(f"cannot read the profile {str(path)!r}: {exc}") from None
        except UnicodeDecodeError:
            raise PipelinesError(
                f"{str(path)!r} is not a profile (not text: a plot? the profile is the .json file "
                "'pipelines calibrate --out' wrote)"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PipelinesError(f"{str(path)!r} is not a profile (not JSON: {exc})") from None
        if not isinstance(data, dict):
            raise PipelinesError(f"{str(path)!r} is not a profile (a JSON {type(data).__name__}, not an object)")
        try:
            return cls.from_dict(data)
        except PipelinesError as exc:
            raise PipelinesError(f"{str(path)!r}: {exc}") from None

    # ----------------------------------------------------------------- checks

    def mismatches(self, *, server_version: str | None = None, protocol: str | None = None,
                   machine: Mapping[str, Any] | None = None) -> list[str]:
        """What differs between where this profile was measured and the server it is used for."""
        found = []
        if server_version is not None and self.server_version is not None and server_version != self.server_version:
            found.append(f"it was measured on Triton {self.server_version}, the server is Triton {server_version}")
        if protocol is not None and protocol != self.protocol:
            found.append(f"it was measured over {self.protocol}, the requests go over {protocol}")
        if machine is not None:
            for key in ("cpu", "cpu_count", "gpu"):
                mine, theirs = self.machine.get(key), machine.get(key)
                if mine is not None and theirs is not None and mine != theirs:
                    found.append(f"its machine has {key} {mine!r}, this one {theirs!r}")
        return found

    def require_match(self, *, server_version: str | None = None, protocol: str | None = None,
                      machine: Mapping[str, Any] | None = None, allow_mismatch: bool = False) -> list[str]:
        """Refuse (:class:`~pipelines.errors.ProfileMismatchError`) to predict a server other than the
        one this profile was measured on: another Triton version, protocol or machine (each
        compared where both sides are known). With ``allow_mismatch``, warn
        (:class:`ProfileMismatchWarning`) instead. Returns the differences, each in words."""
        found = self.mismatches(server_version=server_version, protocol=protocol, machine=machine)
        if found and not allow_mismatch:
            raise ProfileMismatchError(
                f"the server profile of {self.date} was measured elsewhere: {'; '.join(found)}. Its figures are "
                "costs of the server it was measured on: run 'pipelines calibrate' against this server (and "
                "protocol) for a profile that fits it, or pass --allow-mismatch (allow_mismatch=True) to use "
                "it anyway",
                differences=tuple(found),
            )
        if found:
            warnings.warn(self._mismatch_note(found), ProfileMismatchWarning, stacklevel=2)
        return found

    def check(self, *, server_version: str | None = None, protocol: str | None = None,
              machine: Mapping[str, Any] | None = None) -> list[str]:
        """Warn (:class:`ProfileMismatchWarning`) when this profile was measured elsewhere, and return
        the differences: :meth:`require_match` with the mismatch allowed."""
        found = self.mismatches(server_version=server_version, protocol=protocol, machine=machine)
        if found:
            warnings.warn(self._mismatch_note(found), ProfileMismatchWarning, stacklevel=2)
        return found

    def _mismatch_note(self, found: list[str]) -> str:
        return (f"the server profile of {self.date} may not predict this server: {'; '.join(found)}. "
                "Its figures are costs of the server it was measured on; run 'pipelines calibrate' "
                "against this server (and protocol) for a profile that fits it")

    # ----------------------------------------------------------------- display

    def table(self) -> str:
        from .show import profile_table

        return profile_table(self)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        from .show import plot_profile

        return plot_profile(self, path)

    def __str__(self) -> str:
        return self.table()


def _as_json_data(value: Any) -> Any:
    """``value`` with every tuple a list, as JSON gives it back: what a caller edits and compares."""
    if isinstance(value, dict):
        return {k: _as_json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json_data(v) for v in value]
    return value


def with_stand_ins(costs: Mapping[str, Cost]) -> dict[str, Cost]:
    """``costs`` with a stand-in for each boundary a profile may lack (see ``STAND_INS``)."""
    filled = dict(costs)
    for name, stand_in in STAND_INS.items():
        if name not in filled:
            filled[name] = filled[stand_in] if stand_in in filled else Cost(0.0, 0.0)
    return filled


def default_lanes(machine: Mapping[str, Any]) -> float:
    """The lanes of a profile that did not measure them: the cores its machine had, or 1."""
    for key in ("usable_cpus", "cpu_count"):
        cores = machine.get(key)
        if isinstance(cores, int) and cores >= 1:
            return float(cores)
    return 1.0


def load_profile(profile: Profile | str | os.PathLike[str]) -> Profile:
    """A :class:`Profile` as given, or loaded from the JSON file at that path."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile)
    raise PipelinesError(f"a profile is a Profile or the path of its JSON file; got {type(profile).__name__}")
