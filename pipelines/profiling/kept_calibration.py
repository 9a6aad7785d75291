"""A calibration kept and reused: one server profile per server, Triton version, protocol and machine, so
that a prediction for a server calibrated before starts at once, and the step costs kept beside it serve
every pipeline on that server (docs/prediction.md, "Take step costs from your server").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..calibration.profile import Profile, load_profile
from ..errors import PipelinesError

__all__ = ["STORE_VARIABLE", "KeptCalibration", "calibration_key", "calibration_store", "kept_calibration"]

#: The environment variable naming where calibrations are kept (default: ``~/.cache/pipelines/calibrations``).
STORE_VARIABLE = "PIPELINES_CALIBRATIONS"


@dataclass(frozen=True)
class KeptCalibration:
    """A server profile from the store: its file, whether it was there already, and the server in words."""

    path: Path
    reused: bool
    server: str
    date: str

    def describe(self) -> str:
        if self.reused:
            return f"reused the calibration of {self.date} for {self.server} ({self.path})"
        return f"calibrated {self.server}; kept in {self.path} for the next prediction"


def calibration_store() -> Path:
    """Where calibrations are kept: ``$PIPELINES_CALIBRATIONS``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/pipelines/calibrations``."""
    if os.environ.get(STORE_VARIABLE):
        return Path(os.environ[STORE_VARIABLE]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pipelines" / "calibrations"


def calibration_key(url: str | None, protocol: str, version: str) -> str:
    """What decides a server profile: the server (the bundled one, or its URL), its Triton version, the
    protocol, and this machine's CPU and cores (those the client, and the bundled server, run on)."""
    from ..commands.machine import machine_info

    machine = machine_info()
    key = {"format": 1, "server": url or "bundled", "version": version, "protocol": protocol,
           "machine": [machine.get(k) for k in ("machine", "cpu", "cpu_count", "usable_cpus")]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def kept_calibration(url: str | None = None, protocol: str = "http", *, store: str | os.PathLike[str] | None = None,
                     quick: bool = True, progress: bool = True,
                     note: Callable[[str], None] | None = None) -> KeptCalibration:
    """The profile kept for the bundled server (or the one at ``url``) over ``protocol`` on this machine,
    or, where none is kept (or it cannot be read), a calibration made now (``quick``: as ``pipelines
    calibrate --quick``) and kept. ``note`` is told which, before a calibration starts."""
    say = note or (lambda _text: None)
    version, server = _server(url, protocol)
    root = Path(store).expanduser() if store is not None else calibration_store()
    path = root / f"{calibration_key(url, protocol, version)}.json"
    if path.exists():
        try:
            profile = load_profile(path)
        except PipelinesError as exc:
            say(f"the calibration kept in {path} cannot be read ({exc}); calibrating again")
        else:
            return KeptCalibration(path, True, server, profile.date)
    from .calibrate import calibrate
    from .calibrate_command import QUICK

    say(f"no calibration kept for {server}: calibrating it{' (quick)' if quick else ''}, once")
    profile: Profile = calibrate(url, protocol, progress=progress, **(QUICK if quick else {}))
    root.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return KeptCalibration(path, False, server, profile.date)


def _server(url: str | None, protocol: str) -> tuple[str, str]:
    """The server's Triton version and the server in words: the bundled one by its wheel's version (no
    server started to ask), one at a URL by its own answer."""
    if url is None:
        try:
            version = "nvidia-pytriton " + importlib.metadata.version("nvidia-pytriton")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        return version, f"the bundled Triton server ({version}) over {protocol}"
    from ..triton import TritonClient

    with TritonClient(url, protocol, timeout=30) as client:
        version = str(client.metadata().get("version") or "?")
    return version, f"the Triton {version} server at {url} over {protocol}"
