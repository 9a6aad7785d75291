"""A benchmark's results as one object, and ``results.json``: every figure, with the
machine, the versions and the settings that produced them, so a run can be compared
with another one later.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from ..commands.machine import machine_info
from ..commands.output_paths import replace_text
from ..errors import NotFoundError
from .measurement import Measurement
from .verdict import RatioComparison

__all__ = ["BenchmarkResult", "machine_info", "package_versions"]

_PACKAGES = ("pipelines", "numpy", "anyio", "tritonclient", "nvidia-pytriton", "onnxruntime", "cupy-cuda12x")


def package_versions(extra: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """Python's and the relevant packages' versions (None where a package is absent)."""
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions.update(extra or {})
    return versions


@dataclass(frozen=True)
class BenchmarkResult:
    """Everything one benchmark run measured and concluded."""

    pipeline: str
    settings: Mapping[str, Any]
    measurements: tuple[Measurement, ...]
    comparisons: tuple[RatioComparison, ...]
    verdict: str
    machine: Mapping[str, Any] = field(default_factory=machine_info)
    versions: Mapping[str, Any] = field(default_factory=package_versions)
    started: str = ""
    finished: str = ""
    files: tuple[str, ...] = ()
    #: ``"complete"``, or why the run stopped early (``"interrupted"``, ``"failed: ..."``),
    #: or ``"running: ..."`` in the copy written after each concurrency level.
    status: str = "complete"
    #: One-line remarks for the reader, such as plots that could not be drawn.
    notes: tuple[str, ...] = ()
    #: The server's figures predicted from a profile (``--profile``): rows of ``form``,
    #: ``concurrency``, ``p50_ms`` and ``throughput``, set beside the measured ones.
    predictions: tuple[Mapping[str, Any], ...] = ()

    def find(self, label: str, concurrency: int) -> Measurement:
        """The measurement of configuration ``label`` (e.g. ``"server bls"``) at ``concurrency``."""
        for m in self.measurements:
            if m.config.label == label and m.concurrency == concurrency:
                return m
        raise NotFoundError(
            f"no measurement of {label!r} at concurrency {concurrency}; measured: "
            f"{sorted({(m.config.label, m.concurrency) for m in self.measurements})}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "status": self.status,
            "started": self.started,
            "finished": self.finished,
            "machine": dict(self.machine),
            "versions": dict(self.versions),
            "settings": dict(self.settings),
            "measurements": [m.to_dict() for m in self.measurements],
            "prediction_vs_measurement": [c.to_dict() for c in self.comparisons],
            "predictions": [dict(row) for row in self.predictions],
            "verdict": self.verdict,
            "files": list(self.files),
            "notes": list(self.notes),
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write ``results.json`` (strict JSON: missing figures are ``null``).

        The text goes to a temporary file that then replaces ``path``, so an
        interruption mid-write leaves the previous copy whole, never half a file.
        """
        return replace_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    # Cost reports may carry numpy scalars, tuples of them, or paths.
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


__all__ += ["now"]
