"""The soak of a streaming pipeline, small: ``benchmarks/stream_soak.py`` runs 1,000 streams per
form; here 40 per form on one server, 8 at a time, of which 4 are cancelled by the client mid-way
and 2 fail mid-way (in the decoder, and in the step after it). Every answer is checked against
the local runtime's, and every stream's generator must end; nothing may hang.

And what the soak found in the BLS forms, each fixed in ``stream_calls.py``: a stream the BLS model
stops reading (cancelled, or failed after it) kept every response its step still sent, for ever;
and an ended stream let go by Triton's own thread freed Python objects without the GIL, which
killed the BLS model's stub some thousands of streams later (docs/triton_decoupled.md).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import stream_steps as ss
from stream_clients import cancel_after, wait_for_mark

from pipelines.compile.models import stream_calls
from pipelines.triton import TritonServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import stream_soak  # noqa: E402
import stream_soak_steps  # noqa: E402

FORMS = ("ensemble", "bls", "bls-sync", "fused")
STREAMS = 40


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def soak(marks):
    return stream_soak_steps.make_soak(str(marks), max_new_tokens=12)


@pytest.fixture(scope="module")
def server(soak, marks, tmp_path_factory):
    repo = soak.compile("all").merge(ss.blocks(str(marks)).compile("all"))
    with TritonServer(repo.write(tmp_path_factory.mktemp("stream_soak") / "repo"), exit_timeout=3) as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize("form", FORMS)
def test_streams_cancelled_or_failing_mid_way_leave_the_others_right_and_none_hangs(server, soak, marks, form):
    f = stream_soak.soak_form(server, soak, form, marks, streams=STREAMS, warmup=0, settle_s=30)
    assert f.get("hung", 0) == 0 and f.get("wrong", 0) == 0, f["wrong_examples"]
    assert (f["sent_c"], f["sent_x"], f["sent_f"] + f["sent_d"]) == (34, 4, 2)
    assert f["completed_right"] == 34 and f["cancelled_right"] == 4
    assert f.get("failed_right", 0) + f.get("failed_error_overtook_responses", 0) == 2
    if form == "fused":  # the generator of a cancelled stream is closed (unless it ended before the cancel)
        assert f["cancel_stops_generator"], f
    else:  # Triton cannot pass the cancel on: the step runs to its end, as documented
        assert f["cancelled_generator_runs_on_as_documented"], f
    assert f["later_streams_wrong"] == 0 and server.running


def _bls_stub_mib(server: TritonServer, model: str) -> float:
    return stream_soak.server_memory(server.pid)["by_process_mib"][model]


@pytest.mark.server
@pytest.mark.parametrize("form", ["bls", "bls-sync"])
def test_a_stream_the_bls_model_stops_reading_does_not_stay_in_its_memory(server, marks, form):
    """Streams of 40 responses of 64 KiB, each cancelled after its first: the step runs on and
    sends the 39 others to the BLS model (2.4 MiB a stream). Read to their end and let go, 8 more
    such streams leave the BLS model's stub as the 16 before them left it, once its shared memory
    has grown to what such streams need (unread, each stayed: 20 MiB more a time)."""
    model = f"blocks_{form.replace('-', '_')}"
    tag = 100 if form == "bls" else 200

    def eight_cancelled(first):
        for i in range(first, first + 8):
            cancel_after(server.grpc_url, model, {"n": np.array([(tag + i) * 1000 + 40], np.int32)}, 1)
            assert wait_for_mark(marks, f"blocks-{tag + i}-ended-40"), f"stream {tag + i} did not run to its end"
        time.sleep(stream_calls.KEPT.HOLD_S * 1.5 + 0.5)  # the ended streams are let go
        return _bls_stub_mib(server, model)

    eight_cancelled(0)
    before = eight_cancelled(8)
    grew = eight_cancelled(16) - before
    assert grew < 10, f"the BLS model's stub grew {grew:.1f} MiB over 8 more cancelled streams"


def test_a_bls_stream_closed_before_its_end_is_read_to_its_end_and_let_go_later_by_this_process():
    """What the BLS model does with a called stream it stops reading: it reads it to its end off
    the request's path, holds it :data:`_Kept.HOLD_S`, and lets it go on a thread of its own (not
    the stub's, which would free its responses without the GIL)."""
    seen = {"read": 0, "ended_at": None}
    gone = []

    class Responses:  # a BLS response iterator: 50 responses, then its end
        def __iter__(self):
            return self

        def __next__(self):
            if seen["read"] == 50:
                seen["ended_at"] = time.monotonic()
                raise StopIteration
            seen["read"] += 1
            return object()

        def __del__(self):
            gone.append((threading.current_thread().name, time.monotonic()))

    async def close_at_once():
        host = SimpleNamespace(nodes={"gen": {"model": "gen"}})
        stream = stream_calls.CalledStream(host, "gen", Responses(), ["tok"], "__err__", 0)
        await stream.close()

    asyncio.run(close_at_once())
    deadline = time.monotonic() + 30
    while not gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen["read"] == 50 and gone, (seen, gone)
    thread, at = gone[0]
    assert thread == "stream-iterators" and at - seen["ended_at"] >= 2.0, (thread, at, seen)


def test_the_docs_state_each_fact_with_its_test():
    text = (Path(__file__).parents[1] / "docs" / "triton_decoupled.md").read_text()
    for name in [n for n in globals() if n.startswith("test_") and n != "test_the_docs_state_each_fact_with_its_test"]:
        assert name in text, name
