"""Where each node of a streaming pipeline's request runs: once per request, or once per response
of a stream; which nodes stream, which read a stream whole, and in which order they wait for each
other. The local runtime (``pipelines/runtime/streams.py``) and the fused and BLS models
(``compile/models/stream_run.py``) run a streaming request by this one layout, so they agree.

The layout reads a record of each node (:func:`stream_record`) rather than the pipeline, which a
server does not have: the compiler writes the record into the model's JSON, and the local runtime
makes it from the pipeline itself.
"""

from __future__ import annotations

from typing import Any


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
