"""Server profiles: what a Triton server pays at each boundary, so the local runtime can predict it.

``calibrate()`` (``pipelines calibrate``) runs generated probe models on a
server and fits, for each kind of boundary, a fixed cost plus a cost per byte
(the request and the stub also at each probe size, on the way in and out);
the :class:`Profile` saves as JSON and is replayed by
``LocalRuntime(p, mode, profile=...)``.
"""

from __future__ import annotations

from .calibrate import ProbesNotDeployed, calibrate
from .fit import fit_costs
from .probes import probe_pipeline, probe_repository, write_probe_repository
from .profile import BOUNDARIES, Cost, Point, Profile, ProfileMismatchWarning, load_profile

__all__ = [
    "BOUNDARIES",
    "Cost",
    "Point",
    "ProbesNotDeployed",
    "Profile",
    "ProfileMismatchWarning",
    "calibrate",
    "fit_costs",
    "load_profile",
    "probe_pipeline",
    "probe_repository",
    "write_probe_repository",
]
