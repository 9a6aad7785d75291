"""Measuring: the server's boundaries (probe models, ``pipelines calibrate``), each step of a pipeline, and the machine's
noise; what it measures is written as JSON (a server profile, the step profiles) that ``predict/`` reads.

``calibrate()`` runs generated probe models on a server in rounds and fits each boundary's costs into a
:class:`~pipelines.calibration.Profile` (the schema, in ``calibration/``, imports nothing of this package).
"""

from __future__ import annotations

from .calibrate import ProbesNotDeployed, calibrate
from .fit import estimate, fit_costs, fit_rounds
from .measure import Budget
from .probes import probe_pipeline, probe_repository, write_probe_repository

__all__ = [
    "Budget",
    "ProbesNotDeployed",
    "calibrate",
    "estimate",
    "fit_costs",
    "fit_rounds",
    "probe_pipeline",
    "probe_repository",
    "write_probe_repository",
]
