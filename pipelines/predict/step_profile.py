"""A step profile: what one live step costs by batch rows, as the simulator reads it (curves) and
the step profile cache keeps it (JSON); measured by :func:`pipelines.profiling.step_profiles.profile_steps`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType
from typing import Any

from ..core.tensor import TensorSpec
from ..errors import ArgumentError, PipelinesError

__all__ = ["StepProfile"]

_SOURCES = ("measured", "stand_in", "given", "server")


@dataclass(frozen=True)
class StepProfile:
    """One live step, measured (or given): what one execution costs by batch rows.

    ``name`` is the node's name, ``step`` the step's own; ``digest`` its code. ``inputs``/``outputs``: the dtype and
    dims of one row of each tensor it was handed and hands on (the whole tensor where the pipeline does not batch),
    ``in_bytes``/``out_bytes`` what they weigh per row. ``wall_us``/``cpu_us``: the median µs of one execution at each
    of ``rows``; ``warm_wall_us``/``warm_cpu_us`` with its inputs in the caches, as in the fused model (empty where
    they are too small to time out of them). ``gil_share`` and ``memory`` (0..1, at its first batch size; 0 where not
    measured): the part of its CPU time that holds the GIL, and of its time that waits on memory. ``traffic`` (0..1,
    at its first batch size, its inputs in the caches; ``None``: not measured, its ``memory`` stands in): how much it
    slows a copy on another core. ``spread``: how far its rounds disagreed, half the range of their wall times over
    their median, the largest over its batch sizes (``None``: not measured, a cost given). ``source``:
    ``"measured"``, ``"stand_in"`` (an external model's stand-in was timed), ``"given"`` (``costs=``) or
    ``"server"`` (its model on a Triton server, :mod:`pipelines.profiling.server_steps`).
    """

    name: str
    step: str
    digest: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    device: str
    rows: tuple[int, ...]
    wall_us: tuple[float, ...]
    cpu_us: tuple[float, ...]
    gil_share: float
    in_bytes: float
    out_bytes: float
    memory: float = 0.0
    external: bool = False
    source: str = "measured"
    warm_wall_us: tuple[float, ...] = ()
    warm_cpu_us: tuple[float, ...] = ()
    traffic: float | None = None
    spread: float | None = None

    def __post_init__(self) -> None:
        def refuse(what: str) -> ArgumentError:
            return ArgumentError(f"step profile {self.name!r}: {what}", step=self.name)

        rows = tuple(int(r) for r in self.rows)
        if not rows or any(r < 1 for r in rows) or list(rows) != sorted(set(rows)):
            raise refuse(f"rows must be increasing batch sizes >= 1; got {list(self.rows)}")
        for field_name in ("wall_us", "cpu_us", "warm_wall_us", "warm_cpu_us"):
            values = tuple(float(v) for v in getattr(self, field_name))
            untimed = field_name.startswith("warm") and not values  # inputs too small to time out of the caches
            if len(values) != len(rows) and not untimed:
                raise refuse(f"{field_name} has {len(values)} figures for {len(rows)} rows {list(rows)}")
            if not all(math.isfinite(v) and v >= 0 for v in values):
                raise refuse(f"{field_name} must be finite µs >= 0; got {list(values)}")
            object.__setattr__(self, field_name, values)
        for field_name in ("in_bytes", "out_bytes", "gil_share", "memory", "traffic", "spread"):
            if getattr(self, field_name) is None and field_name in ("traffic", "spread"):  # not measured
                continue
            value = float(getattr(self, field_name))
            share = field_name in ("gil_share", "memory", "traffic")
            if not math.isfinite(value) or value < 0 or (share and value > 1):
                bound = "between 0 and 1" if share else "finite and >= 0"
                raise refuse(f"{field_name} must be {bound}; got {getattr(self, field_name)!r}")
            object.__setattr__(self, field_name, value)
        if self.device not in ("cpu", "gpu"):
            raise refuse(f"device must be 'cpu' or 'gpu'; got {self.device!r}")
        if self.source not in _SOURCES:
            raise refuse(f"source must be one of {list(_SOURCES)}; got {self.source!r}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "external", bool(self.external))
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        object.__setattr__(self, "outputs", MappingProxyType(dict(self.outputs)))

    def to_json(self) -> dict[str, Any]:
        """The profile as JSON-ready data; :meth:`from_json` reads it back equal."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update({k: {n: spec.to_dict() for n, spec in data[k].items()} for k in ("inputs", "outputs")})
        data.update({k: list(data[k]) for k in ("rows", "wall_us", "cpu_us", "warm_wall_us", "warm_cpu_us")})
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> StepProfile:
        """A profile written by :meth:`to_json` (as data or JSON text); a missing field, a
        negative or NaN cost is an :class:`~pipelines.errors.ArgumentError` naming it."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        if not isinstance(data, Mapping):
            raise ArgumentError(f"a step profile is a JSON object; got {type(data).__name__}")
        name = data.get("name", "?")
        if missing := [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]:
            raise ArgumentError(f"step profile {name!r} has no {missing[0]!r}; profile the step again", step=name)
        try:
            specs = {k: {n: TensorSpec.from_dict(d) for n, d in dict(data[k]).items()} for k in ("inputs", "outputs")}
            return cls(**{**{f.name: data[f.name] for f in fields(cls) if f.name in data}, **specs})
        except PipelinesError:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise ArgumentError(f"step profile {name!r} is malformed ({type(exc).__name__}: {exc})",
                                step=name) from None
