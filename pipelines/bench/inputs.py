"""The requests a benchmark sends: :mod:`pipelines.sample_inputs`, which the prediction
shares, under the name the benchmark has always given them."""

from __future__ import annotations

from ..sample_inputs import random_request, sample_requests

__all__ = ["random_request", "sample_requests"]
