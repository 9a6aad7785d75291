"""Soak of a streaming pipeline on the bundled server (issue 61, "Targets"): 1,000 streams per form
with 10 % cancelled by the client mid-way and 5 % failing mid-way, 8 in flight over gRPC.

The pipeline (``stream_soak_steps.py``) is textgen's shape: tokenize -> a decoder that yields one
token per response -> detokenize. It is compiled to "all" and served once; each form in turn gets:

- a warm-up (the same mix, ``--warmup`` streams), then the server's memory, the baseline: the
  RSS of tritonserver and of its Python stubs, from /proc;
- ``--streams`` streams. Of each 20: two are cancelled by the client after 2 to 7 responses (the
  gRPC call is cancelled, as ``stop_stream(cancel_requests=True)`` does), one fails in the
  decoder after 4 responses, one every 40 in the detokenizer (the decoder yields a token it
  refuses) and the others complete;
- checks: every completed stream is what ``p.stream(inputs, mode=<form>)`` yields, then the final
  flag; every cancelled one read what the local runtime's first responses are, and stopped; every
  failing one got the local runtime's responses before the failure, then its error (the same
  words, naming the node), then, except in the ensemble (a gate's error ends its stream), the final
  flag; the call ends in every case. The decoder writes one line per stream when its generator
  ends (``ended``, ``closed`` from outside, ``failed``): in the fused form a cancelled stream's
  generator is closed (or had ended before the cancel reached it: counted); in the ensemble and
  BLS forms it runs on to its end, as Triton 2.51 cannot pass the cancel on
  (docs/triton_decoupled.md). Every stream's generator must end: none runs on;
- the memory once every generator has ended (within ``--margin-mib`` of the baseline), and one
  stream per text afterwards, each whole and right (later requests are served).

    .venv/bin/python benchmarks/stream_soak.py [--streams 1000] [--forms ensemble,fused] [--out benchmarks/results/stream_soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # stream_soak_steps, beside this file

import stream_soak_steps as steps  # noqa: E402

FORMS = ("ensemble", "bls", "bls-sync", "fused")
TEXTS = [f"{words} #{i}" for i, words in enumerate(
    "streaming pipelines answer many times over one request each token as it comes and goes on".split())]
MARGIN_MIB = 8.0  # the memory after the run may exceed the baseline by this much (allocator, shared memory pool)
READ_TIMEOUT_S = 60.0  # a response, or the call's end, that takes longer is a hang


@dataclass(frozen=True)
class Planned:
    """One stream: its tag (``<form>-<i>:<kind>``), kind (c, x, f, d), text, and for ``x`` the
    responses read before the cancel."""

    tag: str
    kind: str
    text: str
    cancel_after: int = 0

    @property
    def prompt(self) -> dict[str, np.ndarray]:
        return prompt(self.tag, self.text)


def prompt(tag: str, text: str) -> dict[str, np.ndarray]:
    return {"prompt": np.array([f"{tag}|{text}".encode()], dtype=object)}


def plan(form: str, count: int, *, start: int = 0) -> list[Planned]:
    """``count`` streams: of each 20, 2 cancelled, 1 failing (the decoder, or every other time the detokenizer)."""
    out = []
    for i in range(start, start + count):
        kind = "x" if i % 10 == 3 else ("f" if i % 40 == 7 else "d") if i % 20 == 7 else "c"
        out.append(Planned(f"{form}-{i}:{kind}", kind, TEXTS[i % len(TEXTS)], 2 + i % 6 if kind == "x" else 0))
    return out


@dataclass
class Outcome:
    """What the client read of one stream: texts, the error's text, the final flag, anything after."""

    texts: list[bytes] = field(default_factory=list)
    error: str | None = None
    final: bool = False
    cancelled: bool = False
    cancelled_at: float = 0.0  # time.time() of the cancel
    ended: bool = False  # the gRPC call ended (EOF) after the stream, or was cancelled
    after: int = 0  # messages after the final flag, or the error
    hung: str | None = None


# ----------------------------------------------------------------------------- the client


async def one_stream(stub: Any, model: str, planned: Planned, timeout: float = READ_TIMEOUT_S) -> Outcome:
    """Stream ``planned`` over one gRPC call (``ModelStreamInfer``), as the bench's client does;
    cancel the call after ``cancel_after`` responses for ``x``; read the call to its end otherwise."""
    import grpc
    from tritonclient.grpc import InferResult

    from pipelines.bench.server_target import stream_request

    out = Outcome()
    call = stub.ModelStreamInfer(compression=grpc.Compression.NoCompression)
    try:
        await call.write(stream_request(model, planned.prompt, {"prompt": steps.PROMPT}))
        await call.done_writing()  # one request per call: the call ends once it is answered
        while True:
            message = await asyncio.wait_for(call.read(), timeout)
            if message is grpc.aio.EOF:
                out.ended = True
                return out
            response = message.infer_response
            is_final = response.parameters["triton_final_response"].bool_param
            if out.final or (out.error is not None and (message.error_message or response.outputs or not is_final)):
                out.after += 1  # nothing may follow the final flag, nor the error but the final flag alone
                continue
            if message.error_message:
                out.error = message.error_message
                continue
            if response.outputs:
                out.texts.append(bytes(InferResult(response).as_numpy("text").reshape(-1)[0]))
            if is_final:
                out.final = True
            elif planned.kind == "x" and len(out.texts) == planned.cancel_after:
                out.cancelled_at = time.time()
                call.cancel()
                out.cancelled = out.ended = True
                return out
    except asyncio.TimeoutError:
        out.hung = f"nothing for {timeout:g} s after {len(out.texts)} responses (error: {out.error})"
        return out
    finally:
        if not call.done():
            call.cancel()


async def run_streams(url: str, model: str, plans: list[Planned], concurrency: int) -> list[Outcome]:
    """Every stream of ``plans``, ``concurrency`` at a time, on one channel."""
    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2_grpc

    size = grpcclient.MAX_GRPC_MESSAGE_SIZE
    channel = grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", size),
                                                      ("grpc.max_receive_message_length", size)])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    outcomes: list[Outcome] = [Outcome(hung="not sent: too many streams hung before it")] * len(plans)
    todo = iter(range(len(plans)))
    hung = 0

    async def worker():
        nonlocal hung
        for i in todo:
            if hung >= concurrency:  # the server is stuck: the rest would only wait out their timeouts
                return
            outcomes[i] = await one_stream(stub, model, plans[i])
            hung += outcomes[i].hung is not None

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await channel.close()
    return outcomes


# ----------------------------------------------------------------------------- what is right


def expectations(pipeline: Any, form: str) -> dict[tuple[str, str], tuple[list[bytes], str | None]]:
    """What the local runtime streams in ``form``'s mode for each text and kind: texts, error."""
    from pipelines.errors import PipelinesError

    out = {}
    for text in TEXTS:
        for kind in "cfd":
            texts, error = [], None
            try:
                for response in pipeline.stream(prompt(f"local:{kind}", text), mode=form):
                    texts.append(bytes(response["text"].reshape(-1)[0]))
            except PipelinesError as exc:
                error = str(exc)
            out[(text, kind)] = (texts, error)
    return out


def read_marks(marks: Path, prefix: str) -> dict[str, list[tuple[str, int, float]]]:
    """The decoder's lines for the streams whose tag starts with ``prefix``: tag -> [(how, tokens, when)]."""
    out: dict[str, list[tuple[str, int, float]]] = {}
    path = marks / "ends"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        tag, how, sent, at = line.split()
        if tag.startswith(prefix):
            out.setdefault(tag, []).append((how, int(sent), float(at)))
    return out


def wait_for_marks(marks: Path, plans: list[Planned], timeout: float) -> dict[str, list[tuple[str, int, float]]]:
    """The decoder's lines for ``plans``, once each stream has one (or ``timeout`` has passed)."""
    tags = {p.tag for p in plans}
    prefix = os.path.commonprefix(sorted(tags))
    deadline = time.monotonic() + timeout
    while True:
        found = read_marks(marks, prefix)
        if tags <= found.keys() or time.monotonic() > deadline:
            return {t: found[t] for t in tags if t in found}
        time.sleep(0.2)


def judge(form: str, model: str, plans: list[Planned], outcomes: list[Outcome], expected: dict,
          marks: dict) -> dict[str, Any]:
    """Counts of each kind of stream and how it went; ``wrong`` holds the first few that went wrong."""
    c: Counter = Counter()
    wrong: list[str] = []
    past: list[float] = []  # how long after the client's cancel a stopped generator was closed
    total = len(next(iter(expected.values()))[0])  # a completed stream's responses

    def bad(planned, why):
        c["wrong"] += 1
        if len(wrong) < 10:
            wrong.append(f"{planned.tag}: {why}")

    for planned, out in zip(plans, outcomes, strict=True):
        texts, error = expected[(planned.text, "c" if planned.kind == "x" else planned.kind)]
        mark = marks.get(planned.tag, [])
        c[f"sent_{planned.kind}"] += 1
        if out.hung:
            c["hung"] += 1
            bad(planned, f"hung: {out.hung}")
            continue
        if not out.ended:
            bad(planned, "the call did not end")
        if out.after:
            bad(planned, f"{out.after} messages after the stream's end")
        if len(mark) != 1:
            c["generator_not_ended" if not mark else "generator_ended_twice"] += 1
            bad(planned, f"decoder marks {mark}")
        how = mark[0] if len(mark) == 1 else ("", -1, 0.0)
        if planned.kind == "c":
            if out.error is None and out.final and out.texts == texts:
                c["completed_right"] += 1
            else:
                bad(planned, f"completed wrong: {len(out.texts)}/{len(texts)} responses, final {out.final}, error {out.error}")
        elif planned.kind == "x":
            if out.cancelled and out.texts == texts[: planned.cancel_after]:
                c["cancelled_right"] += 1
            else:
                bad(planned, f"cancel: read {len(out.texts)} of {planned.cancel_after}, error {out.error}, final {out.final}")
            after = how[2] - out.cancelled_at  # when the generator ended, from the client's cancel
            if how[0] == "closed" and how[1] < total * steps.LONG:
                c["cancelled_generator_closed"] += 1
                past.append(after)
            elif how[:2] == ("ended", total * steps.LONG):
                # Ended before the cancel was sent (a client that lags behind its stream), or ran on.
                c["cancelled_generator_ended_before_the_cancel" if after <= 0 else "cancelled_generator_ran_to_its_end"] += 1
        else:
            said = out.error
            if form == "ensemble" and said is not None:  # Triton names the ensemble before the gate's words
                said = said.removeprefix(f"in ensemble '{model}', ")
            prefix_ok = out.texts == texts
            if said == error and prefix_ok and (out.final or form == "ensemble"):
                c["failed_right"] += 1
            elif form == "ensemble" and said == error and texts[: len(out.texts)] == out.texts:
                c["failed_error_overtook_responses"] += 1  # a race in the ensemble (docs/triton_decoupled.md)
            else:
                bad(planned, f"failure: {len(out.texts)}/{len(texts)} responses before it, final {out.final}, "
                             f"error {out.error!r}, expected {error!r}")
            c[f"failed_generator_{how[0] or 'unknown'}"] += 1
    figures = dict(sorted(c.items()))
    # Where a cancelled stream's generator must stop: in the fused form (the others cannot pass the
    # cancel on, and it runs on to its end, as documented).
    ended_first = c["cancelled_generator_ended_before_the_cancel"]
    if form == "fused":
        figures["cancel_stops_generator"] = c["cancelled_generator_closed"] + ended_first == c["sent_x"]
    else:
        figures["cancelled_generator_runs_on_as_documented"] = (
            c["cancelled_generator_ran_to_its_end"] + ended_first == c["sent_x"])
    if past:
        past.sort()
        figures["generator_closed_after_cancel_ms"] = {"p50": round(past[len(past) // 2] * 1e3, 1),
                                                        "max": round(past[-1] * 1e3, 1)}
    figures["wrong_examples"] = wrong
    return figures


# ----------------------------------------------------------------------------- memory


def _status(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry.name))
    return out


def _label(pid: int, server: int) -> str:
    """tritonserver, or the model a stub serves (from its command line: the model's model.py)."""
    if pid == server:
        return "tritonserver"
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    model = next((a for a in args if a.endswith("model.py")), None)
    return Path(model).parent.parent.name if model else Path(args[0]).name


def server_memory(pid: int) -> dict[str, Any]:
    """RSS (MiB) of tritonserver and every process under it (its Python stubs), their anonymous
    part, and each process's RSS by what it serves."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    parts = {p: _status(p) for p in pids}
    mib = lambda key: round(sum(s.get(key, 0) for s in parts.values()) / 1024, 1)  # noqa: E731
    each = Counter()
    for p, s in parts.items():
        each[_label(p, pid)] += s.get("VmRSS", 0) / 1024
    return {"rss_mib": mib("VmRSS"), "anon_mib": mib("RssAnon"), "shmem_mib": mib("RssShmem"), "processes": len(pids),
            "by_process_mib": {k: round(v, 1) for k, v in sorted(each.items())}}


class PeakMemory:
    """The highest RSS sum seen while it runs, sampled every ``every`` seconds on a thread."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every, self.peak = pid, every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, server_memory(self.pid)["rss_mib"])

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- one form


def soak_form(server: Any, pipeline: Any, form: str, marks: Path, *, streams: int, concurrency: int = 8,
              warmup: int = 100, settle_s: float = 60.0) -> dict[str, Any]:
    """The soak of one form on a running ``server``; the figures, with ``ok``."""
    from pipelines.bench.server_target import model_name

    model = model_name(pipeline.name, form)
    expected = expectations(pipeline, form)
    warm = plan(f"{form}w", warmup)
    asyncio.run(run_streams(server.grpc_url, model, warm, concurrency))
    wait_for_marks(marks, warm, settle_s)
    baseline = server_memory(server.pid)
    plans = plan(form, streams)
    start = time.perf_counter()
    with PeakMemory(server.pid) as peak:
        outcomes = asyncio.run(run_streams(server.grpc_url, model, plans, concurrency))
        seconds = time.perf_counter() - start
        found = wait_for_marks(marks, plans, settle_s)
    settled_s = time.perf_counter() - start - seconds
    time.sleep(1.0)  # the last responses' tensors are released
    after = server_memory(server.pid)
    figures = judge(form, model, plans, outcomes, expected, found)
    later = plan(f"{form}z", len(TEXTS))  # one of each text; some cancel or fail, as planned
    later_out = asyncio.run(run_streams(server.grpc_url, model, later, 1))
    later_ok = judge(form, model, later, later_out, expected, wait_for_marks(marks, later, settle_s)).get("wrong", 0)
    growth = after["rss_mib"] - baseline["rss_mib"]
    figures.update({
        "form": form, "model": model, "streams": streams, "concurrency": concurrency, "warmup_streams": warmup,
        "seconds": round(seconds, 2), "streams_per_s": round(streams / seconds, 1),
        "generators_ended_within_s": round(settled_s, 2),
        "memory_baseline": baseline, "memory_peak_rss_mib": peak.peak, "memory_after": after,
        "memory_growth_mib": round(growth, 1), "memory_margin_mib": MARGIN_MIB,
        "later_streams": len(later), "later_streams_wrong": later_ok,
        "server_alive": server.running,
    })
    figures["ok"] = bool(not figures.get("wrong") and not later_ok and server.running and growth <= MARGIN_MIB
                         and figures.get("cancel_stops_generator", True))
    return figures


# ----------------------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams per form (default: 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="streams per form before the baseline (default: 100)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--tokens", type=int, default=24, help="responses of a completed stream (default: 24)")
    parser.add_argument("--token-ms", type=float, default=1.0,
                        help="the decoder sleeps this long per token, as a real one computes (default: 1)")
    parser.add_argument("--keep-log", help="copy the server's log here at the end")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "stream_soak.json"))
    args = parser.parse_args(argv)

    from pipelines.bench.results import package_versions
    from pipelines.commands.machine import machine_info
    from pipelines.compile.repository import write_models
    from pipelines.triton import TritonServer

    forms = [f for f in args.forms.split(",") if f]
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {k: machine_info().get(k) for k in ("cpu", "cpu_count", "usable_cpus")},
        "versions": package_versions(),
        "settings": {"streams_per_form": args.streams, "warmup_streams": args.warmup, "concurrency": args.concurrency,
                     "responses_per_completed_stream": args.tokens,
                     "decoder_sleep_per_token_ms": args.token_ms, "cancelled_share": 0.10, "failing_share": 0.05,
                     "fail_after_responses": steps.FAIL_AT, "cancel_after_responses": "2 to 7",
                     "memory_margin_mib": MARGIN_MIB},
        "load_average_before": round(os.getloadavg()[0], 2),
        "forms": {},
    }
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipelines-stream-soak-") as tmp:
        marks = Path(tmp) / "marks"
        marks.mkdir()
        pipeline = steps.make_soak(str(marks), max_new_tokens=args.tokens, token_ms=args.token_ms)
        repo = write_models(pipeline.compile("all"), Path(tmp) / "repo", overwrite_hint=None)
        with TritonServer(repo, exit_timeout=10) as server:
            result["memory_at_start"] = server_memory(server.pid)
            for form in forms:
                figures = soak_form(server, pipeline, form, marks, streams=args.streams, concurrency=args.concurrency,
                                    warmup=args.warmup)
                result["forms"][form] = figures
                print(summary(figures), flush=True)
            result["memory_at_end"] = server_memory(server.pid)
            result["server_alive_at_end"] = server.running
            result["stub_restarts"] = [f"{model} (reloaded in {s:.1f} s)" for model, s in server.stub_restarts]
            if args.keep_log:
                shutil.copy(server.log_path, args.keep_log)
    result["seconds"] = round(time.perf_counter() - began, 1)
    result["load_average_after"] = round(os.getloadavg()[0], 2)
    result["ok"] = (all(f["ok"] for f in result["forms"].values()) and result["server_alive_at_end"]
                    and not result["stub_restarts"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{'all right' if result['ok'] else 'NOT all right'} in {result['seconds']} s; wrote {args.out}")
    return 0 if result["ok"] else 1


def summary(f: dict[str, Any]) -> str:
    return (f"{f['form']:9} {f['streams']} streams in {f['seconds']} s: completed {f.get('completed_right', 0)}/"
            f"{f.get('sent_c', 0)}, cancelled {f.get('cancelled_right', 0)}/{f.get('sent_x', 0)} (generator closed "
            f"{f.get('cancelled_generator_closed', 0)}, ran to its end {f.get('cancelled_generator_ran_to_its_end', 0)}, "
            f"ended before the cancel {f.get('cancelled_generator_ended_before_the_cancel', 0)}), "
            f"failed {f.get('failed_right', 0)}/{f.get('sent_f', 0) + f.get('sent_d', 0)}, wrong {f.get('wrong', 0)}, "
            f"hung {f.get('hung', 0)}; RSS {f['memory_baseline']['rss_mib']} -> {f['memory_after']['rss_mib']} MiB "
            f"(peak {f['memory_peak_rss_mib']}); later streams wrong {f['later_streams_wrong']}"
            + "".join(f"\n    {w}" for w in f["wrong_examples"]))


if __name__ == "__main__":
    raise SystemExit(main())
