"""Server profiles: what a Triton server pays at each boundary, so that a pipeline's schedule on it
can be predicted.

:func:`pipelines.profiling.calibrate.calibrate` (``pipelines calibrate``) runs generated probe models on a server in
rounds, and fits, for each kind of boundary, its cost at each probe size on the way in
and out (and a fixed cost plus a cost per byte through them), each with a confidence
interval; the :class:`Profile` saves as JSON, and refuses a file whose costs are missing
or no time, or (:meth:`Profile.require_match`) a server it was not measured on.
"""

from __future__ import annotations

from ..errors import ProfileMismatchError
from .profile import BOUNDARIES, Cost, Point, Profile, ProfileMismatchWarning, load_profile

__all__ = [
    "BOUNDARIES",
    "Cost",
    "Point",
    "Profile",
    "ProfileMismatchError",
    "ProfileMismatchWarning",
    "load_profile",
]
