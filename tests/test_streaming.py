"""Streaming pipelines in the local runtime: ``p.stream`` yields each response as it comes, in
every mode; ``p.run`` lists them; failures come after the responses before them; stopping early
stops the generators; each mode keeps its form's order and overlap."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.errors import InferenceError, StepError
from pipelines.examples import textgen
from pipelines.runtime import LocalRuntime

MODES = ("ensemble", "bls", "bls-sync", "fused")
ONE = TensorSpec("INT32", [1])


def n(value: int) -> dict[str, np.ndarray]:
    return {"n": np.array([value], np.int32)}


@step(inputs={"n": ONE}, outputs={"tok": ONE})
def count(n):
    for i in range(int(n[0])):
        yield {"tok": np.array([i], np.int32)}


@step(inputs={"tok": ONE}, outputs={"sq": ONE})
def square(tok):
    return {"sq": tok * tok}


@step(inputs={"sq": ONE}, outputs={"total": ONE}, whole_stream=True)
def running_total(sq):
    total = 0
    for s in sq:
        total += int(s[0])
        yield {"total": np.array([total], np.int32)}


def chain(source=count) -> Pipeline:
    """count -> square (once per response) -> running_total (reads the stream whole, streams again)."""
    p = Pipeline("chain", inputs={"n": ONE})
    c = p.add(source, name="count", n=p.input("n"))
    s = p.add(square, tok=c["tok"])
    t = p.add(running_total, sq=s["sq"])
    p.output("total", t["total"])
    return p


def totals(responses) -> list[int]:
    return [int(r["total"][0]) for r in responses]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_streams_the_same_responses_and_run_lists_them(mode):
    p = chain()
    assert totals(p.stream(n(5), mode=mode)) == [0, 1, 5, 14, 30]
    assert totals(p.run(n(5), mode=mode)) == [0, 1, 5, 14, 30]
    # steps in processes of their own, as on a server: the generators stay in this one
    assert totals(p.run(n(5), mode=mode, isolation="process")) == [0, 1, 5, 14, 30]


@pytest.mark.parametrize("mode", MODES)
def test_a_stream_that_yields_nothing_is_an_empty_iterator_and_an_empty_list(mode):
    p = chain()
    assert list(p.stream(n(0), mode=mode)) == []
    assert p.run(n(0), mode=mode) == []


@pytest.mark.parametrize("mode", MODES)
def test_each_response_reaches_the_caller_before_the_generator_goes_on(mode):
    """The generator waits, after its first yield, for the caller to hold that response: only a
    runtime that hands responses on as they come lets it go on."""
    held = threading.Event()
    waited = []

    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def patient(n):
        yield {"tok": np.array([1], np.int32)}
        waited.append(held.wait(20))
        yield {"tok": np.array([2], np.int32)}

    stream = chain(patient).stream(n(0), mode=mode)
    first = next(stream)
    held.set()
    assert totals([first, *stream]) == [1, 5]
    assert waited == [True]


@pytest.mark.parametrize("mode", MODES)
def test_an_error_mid_stream_comes_after_the_responses_before_it_and_names_the_node(mode):
    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def breaks(n):
        yield {"tok": np.array([1], np.int32)}
        yield {"tok": np.array([2], np.int32)}
        raise ValueError("the model ran out of tokens")

    got = []
    with pytest.raises(StepError, match=r"node 'count'.*\(after 2 responses\) raised ValueError: the model ran out") as err:
        for response in chain(breaks).stream(n(0), mode=mode):
            got.append(response)
    assert totals(got) == [1, 5]
    assert err.value.node == "count"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrong, said", [
    (np.array([2.5], np.float32), "has dtype float32; it declares INT32"),
    (np.array([1, 2], np.int32), r"has shape \[2\]; it declares \[1\]"),
])
def test_a_wrong_dtype_or_shape_names_the_step_the_response_and_the_tensor(mode, wrong, said):
    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def drifts(n):
        yield {"tok": np.array([1], np.int32)}
        yield {"tok": wrong}

    with pytest.raises(StepError, match=r"node 'count', step 'drifts', tensor 'tok': response 2: output 'tok' " + said) as err:
        list(chain(drifts).stream(n(0), mode=mode))
    assert err.value.tensor == "tok"


@pytest.mark.parametrize("mode", MODES)
def test_a_step_after_the_stream_that_fails_ends_it_naming_itself(mode):
    @step(inputs={"tok": ONE}, outputs={"sq": ONE})
    def picky(tok):
        if int(tok[0]) == 3:
            raise ValueError("three is not welcome")
        return {"sq": tok * tok}

    p = Pipeline("picky", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    p.output("sq", p.add(picky, tok=c["tok"])["sq"])
    got = []
    with pytest.raises(StepError, match="node 'picky'.*three is not welcome"):
        for response in p.stream(n(10), mode=mode):
            got.append(int(response["sq"][0]))
    assert got == [0, 1, 4]


@pytest.mark.parametrize("mode", MODES)
def test_stopping_early_stops_the_generator(mode):
    """A consumer that closes the stream closes the step's generator: its finally has run when
    close() returns, and the endless generator yields no more."""
    ended = []
    made = []

    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def endless(n):
        try:
            i = 0
            while True:
                made.append(i)
                yield {"tok": np.array([i % 100], np.int32)}
                i += 1
        finally:
            ended.append(True)

    stream = chain(endless).stream(n(0), mode=mode)
    assert totals([next(stream), next(stream)]) == [0, 1]
    stream.close()
    assert ended == [True]
    so_far = len(made)
    assert len(made) == so_far  # nothing runs on after close()


@pytest.mark.parametrize("mode", MODES)
def test_an_async_generator_streams_too(mode):
    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    async def ticks(n):
        for i in range(int(n[0])):
            await anyio.sleep(0)
            yield {"tok": np.array([i], np.int32)}

    assert totals(chain(ticks).stream(n(4), mode=mode)) == [0, 1, 5, 14]


@pytest.mark.parametrize("mode", MODES)
def test_a_whole_stream_function_answers_once_after_the_stream(mode):
    @step(inputs={"tok": ONE}, outputs={"sum": ONE}, whole_stream=True)
    def add_up(tok):
        return {"sum": np.array([sum(int(t[0]) for t in tok)], np.int32)}

    p = Pipeline("sum", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    p.output("sum", p.add(add_up, tok=c["tok"])["sum"])
    assert [int(r["sum"][0]) for r in p.stream(n(5), mode=mode)] == [10]


@pytest.mark.parametrize("mode", MODES)
def test_a_step_per_response_reads_tensors_made_once_beside_the_stream(mode):
    @step(inputs={"n": ONE}, outputs={"offset": ONE})
    def offset(n):
        return {"offset": n * 100}

    @step(inputs={"tok": ONE, "offset": ONE}, outputs={"out": ONE})
    def shifted(tok, offset):
        return {"out": tok + offset}

    p = Pipeline("shift", inputs={"n": ONE})
    c = p.add(count, n=p.input("n"))
    o = p.add(offset, n=p.input("n"))
    p.output("out", p.add(shifted, tok=c["tok"], offset=o["offset"])["out"])
    assert [int(r["out"][0]) for r in p.stream(n(3), mode=mode)] == [300, 301, 302]


@pytest.mark.parametrize("mode, runs_ahead", [("fused", False), ("bls", True), ("bls-sync", True), ("ensemble", True)])
def test_the_fused_mode_pulls_the_generator_and_the_others_let_it_run_ahead(mode, runs_ahead):
    """In the fused form the generator runs in the model's own process, one response at a time; in
    the others it is a model of its own that runs ahead of the steps after it."""
    second = threading.Event()
    seen = []

    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def two(n):
        yield {"tok": np.array([0], np.int32)}
        second.set()
        yield {"tok": np.array([1], np.int32)}

    @step(inputs={"tok": ONE}, outputs={"out": ONE})
    def look(tok):
        if int(tok[0]) == 0:
            seen.append(second.wait(1.0 if not runs_ahead else 20))
        return {"out": tok}

    p = Pipeline("ahead", inputs={"n": ONE})
    p.output("out", p.add(look, tok=p.add(two, n=p.input("n"))["tok"])["out"])
    assert [int(r["out"][0]) for r in p.stream(n(0), mode=mode)] == [0, 1]
    assert seen == [runs_ahead]


def test_infer_refuses_a_streaming_pipeline_and_a_plain_pipeline_streams_one_answer():
    async def main():
        async with LocalRuntime(chain(), "bls") as rt:
            with pytest.raises(InferenceError, match=r"streams .* infer\(\) answers once; take its responses with rt.stream"):
                await rt.infer(n(2))
            got = []
            await rt.stream(n(2), got.append)
            return got

    assert totals(anyio.run(main)) == [0, 1]
    plain = Pipeline("plain", inputs={"n": ONE})
    plain.output("sq", plain.add(square, tok=plain.input("n"))["sq"])
    assert [int(r["sq"][0]) for r in plain.stream(n(3), mode="bls")] == [9]


@pytest.mark.parametrize("mode", ["bls", "bls-sync", "fused"])
def test_textgen_streams_a_token_per_response_and_a_refused_prompt_gets_one_answer(mode):
    p = textgen.make_textgen(max_new_tokens=16)
    texts = [r["text"][0] for r in p.stream(textgen.sample_inputs(), mode=mode)]
    assert 1 <= len(texts) <= 16 and all(isinstance(t, bytes) for t in texts)
    assert texts == [r["text"][0] for r in p.run(textgen.sample_inputs(), mode="bls")]
    refused = p.run(textgen.sample_inputs(prompt="Tell me a SECRET"), mode=mode)
    assert [r["text"][0] for r in refused] == [textgen.REFUSED]


@pytest.mark.parametrize("mode", MODES)
def test_ungated_textgen_runs_in_every_mode_and_writes_the_gated_text(mode):
    ungated = textgen.make_textgen(max_new_tokens=16, gate=False)
    texts = [r["text"][0] for r in ungated.stream(textgen.sample_inputs(), mode=mode)]
    gated = textgen.make_textgen(max_new_tokens=16).run(textgen.sample_inputs(), mode="fused")
    assert texts == [r["text"][0] for r in gated] and len(texts) >= 1


def test_textgen_detokenizer_keeps_a_character_split_over_tokens_whole():
    pieces = list(textgen.detokenize.impl(iter(np.array([[0xC3], [0xA9], [0x21]], np.int32))))
    assert [p["text"][0] for p in pieces] == [b"", "é".encode(), b"!"]


@pytest.mark.parametrize("mode", ["bls", "bls-sync", "fused"])
def test_a_batched_stream_in_a_when_block_runs_on_its_rows_and_fills_the_others(mode):
    """Rows where the condition holds get the stream; the others get the fill in each response;
    a request where no row holds it gets one response of fills."""

    @step(inputs={"n": ONE}, outputs={"ok": TensorSpec("BOOL", [1])})
    def positive(n):
        return {"ok": n > 0}

    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def three(n):
        for i in range(3):
            yield {"tok": n * 10 + i}

    p = Pipeline("rows", inputs={"n": ONE}, max_batch_size=4)
    ok = p.add(positive, n=p.input("n"))
    with p.when(ok["ok"]):
        s = p.add(square, tok=p.add(three, n=p.input("n"))["tok"])
    p.output("sq", s["sq"], otherwise=-1)
    got = [r["sq"].ravel().tolist() for r in p.stream({"n": np.array([[1], [0], [2]], np.int32)}, mode=mode)]
    assert got == [[100, -1, 400], [121, -1, 441], [144, -1, 484]]
    assert [r["sq"].ravel().tolist() for r in p.run({"n": np.array([[0], [0]], np.int32)}, mode=mode)] == [[-1, -1]]


def test_a_batched_stream_in_the_ensemble_mode():
    @step(inputs={"n": ONE}, outputs={"tok": ONE})
    def two(n):
        yield {"tok": n}
        yield {"tok": n + 1}

    p = Pipeline("batched", inputs={"n": ONE}, max_batch_size=4)
    p.output("sq", p.add(square, tok=p.add(two, n=p.input("n"))["tok"])["sq"])
    got = [r["sq"].ravel().tolist() for r in p.stream({"n": np.array([[1], [2]], np.int32)}, mode="ensemble")]
    assert got == [[1, 4], [4, 9]]


def test_pipelines_run_prints_each_response_of_a_streaming_pipeline_and_saves_them_numbered(tmp_path, capsys):
    from pipelines.cli import main
    from pipelines.examples import textgen

    prompt = tmp_path / "prompt.npy"
    np.save(prompt, np.array([b"hello there"], dtype=object))
    expected = textgen.pipeline.run({"prompt": np.array([b"hello there"], dtype=object)}, mode="fused")
    assert main(["run", "pipelines.examples.textgen:pipeline", "--mode", "fused", "--input", f"prompt={prompt}",
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("response ") == len(expected) and f"{len(expected)} response(s)" in printed
    for i, response in enumerate(expected, start=1):
        assert np.load(tmp_path / "out" / f"text_{i}.npy", allow_pickle=True).tolist() == response["text"].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_a_generator_that_never_ends_is_ended_at_its_steps_timeout(mode):
    from pipelines.errors import StepTimeoutError

    @step(inputs={"n": ONE}, outputs={"tok": ONE}, timeout=0.3)
    def endless(n):
        i = 0
        while True:
            i += 1
            yield {"tok": np.array([i], np.int32)}

    got = []
    with pytest.raises(StepTimeoutError, match=r"node 'count'.*ran past its timeout of 0.3 s after \d+ responses"):
        for response in chain(endless).stream(n(0), mode=mode):
            got.append(response)
    assert got  # the responses before the timeout reached the caller
