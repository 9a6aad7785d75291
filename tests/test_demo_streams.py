"""The streaming part of ``make demo`` (``pipelines.examples.demo_streams``) on the bundled server:
every form of the ungated textgen streams the local runtime's text, token by token, the gated one
refuses a prompt, and the benchmark's own report comes out with a row for every form."""

from __future__ import annotations

import io

import pytest

from pipelines.examples import demo_streams, textgen
from pipelines.forms import FORMS
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = demo_streams.compile_streams().write(tmp_path_factory.mktemp("demo_streams") / "repo")
    # exit_timeout: after the benchmark's gRPC streams the ensemble form can hold the server's
    # unload for its whole exit timeout (reported to the lead); nothing is in flight by then.
    with TritonServer(path, exit_timeout=5) as running:
        yield running


def test_every_form_streams_the_local_runtimes_text_token_by_token(server):
    out = io.StringIO()
    streams = demo_streams.stream_every_form(server.grpc_url, demo_streams.PROMPT, out=out)
    assert [s.form for s in streams] == list(FORMS)
    for s in streams:
        expected = b"".join(r["text"][0] for r in demo_streams.ungated.stream(
            textgen.sample_inputs(prompt=demo_streams.PROMPT), mode=s.form)).decode()
        assert s.text == s.local_text == expected, s.form
        assert s.responses == len(expected) > 1  # one response a token: it streamed
        assert s.first_ms is not None and s.first_ms <= s.total_ms
    printed = out.getvalue()
    for s in streams:
        assert f"{s.model:26s} {s.text}\n" in printed
        assert f"the same text as the local runtime (mode {s.form!r})" in printed
    assert "DIFFERS" not in printed


def test_the_gated_textgen_refuses_a_forbidden_prompt_with_one_response(server):
    refused = demo_streams.refuse_on_server(server.grpc_url, out=None)
    assert "forbidden" in demo_streams.REFUSED_PROMPT
    assert (refused.text, refused.responses) == (textgen.REFUSED.decode(), 1)
    assert refused.agrees
    allowed = demo_streams.refuse_on_server(server.grpc_url, demo_streams.PROMPT, out=None)
    assert allowed.agrees and allowed.responses > 1  # the gate lets a harmless prompt through


def test_the_streaming_part_prints_the_benchmarks_report_for_the_four_forms(server):
    out = io.StringIO()
    assert demo_streams.run_streaming_part(server.grpc_url, out=out, concurrency=(1,), duration=0.2)
    printed = out.getvalue()
    assert "first p50" in printed and "between p50" in printed and "verdict: " in printed
    for where in ("local", "server"):
        for form in FORMS:
            assert f"{where} {form} " in printed, (where, form)
    assert "[refused]" in printed
