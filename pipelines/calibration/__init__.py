"""Server profiles: what a Triton server pays at each boundary, so that a pipeline's schedule on it
can be predicted.

``calibrate()`` (``pipelines calibrate``) runs generated probe models on a server in
rounds, and fits, for each kind of boundary, its cost at each probe size on the way in
and out (and a fixed cost plus a cost per byte through them), each with a confidence
interval; the :class:`Profile` saves as JSON, and refuses a file whose costs are missing
or no time, or (:meth:`Profile.require_match`) a server it was not measured on.
"""

from __future__ import annotations

from ..errors import ProfileMismatchError
from .calibrate import ProbesNotDeployed, calibrate
from .fit import estimate, fit_costs, fit_rounds
from .measure import Budget
from .probes import probe_pipeline, probe_repository, write_probe_repository
from .profile import BOUNDARIES, Cost, Point, Profile, ProfileMismatchWarning, load_profile

__all__ = [
    "BOUNDARIES",
    "Budget",
    "Cost",
    "Point",
    "ProbesNotDeployed",
    "Profile",
    "ProfileMismatchError",
    "ProfileMismatchWarning",
    "calibrate",
    "estimate",
    "fit_costs",
    "fit_rounds",
    "load_profile",
    "probe_pipeline",
    "probe_repository",
    "write_probe_repository",
]
