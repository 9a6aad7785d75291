"""A server profile: what each kind of boundary costs on one Triton server, as a fixed
cost plus a cost per byte, with where and when it was measured. JSON in, JSON out.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import PipelinesError
from ..output_paths import replace_text

__all__ = [
    "BOUNDARIES",
    "STAND_INS",
    "Cost",
    "Point",
    "Profile",
    "ProfileMismatchWarning",
    "default_lanes",
    "load_profile",
]

#: The kinds of boundary a profile prices, with what each one is.
BOUNDARIES = {
    "request": "a request entering and leaving the server (client, protocol, front end); bytes in + out",
    "ensemble": "the ensemble scheduler's own work per request, beyond its steps; bytes in + out",
    "ensemble_step": "an ensemble step's input and output, passed by the ensemble scheduler; bytes in + out",
    "bls_call": "a BLS call made from a stub and its response (async execute); bytes in + out",
    "bls_model": "the BLS model's own stub taking the request's tensors in and giving them out; bytes in + out",
    "bls_sync_call": "a BLS call made from a stub and its response (sync execute); bytes in + out",
    "bls_sync_model": "the sync BLS model's own stub, as bls_model; bytes in + out",
    "stub": "a Python step's stub: its inputs in, its fresh outputs out (shared memory, the stub process); "
    "bytes in + out",
    "ensemble_stub": "a Python step's stub as an ensemble runs it (its outputs go to the ensemble's tensors); "
    "bytes in + out",
    "bls_stub": "a Python step's stub as a BLS model calls it (async execute); bytes in + out",
    "bls_sync_stub": "a Python step's stub as a sync BLS model calls it; bytes in + out",
    "ensemble_gate": "what a gated ensemble pays per request beyond its gate model's step and stub (the failure "
    "tensors every step carries); by the intermediates' bytes",
}
#: Boundaries a profile may lack (profiles written before they were measured): what stands in for them.
# In order: a stand-in may itself stand in.
STAND_INS = {"ensemble": None, "bls_model": "stub", "bls_sync_call": "bls_call", "bls_sync_model": "bls_model",
             "ensemble_stub": "stub", "bls_stub": "stub", "bls_sync_stub": "bls_stub", "ensemble_gate": None}
_FORMAT = 1
MIB = float(1 << 20)


class ProfileMismatchWarning(UserWarning):
    """A profile is used to predict a server other than the one it was measured on."""


@dataclass(frozen=True)
class Cost:
    """``fixed_us`` per crossing plus ``us_per_mib`` for each MiB that crosses (in + out): the
    straight line through the boundary's measured costs, for the table and the plot.

    ``sizes`` are the tensor sizes the boundary was measured at, and ``in_us`` and
    ``out_us`` its cost at each of them on the way in and on the way out. Where they
    are given, they price a crossing (:meth:`way_us`), linear between two sizes: a
    server's cost per byte is not one number from 1 KiB to 32 MiB (HTTP bodies and
    fresh outputs cost more per byte the larger they are), and the way in and the
    way out differ (a step's fresh output costs its stub more than its input).
    """

    fixed_us: float
    us_per_mib: float
    sizes: tuple[int, ...] = ()
    in_us: tuple[float, ...] = ()
    out_us: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.sizes) == len(self.in_us) == len(self.out_us):
            raise PipelinesError(f"a cost's curve needs one in and one out figure per size; got {len(self.sizes)} "
                                 f"sizes, {len(self.in_us)} in and {len(self.out_us)} out")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise PipelinesError(f"a cost's sizes must increase; got {list(self.sizes)}")
        for v in (self.fixed_us, self.us_per_mib, *self.in_us, *self.out_us):
            if not (math.isfinite(v) and v >= 0):  # a time spent: never negative, never NaN
                raise PipelinesError(f"a cost's figures are finite microseconds >= 0; got {v!r}")

    def us(self, nbytes: float) -> float:
        """The line's cost of ``nbytes`` crossing in all (in + out)."""
        return self.fixed_us + self.us_per_mib * nbytes / MIB

    def way_us(self, nbytes: float, *, leaving: bool) -> float:
        """What ``nbytes`` cost on the way in (or out, ``leaving``): the measured curve where there is
        one (linear between sizes, the last slope past the largest), else half the line's fixed
        cost plus its cost per byte."""
        if not self.sizes:
            return self.fixed_us / 2 + self.us_per_mib * nbytes / MIB
        ys = self.out_us if leaving else self.in_us
        xs = self.sizes
        # As numpy.interp does (the first figure below the smallest size), but in plain Python:
        # the replay prices every boundary of every request this way, and numpy.interp's
        # conversions of a handful of numbers took 20 µs a call, 8 % of the event loop's time in
        # chain10's ensemble at concurrency 4 (docs/server_profiles.md).
        i = bisect_left(xs, nbytes)
        if i < len(xs) and xs[i] == nbytes:
            return float(ys[i])
        if i == 0 or len(xs) == 1:
            return float(ys[0])
        if i < len(xs):
            return float(ys[i - 1] + (ys[i] - ys[i - 1]) * (nbytes - xs[i - 1]) / (xs[i] - xs[i - 1]))
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (nbytes - xs[-1])


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
    1, at least 1 and at most the machine's cores. The replay spends every
    boundary cost holding one of that many lanes, as the server burns CPU on its
    cores. A profile saved without it (older ones) gets the machine's usable
    cores as recorded (``usable_cpus``, else ``cpu_count``), or 1 where neither is.

    ``lanes_by_size`` is the same ratio measured at each of a few tensor sizes,
    ``(bytes, lanes)`` by size: large copies compete for the memory bus as well as the cores, so
    the server works on fewer 4 MiB boundaries at once than on 1 KiB ones
    (docs/server_profiles.md). :meth:`lanes_at` reads it; a profile without it has
    ``lanes`` at every size.
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
    # probe's step models' hold µs or None]])
    samples: tuple[tuple, ...] = ()
    lanes: float | None = None  # None: the machine's cores (see above)
    lanes_by_size: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "grpc"):
            raise PipelinesError(f"a profile's protocol is 'http' or 'grpc'; got {self.protocol!r}")
        object.__setattr__(self, "costs", with_stand_ins(self.costs))
        missing = [b for b in BOUNDARIES if b not in self.costs]
        if missing:
            raise PipelinesError(f"a profile needs a cost for every boundary; missing {missing}")
        lanes = self.lanes if self.lanes is not None else default_lanes(self.machine)
        if not isinstance(lanes, (int, float)) or isinstance(lanes, bool) or not lanes >= 1:
            raise PipelinesError(f"a profile's lanes is a number >= 1 (requests the server works on at once); "
                                 f"got {lanes!r}")
        object.__setattr__(self, "lanes", float(lanes))
        by_size = tuple(sorted((int(n), float(v)) for n, v in self.lanes_by_size))
        if any(n < 1 or not v >= 1 for n, v in by_size) or len({n for n, _ in by_size}) != len(by_size):
            raise PipelinesError(f"a profile's lanes_by_size is (bytes >= 1, lanes >= 1) pairs, one per size; "
                                 f"got {self.lanes_by_size!r}")
        object.__setattr__(self, "lanes_by_size", by_size)
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))
        object.__setattr__(self, "machine", MappingProxyType(dict(self.machine)))

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
        return {
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
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        try:
            if data.get("format") != _FORMAT:
                raise PipelinesError(f"profile format {data.get('format')!r}; this version reads format {_FORMAT}")
            return cls(
                costs={name: _cost(c) for name, c in data["costs"].items()},
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
                    (str(s[0]), int(s[1]), int(s[2]), float(s[3]), *(None if v is None else float(v) for v in s[4:8]))
                    for s in data.get("samples", ())
                ),
                lanes=None if data.get("lanes") is None else float(data["lanes"]),
                lanes_by_size=tuple((int(n), float(v)) for n, v in data.get("lanes_by_size", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PipelinesError(f"not a server profile: {type(exc).__name__}: {exc}") from None

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

    def check(self, *, server_version: str | None = None, protocol: str | None = None,
              machine: Mapping[str, Any] | None = None) -> list[str]:
        """Warn (:class:`ProfileMismatchWarning`) when this profile was measured elsewhere."""
        found = self.mismatches(server_version=server_version, protocol=protocol, machine=machine)
        if found:
            warnings.warn(
                f"the server profile of {self.date} may not predict this server: {'; '.join(found)}. "
                "Its figures are costs of the server it was measured on; run 'pipelines calibrate' "
                "against this server (and protocol) for a profile that fits it",
                ProfileMismatchWarning,
                stacklevel=2,
            )
        return found

    # ----------------------------------------------------------------- display

    def table(self) -> str:
        from .show import profile_table

        return profile_table(self)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        from .show import plot_profile

        return plot_profile(self, path)

    def __str__(self) -> str:
        return self.table()


def _cost(data: Mapping[str, Any]) -> Cost:
    return Cost(float(data["fixed_us"]), float(data["us_per_mib"]), tuple(int(v) for v in data.get("sizes", ())),
                tuple(float(v) for v in data.get("in_us", ())), tuple(float(v) for v in data.get("out_us", ())))


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
