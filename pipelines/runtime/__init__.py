"""The local runtime: runs a pipeline's execution plan without a server, in the semantics of each form.
Its scheduler, step instances, batching, BLS gate, devices and cost report live here; Triton is ``pipelines.triton``.
"""

from __future__ import annotations

from .device import gpu_available
from .local import run_many, run_pipeline
from .local_runtime import MODES, LocalRuntime
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
