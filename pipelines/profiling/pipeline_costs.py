"""One pipeline measured for a prediction: each step run for real here (:mod:`.step_profiles`), timed on a server
where one is asked for (:mod:`.server_steps`), each ``when`` condition's share counted (:mod:`.when_shares`), and the
machine watched meanwhile (:mod:`.noise_watch`); all of it in one :class:`~pipelines.predict.measured.PipelineCosts`,
which the simulation (``pipelines.predict``) reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..calibration.profile import Profile
from ..core.graph import Graph
from ..core.planning import plan_of
from ..predict.measured import PipelineCosts
from .noise_watch import NoiseWatch
from .server_steps import steps_for
from .step_profiles import profile_steps
from .when_shares import WhenShares

__all__ = ["measure_pipeline", "sample_inputs", "steps_cache"]


def measure_pipeline(
    pipeline: Graph,
    inputs: Mapping[str, Any] | None,
    profile: Profile,
    *,
    module: Any = None,
    costs: Mapping[str, Any] | None = None,
    cache: str | os.PathLike[str] | None = None,
    when_rates: Mapping[str, float] | None = None,
    step_costs: str = "auto",
    url: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> PipelineCosts:
    """What a prediction of ``pipeline`` on the server ``profile`` simulates, measured here on ``inputs`` (one
    request; ``None``: ``module``'s own samples, else random tensors, :func:`sample_inputs`).

    ``costs``: µs per call (or ``{rows: µs}``) of steps not to measure here; ``cache``: the step profiles' file
    (:func:`steps_cache`); ``progress(done, total, node)`` as each step is profiled. ``step_costs`` and ``url``: where
    each step's cost is timed (:func:`~pipelines.profiling.server_steps.steps_for`; the server's protocol is the
    profile's). ``when_rates``: each ``when`` condition tensor's share of true rows, else counted over the samples.
    """
    watch = NoiseWatch()  # how steady this machine is while the steps are measured
    given = inputs is not None
    request = dict(inputs) if inputs is not None else sample_inputs(pipeline, module)
    notes: list[str] = []
    when = WhenShares(pipeline, plan_of(pipeline, warn=False), request, given, notes)
    when.check(when_rates or {})  # a share that names no condition is refused before the steps are measured
    local = profile_steps(pipeline, request, cache=cache, costs=costs, progress=progress)
    # Steps priced on the server where one is asked for (docs/prediction.md, "Take step costs from your
    # server"): as its step models, and for the fused form as the fused model runs them.
    steps, fused = steps_for(pipeline, request, local, profile, step_costs=step_costs, url=url, cache=cache,
                             notes=notes)
    shares = when.rates(when_rates or {}, module)
    spreads = [p.spread for p in steps.values() if p.spread is not None]
    own = watch.stop(disagreement=float(np.median(spreads)) if spreads else None)
    if all(p.source == "given" for p in steps.values()):  # nothing measured here: its load tells nothing
        own = replace(own, other_load=None, steal=None)
    rows = _rows_of(pipeline, request)
    return PipelineCosts(steps=steps, fused_steps=fused, local_steps=local, when_rates=shares, noise=own, rows=rows,
                         in_bytes=_nbytes(request) / rows, notes=tuple(notes))


def steps_cache(profile: Any, cache: str | os.PathLike[str] | bool | None = True) -> str | os.PathLike[str] | None:
    """Where the step profiles are kept: ``cache`` as given; ``True``, beside the server profile's file
    (``PROFILE.steps.json``; nowhere for a profile given as an object); ``False`` or ``None``, nowhere."""
    if cache is True:
        return Path(profile).with_suffix(".steps.json") if isinstance(profile, (str, os.PathLike)) else None
    if cache is False:
        return None
    return cache


def sample_inputs(pipeline: Graph, module: Any = None) -> dict[str, Any]:
    """One request for a pipeline with no inputs given: ``module``'s own ``sample_inputs()`` or
    ``make_sample()`` where it has one (as the benchmark sends), else random tensors shaped by
    the pipeline's input specs."""
    from ..commands.sample_inputs import sample_requests

    return dict(sample_requests(pipeline, module=module)[0])


def _rows_of(pipeline: Graph, inputs: Mapping[str, Any]) -> int:
    if not pipeline.batched:
        return 1
    first = next(iter(inputs.values()))
    return int(np.shape(first)[0]) if np.ndim(first) else 1


def _nbytes(arrays: Mapping[str, Any]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
