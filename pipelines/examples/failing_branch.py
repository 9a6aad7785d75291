"""A diamond whose one branch fails on half the requests, and the load that shows a
server survives it: the shape that crashes a plain ensemble on Triton 2.51.

``make_failing_diamond()`` builds the pipeline; ``make_failing_chain()`` a chain that
reuses the failing step, whose ensemble is plain (no sibling runs beside a failing step);
``hammer_groups(server, models, groups, seconds)`` runs groups of concurrent clients
(protocol x clients) at the same time, each cycling over ``models``, every other client
sending a failing request, and tallies what each request got. Used by ``tests/test_server_failures.py`` and
``benchmarks/failing_branch_soak.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from ..core.step import DynamicBatching, step
from ..core.tensor import TensorSpec
from ..errors import InferenceError
from ..pipeline import Pipeline

__all__ = [
    "GroupTally",
    "brittle",
    "expected_answer",
    "expected_chain_answer",
    "hammer_groups",
    "make_failing_chain",
    "make_failing_diamond",
    "request_for",
]

F4 = TensorSpec("FP32", [4])


@step(inputs={"x": F4}, outputs={"y": F4}, dynamic_batching=DynamicBatching(max_queue_delay_us=500))
def brittle(x):
    """Refuses a row whose first value is negative, naming the request's tag (its second value)."""
    bad = x[:, 0] < 0
    if bad.any():
        raise ValueError(f"refusing request {int(x[bad][0, 1])}: negative first value")
    return {"y": x * 2}


@step(inputs={"x": F4}, outputs={"y": F4}, dynamic_batching=DynamicBatching(max_queue_delay_us=500))
def plus_one(x):
    return {"y": x + 1}


@step(inputs={"a": F4, "b": F4}, outputs={"y": F4}, dynamic_batching=DynamicBatching(max_queue_delay_us=500))
def join(a, b):
    return {"y": a + b}


def make_failing_diamond(name: str = "failing_diamond", *, max_batch_size: int = 8, expose_branch: bool = False) -> Pipeline:
    """The diamond; ``expose_branch`` also exposes the sound branch's output as ``right``, so that no
    one step produces every output and the compiled ensemble answers through a gate model."""
    p = Pipeline(name, inputs={"x": F4}, max_batch_size=max_batch_size)
    left = p.add(brittle, x=p.input("x"))
    right = p.add(plus_one, x=p.input("x"))
    p.output("y", p.add(join, a=left["y"], b=right["y"])["y"])
    if expose_branch:
        p.output("right", right["y"])
    return p


def make_failing_chain(
    name: str = "failing_chain", *, max_batch_size: int = 8, share_model: bool | None = None
) -> Pipeline:
    """``brittle``, ``plus_one``, then ``brittle`` again (the same step object, as a hand-written
    ensemble reuses one model): each node gets a model of its own (or, with ``share_model=True``,
    one model that learns its node from its input's alias), so the ensemble is not gated and
    the failing node answers with its own error response."""
    twice = brittle if share_model is None else brittle.with_options(share_model=share_model)
    p = Pipeline(name, inputs={"x": F4}, max_batch_size=max_batch_size)
    first = p.add(twice, name="brittle", x=p.input("x"))
    again = p.add(twice, name="brittle_again", x=p.add(plus_one, x=first["y"])["y"])
    p.output("y", again["y"])
    return p


def request_for(tag: int, *, failing: bool) -> np.ndarray:
    """One row, unique per tag; a failing one makes `brittle` refuse it by that tag."""
    return np.array([[-1.0 if failing else 0.5, tag, 2.0, 3.0]], np.float32)


def expected_answer(x: np.ndarray) -> np.ndarray:
    return x * 2 + (x + 1)


def expected_chain_answer(x: np.ndarray) -> np.ndarray:
    return (x * 2 + 1) * 2


@dataclass
class GroupTally:
    """What the requests of one client group got."""

    answered: int = 0
    own_errors: int = 0
    hung: int = 0
    wrong: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.answered + self.own_errors + self.hung + len(self.wrong)


async def _group(server, models, protocol, clients, seconds, request_limit, tags, tally, expected):
    async with server.async_client(protocol, timeout=request_limit + 30) as client:
        stop = anyio.current_time() + seconds

        async def one_client(index: int) -> None:
            failing = index % 2 == 1
            turn = index
            while anyio.current_time() < stop:
                tag = next(tags)
                model = models[turn % len(models)]
                turn += 1
                x = request_for(tag, failing=failing)
                try:
                    with anyio.fail_after(request_limit):
                        got = await client.infer(model, {"x": x})
                except TimeoutError:
                    tally.hung += 1
                    continue
                except InferenceError as exc:
                    if failing and f"refusing request {tag}:" in str(exc) and "brittle" in str(exc):
                        tally.own_errors += 1
                    else:
                        tally.wrong.append(f"{model} tag {tag}: {exc}")
                    continue
                right_ok = "right" not in got or np.array_equal(got["right"], x + 1)
                if not failing and right_ok and np.array_equal(got.get("y"), expected(x)):
                    tally.answered += 1
                else:
                    tally.wrong.append(f"{model} tag {tag}: got {got}")

        async with anyio.create_task_group() as tg:
            for i in range(clients):
                tg.start_soon(one_client, i)


async def hammer_groups(
    server, models: list[str], groups: list[tuple[str, int]], seconds: float, *, request_limit: float = 60.0,
    expected: Callable[[np.ndarray], np.ndarray] = expected_answer,
) -> dict[tuple[str, int], GroupTally]:
    """Run every (protocol, clients) group at once for ``seconds``; a request unanswered after
    ``request_limit`` seconds counts as hung. ``expected`` gives a sound request's answer
    (:func:`expected_chain_answer` for :func:`make_failing_chain`)."""
    tags = itertools.count(1)
    tallies = {group: GroupTally() for group in groups}
    async with anyio.create_task_group() as tg:
        for protocol, clients in groups:
            tg.start_soon(_group, server, models, protocol, clients, seconds, request_limit, tags,
                          tallies[(protocol, clients)], expected)
    return tallies
