"""The step profile cache: a JSON file of step profiles keyed by all that decides a step's cost
(:func:`cache_key`); a step found there is not run again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..commands.output_paths import output_file, replace_text
from ..core.tensor import TensorSpec
from ..errors import PipelinesError
from ..predict.step_profile import StepProfile
from .gil_share import usable_cores

__all__ = ["CACHE_FORMAT", "StepCache", "cache_key", "value_digest"]

#: Version of the cache file; a cache of another format is not read (and is replaced).
# 2: a profile holds its memory share; 3: keys hold where inputs came from; 4: warm timings; 5: its traffic;
# 6: each figure the median of rounds over the steps; 7: the rounds' spread
CACHE_FORMAT = 7


class StepCache:
    """The profiles file: ``{"format": CACHE_FORMAT, "profiles": {key: profile}}``; written whole, through
    a temporary file (:func:`~pipelines.commands.output_paths.replace_text`), keeping the entries of other
    pipelines and steps that share it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = output_file(path, "the step profile cache")
        self.entries = self._read(warn=True)
        self.added: dict[str, dict[str, Any]] = {}

    def _read(self, *, warn: bool) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("profiles"), dict):
                raise PipelinesError(f"format {data.get('format')!r}, not {CACHE_FORMAT}")
        except (OSError, ValueError, AttributeError, PipelinesError) as exc:
            if warn:
                warnings.warn(f"step profile cache {str(self.path)!r} cannot be read ({exc}); its steps are profiled "
                              "again and the file is replaced", stacklevel=2)
            return {}
        return data["profiles"]

    def get(self, key: str) -> StepProfile | None:
        try:
            return StepProfile.from_json(self.entries[key])
        except (KeyError, PipelinesError):  # none yet, or a damaged entry: measured again
            return None

    def extra(self, key: str) -> dict[str, Any]:
        """What an entry keeps beside its profile (``put(..., extra=)``; empty where nothing)."""
        entry = self.entries.get(key)
        found = entry.get("extra") if isinstance(entry, dict) else None
        return dict(found) if isinstance(found, dict) else {}

    def put(self, key: str, profile: StepProfile, *, extra: Mapping[str, Any] | None = None) -> None:
        # beside the profile's fields: StepProfile.from_json reads only its own
        self.entries[key] = self.added[key] = {**profile.to_json(), **({"extra": dict(extra)} if extra else {})}

    def write(self) -> None:
        if not self.added:
            return
        entries = self._read(warn=False)  # what another run may have added meanwhile
        entries.update(self.added)
        replace_text(self.path, json.dumps({"format": CACHE_FORMAT, "profiles": entries}, indent=1, sort_keys=True))
        self.added = {}


def cache_key(digest: str, inputs: Mapping[str, TensorSpec], returns: Sequence[str], sizes: Sequence[int],
              device: str, given: tuple[tuple[int, ...], tuple[float, ...]] | None, origins: Mapping[str, str],
              *, server: str | None = None) -> str:
    """A key of all that decides a step's cost: its code, what it is handed (and ``origins``: where
    each input came from, since a step's cost can follow its inputs' values), what it hands on, the
    batch sizes, its device, any cost given, and this machine (docs/step_profiles.md).
    ``server``: the server that measured it (:mod:`pipelines.profiling.server_steps`); None: here."""
    key = {
        "format": CACHE_FORMAT,
        "digest": digest,
        "inputs": {n: s.to_dict() for n, s in inputs.items()},
        "origins": dict(origins),
        "returns": list(returns),
        "rows": list(sizes),
        "device": device,
        "given": None if given is None else [list(given[0]), list(given[1])],
        "environment": [platform.python_version(), np.__version__, platform.machine(), usable_cores()],
    }
    if server is not None:  # only then: the keys of the steps measured here stay what they were
        key["server"] = server
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def value_digest(value: Any) -> str:
    """A digest of one request tensor's dtype, shape and values (BYTES: each element's bytes)."""
    array = np.asarray(value)
    h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    if array.dtype.kind in "OSU":
        for item in array.flat:
            item = item if isinstance(item, bytes) else str(item).encode()
            h.update(len(item).to_bytes(8, "little") + item)
    else:
        h.update(np.ascontiguousarray(array).view(np.uint8).data)
    return h.hexdigest()
