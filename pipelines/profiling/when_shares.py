"""The share of rows where each ``when`` condition holds, for a prediction (:func:`~.pipeline_costs.measure_pipeline`):
given (``when_rates=``, ``--when-rate``), or counted over the sample requests by running the steps that compute it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.graph import Graph
from ..core.plan import ExecutionPlan
from ..errors import ArgumentError

__all__ = ["WhenShares"]


class WhenShares:
    """One pipeline's ``when`` conditions, counted on ``inputs`` (``inputs_given``: the user's request, else the
    module's samples stand in); each counted share is said in ``notes``."""

    def __init__(self, pipeline: Graph, plan: ExecutionPlan, inputs: Mapping[str, Any], inputs_given: bool,
                 notes: list[str]) -> None:
        self.pipeline, self.plan, self.inputs, self._inputs_given, self.notes = (
            pipeline, plan, inputs, inputs_given, notes)

    def check(self, given: Mapping[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Refuses ``given`` shares that name no condition of the pipeline or are not in 0..1, before anything is
        measured; the conditions by :meth:`Term.describe`, and by the names a share may be given under."""
        terms = {t.describe(): t for n in self.plan.nodes for t in n.when}
        if not terms and given:
            raise ArgumentError(f"pipeline {self.pipeline.name!r} has no `when` block; drop when_rates")
        names = {}
        for t in terms.values():
            names[t.tensor if t.node is None else f"{t.node}.{t.tensor}"] = t
            if t.node is not None:
                names.setdefault(t.node, t)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ArgumentError(f"when_rates names {unknown}; the conditions of pipeline {self.pipeline.name!r} "
                                f"are {sorted(k for k in names if '.' in k or k in self.pipeline.inputs)}")
        for name, share in given.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                raise ArgumentError(f"when_rates[{name!r}] is the share of rows where it is true, 0..1; got {share!r}")
        return terms, names

    def rates(self, given: Mapping[str, float], module: Any) -> dict[str, float]:
        """Each ``when`` condition's share of rows where it holds, by :meth:`Term.describe`.

        A condition tensor's share of true rows is ``given`` (by ``NODE.TENSOR``, a pipeline
        input's name, or ``NODE`` where the node gives one BOOL), else counted over the sample
        requests (the request given, else the module's own samples), running the steps that
        compute it (:meth:`_counted_share`); where they cannot run here, refused, naming the
        ``--when-rate`` to give. A negated condition holds on the other rows.
        """
        terms, names = self.check(given)
        shares = {names[name].key: float(share) for name, share in given.items()}
        rates = {}
        for label, term in terms.items():
            share = shares.get(term.key)
            if share is None:
                share = shares[term.key] = self._counted_share(term, module)
            rates[label] = 1.0 - share if term.negated else share
        return rates

    def _counted_share(self, term: Any, module: Any) -> float:
        """The share of true rows of a condition tensor over the sample requests: the request given (``inputs=``,
        ``--input``), else the module's own samples. A tensor that steps compute is counted by running those steps
        here, on each sample; where they cannot run here, the share is refused, not guessed."""
        from ..commands.sample_inputs import sample_requests

        label = term.tensor if term.node is None else f"{term.node}.{term.tensor}"
        if module is None:  # the module that declared the pipeline, as the benchmark finds it
            module = sys.modules.get(getattr(self.pipeline, "__module__", "") or "")
        requests = [self.inputs]
        if not self._inputs_given and module is not None:
            try:
                requests = sample_requests(self.pipeline, module=module)
            except Exception:  # noqa: BLE001 - any failure of a user's sample hook: the request profiled stands in
                requests = [self.inputs]
        upstream = self._upstream(term.node, label) if term.node is not None else []
        values = []
        for request in requests:
            tensors: dict[tuple[str | None, str], Any] = {(None, name): v for name, v in request.items()}
            for name in upstream:
                node = self.plan.node(name)
                try:
                    out = _run_step(self.pipeline.nodes[name].step, {s.input: tensors[s.key] for s in node.inputs})
                except Exception as exc:  # noqa: BLE001 - any failure of the user's step: the share is refused
                    raise self._uncounted(label, f"step {name!r} failed here on a sample request "
                                                 f"({type(exc).__name__}: {exc})") from None
                tensors.update({(name, o): v for o, v in out.items()})
            values.append(np.asarray(tensors[term.key], dtype=bool).reshape(-1))
        share = float(np.concatenate(values).mean()) if values else 1.0
        source = "the request given" if self._inputs_given else f"{len(requests)} sample request(s)"
        through = f", through {', '.join(upstream)}" if upstream else ""
        self.notes.append(f"when: {label} is true on {share:.0%} of the rows of {source} "
                          f"({sum(v.size for v in values)} rows{through}); --when-rate {label}=SHARE sets another share")
        return share

    def _upstream(self, node: str, label: str) -> list[str]:
        """The steps that compute node ``node``'s outputs from the request, ``node`` last, in the plan's order; the
        share is refused where one of them cannot be run here as a plain function."""
        needed, frontier = {node}, [node]
        while frontier:
            for s in self.plan.node(frontier.pop()).inputs:
                if s.node is not None and s.node not in needed:
                    needed.add(s.node)
                    frontier.append(s.node)
        order = [name for name in self.plan.order if name in needed]
        for name in order:
            n = self.plan.node(name)
            if n.kind != "step" or n.when:
                raise self._uncounted(label, f"{name!r} runs inside a `when` block or merges branches, so not "
                                             "on every row of a request")
            step = self.pipeline.nodes[name].step
            if step.impl is None:
                raise self._uncounted(label, f"step {name!r} is an external model with no Python stand-in")
            if step.options.device == "gpu":
                raise self._uncounted(label, f"step {name!r} runs on the GPU")
        return order

    def _uncounted(self, label: str, why: str) -> ArgumentError:
        return ArgumentError(
            f"pipeline {self.pipeline.name!r}: the share of rows where `when` condition {label} holds cannot be "
            f"counted over the sample requests here: {why}. Give it: --when-rate {label}=SHARE "
            f"(when_rates={{{label!r}: SHARE}}), the share of rows where it is true, 0..1",
            pipeline=self.pipeline.name, node=label.split(".")[0], tensor=label.rsplit(".", 1)[-1])



def _run_step(step: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """One call of ``step`` on ``inputs``, as plain Python (an ``async def`` step awaited on a loop of its own)."""
    import asyncio

    instance = step.instantiate()
    try:
        if not instance.is_async:
            return instance.execute(inputs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(instance.execute_async(inputs))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:  # a notebook's loop runs in this thread
            return pool.submit(asyncio.run, instance.execute_async(inputs)).result()
    finally:
        instance.finalize()


