"""``BenchSettings``: every option that shapes a benchmark run, checked at once (before any
server starts) and recorded in ``results.json``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import PipelinesError
from ..runtime.step_process import ISOLATIONS
from ..triton.async_client import COMPRESSIONS
from .loadgen import LoadPlan
from .measurement import FORMS
from .stability import StabilityRule

__all__ = ["DEFAULT_PIPELINE", "PROTOCOLS", "BenchSettings"]

DEFAULT_PIPELINE = "pipelines.examples.yolov5:pipeline"
PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class BenchSettings:
    """How to measure: where, which forms, at which loads, for how long.

    ``server`` (default: on unless ``url`` is given) starts the embedded Triton
    server on the compiled repository; ``url`` (``HOST:PORT`` of ``protocol``)
    measures a remote server where the repository compiled with ``"all"`` is
    already deployed. ``server_copies`` makes the local runtime copy tensors where
    a server moves them between processes, so that it moves the bytes a server does.
    Windows last ``duration`` seconds, or ``requests`` answers. Generated inputs
    give variable (-1) dims the length ``size``. ``profile`` (the path of a
    ``pipelines calibrate`` profile, or a loaded one) is the server whose prediction
    the report sets beside the measurements; the local runtime never replays it.
    ``turns`` > 1 measures each level in that many turns, every configuration in
    turn, and pools each one's turns: a machine whose speed drifts over seconds
    then moves every form alike, and the ratios between forms hold still.
    ``isolation`` is where the local runtime runs step instances: ``"thread"`` (the
    default) or ``"process"`` (one forked process each, as Triton's stubs; see ``LocalRuntime``).
    ``compression`` ("gzip" or "deflate") compresses the server's requests and responses on
    purpose; by default neither is, as with tritonclient's blocking client and perf_analyzer.
    """

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    local: bool = True
    server_copies: bool = True
    server: bool | None = None
    url: str | None = None
    protocol: str = "http"
    batch: int = 1
    duration: float | None = 2.0
    requests: int | None = None
    warmup: float = 1.0
    stability: float = 0.1
    max_trials: int = 10
    forms: tuple[str, ...] = FORMS
    timeout: float = 60.0
    size: int = 16
    profile: Any = None
    allow_mismatch: bool = False
    turns: int = 1
    isolation: str = "thread"
    compression: str | None = None

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise PipelinesError(f"isolation must be one of {', '.join(ISOLATIONS)}; got {self.isolation!r}")
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise PipelinesError(f"--compression must be one of {', '.join(COMPRESSIONS)}; got {self.compression!r}")
        if isinstance(self.profile, (str, os.PathLike)) and not Path(self.profile).is_file():
            raise PipelinesError(
                f"--profile {os.fspath(self.profile)}: no such file; measure a server into one with "
                "'pipelines calibrate --out FILE'"
            )
        if self.server and self.url is not None:
            raise PipelinesError(
                f"choose the embedded server (--server) or a remote one (--url {self.url}), not both"
            )
        object.__setattr__(self, "server", self.url is None if self.server is None else bool(self.server))
        try:
            levels = tuple(sorted({int(c) for c in self.concurrency}))
        except (TypeError, ValueError):
            levels = ()
        if not levels or levels[0] < 1:
            raise PipelinesError(f"concurrency levels must be integers >= 1, such as 1,2,4; got {self.concurrency!r}")
        object.__setattr__(self, "concurrency", levels)
        if self.protocol not in PROTOCOLS:
            raise PipelinesError(f"--protocol must be 'http' or 'grpc'; got {self.protocol!r}")
        forms = (self.forms,) if isinstance(self.forms, str) else tuple(self.forms)
        unknown = [f for f in forms if f not in FORMS]
        if unknown or not forms:
            raise PipelinesError(f"forms must be some of {list(FORMS)}; got {list(forms)}")
        object.__setattr__(self, "forms", tuple(dict.fromkeys(forms)))  # each once, in the order given
        if not isinstance(self.batch, int) or self.batch < 1:
            raise PipelinesError(f"--batch must be an integer >= 1; got {self.batch!r}")
        if not isinstance(self.size, int) or self.size < 1:
            raise PipelinesError(f"--size must be an integer >= 1; got {self.size!r}")
        if not isinstance(self.turns, int) or self.turns < 1:
            raise PipelinesError(f"--turns must be an integer >= 1; got {self.turns!r}")
        if self.requests is not None:
            object.__setattr__(self, "duration", None)
        if not (self.local or self.on_server):
            raise PipelinesError(
                "nothing to measure: the local runtime and the server are both off; "
                "drop --no-local, or give --server or --url HOST:PORT"
            )
        self.plan(levels[0])  # window, warm-up and stability options fail here, before any server starts

    @property
    def on_server(self) -> bool:
        return bool(self.server) or self.url is not None

    def plan(self, concurrency: int) -> LoadPlan:
        """The load generator's plan for one concurrency level."""
        return LoadPlan(
            concurrency=concurrency,
            duration=self.duration,
            requests=self.requests,
            warmup=self.warmup,
            rule=StabilityRule(tolerance=self.stability, max_trials=self.max_trials),
            timeout=self.timeout,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, profile=None))
        if self.profile is not None:
            data["profile"] = self.profile if isinstance(self.profile, str) else str(getattr(self.profile, "date", ""))
        data["concurrency"] = list(self.concurrency)
        data["forms"] = list(self.forms)
        return data
