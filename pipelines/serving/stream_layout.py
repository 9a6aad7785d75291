"""Where each node of a streaming pipeline's request runs: once per request, or once per response
of a stream; which nodes stream, which read a stream whole, and in which order they wait for each
other (:class:`StreamLayout`); and how a request runs its once-per-request nodes by it
(:class:`TopNodes`). The local runtime (``pipelines/runtime/streams.py``) and the fused and BLS
models (``compile/models/stream_run.py``) run a streaming request by this one layout, so they agree.

The layout reads a record of each node (:func:`stream_record`) rather than the pipeline, which a
server does not have: the compiler writes the record into the model's JSON, and the local runtime
makes it from the pipeline itself.
"""

from __future__ import annotations

from typing import Any

from .streams import END


def stream_record(pipeline: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Where each of ``names`` runs in ``pipeline`` (a ``core.graph.Graph``): ``of``, the stream it
    runs once per response of (``None``: once per request); ``from``, the stream its outputs belong
    to; ``streams``, whether it is a streaming step; ``whole`` and ``reads``, whether it reads a
    stream whole, and which."""
    record = {}
    for name in names:
        step = pipeline.nodes[name].step
        record[name] = {
            "of": pipeline.stream_of(name),
            "from": pipeline.stream_from(name),
            "streams": step.streaming,
            "whole": step.whole_stream,
            "reads": pipeline.stream_input(name) if step.whole_stream else None,
        }
    return record


class StreamLayout:
    """Where each node of one schedule runs (``streams``: :func:`stream_record` of its nodes)."""

    def __init__(self, schedule: Any, streams: dict[str, dict[str, Any]]) -> None:
        order = schedule.order
        self.level: dict[str, str | None] = {n: streams[n]["of"] for n in order}
        self.top = [n for n in order if self.level[n] is None]
        self.sources = [n for n in order if streams[n]["streams"]]
        self.whole = [n for n in order if streams[n]["whole"]]
        self.reads: dict[str, str] = {n: streams[n]["reads"] for n in self.whole}
        self.per_response = {s: [n for n in order if self.level[n] == s] for s in self.sources}
        self.inner_after = {
            s: {n: [b for b in schedule.after[n] if self.level[b] == s] for n in nodes}
            for s, nodes in self.per_response.items()
        }
        self.readers = {s: [w for w in self.whole if self.reads[w] == s] for s in self.sources}
        answers = {None if node is None else streams[node]["from"] for _, (node, _) in schedule.outputs}
        # One stream, or none: the declaration says so.
        self.answers: str | None = next(iter(answers)) if answers else None
        # The once-per-request nodes each waits for: those before it, except the stream a whole_stream
        # step reads as it comes; a stream also waits for those its per-response steps read, so
        # that one after another ("bls-sync") the stream runs once they are done.
        self.after: dict[str, list[str]] = {}
        ordered: dict[str, list[str]] = {}  # one after another, a whole_stream step follows its stream
        for name in self.top:
            read = self.reads.get(name)
            after = [b for b in schedule.after[name] if self.level[b] is None and b != read]
            for node in self.per_response.get(name, ()):
                after += [b for b in schedule.after[node] if self.level[b] is None and b != name and b not in after]
            self.after[name] = after
            ordered[name] = after + ([read] if read in self.level else [])
        self.in_order = _in_order(self.top, ordered)
        # The once-per-request nodes that cannot start before each one ends (they wait for it, or for
        # one that does): no company for a stream that runs, as they have nothing to do meanwhile.
        behind: dict[str, set[str]] = {}
        for name in self.in_order:  # each after the ones it waits for
            behind[name] = set(self.after[name]).union(*(behind[b] for b in self.after[name]))
        self.held_up_by = {n: {m for m in self.top if n in behind[m]} for n in self.top}

    def streamed(self, node: str | None, stream: str) -> bool:
        """Whether ``node``'s outputs come once per response of ``stream`` (it is the stream, or runs in it)."""
        return node is not None and (node == stream or self.level.get(node) == stream)


def _in_order(names: list[str], after: dict[str, list[str]]) -> list[str]:
    """``names`` in their order, each moved after those it waits for (graphlib would reorder ties)."""
    placed: list[str] = []
    left = list(names)
    while left:
        ready = next(n for n in left if all(b in placed for b in after[n]))
        placed.append(ready)
        left.remove(ready)
    return placed


class TopNodes:
    """A streaming request's once-per-request nodes, each run once those it waits for are done.

    The request (the local runtime's, on anyio; a model's, on asyncio) gives ``layout``, ``done``
    (node -> an event, set once the node is done), ``items`` (whole_stream step -> the queue its
    stream's responses are put on) and the three ways a node runs: ``_whole`` (it reads a stream
    whole), ``_source`` (it streams: its responses walked to the end) and ``_once``.
    """

    layout: StreamLayout
    done: dict[str, Any]
    items: dict[str, Any]

    async def _top(self, name: str) -> None:
        for before in self.layout.after[name]:
            await self.done[before].wait()
        try:
            if name in self.layout.whole:
                await self._whole(name)
            elif name in self.layout.sources:
                await self._source(name)
            else:
                await self._once(name)
        except Exception:
            # The responses before the failure go on to the end: the steps that read this stream
            # whole see it end, and answer what they made of it, before the error is told.
            self._end_readers(name)
            for reader in self.layout.readers.get(name, ()):
                await self.done[reader].wait()
            raise
        finally:  # cancelled too: a reader's worker thread must not wait on the queue for ever
            self._end_readers(name)
        self.done[name].set()

    def _end_readers(self, name: str) -> None:
        """Tell the whole_stream readers of stream ``name`` that it ended (or failed)."""
        for reader in self.layout.readers.get(name, ()):
            self.items[reader].put(END)

    async def _whole(self, name: str) -> None:
        raise NotImplementedError

    async def _source(self, name: str) -> None:
        raise NotImplementedError

    async def _once(self, name: str) -> None:
        raise NotImplementedError
