"""What a benchmark measures of a streaming pipeline, from the times its client saw.

Each streamed request leaves a :class:`StreamTimes`: when it was sent, when each response
arrived, when it ended. :func:`stream_figures` turns those of a measurement into its figures,
with the definitions genai-perf gives these measures:

- **time to first response** (TTFT): from sending the request to receiving its first response;
- **time between responses** (inter-token latency, ITL): one figure per request of two responses
  or more, its last response's time less its first's, over its responses less one, as
  genai-perf 24.10 computes it (``(request latency - TTFT) / (output tokens - 1)``, a response
  being a token here): the pace of the stream, whether its responses came one by one or together;
- **gaps between responses**: the gaps between one request's consecutive responses, every gap of
  every request pooled (genai-perf's older ITL, kept for its plot of ITL by token position):
  responses that reach the client together show as gaps near zero, so beside the ITL these say
  whether a stream came one by one or in bursts;
- **responses per second** and **requests per second**: the responses, and the requests, of the
  requests that ended within the measurement windows, over the windows' length.

Only requests that succeeded count, as for a plain pipeline's latencies; a request answered by
no response (a stream that yielded nothing) has no first response, and counts as a request only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .latency import LatencySummary

__all__ = ["StreamSummary", "StreamTimes", "stream_figures"]


@dataclass(frozen=True, eq=False)
class StreamTimes:
    """One streamed request as its client saw it, in ``perf_counter`` seconds: ``sent``, the
    arrival of each response (in order), and ``ended`` (the last response, or the final flag
    alone). ``answers`` holds the responses' outputs where the caller asked to keep them."""

    sent: float
    responses: tuple[float, ...]
    ended: float
    answers: tuple[Mapping[str, Any], ...] = ()

    @property
    def latency(self) -> float:
        """The whole stream: from sending the request to its end."""
        return self.ended - self.sent


@dataclass(frozen=True)
class StreamSummary:
    """A measurement's streaming figures: ``ttft``, ``itl`` and ``gaps`` in milliseconds (every
    figure ``None`` when nothing was measured), the rates over the windows' ``seconds``.

    ``requests`` counts the successful requests, ``empty`` those among them that had no
    response, ``responses`` every response they had.
    """

    requests: int
    responses: int
    empty: int
    seconds: float
    requests_per_s: float
    responses_per_s: float
    ttft: LatencySummary
    itl: LatencySummary
    gaps: LatencySummary

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "responses": self.responses,
            "empty_streams": self.empty,
            "seconds": self.seconds,
            "requests_per_s": self.requests_per_s,
            "responses_per_s": self.responses_per_s,
            "time_to_first_response": self.ttft.to_dict(),
            "time_between_responses": self.itl.to_dict(),
            "gaps_between_responses": self.gaps.to_dict(),
        }


def stream_figures(streams: Sequence[StreamTimes | tuple[float, Sequence[float]]], seconds: float) -> StreamSummary:
    """The figures of ``streams`` (each a :class:`StreamTimes`, or ``(sent, [response times])``)
    measured over windows ``seconds`` long; a pure function of the times it is given."""
    first: list[float] = []
    paces: list[float] = []
    gaps: list[float] = []
    responses = empty = 0
    for stream in streams:
        sent, times = (stream.sent, stream.responses) if isinstance(stream, StreamTimes) else stream
        times = list(times)
        responses += len(times)
        if not times:
            empty += 1
            continue
        first.append(times[0] - sent)
        if len(times) > 1:
            paces.append((times[-1] - times[0]) / (len(times) - 1))
        gaps.extend(later - earlier for earlier, later in zip(times[:-1], times[1:], strict=True))
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    return StreamSummary(
        requests=len(streams),
        responses=responses,
        empty=empty,
        seconds=seconds,
        requests_per_s=rate(len(streams)),
        responses_per_s=rate(responses),
        ttft=LatencySummary.of(first),
        itl=LatencySummary.of(paces),
        gaps=LatencySummary.of(gaps),
    )
