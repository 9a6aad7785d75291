"""Streaming steps and pipelines for the server tests of the fused and BLS forms
(tests/test_stream_server_fused.py, tests/test_stream_server_bls.py): small, quick, and each able
to fail, stop or run on as a test needs. Only numpy and pipelines: their source travels to the server.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pipelines import Pipeline, TensorSpec, step

ONE = TensorSpec("INT32", [1])


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
    """``n % 100`` tokens 0, 1, …; then, by the hundreds of ``n``: 1 raises, 2 yields a wrong dtype,
    3 a wrong shape, 4 a missing output."""
    k, then = int(n[0]) % 100, int(n[0]) // 100
    for i in range(k):
        yield {"tok": np.array([i], np.int32)}
    if then == 1:
        raise ValueError("the model ran out of tokens")
    if then == 2:
        yield {"tok": np.array([2.5], np.float32)}
    if then == 3:
        yield {"tok": np.array([1, 2], np.int32)}
    if then == 4:
        yield {"other": np.array([1], np.int32)}


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def square(tok):
    return {"sq": tok * tok}


@step(inputs={"tok": ONE}, outputs={"sq": ONE, "neg": ONE})
def pair(tok):
    return {"sq": tok * tok, "neg": -tok}


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def picky(tok):
    if int(tok[0]) == 3:
        raise ValueError("three is not welcome")
    return {"sq": tok * tok}


@step(inputs={"sq": ONE}, outputs={"total": ONE}, whole_stream=True)
def running_total(sq):
    total = 0
    for s in sq:
        total += int(s[0])
        yield {"total": np.array([total], np.int32)}


@step(inputs={"tok": ONE}, outputs={"sum": ONE}, whole_stream=True)
def add_up(tok):
    return {"sum": np.array([sum(int(t[0]) for t in tok)], np.int32)}


@step(inputs={"n": ONE}, outputs={"ok": TensorSpec("BOOL", [1])})
def positive(n):
    return {"ok": n > 0}


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def three(n):
    for i in range(3):
        yield {"tok": n * 10 + i}


@step(inputs={"n": ONE}, outputs={"tok": ONE}, parameters={"marks": ""})
class Endless:
    """Streams until it is stopped, or until ``n`` tokens (a bound so a test can never hang), 2 ms
    apart, sleeping ``n // 1000`` hours inside its third response if that is not 0 (stuck);
    leaves a mark ``endless-<tokens>-<how>``, how: "closed" (stopped) or "ran out"."""

    def initialize(self, config):
        self.marks = config["parameters"]["marks"]

    def execute(self, n):
        limit, stuck = int(n[0]) % 1000, int(n[0]) // 1000
        sent, how = 0, "ran out"
        try:
            while sent < limit:
                if stuck and sent == 2:
                    time.sleep(3600 * stuck)
                yield {"tok": np.array([sent % 100], np.int32)}
                sent += 1
                time.sleep(0.002)
        except GeneratorExit:
            how = "closed"
            raise
        finally:
            open(os.path.join(self.marks, f"endless-{sent}-{how}"), "w").close()


@step(inputs={"tok": ONE}, outputs={"sq": ONE}, parameters={"marks": ""})
class Tally:
    """square, leaving one line per call in ``<marks>/tally``: how many responses reached it."""

    def initialize(self, config):
        self.path = os.path.join(config["parameters"]["marks"], "tally")

    def execute(self, tok):
        with open(self.path, "a") as f:
            f.write(f"{int(tok[0])}\n")
        return {"sq": tok * tok}


def chain(name: str = "chain", source=count) -> Pipeline:
    """count -> square (once per response) -> running_total (reads the stream whole, streams again)."""
    p = Pipeline(name, inputs={"n": ONE})
    c = p.add(source, name="count", n=p.input("n"))
    s = p.add(square, tok=c["tok"])
    p.output("total", p.add(running_total, sq=s["sq"])["total"])
    return p


def squares(name: str = "squares") -> Pipeline:
    """count -> square: one answer per token (no whole_stream step, no when: every form)."""
    p = Pipeline(name, inputs={"n": ONE})
    p.output("sq", p.add(square, tok=p.add(count, n=p.input("n"))["tok"])["sq"])
    return p


def picky_pipeline() -> Pipeline:
    p = Pipeline("picky", inputs={"n": ONE})
    p.output("sq", p.add(picky, tok=p.add(count, n=p.input("n"))["tok"])["sq"])
    return p


def summed() -> Pipeline:
    p = Pipeline("summed", inputs={"n": ONE})
    p.output("sum", p.add(add_up, tok=p.add(count, n=p.input("n"))["tok"])["sum"])
    return p


def three_outputs() -> Pipeline:
    """Three outputs of one stream, one straight from the generator: every subset is asked for."""
    p = Pipeline("three_outputs", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    two = p.add(pair, tok=c["tok"])
    p.output("tok", c["tok"])
    p.output("sq", two["sq"])
    p.output("neg", two["neg"])
    return p


def named() -> Pipeline:
    """Node names as users write them: dots, dashes, capitals."""
    p = Pipeline("Named-Stream.v1", inputs={"n": ONE})
    c = p.add(count, name="Gen.v2-A", n=p.input("n"))
    s = p.add(picky, name="Square-It.B", tok=c["tok"])
    p.output("Total.Out", p.add(running_total, name="Run_Total-C", sq=s["sq"])["total"])
    return p


def rows() -> Pipeline:
    """A batched stream in a when block: rows where it holds stream, the others get the fill."""
    p = Pipeline("rows", inputs={"n": ONE}, max_batch_size=4)
    ok = p.add(positive, n=p.input("n"))
    with p.when(ok["ok"]):
        s = p.add(square, tok=p.add(three, n=p.input("n"))["tok"])
    p.output("sq", s["sq"], otherwise=-1)
    return p


def endless(marks: str, *, name: str = "endless", timeout: float | None = None, tally: bool = False) -> Pipeline:
    """Endless -> square (or Tally, which counts its calls), with the step's ``timeout`` if given."""
    options = {"parameters": {"marks": marks}}
    if timeout is not None:
        options["timeout"] = timeout
    p = Pipeline(name, inputs={"n": ONE})
    gen = p.add(Endless.with_options(**options), name="gen", n=p.input("n"))
    after = Tally.with_options(parameters={"marks": marks}) if tally else square
    p.output("sq", p.add(after, name="square", tok=gen["tok"])["sq"])
    return p


@step(inputs={"n": ONE}, outputs={"block": TensorSpec("FP32", [16384])}, parameters={"marks": ""})
class Blocks:
    """``n % 1000`` responses of 64 KiB, 2 ms apart, for a memory check; leaves a mark
    ``blocks-<n // 1000>-<how>-<sent>`` at its end, how: "ended" or "closed"."""

    def initialize(self, config):
        self.marks = config["parameters"]["marks"]

    def execute(self, n):
        count, tag = int(n[0]) % 1000, int(n[0]) // 1000
        sent, how = 0, "ended"
        try:
            for i in range(count):
                yield {"block": np.full([16384], i, np.float32)}
                sent += 1
                time.sleep(0.002)
        except GeneratorExit:
            how = "closed"
            raise
        finally:
            open(os.path.join(self.marks, f"blocks-{tag}-{how}-{sent}"), "w").close()


def blocks(marks: str) -> Pipeline:
    """Blocks alone: the stream is the pipeline's output."""
    p = Pipeline("blocks", inputs={"n": ONE})
    p.output("block", p.add(Blocks.with_options(parameters={"marks": marks}), name="gen", n=p.input("n"))["block"])
    return p
