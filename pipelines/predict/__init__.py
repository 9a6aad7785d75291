"""Predicting a Triton server by simulation: the server's schedule on a virtual clock. It reads what was
measured (a server profile, a pipeline's costs) and measures nothing: ``pipelines.profiling`` measures, and
:mod:`pipelines.measured_prediction` (``p.predict``, ``pipelines predict``) measures, then simulates here.

- :mod:`~pipelines.predict.spec`: what the simulator is given (frozen data);
- :mod:`~pipelines.predict.step_profile` and :mod:`~pipelines.predict.measured`: what was measured of the steps
  and of the pipeline (:func:`pipelines.profiling.pipeline_costs.measure_pipeline`), as JSON;
- :mod:`~pipelines.predict.simulator`: the discrete-event simulation (SimPy);
- :mod:`~pipelines.predict.prediction`: the :class:`Predictor` and the table of forms × loads;
- :mod:`~pipelines.predict.advise`: the search over forms, instances and batching.

The boundary costs come from the server profile (:mod:`pipelines.calibration`).
"""

from __future__ import annotations

from .advise import Advice, Candidate, advice_load, search
from .configuration import Configuration, ModelChoice, configured, default_configuration
from .measured import PipelineCosts
from .prediction import Prediction, PredictionRow, Predictor, checked_profile, loads, predicted_forms
from .simulator import simulate
from .spec import Curve, Load, SimResult, SimSpec, StepSpec, WayCost

__all__ = [
    "Advice",
    "Candidate",
    "Configuration",
    "Curve",
    "Load",
    "ModelChoice",
    "PipelineCosts",
    "Prediction",
    "PredictionRow",
    "Predictor",
    "SimResult",
    "SimSpec",
    "StepSpec",
    "WayCost",
    "advice_load",
    "checked_profile",
    "configured",
    "default_configuration",
    "loads",
    "predicted_forms",
    "search",
    "simulate",
]
