"""Replaying a server profile in the local runtime: each boundary pays its calibrated cost
where a Triton server pays it, so the local figures predict the server's.

Where each cost is spent (see :mod:`pipelines.calibration` for how they are measured):

- **request** in and out: before the first step and after the last
  (the client, the protocol and the server's front end), holding no instance;
  in the ensemble form, with the **ensemble** scheduler's own cost per request;
- **ensemble step** (``"ensemble"``) or **BLS call** (``"bls"``; **BLS sync call** in
  ``"bls-sync"``, whose ``exec()`` costs less than ``async_exec()``):
  around each step's execution, outside the step's instance. A BLS call is made
  while the request holds its place in the BLS model's instance
  (:class:`~pipelines.runtime.bls_gate.BlsGate`), so it occupies that instance as on
  the server;
- **stub** input and output (the form's own: **ensemble_stub**, **bls_stub**,
  **bls_sync_stub**): while the step's instance is held (before and after its
  function runs), so they queue, batch and count against ``instance_count`` as the
  Python stub's shared-memory copies do; in the BLS modes the BLS model's own stub
  (**bls_model**, **bls_sync_model**) pays for the request's inputs and outputs while its instance is
  held, its fixed cost once per round (execute call). A step
  that stands for an external model (another backend) has no stub and pays none;
- an ensemble that compiles with a **gate model** of its own (see
  :mod:`pipelines.compile.ensemble`) pays one more ensemble step and stub per
  request, for its outputs, holding the gate's one instance, and the profile's
  **ensemble_gate**, what its steps' failure tensors cost, once per request;
- ``"fused"``: the Python steps run in the top-level model's own process, so they
  pay no call and no stub; the request and the model's own stub are paid as in BLS,
  and external models are called through BLS.

Each way is priced by :meth:`~pipelines.calibration.profile.Cost.way_us`: the
profile's figure at that many bytes, between its measured sizes.

A step that runs in a worker thread (as steps do while requests run side by side) pays
its stub's costs in that thread, before and after its function
(:class:`StubInThread`): a thread's sleep is not rounded, so each execution holds its
instance for what its stub costs, and the hand-over to the thread and back, which
holds the instance too, pays for as much of them.

Every other cost is spent by sleeping on the event loop, which wakes in steps of about a
millisecond; each request keeps a ledger of what it owes, so the rounding of one
sleep is made up by the next, and what it still owes below a millisecond when it
leaves is slept in a worker thread, whose sleep is not rounded: a request's total
is right to within about a tenth of a millisecond. A stub's costs paid on the event loop
(a step run inline, one request at a time), while one of its model's instances is held,
draw on a ledger of that instance's own instead (one instance pays one thing at
a time, so its sleeps make up for each other): were they to pay the request's
debt from the way in or a hop, a 0.3 ms stub would sometimes hold its instance a
whole millisecond more, and at a concurrency where the instance is the
bottleneck the replay would lose throughput the server keeps (the diamond at
concurrency 4 predicted 44 infer/s against the server's 48 that way). The BLS
model's own stub has one ledger for all its instances, which the requests of an
async round pay side by side: a round's stub costs come out shorter in time than
one thread would take (measured against the alternatives in
docs/server_profiles.md, this is what predicted best). The request's ledger
keeps the accounting that the cost report shows in Triton's statistics columns.

On the server these costs burn CPU, and requests at once compete for its cores.
So every sleep is taken holding one of the profile's ``lanes`` (``ceil(lanes)``
slots shared by one runtime's requests; while more than ``lanes`` are held, each
holder's sleep stretches by ``held / lanes``, so 1.4 lanes serve 1.4 requests'
worth at once): a boundary that finds every slot busy waits for one, as it waits
for a core on the server (a stub paid in a worker thread, which cannot wait on the event
loop, only stretches: the same throughput). The lanes are the profile's at the bytes the boundary carries
(:meth:`~pipelines.calibration.profile.Profile.lanes_at`): the server works on fewer
large copies at once than small ones. At concurrency 1 nothing waits or stretches. The wait
and the stretch count in the column of the boundary they delay (compute input or
output for a stub, request+hops for the others): a starved boundary takes longer
on the server too, and Triton's statistics show it inside that boundary's own
figures, not as queueing for an instance.

The cores are the steps' too: a step's own compute, run beside costs being slept, is held
afterwards as long as it would have run on the server's cores shared with them
(:mod:`pipelines.runtime.cpu_share`); every sleeper holding a lane counts on that clock.
"""

from __future__ import annotations

import math
import os
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from ..forms import form
from ..tables import format_table
from .cpu_share import CpuShare

if TYPE_CHECKING:
    from ..calibration.profile import Profile
    from ..compile.ensemble import EnsembleLayout
    from .report import Report

__all__ = ["Ledger", "Replay", "ServerPrediction", "StubInThread", "nbytes_of"]

def _external(model: object) -> bool:
    return getattr(getattr(model, "step", None), "external", None) is not None


# The event loop oversleeps by about this much past the millisecond it rounds up to.
_WAKE_S = 150e-6
# What a hand-over to a worker thread and back is never learned to cost less than, and a debt a
# request always settles in a thread, however dear hand-overs were learned to be (see _ThreadSleep).
_HANDOVER_MIN_S = 20e-6
_SETTLE_ALWAYS_S = 250e-6


class Ledger:
    """What one request (or one step model's batches) owes and has spent, in seconds."""

    __slots__ = ("debt", "queue", "input", "output", "overhead")

    def __init__(self) -> None:
        self.debt = 0.0
        self.queue = 0.0  # waiting for the BLS model's instance
        self.input = 0.0  # stub input (Triton's compute input)
        self.output = 0.0  # stub output (compute output)
        self.overhead = 0.0  # request, ensemble steps, BLS calls: outside any model's statistics


_current: ContextVar[Ledger | None] = ContextVar("pipelines_replay_ledger", default=None)


def nbytes_of(tensors: Any) -> int:
    """Bytes held by a dict of arrays (or one array)."""
    if isinstance(tensors, dict):
        return sum(int(getattr(t, "nbytes", 0)) for t in tensors.values())
    return int(getattr(tensors, "nbytes", 0))


class _Lanes:
    """The server's CPU as the replay sees it: ``ceil(lanes)`` slots, and while more than
    ``lanes`` of them are held, each holder's sleep stretches by ``held / lanes`` (that many
    requests sharing ``lanes`` cores), so a fractional ``lanes`` gives that throughput. The
    lanes are the profile's at the bytes each boundary carries (:meth:`Profile.lanes_at`)."""

    def __init__(self, profile: Profile, cpu: CpuShare | None = None) -> None:
        self._profile = profile
        self._cpu = cpu  # whose clock counts the sleepers (see pipelines.runtime.cpu_share)
        self._at: dict[int, float] = {}  # by bytes: a pipeline's tensors come in a few sizes
        most = max([profile.lanes, *(v for _, v in profile.lanes_by_size)])  # each >= 1 (Profile checks)
        self.slots = math.ceil(most - 1e-9)
        self.held = 0
        self._held_lock = threading.Lock()  # stubs paid in worker threads hold lanes too
        self._semaphore: anyio.Semaphore | None = None

    def take(self, nbytes: int) -> float:
        """Hold one more lane; returns the stretch of a boundary on ``nbytes`` held now."""
        with self._held_lock:
            self.held += 1
            held = self.held
        if self._cpu is not None:
            self._cpu.sleeper(+1)
        return max(1.0, held / self.at(nbytes))

    def give(self) -> None:
        with self._held_lock:
            self.held -= 1
        if self._cpu is not None:
            self._cpu.sleeper(-1)

    def at(self, nbytes: int) -> float:
        lanes = self._at.get(nbytes)
        if lanes is None:
            if len(self._at) >= 4096:  # inputs of every size (images): a bounded memo, not a leak
                self._at.clear()
            lanes = self._at[nbytes] = self._profile.lanes_at(nbytes)
        return lanes

    @property
    def semaphore(self) -> anyio.Semaphore:
        if self._semaphore is None:  # made on first use, inside the event loop that runs the requests
            self._semaphore = anyio.Semaphore(self.slots)
        return self._semaphore


class _ThreadSleep:
    """Sleeping in a worker thread, which is not rounded to whole milliseconds as the event
    loop's timeouts are. Handing the sleep to a thread and back costs a while of its own
    (about 0.2 ms on a 2-core VM), which it learns from each sleep and leaves out of the next.

    Each sleep moves what it learned by a fifth of the difference, and by at most a fifth of
    what it learned: a loaded machine once took 20 ms to hand one sleep over, and learning
    that (4 ms at once) made the hand-over look dearer than every request's remaining debt,
    so no request slept again and nothing could teach it otherwise (a 0.6 ms request cost
    replayed as 0.24 ms on average, most requests paying nothing). A machine whose hand-overs
    stay slow under load is still learned, within a dozen sleeps; and a debt above
    :data:`_SETTLE_ALWAYS_S` is always slept, so a slow spell learned is unlearned after it."""

    def __init__(self, sleep=time.sleep) -> None:
        self.overhead = 200e-6
        self._sleep = sleep

    def skips(self, debt: float) -> bool:
        """Whether ``debt`` is too small to be worth a hand-over."""
        return debt <= min(self.overhead / 2, _SETTLE_ALWAYS_S)

    async def __call__(self, seconds: float) -> float:
        """Sleep about ``seconds``; returns how long it took."""
        asked = max(0.0, seconds - self.overhead)
        t = perf_counter()
        await anyio.to_thread.run_sync(self._sleep, asked)
        took = perf_counter() - t
        step = max(-self.overhead, min(self.overhead, took - asked - self.overhead))
        self.overhead = max(_HANDOVER_MIN_S, self.overhead + 0.2 * step)
        return took


async def _spend(ledger: Ledger, seconds: float, lanes: _Lanes, nbytes: int,
                 settle: _ThreadSleep | None = None) -> float:
    """Pay ``seconds`` on ``ledger``'s account for a boundary carrying ``nbytes``, sleeping while
    holding a lane; returns what the lanes added: the wait for one, and the stretch of a shared
    one (0.0 when one was free). With ``settle`` (the request's last cost), what is left of
    the debt below a millisecond is slept by it too, to within a tenth of a millisecond:
    otherwise the loop's rounding would leave up to 0.65 ms of every request unpaid, or
    charge 1.15 ms for 0.65 (docs/server_profiles.md)."""
    ledger.debt += seconds
    whole_ms = (math.floor if settle is not None else round)((ledger.debt - _WAKE_S) * 1e3)
    if whole_ms < 1 and (settle is None or settle.skips(ledger.debt)):
        return 0.0
    added = 0.0
    semaphore = lanes.semaphore
    try:
        semaphore.acquire_nowait()
    except anyio.WouldBlock:
        queued = perf_counter()
        await semaphore.acquire()
        added = perf_counter() - queued
    stretch = lanes.take(nbytes)
    try:
        if whole_ms >= 1:
            t = perf_counter()
            await anyio.sleep(whole_ms * 1e-3 * stretch - 50e-6)  # the loop rounds the timeout up to whole ms
            slept = perf_counter() - t
            ledger.debt -= slept / stretch  # what was paid; the rest is the stretch
            added += slept - slept / stretch
        if settle is not None and not settle.skips(ledger.debt):
            slept = await settle(ledger.debt * stretch)
            ledger.debt -= slept / stretch
            added += slept - slept / stretch
    finally:
        lanes.give()
        semaphore.release()
    return added


class StubInThread:
    """One execution's stub costs, slept in the worker thread that runs the step: before its
    function (the stub taking the inputs) and after it (giving the outputs), while the
    instance is held. A thread's sleep is not rounded to whole milliseconds as the event loop's
    are, so the instance is held for the stub's costs as they are, not for a millisecond one
    time and nothing the next: at a concurrency where the requests meet at single instances,
    that lumpiness made them queue where the server's do not (docs/server_profiles.md).

    Handing the execution to the thread, and the answer back to the event loop, take a
    while of the local runtime's own with the instance held; that while pays for as much of the
    stub's costs, so they are not paid twice. Each boundary holds a lane, stretched as on the
    event loop (the thread takes the stretch, not a wait for a free slot: throughput is the same).
    """

    __slots__ = ("_replay", "_cost", "_began", "_credit", "ended", "input", "output")

    def __init__(self, replay: Replay, cost: Any) -> None:
        self._replay = replay
        self._cost = cost
        self._began = perf_counter()  # handed to the thread from here
        self._credit = 0.0  # the hand-over's time beyond the way in: paid for part of the way out
        self.ended = 0.0  # when the way out was paid (0.0: never), for the event loop to learn the way back
        self.input = 0.0  # what each way cost, stretch included (Triton's compute input, output)
        self.output = 0.0

    def lag(self) -> float:
        """The hand-over to the worker thread so far, which holds the instance too."""
        return perf_counter() - self._began

    def enter(self, nbytes: int, *, lag: float | None = None, spent: float = 0.0) -> None:
        """On the worker thread, before the step's function: the stub takes ``nbytes`` in.

        A step in a process of its own (:mod:`pipelines.runtime.step_process`) pays its way in
        after the call instead, with ``lag`` taken before it, and ``spent``: the call's time
        moving tensors to and from its process, through shared memory as a stub's are, which
        pays for as much of both ways.
        """
        lag = self.lag() if lag is None else lag
        self.input, owed = self._pay(nbytes, leaving=False, credit=lag + spent)
        self._credit = max(0.0, -owed)

    def leave(self, nbytes: int) -> None:
        """On the worker thread, after the step's function: the stub gives ``nbytes`` back."""
        self.output, _ = self._pay(nbytes, leaving=True, credit=self._credit + self._replay._return_lag)
        self.ended = perf_counter()

    def _pay(self, nbytes: int, *, leaving: bool, credit: float) -> tuple[float, float]:
        """Sleep one way's cost less ``credit``, holding a lane: ``(its cost, what was owed)``."""
        replay = self._replay
        lanes = replay._lanes
        seconds = replay._way(self._cost, nbytes, leaving)
        stretch = lanes.take(nbytes)
        try:
            owed = seconds * stretch - credit
            if owed > 0:
                time.sleep(owed)
        finally:
            lanes.give()
        return seconds * stretch, owed


@dataclass(frozen=True)
class ServerPrediction:
    """The server's figures a profile predicts for one form, per request in µs, in the
    columns of Triton's statistics (summed over the models a request runs), plus what
    no model's statistics show: the request's way in and out and the hops between models.
    """

    mode: str
    profile: str
    latency_us: float
    latency_p50_us: float
    throughput_rps: float
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    overhead_us: float

    def __str__(self) -> str:
        def us(v: float) -> str:
            return f"{v / 1e3:.2f} ms" if v >= 1e3 else f"{v:.0f} µs"

        rows = [(self.mode, us(self.latency_p50_us), f"{self.throughput_rps:.1f}", us(self.queue_us),
                 us(self.compute_input_us), us(self.compute_infer_us), us(self.compute_output_us),
                 us(self.overhead_us))]
        head = ("form", "p50", "infer/s", "queue", "compute input", "compute infer", "compute output", "request+hops")
        return f"predicted for the server of {self.profile}:\n" + format_table(head, rows) + "\n"


class Replay:
    """A profile's costs, ready to be spent by one :class:`~pipelines.runtime.local.LocalRuntime`."""

    def __init__(self, profile: Profile | str | os.PathLike[str], mode: str, layout: EnsembleLayout | None = None) -> None:
        from ..calibration.profile import default_lanes, load_profile

        self.profile = load_profile(profile)
        self.mode = mode
        costs = self.profile.costs
        self._request = costs["request"]
        the_form = form(mode, what="mode")
        self._hop = costs[the_form.call_cost]
        self._stub = costs[the_form.stub_cost]
        # What the top-level model costs once per request: a Python model's own stub (BLS, fused),
        # paid while its instance is held; the ensemble scheduler's own work, which holds no
        # instance and rides with the request's way in and out instead.
        self._own = costs[the_form.own_cost]
        self._own_rides_with_request = not the_form.one_execute_per_instance
        # "fused": the Python steps run inside the top-level model's own process, with no call
        # and no stub of their own; only external models are called, through BLS.
        self._in_process = the_form.in_process
        # An ensemble whose steps can fail side by side ends in a gate model (a Python model with
        # one instance) that every request passes through: one more step, and one more stub.
        # ``layout``: the ensemble's (compile.ensemble.ensemble_layout_of), in the ensemble mode.
        self._gate = anyio.Lock() if mode == "ensemble" and layout is not None and layout.gate_inputs else None
        self._gate_extra = costs["ensemble_gate"]
        self._totals = Ledger()
        self._models: dict[tuple[int, int], Ledger] = {}  # what each held instance owes, by (id(model), index)
        # The server's cores: shared by this runtime's requests' replayed costs (lanes), and
        # by those and the steps' own compute (cpu).
        self.cpu = CpuShare(default_lanes(self.profile.machine))
        self._lanes = _Lanes(self.profile, self.cpu)
        self._settle = _ThreadSleep()
        self._return_lag = 60e-6  # a worker thread's answer reaching the event loop (learned)

    def reset(self) -> None:
        self._totals = Ledger()

    # ------------------------------------------------------------ one request

    def begin(self) -> Ledger:
        """A ledger for the request being served (the steps it runs find it in their context)."""
        ledger = Ledger()
        _current.set(ledger)
        return ledger

    def finish(self, ledger: Ledger) -> None:
        totals = self._totals
        totals.queue += ledger.queue
        totals.input += ledger.input
        totals.output += ledger.output
        totals.overhead += ledger.overhead

    async def request(self, ledger: Ledger, nbytes: int, *, leaving: bool) -> None:
        """The request entering (its inputs) or leaving (its outputs) the server."""
        if leaving and self._gate is not None:
            await self._through_gate(ledger, nbytes)
        seconds = self._way(self._request, nbytes, leaving)
        if self._own_rides_with_request:
            seconds += self._way(self._own, nbytes, leaving)
        ledger.overhead += seconds
        settle = self._settle if leaving else None  # its last cost: what is left of its debt is paid now
        ledger.overhead += await _spend(ledger, seconds, self._lanes, nbytes, settle)

    async def bls_stub(self, ledger: Ledger, nbytes: int, *, leaving: bool, opens_round: bool = True) -> None:
        """The BLS model's own stub taking the request's inputs, or giving its outputs. Its fixed
        cost is paid once per execute call, by the request that opens the round."""
        await self._stub_half(ledger, self._holder(self), nbytes, leaving=leaving, cost=self._own,
                              fixed=opens_round)

    def _holder(self, model: object, instance: int = 0) -> Ledger:
        """The debt of what one of ``model``'s instances pays while held (see the module docstring):
        one instance pays one thing at a time, so its sleeps make up for each other."""
        return self._models.setdefault((id(model), instance), Ledger())

    async def _stub_half(self, accounts: Ledger, holder: Ledger, nbytes: int, *, leaving: bool,
                         cost: Any = None, fixed: bool = True) -> None:
        """A Python stub taking tensors in, or giving them back out: paid on ``holder``'s debt,
        told in ``accounts``' statistics."""
        cost = self._stub if cost is None else cost
        seconds = self._way(cost, nbytes, leaving)
        if not fixed:  # only what its bytes add
            seconds = max(0.0, seconds - self._way(cost, 0, leaving))
        seconds += await _spend(holder, seconds, self._lanes, nbytes)  # what it costs, starved of a core or not
        if leaving:
            accounts.output += seconds
        else:
            accounts.input += seconds

    async def _through_gate(self, ledger: Ledger, nbytes: int) -> None:
        """The ensemble's gate model: a step taking the outputs in and giving them back out.

        (Its dynamic batching, which merges concurrent requests' gate calls, is not replayed.)
        """
        hop = self._way(self._hop, nbytes, False) + self._way(self._hop, nbytes, True)
        ledger.overhead += hop
        ledger.overhead += await _spend(ledger, hop, self._lanes, nbytes)
        assert self._gate is not None
        queued = perf_counter()
        async with self._gate:  # its one instance
            ledger.queue += perf_counter() - queued
            for leaving in (False, True):
                await self._stub_half(ledger, self._holder(self._gate), nbytes, leaving=leaving)
        # What the failure tensors cost beyond the gate's own step and stub: the profile's line,
        # whose cost does not grow with the intermediates' bytes within its noise, at none.
        extra = self._gate_extra.fixed_us / 1e6
        ledger.overhead += extra
        ledger.overhead += await _spend(ledger, extra, self._lanes, nbytes)

    def queued(self, ledger: Ledger, seconds: float) -> None:
        ledger.queue += seconds

    async def hop(self, model: object, nbytes: int, *, leaving: bool) -> None:
        """An ensemble step's or a BLS call's cost on the way to a step, or back (``leaving``)."""
        if self._in_process and not _external(model):
            return
        ledger = _current.get()
        if ledger is None:  # pragma: no cover - a hop always runs inside a request
            return
        seconds = self._way(self._hop, nbytes, leaving)
        ledger.overhead += seconds
        ledger.overhead += await _spend(ledger, seconds, self._lanes, nbytes)

    async def stub(self, model: object, nbytes: int, *, leaving: bool, instance: int = 0) -> None:
        """A step's stub taking its inputs, or giving its outputs; the caller holds ``instance``."""
        if not self._has_stub(model):
            return
        # a dynamic batch runs for several requests at once: its statistics go to the totals
        accounts = _current.get() or self._totals
        await self._stub_half(accounts, self._holder(model, instance), nbytes, leaving=leaving)

    def stub_in_thread(self, model: object) -> StubInThread | None:
        """The stub costs of one execution of ``model`` that runs in a worker thread, to be
        paid there (:class:`StubInThread`); ``None`` where it pays none."""
        return StubInThread(self, self._stub) if self._has_stub(model) else None

    def account(self, stub: StubInThread) -> None:
        """Back on the event loop after the thread paid ``stub``: its costs go to the request's statistics
        (a dynamic batch's to the totals, as :meth:`stub` does), and how long its answer took to get
        here is learned."""
        if stub.ended:
            self._return_lag += 0.1 * (min(perf_counter() - stub.ended, 1e-3) - self._return_lag)
        accounts = _current.get() or self._totals
        accounts.input += stub.input
        accounts.output += stub.output

    def _has_stub(self, model: object) -> bool:
        """Whether ``model``'s executions pay a Python stub: an external model (ONNX Runtime,
        TensorRT...) runs in none, nor does a fused form's step."""
        return not (self._in_process or _external(model))

    @staticmethod
    def _way(cost: Any, nbytes: int, leaving: bool) -> float:
        """Seconds ``nbytes`` cost crossing ``cost``'s boundary one way (see :meth:`Cost.way_us`)."""
        return cost.way_us(nbytes, leaving=leaving) * 1e-6

    # --------------------------------------------------------------- report

    def predict(self, report: Report) -> ServerPrediction:
        """The report's figures as the server's, in Triton's statistics columns."""
        n = report.requests or 1
        t = self._totals
        p = self.profile
        return ServerPrediction(
            mode=report.mode,
            profile=f"Triton {p.server_version or '?'} over {p.protocol} ({p.date})",
            latency_us=report.latency_us,
            latency_p50_us=report.latency_p50_us,
            throughput_rps=report.throughput_rps,
            queue_us=sum(s.queue_wait_us * s.calls for s in report.steps) / n + t.queue * 1e6 / n,
            compute_input_us=t.input * 1e6 / n,
            compute_infer_us=sum(s.compute_us * s.calls for s in report.steps) / n,
            compute_output_us=t.output * 1e6 / n,
            overhead_us=t.overhead * 1e6 / n,
        )
