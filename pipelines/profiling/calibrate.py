"""``calibrate``: measure a Triton server once with the probe models and fit its profile."""

from __future__ import annotations

import os
import statistics
import tempfile
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from time import perf_counter

from ..calibration.noise import round_disagreement
from ..calibration.profile import Profile
from ..commands.output_paths import output_dir
from ..errors import PipelinesError
from ..freed_memory import keep_freed_memory_here
from .fit import fit_rounds
from .measure import Budget, measure_lanes, measure_probes, measure_rounds, round_request_us
from .noise_watch import NoiseWatch
from .probes import BUSY_MS, CHAINS, SIZES, Probe, probe_plan, probe_repository
from .wake import SLEEP_MODEL, WAKE_MODEL, fit_wake, measure_wake

__all__ = ["MachineBusyWarning", "ProbesNotDeployed", "calibrate"]

PROTOCOLS = ("http", "grpc")


class MachineBusyWarning(UserWarning):
    """The machine was busy while it was calibrated: the profile is still used, its ranges widened."""


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
    from ..commands.machine import machine_info
    from ..commands.progress import Progress
    from ..triton import TritonClient, TritonServer
    from ..triton.async_client import AsyncTritonClient

    if protocol not in PROTOCOLS:
        raise PipelinesError(f"protocol must be 'http' or 'grpc'; got {protocol!r}")
    chains, sizes = tuple(sorted(set(chains))), tuple(sorted(set(sizes)))
    budget = budget or Budget()
    if not chains or min(chains) < 1 or not sizes or min(sizes) < 1:
        raise PipelinesError(f"chains and sizes must be positive; got chains {chains}, sizes {sizes}")
    probes = probe_plan(chains, sizes)
    # The client's request and response buffers are this process's: they page-fault alike
    # here, in the bench and in the local runtime (see pipelines.freed_memory).
    keep_freed_memory_here()
    machine = machine_info()
    bar = Progress(enabled=progress)
    began = perf_counter()
    watch = NoiseWatch()  # the server is this process's child: what the machine spent beyond them is others'
    with ExitStack() as stack:
        if url is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-calibrate-")))
            repo = probe_repository(chains).write(root / "repo")
            bar.note(f"starting the bundled Triton server on {len(probe_repository(chains))} probe models")
            server = stack.enter_context(TritonServer(repo, restart_on_crash=False))  # one server's figures
            server.require(list(server.unavailable))  # every model there is a probe
            client = stack.enter_context(server.client(protocol, timeout=120))
            connect = partial(server.async_client, protocol, timeout=120)
            cores = machine.get("usable_cpus") or machine.get("cpu_count")
        else:
            client = stack.enter_context(TritonClient(url, protocol, timeout=120))
            _require_probes(client, url, probes, chains, probes_dir)
            connect = partial(AsyncTritonClient, url, protocol, timeout=120)
            cores = None  # the remote machine's are not known here
        version = client.metadata().get("version")

        def tick(done: int, total: int, probe: Probe) -> None:
            # one stage for all probes: without a terminal, a line for it (and one every 30 s), not per probe
            bar.update("calibrating", "probes", done / total, f"{done}/{total} probes x rounds ({probe.label})")

        samples = measure_probes(
            lambda model, inputs: client.infer(model, inputs), probes, budget, tick, statistics=client.statistics,
            busy_ms=BUSY_MS,
        )
        bar.update("calibrating", "wake", 0.0, "hand-offs after a wait")
        woken = measure_wake(lambda model, inputs: client.infer(model, inputs), rounds=budget.rounds)
        bar.update("calibrating", "lanes", 0.0, "requests at once")
        lane_probes = _lane_probes(chains, sizes)
        lanes, rows = measure_lanes(connect, lane_probes, cores, budget.lanes_seconds)
        # size by size as well: large copies share the memory bus as well as the cores
        lanes_by_size = tuple((p.size, row[3]) for p, row in zip(lane_probes, rows, strict=True))
        bar.update("calibrating", "rounds", 0.0, "a fused model's rounds")
        # The smallest size: a round's bytes are priced by fused_model, what is left is each request's own.
        rounds = measure_rounds(connect, Probe("fused", chains[0], sizes[0]), seconds=budget.lanes_seconds)
        round_rows = [row for s in samples for row in s.round_rows()]
        # While the server still runs: its CPU time is ours only while it is our child. The server's own spread from
        # window to window: its lanes windows' (many requests each, as a benchmark's), else its probes' rounds'.
        windows = [row[4] for row in rows]
        noise = watch.stop(disagreement=statistics.median(windows) if windows else round_disagreement(round_rows))
    costs, points, estimated = fit_rounds(round_rows)
    bar.finish("calibrated", f"{len(samples)} probes, {budget.rounds} rounds, in {perf_counter() - began:.0f} s")
    if noise.busy:
        line = noise.line("the machine")
        if bar.enabled:
            bar.note(line)
        else:
            warnings.warn(line, MachineBusyWarning, stacklevel=2)
    return Profile(
        costs=costs,
        server_version=version,
        protocol=protocol,
        machine=machine,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        url=url,
        points=points,
        samples=tuple(estimated),
        lanes=lanes,
        lanes_by_size=lanes_by_size,
        rounds=budget.rounds,
        round_samples=tuple(round_rows),
        wake=fit_wake(woken["busy"]),
        wake_idle=fit_wake(woken["idle"], against=woken["busy"]),
        round_request_us=round_request_us(rounds),
        noise=noise,
    )


def _lane_probes(chains: tuple[int, ...], sizes: tuple[int, ...]) -> list[Probe]:
    """The longest ensemble chain with the smallest tensor (fixed costs), and with the smallest
    of 1 MiB or more (costs per byte), where there is one."""
    probes = [Probe("ensemble", chains[-1], sizes[0])]
    large = [s for s in sizes if s >= 1 << 20]
    if large and large[0] != sizes[0]:  # every size 1 MiB or more: the smallest is measured once
        probes.append(Probe("ensemble", chains[-1], large[0]))
    return probes


def _require_probes(client, url: str, probes: list[Probe], chains: tuple[int, ...], probes_dir) -> None:
    client.metadata()  # a server that cannot be reached is said so (ServerError), not taken for one without probes
    missing = sorted(m for m in {*(p.model for p in probes), WAKE_MODEL, SLEEP_MODEL} if not client.ready(m))
    if missing:
        # every chain, so that the deployed repository serves --quick and full calibrations alike;
        # into a directory of the user's beside what is there, never over a file or a model not ours
        target = output_dir(probes_dir, "the probe repository (--probes)")
        path = probe_repository(tuple(sorted(set(CHAINS) | set(chains)))).write(target)
        raise ProbesNotDeployed(
            f"the server at {url} does not serve the probe models ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); wrote them to {str(path)!r}: deploy that repository "
            "on the server (its Python needs pipelines installed), then run 'pipelines calibrate' again",
            path,
        )
