"""Step costs from the server: each step's own model, compiled and served by Triton, called at each
batch size and timed by Triton's statistics (:mod:`.server_step_run`), in place of the step profiles timed in this
process (docs/prediction.md, "Take step costs from your server").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import ArgumentError
from ..predict.spec import WayCost, way_costs
from ..predict.step_profile import StepProfile
from .server_step_run import CannotServe, Measured, ServerRun
from .step_cache import StepCache

if TYPE_CHECKING:  # pragma: no cover
    from ..core.graph import Graph

__all__ = ["STEP_COSTS", "ServerStepCosts", "server_step_costs", "steps_for"]

#: Where a prediction takes its step costs from: a server where one is given (``auto``), the
#: server (the bundled one unless ``url``), or the step profiles timed here (``local``).
STEP_COSTS = ("auto", "server", "local")
LOCAL = "local step profile"


@dataclass(frozen=True)
class ServerStepCosts:
    """Each live node's profile (the server's where its model was timed there, else the local one),
    where each came from in words (``sources``), the server in words, and one line of why the
    local profiles stand in (``fallback``; "" where none do for that reason). ``fused`` and
    ``fused_sources``: the same for the fused form, from the fused model's own timings of its steps."""

    profiles: Mapping[str, StepProfile]
    sources: Mapping[str, str]
    server: str
    fallback: str = ""
    fused: Mapping[str, StepProfile] = field(default_factory=dict)
    fused_sources: Mapping[str, str] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """The lines a prediction shows: the fallback (every step's cost then its local profile's), or
        where each step's cost came from."""
        if self.fallback:
            return [self.fallback]
        timed = [f"{node} ({source})" for node, source in self.sources.items() if source.startswith("server")]
        others: dict[str, list[str]] = {}
        for node, source in self.sources.items():
            if not source.startswith("server"):
                others.setdefault(source, []).append(node)
        lines = [f"step costs from {self.server}: " + "; ".join(timed)] if timed else []
        lines += [f"step costs from the {source}: {', '.join(nodes)}" for source, nodes in others.items()]
        fused = [f"{node} ({source})" for node, source in self.fused_sources.items() if source.startswith("server")]
        if fused:
            lines.append("the fused form's step costs from the fused model's own timings of its steps: "
                         + "; ".join(fused))
        if kept := [node for node, source in self.fused_sources.items() if not source.startswith("server")]:
            lines.append(f"the fused form keeps the local step profiles of {', '.join(kept)}: the fused model "
                         "did not time them on the server")
        return lines


def server_step_costs(
    pipeline: Graph,
    inputs: Mapping[str, Any],
    local: Mapping[str, StepProfile],
    stub: tuple[WayCost, WayCost],
    *,
    url: str | None = None,
    protocol: str = "http",
    cache: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ServerStepCosts:
    """Each live step of ``pipeline`` timed as its own model on a Triton server (:class:`.server_step_run.ServerRun`):
    the bundled one, started on the pipeline's step models and their twins (each step's inputs and outputs, no
    work), or the one at ``url``, which must serve the step models (the ensemble's or BLS form's repository).
    ``inputs``: one request, propagated through the step models on the server. Each model is called at two of the
    batch sizes of its ``local`` profile (its first and its largest that carries at most
    :data:`~.server_step_run.TIMED_BYTES`; the rest follow the local curve); its cost at each is what Triton says
    one execution held its instance (compute input, infer and output) less its twin's, or at ``url`` less its
    stub's ways in and out (``stub``: the server profile's ``stub`` boundary). Its CPU time is that of its stub processes over the calls, less
    its twin's (at ``url``: the local profile's share of CPU in wall time). Shapes, GIL share and
    memory share stay the local profile's; a cost given (``costs=``) stays given.

    A server that cannot serve the run (a model fails to load, the server cannot be reached or
    started) is no error: every step keeps its local profile and ``fallback`` says why, naming
    the model. ``cache``: the step profile cache; a step whose code, inputs and server are found
    there is not called again, and with every step found no server is started."""
    say = progress or (lambda _text: None)
    run = ServerRun(pipeline, inputs, local, url, protocol)
    found = StepCache(cache) if cache is not None else None
    measured: Measured = {}
    fused: Measured = {}
    for node, key in run.keys.items():  # the fused model's timings: kept with its step model's, where it had them
        for into, kept_as in ((measured, key), (fused, f"{key}:fused")):
            hit = found.get(kept_as) if found is not None else None
            if hit is not None:
                into[node] = (hit, {**found.extra(kept_as), "kept": True})  # type: ignore[union-attr]
    missing = [n for n in run.keys if n not in measured]
    fallback = ""
    if missing:
        try:
            steps, in_fused = run.measure(missing, say)
            for into, suffix, new in ((measured, "", steps), (fused, ":fused", in_fused)):
                for node, (profile, extra) in new.items():
                    into[node] = (profile, extra)
                    if found is not None:
                        found.put(run.keys[node] + suffix, profile, extra=extra)
        except CannotServe as why:
            fallback = f"{why}; the local step profiles are used instead"
            measured.clear()
            fused.clear()
        finally:
            if found is not None:
                found.write()
    profiles, sources, fused_profiles, fused_sources = {}, {}, {}, {}
    for node, mine in local.items():
        if node in measured:
            profile, extra = measured[node]
            profiles[node], sources[node] = _own(mine, profile, extra, stub), _source(extra)
        else:
            profiles[node] = mine
            sources[node] = "given cost (costs=)" if mine.source == "given" else LOCAL
        if node in fused:
            fused_profiles[node], fused_sources[node] = fused[node][0], _source(fused[node][1])
        else:
            fused_profiles[node] = mine
            fused_sources[node] = "given cost (costs=)" if mine.source == "given" else LOCAL
    return ServerStepCosts(profiles, sources, run.where, fallback, fused_profiles,
                           {n: s for n, s in fused_sources.items() if n in run.keys})


def _source(extra: Mapping[str, Any]) -> str:
    """Where a step's cost came from, in words: its model, the requests and batch sizes it was timed by."""
    sizes = " and ".join(str(r) for r in extra.get("sizes", ()))
    return "".join((
        f"server statistics (model {extra.get('model', '?')}, {extra.get('requests', 0)} requests",
        f" of {sizes} row{'' if sizes == '1' else 's'}" if sizes else "",
        ", CPU as timed here" if extra.get("cpu") is False else "",
        ", kept from an earlier run" if extra.get("kept") else "", ")"))



def _own(mine: StepProfile, raw: StepProfile, extra: Mapping[str, Any], stub: tuple[WayCost, WayCost]) -> StepProfile:
    """The step's own cost: as measured where its twin's was taken off on the server; else (a server at a URL,
    which serves no twins) its model's less the server profile's stub ways in and out, by the batch's bytes and
    tensors as the simulation prices them, and its CPU the local profile's share of its wall time."""
    local_share = {rows: c / w if w > 0 else 1.0 for rows, c, w in zip(mine.rows, mine.cpu_us, mine.wall_us,
                                                                        strict=True)}
    way_in, way_out = stub
    wall, cpu = [], []
    for rows, held, used in zip(raw.rows, raw.wall_us, raw.cpu_us, strict=True):
        ways = 0.0 if extra.get("twin") else (
            way_in.at(rows * mine.in_bytes) + max(0, len(mine.inputs) - 1) * way_in.at(0)
            + way_out.at(rows * mine.out_bytes) + max(0, len(mine.outputs) - 1) * way_out.at(0))
        # a step cheaper than the noise of what is taken off: a µs, not nothing
        own = max(held - ways, min(held, 1.0))
        wall.append(own)
        cpu.append(max(used - ways, 0.0) if extra.get("cpu") else own * local_share.get(rows, 1.0))
    return replace(mine, rows=raw.rows, wall_us=tuple(wall), cpu_us=tuple(cpu), warm_wall_us=(), warm_cpu_us=(),
                   source="server")



def steps_for(pipeline: Graph, inputs: Mapping[str, Any], local: Mapping[str, StepProfile], server: Any, *,
              step_costs: str = "auto", url: str | None = None, cache: str | os.PathLike[str] | None = None,
              notes: list[str]) -> tuple[dict[str, StepProfile], dict[str, StepProfile]]:
    """The step profiles a prediction simulates its step models with, and those of the fused form
    (:func:`~pipelines.profiling.pipeline_costs.measure_pipeline`): ``local`` for ``step_costs="local"``, or
    ``"auto"`` with no ``url``; else the server's (:func:`server_step_costs`, over the server profile ``server``'s
    protocol), each step's source and any fallback added to ``notes``."""
    if step_costs not in STEP_COSTS:
        raise ArgumentError(f"step_costs is one of {', '.join(STEP_COSTS)}; got {step_costs!r}")
    if step_costs == "local" or (step_costs == "auto" and url is None):
        return dict(local), dict(local)
    found = server_step_costs(pipeline, inputs, local, way_costs(server.costs["stub"]), url=url,
                              protocol=server.protocol if server.protocol in ("http", "grpc") else "http", cache=cache)
    notes += found.notes()
    return dict(found.profiles), dict(found.fused or local)
