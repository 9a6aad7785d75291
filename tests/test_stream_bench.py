"""``pipelines bench`` on a streaming pipeline: the figures computed from known times exactly, a
real local run of the textgen example that reports every measure, the user's prompts as
requests, and the gRPC stream client on the bundled server (marked ``server``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines.bench import BenchSettings, run_benchmark
from pipelines.bench.command import run as bench_command
from pipelines.bench.inputs import given_requests, is_prompt_file, prompt_requests
from pipelines.bench.loadgen import LoadPlan, run_load
from pipelines.bench.measurement import Configuration, Measurement
from pipelines.bench.report_tables import render
from pipelines.bench.server_target import StreamingServerTarget, check_streaming_settings
from pipelines.bench.stability import StabilityRule
from pipelines.bench.streams import StreamTimes, stream_figures
from pipelines.commands.input_files import parse_inputs
from pipelines.core.tensor import TensorSpec
from pipelines.errors import InferenceError, PipelinesError
from pipelines.examples import textgen

sys.path.insert(0, str(Path(__file__).parent))
from test_triton_decoupled_facts import write_models  # noqa: E402  (the hand-written decoupled models)

SHORT = {"duration": 0.3, "warmup": 0.1, "max_trials": 3}


# ------------------------------------------------------------------------ the figures, by hand


def test_the_figures_of_known_times_are_computed_exactly():
    """Four requests over windows 2 s long: first responses after 10, 20 and 40 ms; gaps of 5, 10,
    30 and 0 ms; one request answered by no response (a request, with no first response)."""
    streams = [
        (0.0, [0.010, 0.015, 0.025]),  # first 10 ms; gaps 5, 10: a pace of 7.5 ms
        (1.0, [1.020, 1.050]),  # first 20 ms; gap 30
        (1.5, []),  # no response
        (1.6, [1.640]),  # first 40 ms; one response, no gap nor pace
    ]
    got = stream_figures(streams, 2.0)
    assert (got.requests, got.responses, got.empty) == (4, 6, 1)
    assert got.requests_per_s == pytest.approx(2.0) and got.responses_per_s == pytest.approx(3.0)
    assert got.ttft.count == 3 and got.itl.count == 2 and got.gaps.count == 3
    # The nearest observation: p50 of [10, 20, 40] is at index 1; p95 and p99 at index round(1.9) = 2.
    assert (got.ttft.p50_ms, got.ttft.p95_ms, got.ttft.p99_ms) == pytest.approx((20.0, 40.0, 40.0))
    # genai-perf's ITL, one per request of two responses or more: [7.5, 30]; p50 at index round(0.5) = 0.
    assert (got.itl.p50_ms, got.itl.p99_ms, got.itl.avg_ms) == pytest.approx((7.5, 30.0, 18.75))
    # Every gap pooled, [5, 10, 30]: p50 at index 1, p99 at index round(1.98) = 2.
    assert (got.gaps.p50_ms, got.gaps.p99_ms, got.gaps.avg_ms) == pytest.approx((10.0, 30.0, 15.0))


def test_responses_held_back_show_in_the_first_response_and_the_gaps():
    """Ten responses 1 ms apart, and ten held back (the first at 9 ms, the nine others together at
    10 ms): the wait shows in the time to first response, the burst in gaps of zero."""
    steady = (0.0, [0.001 * (i + 1) for i in range(10)])
    burst = (1.0, [1.009] + [1.010] * 9)
    one_by_one, together = stream_figures([steady], 1.0), stream_figures([burst], 1.0)
    assert one_by_one.itl.p50_ms == pytest.approx(1.0) and one_by_one.gaps.p50_ms == pytest.approx(1.0)
    assert together.ttft.p50_ms == pytest.approx(9.0) and together.itl.p50_ms == pytest.approx(1 / 9)
    assert together.gaps.p50_ms == pytest.approx(0.0)


def test_stream_times_and_pairs_give_the_same_figures_and_none_is_measured_from_nothing():
    times = [StreamTimes(0.0, (0.004, 0.006), 0.007), StreamTimes(0.5, (0.503,), 0.6)]
    assert stream_figures(times, 1.0) == stream_figures([(0.0, [0.004, 0.006]), (0.5, [0.503])], 1.0)
    assert times[1].latency == pytest.approx(0.1)
    nothing = stream_figures([], 0.0)
    assert (nothing.requests, nothing.responses_per_s, nothing.ttft.p50_ms, nothing.itl.p99_ms) == (0, 0.0, None, None)


def test_a_measurement_keeps_the_stream_figures_and_a_plain_one_keeps_its_keys():
    """results.json of a plain pipeline keeps exactly the keys it had; a stream adds ``stream``."""

    async def streamed(_inputs):
        await anyio.sleep(0.002)
        return StreamTimes(0.0, (0.001, 0.002), 0.003)

    async def plain(_inputs):
        await anyio.sleep(0.002)
        return {"y": np.zeros(1)}

    plan = LoadPlan(concurrency=2, duration=0.1, warmup=0.0, rule=StabilityRule(windows=1, max_trials=1))
    for infer, streaming in ((streamed, True), (plain, False)):
        load = anyio.run(run_load, infer, [{"x": np.zeros(1)}], plan)
        m = Measurement.from_load(Configuration("local", "fused"), load, batch=1, streaming=streaming)
        data = m.to_dict()
        if streaming:
            assert m.stream.requests == m.requests > 0 and m.stream.responses == 2 * m.requests
            assert data["stream"]["time_to_first_response"]["p50_ms"] == pytest.approx(1.0)
            assert data["stream"]["time_between_responses"]["p99_ms"] == pytest.approx(1.0)
            assert m.latency.p50_ms == pytest.approx(3.0)  # the stream's own clock: sent to its end
        else:
            assert m.stream is None and "stream" not in data


# ------------------------------------------------------------------------ a real local run


def test_a_local_run_of_textgen_reports_every_measure(tmp_path):
    """Every measure, for every local form the gated example runs (the ensemble cannot run `when`),
    from real streams; each request's responses are the tokens p.run gives for its prompt."""
    pipeline = textgen.make_textgen(max_new_tokens=12)
    tokens = len(pipeline.run(textgen.sample_inputs(), mode="fused"))
    result = run_benchmark(pipeline, BenchSettings(concurrency=(1, 2), server=False, **SHORT),
                           inputs=textgen.sample_inputs(), out=tmp_path, progress=False, echo=False)
    assert {m.config.form for m in result.measurements} == {"bls", "bls-sync", "fused"}
    for m in result.measurements:
        st = m.stream
        assert m.errors == 0 and st.requests == m.requests > 0, m
        assert st.responses == tokens * st.requests and st.empty == 0
        for figure in (st.ttft.p50_ms, st.ttft.p95_ms, st.ttft.p99_ms):
            assert figure is not None and figure > 0
        # On a starved machine responses may reach the client together: a gap of zero is a measure too.
        assert st.itl.p50_ms is not None and st.itl.p99_ms is not None and st.itl.p50_ms >= 0
        assert st.ttft.p50_ms <= st.ttft.p95_ms <= st.ttft.p99_ms and st.itl.p50_ms <= st.itl.p99_ms
        assert st.ttft.p50_ms <= m.latency.p50_ms  # the first response comes no later than the stream's end
        assert st.responses_per_s == pytest.approx(tokens * st.requests_per_s)
        assert st.requests_per_s == pytest.approx(m.throughput)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert all("time_to_first_response" in m["stream"] for m in saved["measurements"])
    table = render(result)
    assert "first p50" in table and "between p50" in table and "resp/s" in table
    assert "the first response comes soonest from" in result.verdict
    pytest.importorskip("matplotlib")
    assert (tmp_path / "ttft_p50.png").is_file()


def test_a_plain_pipeline_keeps_its_table_results_and_plots(tmp_path):
    from pipelines.examples.basic import diamond

    result = run_benchmark(diamond, BenchSettings(concurrency=(1,), server=False, forms=("fused",), **SHORT),
                           out=tmp_path, progress=False, echo=False)
    assert all(m.stream is None for m in result.measurements)
    assert "stream" not in json.loads((tmp_path / "results.json").read_text())["measurements"][0]
    assert "first p50" not in render(result) and "infer/s" in render(result)
    assert not (tmp_path / "ttft_p50.png").exists()


def test_a_stream_read_whole_leaves_the_ensemble_out_and_says_why():
    """No `when`, but a step that reads the stream whole: the ensemble cannot run it."""
    from pipelines import Pipeline
    from pipelines.errors import NotCompilableError

    p = Pipeline("whole", inputs={"prompt": TensorSpec("BYTES", [1])})
    tokens = p.add(textgen.tokenize, prompt=p.input("prompt"))
    generated = p.add(textgen.decode.with_options(parameters={"max_new_tokens": 4}), tokens=tokens["tokens"])
    p.output("text", p.add(textgen.detokenize, token=generated["token"])["text"])
    result = run_benchmark(p, BenchSettings(concurrency=(1,), server=False, forms=("ensemble", "fused"), **SHORT),
                           inputs=textgen.sample_inputs(), out=None, progress=False, echo=False)
    assert [m.config.form for m in result.measurements] == ["fused"]
    assert any(n.startswith("ensemble left out") and "whole_stream=True" in n for n in result.notes), result.notes
    with pytest.raises(NotCompilableError, match=r"reads the stream of 'decode' whole.*benchmark --forms bls,fused"):
        run_benchmark(p, BenchSettings(concurrency=(1,), server=False, forms=("ensemble",), **SHORT),
                      inputs=textgen.sample_inputs(), out=None, progress=False, echo=False)


# ------------------------------------------------------------------------ the user's prompts


def test_a_prompt_file_makes_one_request_per_line(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nnaïve café\nlast line", encoding="utf-8")
    requests = given_requests(textgen.pipeline, [str(prompts)], parse_inputs)
    assert [r["prompt"].tolist() for r in requests] == [[b"Hello there"], ["naïve café".encode()], [b"last line"]]
    assert requests[0]["prompt"].dtype == object and requests[0]["prompt"].shape == (1,)
    assert given_requests(textgen.pipeline, [f"prompt={prompts}"], parse_inputs)[2]["prompt"].tolist() == [b"last line"]
    assert is_prompt_file("prompts.txt") and is_prompt_file("prompt=p.TXT") and not is_prompt_file("x=x.npy")


def test_a_prompt_file_is_refused_where_it_cannot_be_one_string(tmp_path):
    from pipelines.examples.basic import diamond

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\n")
    with pytest.raises(PipelinesError, match=r"pipeline 'diamond' has no BYTES input"):
        prompt_requests(diamond, str(prompts))
    with pytest.raises(PipelinesError, match=r"input 'x' of pipeline 'diamond' is FP32 .*give it as x=FILE.npy"):
        prompt_requests(diamond, f"x={prompts}")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(PipelinesError, match=r"holds no prompt"):
        prompt_requests(textgen.pipeline, str(tmp_path / "empty.txt"))
    with pytest.raises(PipelinesError, match=r"no input 'text'"):
        prompt_requests(textgen.pipeline, f"text={prompts}")


def test_bench_streams_the_users_prompts(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The first prompt\nA second, longer prompt than the first\n")
    status = bench_command(["pipelines.examples.textgen:pipeline", "--no-server", "--forms", "fused",
                            "--concurrency", "1", "--duration", "0.3", "--warmup", "0.1", "--max-trials", "3",
                            "--input", str(prompts), "--out", str(tmp_path / "out"), "--quiet"])
    assert status == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["settings"]["samples"] == 2
    (m,) = saved["measurements"]
    assert m["completed_by_sample"][0] > 0 and m["completed_by_sample"][1] > 0
    assert m["stream"]["responses"] > m["stream"]["requests"] > 0
    assert "first p50" in capsys.readouterr().out


def test_a_remote_server_over_http_or_compressed_streams_are_refused_before_anything_runs():
    with pytest.raises(PipelinesError, match=r"streams it over gRPC .*--protocol grpc"):
        check_streaming_settings(textgen.pipeline, BenchSettings(url="host:8000", local=False))
    with pytest.raises(PipelinesError, match=r"drop --compression gzip"):
        check_streaming_settings(textgen.pipeline, BenchSettings(compression="gzip", local=False))
    check_streaming_settings(textgen.pipeline, BenchSettings(url="host:8001", protocol="grpc"))  # fine


# ------------------------------------------------------------------------ the gRPC stream client


@pytest.fixture(scope="module")
def decoupled_server(tmp_path_factory):
    from pipelines.triton import TritonServer

    root = write_models(tmp_path_factory.mktemp("stream-bench") / "models")
    with TritonServer(root, exit_timeout=3) as server:
        yield server


@pytest.mark.server
def test_the_grpc_stream_client_times_each_response_to_the_final_flag(decoupled_server):
    """Against hand-written decoupled models: a model that sends its final flag alone, an ensemble
    (the flag on the last response or alone), no response at all, and an error mid-stream."""
    specs = {"N": TensorSpec("INT32", [1])}

    async def stream(model: str, n: int) -> StreamTimes:
        target = StreamingServerTarget(decoupled_server.grpc_url, decoupled_server.async_client("grpc"), model, specs)
        try:
            return await target.stream({"N": np.array([n], np.int32)}, keep=True)
        finally:
            await target.close()

    gen = anyio.run(stream, "gen", 3)
    assert [a["TOKEN"].tolist() for a in gen.answers] == [[0], [1], [2]]
    assert gen.sent < gen.responses[0] <= gen.responses[1] <= gen.responses[2] <= gen.ended
    for _ in range(3):  # the ensemble's final flag races its last response
        assert [a["SQ"].tolist() for a in anyio.run(stream, "ens_decoupled", 3).answers] == [[0], [1], [4]]
    assert [a["SQ"].tolist() for a in anyio.run(stream, "bls_async", 3).answers] == [[0], [1], [4]]
    empty = anyio.run(stream, "gen", 0)
    assert empty.responses == () and empty.ended >= empty.sent
    with pytest.raises(InferenceError, match=r"gen failed after 2 responses \(stream of model 'gen' after 2"):
        anyio.run(stream, "gen", 102)


@pytest.mark.server
def test_the_load_generator_streams_many_requests_at_once_on_the_server(decoupled_server):
    """Four streams in flight, each on its own call: every request gets its responses, and the
    figures count them."""
    specs = {"N": TensorSpec("INT32", [1])}
    plan = LoadPlan(concurrency=4, duration=0.5, warmup=0.1, rule=StabilityRule(windows=1, max_trials=1))

    async def measure():
        target = StreamingServerTarget(decoupled_server.grpc_url, decoupled_server.async_client("grpc"), "bls_async", specs)
        try:
            return await run_load(target.infer, [{"N": np.array([5], np.int32)}], plan)
        finally:
            await target.close()

    load = anyio.run(measure)
    m = Measurement.from_load(Configuration("server", "bls", "bls_async"), load, batch=1, streaming=True)
    assert m.errors == 0 and m.requests > 0
    assert m.stream.responses == 5 * m.stream.requests and m.stream.gaps.count == 4 * m.stream.requests
    assert m.stream.itl.count == m.stream.requests


@pytest.mark.server
def test_bench_measures_the_fused_form_on_the_bundled_server_and_it_streams_the_local_text(tmp_path):
    """The compiled fused form, served: the bench's figures from real streams (every response of
    every request counted), and the text each prompt streams is the local runtime's."""
    from contextlib import ExitStack

    from pipelines.bench.runner import write_bench_repository
    from pipelines.triton import TritonServer

    pipeline = textgen.make_textgen(max_new_tokens=8)
    requests = [textgen.sample_inputs(prompt=p) for p in ("One prompt", "Another, longer prompt", "a secret")]
    local = [[r["text"][0] for r in pipeline.run(request, mode="fused")] for request in requests]
    with ExitStack() as stack:
        server = stack.enter_context(TritonServer(write_bench_repository(pipeline, tmp_path, stack), exit_timeout=5))
        settings = BenchSettings(concurrency=(2,), url=server.grpc_url, protocol="grpc", local=False,
                                 forms=("fused",), **SHORT)
        result = run_benchmark(pipeline, settings, inputs=requests[0], out=tmp_path / "out", progress=False, echo=False)

        async def served():
            target = StreamingServerTarget(server.grpc_url, server.async_client("grpc"), "textgen_fused",
                                           pipeline.inputs, timeout=30)
            try:
                return [[a["text"][0] for a in (await target.stream(r, keep=True)).answers] for r in requests]
            finally:
                await target.close()

        assert anyio.run(served) == local
    assert local[2] == [textgen.REFUSED]
    (m,) = result.measurements
    assert m.config.label == "server fused" and m.errors == 0, m.error_messages
    st = m.stream
    assert st.requests == m.requests > 0 and st.responses == len(local[0]) * st.requests
    assert None not in (st.ttft.p50_ms, st.ttft.p95_ms, st.ttft.p99_ms, st.itl.p50_ms, st.itl.p99_ms)
    assert "textgen_fused" in {t.model for t in m.breakdown}
