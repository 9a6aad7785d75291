"""The probe models: chains of identity Python steps, compiled by pipelines itself.

A probe is a real compiled pipeline, so calibration measures what users'
compiled models pay: the step adapter, the ensemble's wiring and the BLS
executor that ``p.compile`` writes. ``probe_<n>`` chains ``n`` identity steps
over one ``UINT8`` tensor of any length; the step model of ``probe_1`` is also
called directly, which gives a request and one stub with no ensemble or BLS
model around it. ``probe_grown`` puts identity steps between a step that grows
a one-number request to the size asked for and one that shrinks it to a byte:
its stubs pass intermediates of that size, as a user's steps mostly do, with
no request or answer of that size on the server at the same time. ``probe_gated``
is the same chain with a one-number step beside it (``count``, a second output), so
that its ensemble is gated (:mod:`pipelines.compile.ensemble`: a step runs beside
others): every step carries a failure tensor, and a gate model answers; what it
costs beyond ``probe_grown``'s ensemble is what a gated ensemble pays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np

from ..calibration.cost import size_label
from ..compile import ModelRepository, compile_pipeline
from ..core.graph import Graph
from ..core.step import step
from ..core.tensor import TensorSpec
from ..forms import model_name
from .wake import sleep_pipeline, wake_pipeline

__all__ = ["BLS_KINDS", "BUSY_MS", "CHAINS", "GATED_ROW", "GROWN_KINDS", "GROWN_ROW", "GROWN_STEPS", "HELD_KINDS",
           "KINDS", "SIZES", "Probe", "count", "grow", "grown_pipeline", "identity", "probe_pipeline", "probe_plan",
           "probe_repository", "shrink", "size_label"]

BYTES = TensorSpec("UINT8", [-1])
NBYTES = TensorSpec("INT64", [1])

#: Chain lengths measured as ensembles and BLS models.
CHAINS = (1, 2, 4, 8)
#: Tensor sizes in bytes, 1 KiB to 32 MiB.
SIZES = (1 << 10, 64 << 10, 1 << 20, 4 << 20, 12 << 20, 32 << 20)
#: ``"step"`` calls a step model directly; the others call a chain's top-level model.
KINDS = ("step", "ensemble", "bls", "bls-sync", "fused")
#: The kinds whose top-level model is a BLS model, which calls its steps' models.
BLS_KINDS = ("bls", "bls-sync")
#: The kinds whose top-level model is a Python model: its statistics say what it holds its instance.
HELD_KINDS = (*BLS_KINDS, "fused")
#: The kinds that run ``probe_grown`` (the fused model has no stubs between its steps for it to price).
GROWN_KINDS = ("ensemble", *BLS_KINDS)
#: Identity steps between ``grow`` and ``shrink`` in ``probe_grown``.
GROWN_STEPS = 2
GROWN = "probe_grown"
#: What a grown probe's samples are fitted as: its kind after this (``"grown ensemble"``).
GROWN_ROW = "grown "
GATED = "probe_gated"
#: What the gated probe's samples are fitted as (an ensemble only: the BLS forms carry no failure tensors).
GATED_ROW = "gated ensemble"


#: How long each probe step works (busy, so exactly) before it answers, in ms.
BUSY_MS = 0.5


@step(inputs={"x": BYTES}, outputs={"y": BYTES}, name="identity", parameters={"busy_ms": BUSY_MS})
class identity:  # noqa: N801 - the probe step models are named after it
    """Works ``busy_ms`` on the CPU, then hands its input back: whatever a call costs on the
    server beyond that is the server's.

    It works a while, as real steps do, because that is what the server's hand-offs
    cost: a thread waiting on an instant step is still awake when the answer comes,
    one waiting on a step that takes a while has gone to sleep and must be woken.
    Measured on this machine, a 1 ms step made each hand-off 30–130 µs dearer than
    an instant one, in every form (docs/calibration_internals.md). Busy, not asleep, so that
    the time is exact and :func:`pipelines.profiling.measure.measure_probes` can
    take it off.
    """

    def initialize(self, config):
        self.seconds = float(config.get("parameters", {}).get("busy_ms", BUSY_MS)) / 1e3

    def execute(self, x):
        end = perf_counter() + self.seconds
        while perf_counter() < end:
            pass
        return {"y": x}


@step(inputs={"n": NBYTES}, outputs={"y": BYTES}, name="grow")
def grow(n):
    """A new tensor of ``n`` bytes, written, as a step that makes an intermediate writes one."""
    return {"y": np.ones((n.shape[0], int(n.reshape(-1)[0])), np.uint8)}


@step(inputs={"x": BYTES}, outputs={"y": BYTES}, name="shrink")
def shrink(x):
    """The first byte of each row: an answer of one byte, whatever the intermediates' size."""
    return {"y": x[:, :1].copy()}


@step(inputs={"n": NBYTES}, outputs={"m": NBYTES}, name="count")
def count(n):
    """The request's one number, handed back: a step beside the chain that gates its ensemble."""
    return {"m": n}


def _identities(p: Graph, ref, steps: int):
    """``steps`` identity nodes after ``ref``, each a model of its own."""
    for i in range(steps):
        node = identity if i == 0 else identity.with_options()  # a copy: a model of its own
        ref = p.add(node, name=f"id_{i}", x=ref)["y"]
    return ref


def _identity_models(pipeline: str, steps: int) -> tuple[str, ...]:
    return tuple(f"{pipeline}__identity" if i == 0 else f"{pipeline}__id_{i}" for i in range(steps))


def grown_pipeline(steps: int = GROWN_STEPS, *, gated: bool = False) -> Graph:
    """``n -> grow -> identity x steps -> shrink -> y``: intermediates of ``n`` bytes between
    a request and an answer of a few bytes; ``gated``: also ``n -> count -> m`` beside the
    chain, which gates its ensemble (a gate model answers, as no one step gives both outputs).

    What it prices, at each size, with its requests back to back as a pipeline's come
    (:func:`pipelines.profiling.measure.measure_probes`):

    - ``ensemble_stub``, ``bls_stub`` and ``bls_sync_stub``: the stub of a step whose
      input comes from a step and whose output goes to one, in each form. Their figure is
      its identity steps' own statistics (compute input on the way in; compute infer and
      output on the way out), less their 0.5 ms of work.
    - ``bls_call`` and ``bls_sync_call`` above the smallest size: the time its BLS model
      held its instance, less what all its step models held and less the BLS model's own
      stub. What is left is its calls, warm: two ways of a few bytes, priced at the
      smallest size, and six ways that carry the intermediate.
    - ``ensemble_gate`` (gated): its latency less the plain grown ensemble's, less the gate
      model's step and stub, which the profile prices already.
    """
    p = Graph(GATED if gated else GROWN, inputs={"n": NBYTES}, max_batch_size=8)
    ref = p.add(grow, n=p.input("n"))["y"]
    p.output("y", p.add(shrink, x=_identities(p, ref, steps))["y"])
    if gated:
        p.output("m", p.add(count, n=p.input("n"))["m"])
    return p


def probe_pipeline(steps: int) -> Graph:
    """``x -> identity -> ... -> y``: ``steps`` nodes, each its own composing model.

    One model per node, as most pipelines have: a step model shared by several
    nodes would make the ensemble route failures through a gate model
    (see :mod:`pipelines.compile.ensemble`), which a chain of distinct steps
    does not pay.

    What its probes price, at each size, from medians over the rounds
    (:mod:`pipelines.profiling.fit`):

    - called as ``probe_1``'s step model alone (kind ``"step"``): ``stub``, from the step's own
      statistics (compute input, infer and output, less its work), and ``request``: the
      latency less that stub.
    - as an ensemble of 1, 2, 4 and 8 steps: a least-squares line over the chain length
      through the ensemble's own request time (its statistics, which hold none of the
      client's send). Its slope less one stub (the chain's own statistics) is
      ``ensemble_step``, and its intercept is ``ensemble``.
    - as an async and a sync BLS model: the same line, through the time the BLS model held
      its instance (its own statistics). Its slope less one stub is ``bls_call`` /
      ``bls_sync_call``, and its intercept is ``bls_model`` / ``bls_sync_model``.
    - as a fused model: the same line, through the time the fused model held its instance. Its
      steps run in its process, with no stub, so its slope is ``fused_step`` (its own work around
      each step) and its intercept ``fused_model``.
    - without statistics, the lines go through the latencies, less the request.
    """
    p = Graph(f"probe_{steps}", inputs={"x": BYTES}, max_batch_size=8)
    p.output("y", _identities(p, p.input("x"), steps))
    return p


@dataclass(frozen=True)
class Probe:
    """One measured configuration: a kind of call, a chain length and a tensor size; ``grown``:
    the chain of ``probe_grown``, whose intermediates are ``size`` bytes and whose request and
    answer are a few bytes. What each kind prices: :func:`probe_pipeline` (the step and the
    chains) and :func:`grown_pipeline` (the grown and gated probes)."""

    kind: str
    steps: int
    size: int
    grown: bool = False
    gated: bool = False  # the gated grown probe (an ensemble)

    @property
    def pipeline(self) -> str:
        return GATED if self.gated else GROWN if self.grown else f"probe_{self.steps}"

    @property
    def row_kind(self) -> str:
        """The kind its samples are fitted as: ``"grown ensemble"`` for a grown one."""
        return GATED_ROW if self.gated else GROWN_ROW + self.kind if self.grown else self.kind

    @property
    def step_models(self) -> tuple[str, ...]:
        """The identity step models this probe runs (their statistics price a stub; none for the
        gated probe, whose figure is its latency)."""
        if self.gated or self.kind == "fused":  # a fused model runs its steps in its own process
            return ()
        return _identity_models(self.pipeline, 1 if self.kind == "step" else self.steps)

    @property
    def all_step_models(self) -> tuple[str, ...]:
        """Every step model one request runs: a grown probe's ``grow`` and ``shrink`` too."""
        if self.grown:
            identities = _identity_models(self.pipeline, self.steps)
            beside = (f"{self.pipeline}__count",) if self.gated else ()
            return (f"{self.pipeline}__grow", *identities, f"{self.pipeline}__shrink", *beside)
        return self.step_models

    @property
    def stub_models(self) -> tuple[str, ...]:
        """The step models whose statistics price this probe's stubs. In an ensemble, the last
        step's output is the ensemble's answer, and Triton counts copying it into the response
        in that step's compute output (at 4 MiB, 1.35 ms against 0.55 for a step whose output
        feeds the next one: docs/calibration_internals.md); a step of a user's pipeline mostly feeds
        another step, and the answer's copy is the ensemble's own, paid by the request's
        outputs. So an ensemble's stubs are priced by its steps before the last (none in an
        ensemble of one step); a BLS model takes every step's outputs back alike, and in a
        grown probe every identity step's output feeds another step."""
        if self.kind == "ensemble" and not self.grown:
            return self.step_models[:-1]
        return self.step_models

    @property
    def model(self) -> str:
        if self.kind == "step":
            return self.step_models[0]
        if self.gated:  # compiled as an ensemble alone, which then takes the pipeline's own name
            return GATED
        return model_name(self.pipeline, self.kind)

    def inputs(self) -> dict[str, np.ndarray]:
        if self.grown:
            return {"n": np.array([[self.size]], np.int64)}
        return {"x": np.zeros((1, self.size), np.uint8)}

    @property
    def label(self) -> str:
        if self.kind == "step":
            return f"step {size_label(self.size)}"
        shape = "gated" if self.gated else "grown" if self.grown else f"x{self.steps}"
        return f"{self.kind} {shape} {size_label(self.size)}"


def probe_plan(chains: tuple[int, ...] = CHAINS, sizes: tuple[int, ...] = SIZES) -> list[Probe]:
    """Every probe, small tensors first (a failure shows before the slow ones run): per size, the
    step, each kind's chains, then each kind's grown probe and the gated one."""
    plan = []
    for size in sorted(sizes):
        plan.append(Probe("step", 1, size))
        for kind in KINDS[1:]:
            plan += [Probe(kind, n, size) for n in sorted(chains)]
        plan += [Probe(kind, GROWN_STEPS, size, grown=True) for kind in GROWN_KINDS]
        plan.append(Probe("ensemble", GROWN_STEPS, size, grown=True, gated=True))
    return plan


def probe_repository(chains: tuple[int, ...] = CHAINS) -> ModelRepository:
    """The probe pipelines in one repository: the chains in every form, the grown probe as an ensemble
    and BLS models (async and sync)."""
    repos = [compile_pipeline(probe_pipeline(n), "all") for n in sorted(chains)]
    repos += [compile_pipeline(grown_pipeline(), "both"), compile_pipeline(grown_pipeline(gated=True), "ensemble")]
    # the step models of these two are called directly
    repos += [compile_pipeline(wake_pipeline(), "ensemble"), compile_pipeline(sleep_pipeline(), "ensemble")]
    first, *rest = repos
    return first.merge(*rest) if rest else first


def write_probe_repository(path: str | os.PathLike[str], chains: tuple[int, ...] = CHAINS) -> Path:
    """Write the probe repository to ``path`` (to deploy on a remote server before calibrating it)."""
    return probe_repository(chains).write(path, overwrite=True)
