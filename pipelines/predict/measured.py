"""What was measured of one pipeline, as the simulation reads it: each step's costs, the share of rows where each
``when`` condition holds, how busy this machine was meanwhile, and the request's size. Measured by
:func:`pipelines.profiling.pipeline_costs.measure_pipeline`; this schema imports nothing of the measuring, and a
:class:`~pipelines.predict.prediction.Predictor` reads nothing else of the pipeline's run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from ..calibration.noise import MachineNoise
from ..errors import ArgumentError
from .step_profile import StepProfile

__all__ = ["PipelineCosts"]

_PROFILES = ("steps", "fused_steps", "local_steps")


@dataclass(frozen=True)
class PipelineCosts:
    """One pipeline measured here (or its costs given), by node name.

    ``steps``: each live step's profile as its step model is simulated (timed on a server where one was asked for,
    else here); ``fused_steps``: as the fused model runs them; ``local_steps``: as timed here, whichever the others
    are. ``when_rates``: each ``when`` condition's share of rows where it holds (by its description). ``noise``:
    this machine while the steps were measured (its load and steal ``None`` where nothing was measured here).
    ``rows``: the request's rows; ``in_bytes``: what one row of it weighs. ``notes``: what the measuring has to say
    (where each step's cost came from, each share counted), in its order.
    """

    steps: Mapping[str, StepProfile]
    fused_steps: Mapping[str, StepProfile]
    local_steps: Mapping[str, StepProfile]
    when_rates: Mapping[str, float] = field(default_factory=dict)
    noise: MachineNoise = field(default_factory=MachineNoise)
    rows: int = 1
    in_bytes: float = 0.0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in _PROFILES:
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        if set(self.fused_steps) != set(self.steps):
            raise ArgumentError(f"the fused form's step costs are of {sorted(self.fused_steps)}, the step models' "
                                f"of {sorted(self.steps)}: each live step needs both")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ArgumentError(f"a request's rows are an int >= 1; got {self.rows!r}")
        object.__setattr__(self, "when_rates", MappingProxyType({k: float(v) for k, v in self.when_rates.items()}))
        object.__setattr__(self, "in_bytes", float(self.in_bytes))
        object.__setattr__(self, "notes", tuple(self.notes))

    def to_json(self) -> dict[str, Any]:
        """The costs as JSON-ready data; :meth:`from_json` reads them back equal."""
        data: dict[str, Any] = {name: {node: p.to_json() for node, p in getattr(self, name).items()}
                                for name in _PROFILES}
        data.update(when_rates=dict(self.when_rates), noise=asdict(self.noise), rows=self.rows,
                    in_bytes=self.in_bytes, notes=list(self.notes))
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> PipelineCosts:
        """Costs written by :meth:`to_json` (as data or JSON text); a malformed one is an
        :class:`~pipelines.errors.ArgumentError` naming what is wrong."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        if not isinstance(data, Mapping):
            raise ArgumentError(f"a pipeline's costs are a JSON object; got {type(data).__name__}")
        if missing := [name for name in _PROFILES if name not in data]:
            raise ArgumentError(f"the pipeline's costs have no {missing[0]!r}; measure the pipeline again")
        try:
            profiles = {name: {node: StepProfile.from_json(p) for node, p in dict(data[name]).items()}
                        for name in _PROFILES}
            return cls(**profiles, when_rates=dict(data.get("when_rates", {})),
                       noise=MachineNoise(**dict(data.get("noise", {}))), rows=data.get("rows", 1),
                       in_bytes=data.get("in_bytes", 0.0), notes=tuple(data.get("notes", ())))
        except TypeError as exc:
            raise ArgumentError(f"the pipeline's costs are malformed ({exc})") from None
