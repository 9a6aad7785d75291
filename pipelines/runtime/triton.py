"""Kept so that ``from pipelines.runtime.triton import TritonServer`` still works: the embedded
server and its clients live in :mod:`pipelines.triton`."""

from __future__ import annotations

from ..triton import *  # noqa: F403  (a re-export of the whole public API, nothing else)
from ..triton import __all__  # noqa: F401
