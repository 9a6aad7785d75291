"""Running pipelines: the local runtime (no server) and its cost report.

``pipelines.runtime.triton`` (the embedded Triton server and its clients) is
imported on demand, not here, so the local runtime needs no server pieces.
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
