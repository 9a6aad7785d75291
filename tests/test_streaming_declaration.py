"""Declaring a streaming pipeline: which steps stream, the wiring a stream refuses at the line that
made it, and the server-side commands that refuse a streaming pipeline until its forms exist."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.cli import main
from pipelines.errors import DeclarationError, NotCompilableError, PipelinesError, StepDeclarationError
from pipelines.examples import textgen

ONE = TensorSpec("INT32", [1])


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
    for i in range(int(n[0])):
        yield {"tok": np.array([i], np.int32)}


@step(inputs={"n": ONE}, outputs={"tok": ONE})
async def count_async(n):
    for i in range(int(n[0])):
        yield {"tok": np.array([i], np.int32)}


@step(inputs={"tok": ONE}, outputs={"out": ONE})
def double(tok):
    return {"out": tok * 2}


@step(inputs={"a": ONE, "b": ONE}, outputs={"out": ONE})
def add(a, b):
    return {"out": a + b}


@step(inputs={"tok": ONE}, outputs={"out": ONE}, whole_stream=True)
def total(tok):
    return {"out": np.array([sum(int(t[0]) for t in tok)], np.int32)}


def test_a_generator_function_async_generator_or_generator_method_is_a_streaming_step():
    class Counter:
        def execute(self, n):
            yield {"tok": n}

    assert count.streaming and count_async.streaming
    assert step(Counter, inputs={"n": ONE}, outputs={"tok": ONE}).streaming
    assert not double.streaming
    # a function that returns an iterator streams when it says so
    listed = step(lambda n: iter([{"tok": n}]), name="listed", inputs={"n": ONE}, outputs={"tok": ONE}, streaming=True)
    assert listed.streaming
    assert count.with_options(instance_count=2).streaming


@pytest.mark.parametrize("options, words", [
    ({"streaming": False}, "is a generator function but is declared streaming=False"),
    ({"dynamic_batching": True, "max_batch_size": 4}, "a stream belongs to one request, so drop dynamic_batching"),
])
def test_a_streaming_declaration_that_cannot_hold_is_refused_where_it_is_made(options, words):
    def gen(n):
        yield {"tok": n}

    with pytest.raises(StepDeclarationError, match=words):
        step(gen, inputs={"n": ONE}, outputs={"tok": ONE}, **options)


def test_an_async_step_cannot_read_a_stream_whole():
    async def reader(tok):
        return {"out": tok}

    with pytest.raises(StepDeclarationError, match="iterates it with a plain for loop"):
        step(reader, inputs={"tok": ONE}, outputs={"out": ONE}, whole_stream=True)


def test_a_pipeline_with_a_streaming_step_is_a_streaming_pipeline_and_says_where_each_step_runs():
    p = Pipeline("s", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    d = p.add(double, tok=c["tok"])
    t = p.add(total, tok=d["out"])
    p.output("sum", t["out"])
    assert p.streaming
    assert p.stream_of("count") is None and p.stream_of("double") == "count" and p.stream_of("total") is None
    assert p.stream_from("double") == "count" and p.stream_from("total") is None
    plain = Pipeline("plain", inputs={"n": ONE})
    plain.output("out", plain.add(double, tok=plain.input("n"))["out"])
    assert not plain.streaming


def test_a_join_of_two_streams_is_refused_at_the_line_that_makes_it():
    p = Pipeline("join", inputs={"n": ONE})
    a = p.add(count, name="a", n=p.input("n"))
    b = p.add(count, name="b", n=p.input("n"))
    with pytest.raises(DeclarationError, match=r"would join the stream of 'b' .* to the stream of 'a'"):
        p.add(add, a=a["tok"], b=b["tok"])
    assert "add" not in p.nodes  # the refused line left nothing half-made
    joined = p.add(add, a=a["tok"])  # bound later: refused at bind, the line that makes the join
    with pytest.raises(DeclarationError, match="two streams have no common response"):
        p.bind(joined, b=b["tok"])


def test_a_stream_into_a_streaming_step_must_be_read_whole():
    p = Pipeline("nested", inputs={"n": ONE})
    a = p.add(count, name="a", n=p.input("n"))
    with pytest.raises(DeclarationError, match=r"a stream of streams .* whole_stream=True"):
        p.add(count, name="again", n=a["tok"])


def test_a_condition_that_streams_is_refused_at_the_when_that_reads_it():
    @step(inputs={"tok": ONE}, outputs={"ok": TensorSpec("BOOL", [1])})
    def positive(tok):
        return {"ok": tok > 0}

    p = Pipeline("cond", inputs={"n": ONE})
    a = p.add(count, n=p.input("n"))
    ok = p.add(positive, tok=a["tok"])
    with pytest.raises(DeclarationError, match="a condition is read once per request"):
        with p.when(ok["ok"]):
            pass


def test_a_whole_stream_step_that_no_stream_feeds_and_outputs_of_two_paces_are_refused_at_validate():
    p = Pipeline("nostream", inputs={"n": ONE})
    p.output("out", p.add(total, tok=p.input("n"))["out"])
    with pytest.raises(DeclarationError, match="no stream feeds it"):
        p.validate()
    q = Pipeline("paces", inputs={"n": ONE})
    c = q.add(count, n=q.input("n"))
    q.output("each", q.add(double, tok=c["tok"])["out"])
    q.output("once", q.add(double, name="once", tok=q.input("n"))["out"])
    with pytest.raises(DeclarationError, match=r"'each' \(once per response of 'count'\), 'once' \(once per request\)"):
        q.validate()


def test_server_forms_refuse_a_streaming_pipeline_in_one_line(tmp_path, capsys):
    p = textgen.make_textgen()
    said = "streaming pipelines run in the local runtime for now"
    for call in (lambda: p.predict(None), lambda: p.advise(None)):
        with pytest.raises(NotCompilableError, match=said):
            call()
    # compile: each form that cannot run it says so (the ensemble: its when block)
    with pytest.raises(NotCompilableError, match="the 'bls' form does not stream yet"):
        p.compile("bls")
    with pytest.raises(NotCompilableError, match=r"no form of compile\('all'\) can run it \(ensemble: .*cannot skip"):
        p.compile("all")
    spec = "pipelines.examples.textgen:pipeline"
    for argv in (["compile", spec, "--out", str(tmp_path / "repo")], ["predict", spec, "--profile", "x.json"],
                 ["bench", spec, "--server", "--requests", "1", "--concurrency", "1"], ["serve", "--local", spec]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert (argv[0] == "compile" or said in err) and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "repo").exists()


def test_a_streaming_pipelines_refusals_come_from_the_errors_root():
    with pytest.raises(PipelinesError):
        textgen.make_textgen().compile("fused")


def test_a_streaming_step_called_as_plain_python_lists_its_responses():
    assert [int(r["tok"][0]) for r in count(n=np.array([3], np.int32))] == [0, 1, 2]
    assert [int(r["tok"][0]) for r in count_async(n=np.array([2], np.int32))] == [0, 1]
    assert total(tok=iter([np.array([2], np.int32), np.array([3], np.int32)]))["out"][0] == 5
