"""Running a plan's nodes concurrently, and the plan cut down to the outputs a request wants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


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


class Schedule:
    """The execution plan cut down to one set of wanted outputs.

    A filter of the plan, no graph walk of its own: each output lists the nodes
    it needs and each tensor its readers, so ``ExecutionPlan.for_outputs`` gives
    the same nodes, returns and reads (a test holds them equal).
    """

    def __init__(self, plan: Mapping[str, Any], wanted: Any) -> None:
        outputs = [out for out in plan["outputs"] if out["name"] in wanted]
        self.wanted = [out["name"] for out in outputs]
        needed = {name for out in outputs for name in out["needs"]}
        nodes = [node for node in plan["nodes"] if node["name"] in needed]
        self.order = [node["name"] for node in nodes]
        # Every node needs the one before it: running them in turn is all an async executor can do.
        self.chain = all(prev in node["after"] for prev, node in zip(self.order, nodes[1:], strict=False))
        # graphlib wants node -> predecessors; a needed node's predecessors are all needed.
        self.after = {node["name"]: node["after"] for node in nodes}
        exposed = {}
        for out in outputs:
            key = (out["node"], out["tensor"])
            exposed[key] = exposed.get(key, 0) + 1
        self.uses = {}
        for tensor in plan["tensors"]:
            key = (tensor["node"], tensor["name"])
            reads = sum(1 for c in tensor["consumers"] if c in needed) + exposed.get(key, 0)
            if reads:
                self.uses[key] = reads
        self.returns = {
            node["name"]: [o for o in node["returns"] if (node["name"], o) in self.uses] for node in nodes
        }
