"""Running pipelines: the local runtime (no server) and its cost report.

The embedded Triton server and its clients are a separate package, ``pipelines.triton``;
the two share no code, so the local runtime needs no server pieces.
"""

from __future__ import annotations

from .device import gpu_available
from .local import MODES, LocalRuntime, run_many, run_pipeline
from .report import Comparison, Report, StepCost, compare

__all__ = [
    "MODES",
    "Comparison",
    "LocalRuntime",
    "Report",
    "StepCost",
    "compare",
    "gpu_available",
    "run_many",
    "run_pipeline",
]
