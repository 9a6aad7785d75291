"""The streaming part of ``make demo``: the textgen example on the bundled Triton server.

One prompt streams through every form of ``textgen_ungated`` (``make_textgen(gate=False)``: no
safety check, so the ensemble can run it too), printed token by token as the responses arrive,
each form's text checked against the local runtime's (``p.stream(..., mode=form)``). The gated
``textgen`` (``pipelines.examples.textgen:pipeline``, whose ``when`` block an ensemble cannot
run) refuses a prompt that says "forbidden", in its fused form. Then the benchmark measures the
four forms, locally and on the server, and prints the table ``pipelines bench --server`` prints.

``pipelines bench pipelines.examples.demo_streams:ungated --server`` measures the same pipeline on
the same prompts (:func:`sample_inputs`) with the benchmark's full windows.
"""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np

from ..bench import BenchmarkResult, BenchSettings, render, run_benchmark
from ..compile import ModelRepository
from ..errors import PipelinesError
from ..forms import FORMS
from ..pipeline import Pipeline
from . import textgen

__all__ = [
    "PROMPT",
    "PROMPTS",
    "REFUSED_PROMPT",
    "FormStream",
    "bench_forms",
    "bench_table",
    "compile_streams",
    "gated",
    "refuse_on_server",
    "run_streaming_part",
    "sample_inputs",
    "stream_every_form",
    "stream_on_server",
    "ungated",
]

#: The prompt streamed through every form.
PROMPT = "Streaming pipelines answer"
#: The prompts the benchmark sends, round-robin: texts of different lengths, as users send.
PROMPTS = (
    PROMPT,
    "Tell me about Triton",
    "One declaration, four forms",
    "A longer prompt, so that the decoder attends over more tokens for each one it generates",
)
#: A prompt the gated pipeline's safety check refuses: it answers once, and generates nothing.
REFUSED_PROMPT = "Tell me the forbidden word"

#: All four forms (the ensemble too): no `when` block, no step that reads the stream whole.
ungated = textgen.make_textgen(name="textgen_ungated", gate=False)
#: The example's own pipeline, with its safety check: BLS, bls-sync and fused only.
gated = textgen.pipeline
#: The form the gated pipeline is served in here (one Python model, so one more stub only).
GATED_FORM = "fused"


def sample_inputs(batch: int = 1) -> list[dict[str, np.ndarray]]:
    """The benchmark's requests (``pipelines bench`` calls this): one per prompt of :data:`PROMPTS`."""
    return [textgen.sample_inputs(batch, prompt=p) for p in PROMPTS]


def compile_streams() -> ModelRepository:
    """``textgen_ungated`` in every form side by side, and the gated ``textgen`` as one fused model
    (named ``textgen``), to merge into the demo's repository."""
    return ungated.compile("all").merge(gated.compile(GATED_FORM))


@dataclass(frozen=True)
class FormStream:
    """One prompt streamed by one form: the server's text and the local runtime's, the time to
    the first response and to the end (ms, as the client saw them), and the responses counted."""

    form: str
    model: str
    text: str
    local_text: str
    first_ms: float | None
    total_ms: float
    responses: int

    @property
    def agrees(self) -> bool:
        return self.text == self.local_text


def _text(responses: Sequence[Any]) -> str:
    return b"".join(bytes(r["text"].reshape(-1)[0]) for r in responses).decode("utf-8", errors="replace")


def stream_on_server(grpc_url: str, model: str, prompt: str, *, on_response: Any = None,
                     timeout: float = 60.0) -> tuple[list[dict[str, np.ndarray]], float | None, float]:
    """Stream ``prompt`` to ``model`` with tritonclient's gRPC stream, as a client of a decoupled
    model does; call ``on_response(outputs)`` on each response as it arrives. Returns the
    responses, and the seconds to the first one (None if none came) and to the final flag."""
    import tritonclient.grpc as grpcclient

    arrived: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: arrived.put((result, error, time.perf_counter())))
    try:
        tensor = grpcclient.InferInput("prompt", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        sent = time.perf_counter()
        # The empty final response tells the client the stream has ended, whichever form sent it.
        client.async_stream_infer(model, [tensor], enable_empty_final_response=True)
        responses: list[dict[str, np.ndarray]] = []
        first = None
        while True:
            try:
                result, error, at = arrived.get(timeout=timeout)
            except queue.Empty:
                raise PipelinesError(f"model {model!r} sent nothing for {timeout:g} s (gRPC {grpc_url})") from None
            if error is not None:
                raise PipelinesError(f"model {model!r} answered an error after {len(responses)} responses: {error}")
            response = result.get_response()
            if response.outputs:
                outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
                responses.append(outputs)
                first = at - sent if first is None else first
                if on_response is not None:
                    on_response(outputs)
            if response.parameters["triton_final_response"].bool_param:
                return responses, first, at - sent
    finally:
        client.stop_stream()
        client.close()


def _stream_form(grpc_url: str, pipeline: Pipeline, form: str, model: str, prompt: str, out: TextIO | None,
                 *, side_by_side: bool = True) -> FormStream:
    local_text = _text(list(pipeline.stream(textgen.sample_inputs(prompt=prompt), mode=form)))
    # One stream first, unprinted: a model's first request pays for its first use (imports, caches),
    # which is not what a client of a running server waits for.
    stream_on_server(grpc_url, model, PROMPTS[-1])
    if out is not None:
        out.write(f"  {model:26s} ")
        out.flush()

    def show(outputs: dict[str, np.ndarray]) -> None:
        if out is not None:
            out.write(_text([outputs]))
            out.flush()  # each token as it arrives

    responses, first, total = stream_on_server(grpc_url, model, prompt, on_response=show)
    stream = FormStream(form, model, _text(responses), local_text, None if first is None else first * 1e3,
                        total * 1e3, len(responses))
    if out is not None:
        first_ms = "-" if stream.first_ms is None else f"{stream.first_ms:.1f} ms"
        same = "the same text as" if stream.agrees else f"DIFFERS FROM {stream.local_text!r}, the text of"
        count = f"{stream.responses} response" + ("s" if stream.responses != 1 else "")
        out.write(f"\n  {'':26s} first response {first_ms}, {count} in {stream.total_ms:.1f} ms; "
                  f"{same} the local runtime (mode {form!r})\n")
        out.flush()
    return stream


def stream_every_form(grpc_url: str, prompt: str = PROMPT, *, pipeline: Pipeline = ungated,
                      forms: Sequence[str] = tuple(FORMS), out: TextIO | None = sys.stdout) -> list[FormStream]:
    """Stream ``prompt`` through each form of ``pipeline`` (compiled ``"all"``) on the server at
    ``grpc_url``, writing each token to ``out`` as it arrives; each form's text beside the local runtime's."""
    return [_stream_form(grpc_url, pipeline, form, FORMS[form].model_name(pipeline.name, side_by_side=True),
                         prompt, out) for form in forms]


def refuse_on_server(grpc_url: str, prompt: str = REFUSED_PROMPT, *, out: TextIO | None = sys.stdout) -> FormStream:
    """The gated pipeline (compiled to its fused form alone, a model named after it) on ``prompt``."""
    return _stream_form(grpc_url, gated, GATED_FORM, gated.name, prompt, out)


def bench_forms(grpc_url: str, *, prompts: Sequence[str] = PROMPTS, concurrency: Sequence[int] = (1, 4),
                duration: float = 0.5, local: bool = True, progress: bool = False) -> BenchmarkResult:
    """A short benchmark of ``textgen_ungated`` in its four forms, locally and on the server at
    ``grpc_url`` (where :func:`compile_streams`'s models are loaded): ``pipelines bench --server``'s
    own run, with windows of ``duration`` seconds, a short warm-up and at most four windows."""
    settings = BenchSettings(url=grpc_url, protocol="grpc", local=local, concurrency=tuple(concurrency),
                             duration=duration, warmup=duration / 2, max_trials=4)
    return run_benchmark(ungated, settings, inputs=[textgen.sample_inputs(prompt=p) for p in prompts],
                         out=None, progress=progress, echo=False)


def bench_table(result: BenchmarkResult) -> str:
    """The report ``pipelines bench`` prints (its own :func:`~pipelines.bench.render`): the heading, the
    streaming table and the verdict, without the per-model tables that a short demo run does not need."""
    short = replace(result, comparisons=(),
                    measurements=tuple(replace(m, breakdown=(), local_report=None) for m in result.measurements))
    return render(short, files=False).strip("\n")


def run_streaming_part(grpc_url: str, *, out: TextIO = sys.stdout, bench: bool = True,
                       concurrency: Sequence[int] = (1, 4), duration: float = 0.5) -> bool:
    """The demo's streaming part, on a server serving :func:`compile_streams`'s models: every form
    streams :data:`PROMPT`, the gated pipeline refuses :data:`REFUSED_PROMPT`, then (``bench``) the
    benchmark's report. True if every form's text equals the local runtime's."""
    out.write(f"\n== streaming: {ungated.name} (tokenize -> decode, a generator that yields one token a response "
              "-> detokenize_token),\n   one prompt through every form on the server, each token printed as it "
              f"arrives (gRPC stream)\n  prompt: {PROMPT!r}\n")
    streams = stream_every_form(grpc_url, PROMPT, out=out)
    out.write(f"\n== the gated textgen (a safety check beside the tokenizer; `when` it says no, nothing is "
              f"generated),\n   in its {GATED_FORM} form (an ensemble cannot run a `when` block)\n"
              f"  prompt: {REFUSED_PROMPT!r}\n")
    refused = refuse_on_server(grpc_url, REFUSED_PROMPT, out=out)
    if bench:
        # Eight configurations (four forms, local and server) a level: a warm-up and three to four windows each.
        low, high = (8 * len(concurrency) * duration * (0.5 + n) for n in (3, 4))
        out.write(f"\n== the benchmark ({', '.join(str(c) for c in concurrency)} requests in flight, "
                  f"{len(PROMPTS)} prompts in turn, windows of {duration:g} s: about {low:.0f}-{high:.0f} s) ...\n")
        out.flush()
        started = time.perf_counter()
        result = bench_forms(grpc_url, concurrency=concurrency, duration=duration,
                             progress=bool(getattr(sys.stderr, "isatty", lambda: False)()))
        out.write(f"  measured in {time.perf_counter() - started:.0f} s\n\n")
        out.write("".join(f"  {line}\n" if line else "\n" for line in bench_table(result).splitlines()))
        out.write("\nFor figures you would publish (the same prompts, longer windows): "
                  "pipelines bench pipelines.examples.demo_streams:ungated --server\n")
    out.flush()
    return all(s.agrees for s in streams) and refused.agrees
