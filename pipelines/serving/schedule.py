"""Running a plan's nodes concurrently, and the plan cut down to the outputs a request wants.

:func:`cut_plan` is the one cut: ``pipelines.core.plan`` builds and prunes the host's plan with it,
and :class:`Schedule` (the BLS and fused executors in a server, the local runtime) reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

Key = tuple["str | None", str]  # (producing node, or None for a pipeline input; tensor name)


async def run_concurrently(
    after: Mapping[str, Any], start: Callable[[str, bool], Any], collect: Callable[[str, Any], None]
) -> None:
    """Start each node as soon as the nodes it comes ``after`` are done (``graphlib``).

    ``start(name, alone)`` returns the node's awaitable (``alone``: it is the only
    node ready and nothing else is in flight); ``collect(name, future)`` takes its
    finished future, and may raise to stop the run: the calls still in flight are
    then awaited and dropped.
    """
    import asyncio
    import graphlib

    sorter = graphlib.TopologicalSorter(after)
    sorter.prepare()
    running: dict[Any, str] = {}
    try:
        while sorter.is_active():
            ready = sorter.get_ready()
            alone = len(ready) == 1 and not running
            for name in ready:
                running[asyncio.ensure_future(start(name, alone))] = name
            if len(running) == 1:  # one call in flight: await it, without asyncio.wait's own future
                future = next(iter(running))
                await asyncio.gather(future, return_exceptions=True)  # collect() says what went wrong
                done: Any = (future,)
            else:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                name = running.pop(future)
                collect(name, future)
                sorter.done(name)
    finally:
        if running:  # a sibling failed: wait for the calls in flight, then drop them
            await asyncio.gather(*running, return_exceptions=True)


def cut_plan(
    plan: Mapping[str, Any], wanted: Collection[str], position: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """``plan`` (its JSON form) cut down to the nodes the outputs ``wanted`` need, everything derived again.

    The one algorithm that cuts a plan: ``pipelines.core.plan`` builds and prunes the host's
    ``ExecutionPlan`` with it, and :class:`Schedule` (the server's executors and the local
    runtime) reads its result. It walks each node's inputs and ``when`` conditions, so it needs
    none of the derived fields (``needs``, ``after``, ``before``, readers): the host gives it
    nodes that have none yet. ``plan["nodes"]`` must be in topological order; a node's
    ``returns`` may only shrink. ``position`` orders the nodes of a parallel group (default:
    plan order).
    """
    by_name = {node["name"]: node for node in plan["nodes"]}
    outputs = []
    for out in plan["outputs"]:
        if out["name"] not in wanted:
            continue
        needs: set[str] = set()
        stack = [out["node"]]
        while stack:
            name = stack.pop()
            if name not in needs:
                needs.add(name)
                stack += [key[0] for key, _ in _reads(by_name[name]) if key[0] is not None]
        outputs.append({**out, "needs": [node["name"] for node in plan["nodes"] if node["name"] in needs]})
    needed = {name for out in outputs for name in out["needs"]}
    live = [node for node in plan["nodes"] if node["name"] in needed]
    position = position or {node["name"]: i for i, node in enumerate(plan["nodes"])}

    # Tensors: who reads each, in order; outputs hold theirs until the answer.
    readers: dict[Key, list[str]] = {}
    dtypes: dict[Key, str] = {}
    for node in live:
        for key, dtype in _reads(node):
            readers.setdefault(key, []).append(node["name"])
            dtypes[key] = dtype
    exposed: dict[Key, list[str]] = {}
    for out in outputs:
        key = (out["node"], out["tensor"])
        exposed.setdefault(key, []).append(out["name"])
        dtypes[key] = out["dtype"]
    keys: list[Key] = [(None, name) for name in plan["inputs"] if (None, name) in readers]
    for node in live:
        keys += [(node["name"], o) for o in node["returns"] if (node["name"], o) in readers or (node["name"], o) in exposed]
    ensemble = {(t["node"], t["name"]): t["ensemble"] for t in plan["tensors"]}  # none yet while the host builds
    tensors = [
        {
            "node": key[0],
            "name": key[1],
            "dtype": dtypes[key],
            "ensemble": ensemble.get(key, key[1]),
            "consumers": readers.get(key, []),
            "outputs": exposed.get(key, []),
            "last_use": None if key in exposed else readers[key][-1],
        }
        for key in keys
    ]

    after = {node["name"]: list(dict.fromkeys(key[0] for key, _ in _reads(node) if key[0] is not None)) for node in live}
    before: dict[str, list[str]] = {node["name"]: [] for node in live}
    for node in live:
        for pred in after[node["name"]]:
            before[pred].append(node["name"])
    level: dict[str, int] = {}
    for node in live:
        level[node["name"]] = 1 + max((level[p] for p in after[node["name"]]), default=-1)
    groups = [
        sorted((name for name, lv in level.items() if lv == i), key=position.__getitem__)
        for i in range(1 + max(level.values(), default=-1))
    ]
    nodes = [
        {
            **node,
            "returns": [o for o in node["returns"] if (node["name"], o) in readers or (node["name"], o) in exposed],
            "after": after[node["name"]],
            "before": before[node["name"]],
        }
        for node in live
    ]
    models = [
        {**model, "nodes": [x for x in model["nodes"] if x in needed]}
        for model in plan["models"]
        if any(x in needed for x in model["nodes"])
    ]
    return {**plan, "outputs": outputs, "nodes": nodes, "groups": groups, "tensors": tensors, "models": models}


def _reads(node: Mapping[str, Any]) -> list[tuple[Key, str]]:
    """What ``node`` reads, with each tensor's dtype: its inputs, then its conditions.

    A condition is read as an input is: the node waits for it, and it is released after
    its last reader.
    """
    inputs = [((s["node"], s["tensor"]), s["dtype"]) for s in node["inputs"]]
    return inputs + [((t["node"], t["tensor"]), "BOOL") for t in node.get("when", ())]


class Schedule:
    """The execution plan cut down to one set of wanted outputs (:func:`cut_plan`), indexed
    by node name for an executor's hot path.

    ``every_node``: run every node of ``plan`` whatever ``wanted`` asks for (the local
    runtime's gated ensemble, where Triton prunes no step: every output passes the gate);
    only ``wanted`` is answered.
    """

    def __init__(self, plan: Mapping[str, Any], wanted: Collection[str], *, every_node: bool = False) -> None:
        cut = cut_plan(plan, [out["name"] for out in plan["outputs"]] if every_node else wanted)
        outputs = [out for out in cut["outputs"] if out["name"] in wanted]
        self.wanted = [out["name"] for out in outputs]
        #: (output name, the tensor it answers with), for each wanted output
        self.outputs = [(out["name"], (out["node"], out["tensor"])) for out in outputs]
        #: the wanted outputs declared as ``~flag``: answered negated (``rows.negated``), before any fill
        self.negated = frozenset(out["name"] for out in outputs if out.get("negated"))
        nodes = cut["nodes"]
        self.order = [node["name"] for node in nodes]
        # Every node needs the one before it: running them in turn is all an async executor can do.
        self.chain = all(prev in node["after"] for prev, node in zip(self.order, nodes[1:], strict=False))
        # graphlib wants node -> predecessors; a needed node's predecessors are all needed.
        self.after = {node["name"]: node["after"] for node in nodes}
        self.before = {node["name"]: node["before"] for node in nodes}
        self.returns = {node["name"]: node["returns"] for node in nodes}
        #: tensor -> how many reads it has left at the start of a request (each binding, each output)
        self.uses = {(t["node"], t["name"]): len(t["consumers"]) + len(t["outputs"]) for t in cut["tensors"]}
        #: the pipeline inputs some node reads, in the plan's order
        self.inputs = [name for node, name in self.uses if node is None]
