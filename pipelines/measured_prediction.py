"""``predict`` and ``advise`` as a user calls them (``p.predict``, ``pipelines predict``): the pipeline measured
here (:func:`pipelines.profiling.pipeline_costs.measure_pipeline`), then its server simulated on what was measured
(:mod:`pipelines.predict`, which measures nothing).

It sits above both: the measuring imports the simulation's schemas, and the simulation nothing of the measuring.
What is checked without measuring (the pipeline, the server profile, the loads) is checked first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .core.graph import Graph
from .predict.advise import Advice, advice_load, search
from .predict.prediction import Prediction, Predictor, checked_profile, loads, predicted_forms
from .profiling.pipeline_costs import measure_pipeline, steps_cache

if TYPE_CHECKING:
    from .calibration import Profile

__all__ = ["advise", "predict", "predictor"]


def predictor(
    pipeline: Graph,
    profile: Profile | str | os.PathLike[str],
    *,
    inputs: Mapping[str, Any] | None = None,
    module: Any = None,
    costs: Mapping[str, Any] | None = None,
    cache: str | os.PathLike[str] | bool | None = True,
    cores: float | None = None,
    allow_mismatch: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    when_rates: Mapping[str, float] | None = None,
    step_costs: str = "auto",
    url: str | None = None,
) -> Predictor:
    """A :class:`~pipelines.predict.Predictor` of ``pipeline`` on the server ``profile``, its steps measured here
    (options as for :func:`predict`); ``advise`` simulates hundreds of configurations with one."""
    server, notes = checked_profile(pipeline, profile, allow_mismatch=allow_mismatch)
    measured = measure_pipeline(pipeline, inputs, server, module=module, costs=costs, cache=steps_cache(profile, cache),
                                when_rates=when_rates, step_costs=step_costs, url=url, progress=progress)
    return Predictor(pipeline, server, measured, cores=cores, notes=notes)


def predict(
    pipeline: Graph,
    profile: Profile | str | os.PathLike[str],
    concurrency: Sequence[int] | int | None = (1, 4, 16),
    forms: Iterable[str] | None = None,
    *,
    rate: Sequence[float] | float | None = None,
    **options: Any,
) -> Prediction:
    """Predict each form of ``pipeline`` at each concurrency (closed loop) or rate (open loop).

    ``profile``: a server profile or the path of its JSON file. ``options``: ``inputs``, one sample request
    (default: the pipeline module's own samples, else random tensors). ``costs``: µs per call
    (or ``{rows: µs}``) for steps not to measure here, such as external models without a
    stand-in. ``cache``: where the step profiles are kept (default: beside the profile file).
    ``cores``: the server's cores (default: those of the machine the profile was measured on);
    ``allow_mismatch``: use a profile measured on another machine (warns instead of refusing).
    ``step_costs``: ``"server"`` times each step's own model on the bundled Triton server (or ``url``),
    ``"local"`` takes the step profiles timed here, ``"auto"`` (default) the server at ``url`` where one
    is given; the notes say where each step's cost came from (:mod:`pipelines.profiling.server_steps`).
    ``when_rates``: each `when` condition tensor's share of true rows (default: counted over the samples);
    ``progress(done, total, node)``: called as each step is profiled.
    """
    wanted = loads(concurrency, rate)
    return predicted_forms(predictor(pipeline, profile, **options), wanted, forms)


def advise(
    pipeline: Graph,
    profile: Profile | str | os.PathLike[str],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    p95_ms: float | None = None,
    forms: Iterable[str] | None = None,
    cores: float | None = None,
    inputs: Mapping[str, Any] | None = None,
    module: Any = None,
    costs: Mapping[str, Any] | None = None,
    cache: str | os.PathLike[str] | bool | None = True,
    allow_mismatch: bool = False,
    budget: int = 300,
    progress: Callable[[int, int], None] | None = None,
    when_rates: Mapping[str, float] | None = None,
    step_costs: str = "auto",
    url: str | None = None,
) -> Advice:
    """Rank ``pipeline``'s configurations by predicted throughput under ``p95_ms`` (or by p95
    where no bound is given; ties within :data:`~pipelines.predict.advise.TIE` go to the one that changes least),
    at ``concurrency`` clients (default 8) or ``rate`` requests/s.
    ``cores`` is the server's (default: the profile's). ``when_rates``: the share of rows where
    each `when` condition tensor is true (default: counted over the sample requests). ``step_costs``
    and ``url``: where each step's cost is timed (:func:`predict`); ``progress(done, budget)`` as
    configurations are simulated."""
    load = advice_load(concurrency, rate)
    found = predictor(pipeline, profile, inputs=inputs, module=module, costs=costs, cache=cache, cores=cores,
                      allow_mismatch=allow_mismatch, when_rates=when_rates, step_costs=step_costs, url=url)
    return search(found, load, forms=forms, p95_ms=p95_ms, budget=budget, progress=progress)
