"""A server profile: what each kind of boundary costs on one Triton server, as a fixed
cost plus a cost per byte, with where and when it was measured. JSON in, JSON out.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import PipelinesError

__all__ = [
    "BOUNDARIES",
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
    "ensemble_step": "an ensemble step's input and output, passed by the ensemble scheduler; bytes in + out",
    "bls_call": "a BLS call made from a stub and its response; bytes in + out",
    "stub": "a Python stub's input and output (shared memory to and from the stub process); bytes in + out",
}
_FORMAT = 1
MIB = float(1 << 20)


class ProfileMismatchWarning(UserWarning):
    """A profile is used to predict a server other than the one it was measured on."""


@dataclass(frozen=True)
class Cost:
    """``fixed_us`` per crossing plus ``us_per_mib`` for each MiB that crosses."""

    fixed_us: float
    us_per_mib: float

    def seconds(self, nbytes: float) -> float:
        return (self.fixed_us + self.us_per_mib * nbytes / MIB) * 1e-6

    def us(self, nbytes: float) -> float:
        return self.fixed_us + self.us_per_mib * nbytes / MIB


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
    """

    costs: Mapping[str, Cost]
    server_version: str | None
    protocol: str
    machine: Mapping[str, Any]
    date: str
    url: str | None = None
    points: tuple[Point, ...] = ()
    # per probe: (kind, steps, tensor bytes, median latency µs, stub µs per execution or None)
    samples: tuple[tuple[str, int, int, float, float | None], ...] = ()
    lanes: float | None = None  # None: the machine's cores (see above)

    def __post_init__(self) -> None:
        missing = [b for b in BOUNDARIES if b not in self.costs]
        if missing:
            raise PipelinesError(f"a profile needs a cost for every boundary; missing {missing}")
        lanes = self.lanes if self.lanes is not None else default_lanes(self.machine)
        if not isinstance(lanes, (int, float)) or isinstance(lanes, bool) or not lanes >= 1:
            raise PipelinesError(f"a profile's lanes is a number >= 1 (requests the server works on at once); "
                                 f"got {lanes!r}")
        object.__setattr__(self, "lanes", float(lanes))
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))
        object.__setattr__(self, "machine", MappingProxyType(dict(self.machine)))

    def cost(self, boundary: str) -> Cost:
        return self.costs[boundary]

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
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        try:
            if data.get("format") != _FORMAT:
                raise PipelinesError(f"profile format {data.get('format')!r}; this version reads format {_FORMAT}")
            return cls(
                costs={name: Cost(float(c["fixed_us"]), float(c["us_per_mib"])) for name, c in data["costs"].items()},
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
                    (str(s[0]), int(s[1]), int(s[2]), float(s[3]), None if s[4] is None else float(s[4]))
                    for s in data.get("samples", ())
                ),
                lanes=None if data.get("lanes") is None else float(data["lanes"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PipelinesError(f"not a server profile: {type(exc).__name__}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PipelinesError(f"cannot read the profile {str(path)!r}: {exc}") from None
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
