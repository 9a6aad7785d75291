"""Predicting a Triton server by simulation: the server's schedule on a virtual clock.

- :mod:`~pipelines.predict.spec`: what the simulator is given (frozen data);
- :mod:`~pipelines.predict.simulator`: the discrete-event simulation (SimPy);
- :mod:`~pipelines.profiling.step_profiles`: each step run for real here, per batch size;
- :mod:`~pipelines.predict.prediction`: ``p.predict(profile, ...)``, a table of forms × loads;
- :mod:`~pipelines.predict.advise`: the search over forms, instances and batching;
- :mod:`~pipelines.predict.verify`: ``advise --verify`` on a real server.

The boundary costs come from the server profile (:mod:`pipelines.calibration`).
"""

from __future__ import annotations

from .advise import Advice, Candidate, advise
from .configuration import Configuration, ModelChoice, configured, default_configuration
from .prediction import Prediction, PredictionRow, Predictor, predict
from .simulator import simulate
from .spec import Curve, Load, SimResult, SimSpec, StepSpec, WayCost

__all__ = [
    "Advice",
    "Candidate",
    "Configuration",
    "Curve",
    "Load",
    "ModelChoice",
    "Prediction",
    "PredictionRow",
    "Predictor",
    "SimResult",
    "SimSpec",
    "StepSpec",
    "WayCost",
    "advise",
    "configured",
    "default_configuration",
    "predict",
    "simulate",
]
