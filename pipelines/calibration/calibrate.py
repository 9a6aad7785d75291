"""``calibrate``: measure a Triton server once with the probe models and fit its profile."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

from ..errors import PipelinesError
from .fit import fit_costs
from .measure import Budget, measure_probes
from .probes import CHAINS, SIZES, Probe, probe_plan, probe_repository
from .profile import Profile

__all__ = ["ProbesNotDeployed", "calibrate"]

PROTOCOLS = ("http", "grpc")


class ProbesNotDeployed(PipelinesError):
    """The remote server lacks the probe models; ``repository`` holds them, ready to deploy."""

    def __init__(self, message: str, repository: Path) -> None:
        super().__init__(message)
        self.repository = repository


def calibrate(
    url: str | None = None,
    protocol: str = "http",
    *,
    chains: Sequence[int] = CHAINS,
    sizes: Sequence[int] = SIZES,
    budget: Budget | None = None,
    probes_dir: str | os.PathLike[str] = "probe_repository",
    progress: bool = True,
) -> Profile:
    """Measure the bundled Triton server (or the one at ``url``) and return its :class:`Profile`.

    For a remote server the probe models must be deployed there first: when they
    are not, the probe repository is written to ``probes_dir`` and
    :class:`ProbesNotDeployed` says what to do with it.
    """
    from ..bench.progress import Progress
    from ..bench.results import machine_info
    from ..runtime.triton import TritonClient, TritonServer

    if protocol not in PROTOCOLS:
        raise PipelinesError(f"protocol must be 'http' or 'grpc'; got {protocol!r}")
    chains, sizes = tuple(sorted(set(chains))), tuple(sorted(set(sizes)))
    if not chains or min(chains) < 1 or not sizes or min(sizes) < 1:
        raise PipelinesError(f"chains and sizes must be positive; got chains {chains}, sizes {sizes}")
    probes = probe_plan(chains, sizes)
    bar = Progress(enabled=progress)
    began = perf_counter()
    with ExitStack() as stack:
        if url is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-calibrate-")))
            repo = probe_repository(chains).write(root / "repo")
            bar.note(f"starting the bundled Triton server on {len(probe_repository(chains))} probe models")
            server = stack.enter_context(TritonServer(repo))
            client = stack.enter_context(server.client(protocol, timeout=120))
        else:
            client = stack.enter_context(TritonClient(url, protocol, timeout=120))
            _require_probes(client, url, probes, chains, probes_dir)
        version = client.metadata().get("version")

        def tick(done: int, total: int, probe: Probe) -> None:
            bar.update("calibrating", probe.label, done / total, f"{done}/{total} probes")

        samples = measure_probes(
            lambda model, inputs: client.infer(model, inputs), probes, budget, tick, statistics=client.statistics
        )
    costs, points = fit_costs([s.row for s in samples])
    bar.finish("calibrated", f"{len(samples)} probes in {perf_counter() - began:.0f} s")
    return Profile(
        costs=costs,
        server_version=version,
        protocol=protocol,
        machine=machine_info(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        url=url,
        points=points,
        samples=tuple(s.row for s in samples),
    )


def _require_probes(client, url: str, probes: list[Probe], chains: tuple[int, ...], probes_dir) -> None:
    missing = sorted({p.model for p in probes if not client.ready(p.model)})
    if missing:
        # every chain, so that the deployed repository serves --quick and full calibrations alike
        path = probe_repository(tuple(sorted(set(CHAINS) | set(chains)))).write(probes_dir, overwrite=True)
        raise ProbesNotDeployed(
            f"the server at {url} does not serve the probe models ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); wrote them to {str(path)!r}: deploy that repository "
            "on the server (its Python needs pipelines installed), then run 'pipelines calibrate' again",
            path,
        )
