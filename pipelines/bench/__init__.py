"""Benchmark a pipeline in every form of the forms table, in the local runtime and on a
Triton server, side by side: ``run_benchmark(target, BenchSettings(...))`` or ``pipelines bench MODULE:ATTR``.
"""

from __future__ import annotations

from ..triton.statistics import ModelTimes
from .latency import LatencySummary
from .loadgen import LoadPlan, LoadResult, Window, run_load
from .measurement import FORMS, Configuration, Measurement
from .report_tables import prediction_table, render
from .results import BenchmarkResult
from .runner import run_benchmark
from .settings import DEFAULT_PIPELINE, BenchSettings
from .stability import StabilityRule
from .streams import StreamSummary, StreamTimes, stream_figures
from .verdict import RatioComparison

__all__ = [
    "DEFAULT_PIPELINE",
    "FORMS",
    "BenchSettings",
    "BenchmarkResult",
    "Configuration",
    "LatencySummary",
    "LoadPlan",
    "LoadResult",
    "Measurement",
    "ModelTimes",
    "RatioComparison",
    "StabilityRule",
    "StreamSummary",
    "StreamTimes",
    "Window",
    "prediction_table",
    "render",
    "run_benchmark",
    "run_load",
    "stream_figures",
]
