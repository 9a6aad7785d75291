"""Streaming on the bundled server (issue 61, "Targets"): the textgen example in every form that
can run it, at concurrency 1 and 4, by time to first response (TTFT), time between responses and
responses per second; beside them what the target compares TTFT with (the decoder's own time to
its first yield, in this process, and the round trip of a streamed request to a decoupled
identity model on the same server), what a Python model pays Triton per response (a decoupled
model that sends its responses back to back), and whether every form streams the same text as
the local runtime, prompt by prompt, over gRPC. Last, the time to first response at concurrency 1
side by side (``--side-by-side ROUNDS``): the identity, an identity that streams as many responses
as the pipeline, the pipeline's work written by hand in one decoupled model (``textgen_direct``),
the fused form and the ensemble, a block of requests of each in turn, so that the target is
checked on figures a busy machine slowed alike.

The gated example (a safety check under ``when``, a detokenizer that reads the stream whole) runs
in bls, bls-sync and fused; the ensemble cannot run it, so the ungated variant
(``make_textgen(gate=False)``: the same generation, detokenized token by token) is measured in all
four forms, where the example offers it. A form the compiler does not write yet for a streaming
pipeline is recorded as not measured, with why.

The server runs with one BLAS thread per process (``OPENBLAS_NUM_THREADS=1``, ``OMP_NUM_THREADS=1``;
``--blas-threads inherit`` leaves this shell's): numpy's OpenBLAS keeps a worker thread spinning in
every stub after each call, and on a machine of few cores that spinning holds back the server's
own threads, so responses leave in bursts (docs/benchmarking_streams.md). ``--compare-inherited``
(on by default) measures the ungated forms at concurrency 1 once more on a server that inherits
this shell's environment, to show the difference.

    .venv/bin/python benchmarks/streaming.py [--duration 2] [--turns 2] [--levels 1,4] [--no-local]
        [--no-compare-inherited] [--blas-threads 1|inherit] [--side-by-side 8]
        [--out benchmarks/results/streaming.json]

A quicker run (about 4 minutes): ``--duration 1 --turns 1 --no-local --no-compare-inherited``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter
from typing import Any

import anyio
import numpy as np

from pipelines.bench import BenchSettings, LoadPlan, Measurement, run_benchmark, run_load
from pipelines.bench.measurement import Configuration
from pipelines.bench.results import package_versions
from pipelines.bench.runner import write_bench_repository
from pipelines.bench.server_target import StreamingServerTarget, model_name
from pipelines.bench.stability import StabilityRule
from pipelines.commands.machine import machine_info
from pipelines.compile.configs import config_text
from pipelines.core.tensor import TensorSpec
from pipelines.errors import PipelinesError
from pipelines.examples import textgen
from pipelines.forms import FormLeftOutWarning
from pipelines.percentiles import percentiles
from pipelines.triton import TritonServer

LEVELS = (1, 4)
PROMPTS = 20
IDENTITY = "identity_stream"
BURST = "burst_stream"
BURST_UNASKED = "burst_stream_unasked"  # the same without asking whether the request was cancelled
BURST_RESPONSES = 48  # as many as the decoder's max_new_tokens
DIRECT = "textgen_direct"  # the ungated pipeline's work written by hand in one decoupled model
SIDE_BY_SIDE_BLOCK = 25  # requests of one model in a row in the side-by-side comparison
PAUSE_S = 0.001  # the decoder's first yield after this long asleep: as a request at concurrency 1 finds it
TARGET = 1.3  # TTFT of the ensemble and fused within this factor of first yield + round trip
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

# A decoupled Python model that answers a prompt with itself, once, then the final flag alone:
# the round trip of one streamed response, with nothing computed.
_IDENTITY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text", prompt)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


# The same prompt sent back BURST_RESPONSES times, nothing computed between the responses but the
# question a streaming model of the project asks between two (is the request cancelled?; not asked
# where ASK is False): what a Python model pays Triton for each response it streams.
_BURST = f"""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
            for i in range({BURST_RESPONSES}):
                if ASK and i and sender.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text", prompt)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


# The ungated textgen's work with none of the project's machinery: the prompt's bytes as tokens,
# the example's own Decoder class (its source, copied in), each token's byte sent as it comes,
# asking between two responses whether the request was cancelled, as the project's models do.
# What a form could at best do on this server: its time to first response less the fused form's
# is what the project's model code costs.
_DIRECT = """
from collections.abc import Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

VOCAB = {vocab}
EOS = {eos}

{decoder}

class TritonPythonModel:
    def initialize(self, args):
        self.decoder = Decoder()
        self.decoder.initialize({{"parameters": {{"max_new_tokens": {max_new_tokens}}}}})

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
            tokens = np.frombuffer(bytes(prompt[0]), dtype=np.uint8).astype(np.int32)
            for i, out in enumerate(self.decoder.execute(tokens)):
                if i and sender.is_cancelled():
                    break
                text = np.array([bytes([int(out["token"][0])])], dtype=object)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text", text)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def direct_code() -> str:
    import inspect

    return _DIRECT.format(vocab=textgen.VOCAB, eos=textgen.EOS, decoder=inspect.getsource(textgen.Decoder),
                          max_new_tokens=BURST_RESPONSES)


def write_identity(repo: Path) -> None:
    """The identity model, the ones that answer BURST_RESPONSES times back to back, and the direct model."""
    from tritonclient.grpc import model_config_pb2 as mc

    for name, code in ((IDENTITY, _IDENTITY), (BURST, _BURST.replace("ASK", "True")),
                       (BURST_UNASKED, _BURST.replace("ASK", "False")), (DIRECT, direct_code())):
        config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
        config.input.add(name="prompt", data_type=mc.TYPE_STRING, dims=[1])
        config.output.add(name="text", data_type=mc.TYPE_STRING, dims=[1])
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
        config.model_transaction_policy.decoupled = True
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(config_text(config))
        (repo / name / "1" / "model.py").write_text(code)


def prompts(count: int = PROMPTS) -> list[str]:
    """Prompts of different lengths (the decoder's cost grows with the text), one refused by the gate."""
    words = "streaming pipelines answer many times over one request each token as it comes".split()
    out = [" ".join(words[: 2 + i % len(words)]) + f" #{i}" for i in range(count - 1)]
    return [*out, "tell me a secret"]


def first_yield(samples: int = 50) -> dict[str, float]:
    """The decoder alone, in this process: from calling it on the sample prompt's tokens to its
    first token, and then each next token (the mean over the rest of its stream, per stream);
    ``after_pause_p50_ms``: its first token when each call comes after PAUSE_S asleep, as in a
    server at concurrency 1, where the process waits for each request while others run."""
    decoder = textgen.Decoder()
    decoder.initialize({"parameters": {"max_new_tokens": 48}})
    tokens = textgen.tokenize.impl(textgen.sample_inputs()["prompt"])["tokens"]
    times, paces, paused = [], [], []
    for _ in range(samples):
        time.sleep(PAUSE_S)
        start = perf_counter()
        stream = decoder.execute(tokens)
        next(stream)
        paused.append((perf_counter() - start) * 1e3)
        for _ in stream:
            pass
        start = perf_counter()
        stream = decoder.execute(tokens)
        next(stream)
        first = perf_counter()
        rest = sum(1 for _ in stream)
        times.append((first - start) * 1e3)
        if rest:
            paces.append((perf_counter() - first) * 1e3 / rest)
    p50, p95 = percentiles(times, (50, 95))
    (per_token,) = percentiles(paces, (50,))
    (after_pause,) = percentiles(paused, (50,))
    return {"p50_ms": p50, "p95_ms": p95, "min_ms": min(times), "per_token_p50_ms": per_token,
            "after_pause_p50_ms": after_pause, "pause_s": PAUSE_S, "samples": samples}


def first_yield_with(env: dict[str, str]) -> dict[str, float]:
    """:func:`first_yield` in a process of its own with the server's environment added (its BLAS
    threads): this one's numpy has its threads already."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import streaming; "
            "print(json.dumps(streaming.first_yield()))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _model_load(url: str, stats: Any, model: str, concurrency: int, duration: float) -> Measurement:
    target = StreamingServerTarget(url, stats, model, {"prompt": TensorSpec("BYTES", [1])})
    plan = LoadPlan(concurrency=concurrency, duration=duration, warmup=0.5, rule=StabilityRule(max_trials=6))
    try:
        load = await run_load(target.infer, [textgen.sample_inputs()], plan)
    finally:
        await target.close()
    return Measurement.from_load(Configuration("server", "fused", model), load, batch=1, streaming=True)


def round_trip(server: TritonServer, duration: float, levels: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """The identity model streamed: TTFT is the round trip of one streamed response."""
    out = {}
    for c in levels:
        m = anyio.run(_model_load, server.grpc_url, server.async_client("grpc"), IDENTITY, c, duration)
        out[c] = {"ttft_p50_ms": m.stream.ttft.p50_ms, "ttft_p95_ms": m.stream.ttft.p95_ms,
                  "requests_per_s": m.stream.requests_per_s, "errors": m.errors, "stable": m.stable}
    return out


async def _side_by_side(url: str, models: list[str], rounds: int, block: int) -> dict[str, list[float]]:
    targets = {m: StreamingServerTarget(url, None, m, {"prompt": TensorSpec("BYTES", [1])}) for m in models}
    request = textgen.sample_inputs()
    ttft: dict[str, list[float]] = {m: [] for m in models}
    try:
        for m in models:  # warm-up
            for _ in range(block):
                await targets[m].stream(request)
        for _ in range(rounds):
            for m in models:
                for _ in range(block):
                    streamed = await targets[m].stream(request)
                    if streamed.responses:
                        ttft[m].append((streamed.responses[0] - streamed.sent) * 1e3)
    finally:
        for target in targets.values():
            await target.close()
    return ttft


def side_by_side(server: TritonServer, models: list[str], rounds: int, block: int) -> dict[str, Any]:
    """TTFT at concurrency 1 of ``models`` (the sample prompt), measured in turn: ``block`` requests
    of each, ``rounds`` times over, so that a busy machine slows each alike; pooled percentiles."""
    out: dict[str, Any] = {"rounds": rounds, "block": block, "load_average_before": load_average()}
    ttft = anyio.run(_side_by_side, server.grpc_url, models, rounds, block)
    out["load_average_after"] = load_average()
    out["models"] = {}
    for m, times in ttft.items():
        p50, p95 = percentiles(times, (50, 95))
        per_round = [percentiles(times[i * block:(i + 1) * block], (50,))[0] for i in range(rounds)]
        out["models"][m] = {"ttft_p50_ms": p50, "ttft_p95_ms": p95, "requests": len(times),
                            "round_p50_ms": [round(x, 3) for x in per_round]}
    return out


def per_response_floor(server: TritonServer, duration: float) -> dict[str, Any]:
    """The back-to-back models at concurrency 1: their ITL is what Triton takes per streamed response
    (``unasked``: without the question whether the request was cancelled, between two responses)."""
    out: dict[str, Any] = {"responses": BURST_RESPONSES}
    for key, model in (("", BURST), ("unasked_", BURST_UNASKED)):
        m = anyio.run(_model_load, server.grpc_url, server.async_client("grpc"), model, 1, duration)
        st = m.stream
        out.update({f"{key}itl_p50_ms": st.itl.p50_ms, f"{key}itl_p99_ms": st.itl.p99_ms,
                    f"{key}gaps_p50_ms": st.gaps.p50_ms, f"{key}errors": m.errors})
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def figures(m: Measurement) -> dict[str, Any]:
    st = m.stream
    return {
        "form": m.config.form, "where": m.config.where, "concurrency": m.concurrency,
        "ttft_p50_ms": st.ttft.p50_ms, "ttft_p95_ms": st.ttft.p95_ms, "ttft_p99_ms": st.ttft.p99_ms,
        "itl_p50_ms": st.itl.p50_ms, "itl_p99_ms": st.itl.p99_ms, "gaps_p50_ms": st.gaps.p50_ms,
        "gaps_p99_ms": st.gaps.p99_ms, "responses_per_s": st.responses_per_s,
        "requests_per_s": st.requests_per_s, "stream_p50_ms": m.latency.p50_ms,
        # near 1: the responses came in one burst at the stream's end, not one by one
        "first_response_share_of_stream": st.ttft.p50_ms / m.latency.p50_ms if m.latency.p50_ms else None,
        "errors": m.errors,
        "stable": m.stable,
        "breakdown_us": {t.model: round(t.total_us) for t in m.breakdown},
    }


async def _server_texts(url: str, stats: Any, model: str, requests: list[dict]) -> list[list[bytes]] | str:
    target = StreamingServerTarget(url, stats, model, {"prompt": TensorSpec("BYTES", [1])}, timeout=60)
    try:
        out = []
        for request in requests:
            streamed = await target.stream(request, keep=True)
            out.append([bytes(a["text"].reshape(-1)[0]) for a in streamed.answers])
        return out
    except PipelinesError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        await target.close()


def same_text(server: TritonServer, pipeline: Any, forms: list[str]) -> dict[str, Any]:
    """Each form's streamed responses over gRPC against the local runtime's in the same mode, prompt by prompt."""
    requests = [{"prompt": np.array([p.encode()], dtype=object)} for p in prompts()]
    out = {}
    for form in forms:
        local = [[bytes(r["text"].reshape(-1)[0]) for r in pipeline.run(req, mode=form)] for req in requests]
        served = anyio.run(_server_texts, server.grpc_url, server.async_client("grpc"),
                           model_name(pipeline.name, form), requests)
        if isinstance(served, str):
            out[form] = {"same": False, "error": served}
            continue
        differ = [i for i, (a, b) in enumerate(zip(local, served, strict=True)) if a != b]
        out[form] = {"same": not differ, "prompts": len(requests), "responses": sum(len(r) for r in served),
                     "differing_prompts": differ}
    return out


def servable_forms(pipeline: Any, wanted: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The forms the compiler writes for ``pipeline``, and why each other one is not measured."""
    left: dict[str, str] = {}
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", FormLeftOutWarning)
            repository = pipeline.compile("all")
    except PipelinesError as exc:
        return [], {form: f"{type(exc).__name__}: {exc}" for form in wanted}
    names = set(repository.models)
    for form in wanted:
        if model_name(pipeline.name, form) not in names:
            left[form] = next((str(w.message) for w in said if form in str(w.message)), "not compiled")
    return [f for f in wanted if f not in left], left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement window (default: 2)")
    parser.add_argument("--turns", type=int, default=2,
                        help="measure each level in this many turns, the forms in turn (default: 2; a busy machine "
                             "then slows every form alike)")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels (default: 1,4)")
    parser.add_argument("--local", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the local runtime's modes (default: on)")
    parser.add_argument("--blas-threads", default="1",
                        help="BLAS threads of the server's processes (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS), or "
                             "'inherit' for this shell's (default: 1)")
    parser.add_argument("--compare-inherited", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the ungated forms at concurrency 1 again on a server that inherits this "
                             "shell's environment (default: on)")
    parser.add_argument("--side-by-side", type=int, default=8, metavar="ROUNDS",
                        help="rounds of the time-to-first-response comparison at concurrency 1 (identity, streamed "
                             "identity, direct model, fused, ensemble in turn; 0: none; default: 8)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "streaming.json"))
    args = parser.parse_args(argv)
    levels = tuple(int(c) for c in args.levels.split(","))
    env = {} if args.blas_threads == "inherit" else {k: str(int(args.blas_threads)) for k in ONE_THREAD}
    gated = textgen.make_textgen()
    try:
        ungated = textgen.make_textgen(name="textgen_ungated", gate=False)
    except TypeError:
        ungated = None  # an example without the ungated variant: the ensemble is not measured
    cases = [(gated, ("bls", "bls-sync", "fused"))]
    if ungated is not None:
        cases.append((ungated, ("ensemble", "bls", "bls-sync", "fused")))
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {k: machine_info().get(k) for k in ("cpu", "cpu_count", "usable_cpus")},
        "versions": package_versions(),
        "settings": {"concurrency": list(levels), "duration_s": args.duration, "turns": args.turns,
                     "prompts": PROMPTS, "server_env": env or "inherited",
                     "inherited_blas": {k: os.environ.get(k) for k in ONE_THREAD}},
        "load_average_before": load_average(),  # 1, 5 and 15 minutes: a shared machine is as slow as its neighbours
        "first_yield": first_yield_with(env),
        "notes": [] if ungated is not None else ["textgen has no ungated variant: the ensemble was not measured"],
    }
    print(f"decoder in process: first yield p50 {result['first_yield']['p50_ms']:.2f} ms, "
          f"then {result['first_yield']['per_token_p50_ms']:.2f} ms a token")
    with tempfile.TemporaryDirectory(prefix="pipelines-streaming-") as tmp, ExitStack() as stack:
        out = Path(tmp)
        plan = {}
        for pipeline, wanted in cases:
            forms, left = servable_forms(pipeline, wanted)
            plan[pipeline.name] = (pipeline, forms, left)
            if forms:
                write_bench_repository(pipeline, out, stack)
        repo = out / "model_repository"
        write_identity(repo)
        with TritonServer(repo, exit_timeout=10, env=env) as server:
            result["round_trip"] = round_trip(server, args.duration, levels)
            result["per_response_floor"] = per_response_floor(server, args.duration)
            print(f"identity round trip (streamed, c=1): p50 {result['round_trip'][levels[0]]['ttft_p50_ms']:.2f} ms; "
                  f"a response back to back: {result['per_response_floor']['itl_p50_ms']:.3f} ms")
            result["pipelines"] = {}
            for name, (pipeline, forms, left) in plan.items():
                entry: dict[str, Any] = {"not_measured": left, "measurements": [], "load_average": load_average()}
                result["pipelines"][name] = entry
                if not forms:
                    print(f"{name}: no form measured: {next(iter(left.values()), '')}", file=sys.stderr)
                    continue
                settings = BenchSettings(concurrency=levels, url=server.grpc_url, protocol="grpc", local=args.local,
                                         forms=tuple(forms), duration=args.duration, turns=args.turns)
                bench = run_benchmark(pipeline, settings, out=out / name, progress=False)
                entry["measurements"] = [figures(m) for m in bench.measurements]
                entry["verdict"] = bench.verdict
                entry["same_text_as_local"] = same_text(server, pipeline, forms)
            if args.side_by_side and ungated is not None:
                models = [IDENTITY, BURST, DIRECT] + [model_name(ungated.name, f) for f in ("fused", "ensemble")
                                                      if f in plan[ungated.name][1]]
                result["side_by_side"] = side_by_side(server, models, args.side_by_side, SIDE_BY_SIDE_BLOCK)
        if args.compare_inherited and env and ungated is not None and plan[ungated.name][1]:
            result["inherited_env"] = inherited(repo, ungated, plan[ungated.name][1], args, out)
    result["load_average_after"] = load_average()
    result["target"] = target_check(result)
    result["per_response"] = per_response(result)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    print(json.dumps({"target": result["target"], "per_response": result["per_response"]}, indent=1))
    print(f"wrote {args.out}")
    return 0


def inherited(repo: Path, pipeline: Any, forms: list[str], args: Any, out: Path) -> dict[str, Any]:
    """The forms at concurrency 1 on a server with this shell's environment (its BLAS threads)."""
    with TritonServer(repo, exit_timeout=10) as server:
        settings = BenchSettings(concurrency=(1,), url=server.grpc_url, protocol="grpc", local=False,
                                 forms=tuple(forms), duration=args.duration, turns=args.turns)
        bench = run_benchmark(pipeline, settings, out=out / "inherited", progress=False, echo=False)
        floor = per_response_floor(server, args.duration)
    return {"env": {k: os.environ.get(k) for k in ONE_THREAD}, "load_average": load_average(),
            "first_yield": first_yield_with({}), "measurements": [figures(m) for m in bench.measurements],
            "per_response_floor": floor}


def per_response(result: dict[str, Any]) -> dict[str, Any]:
    """What each form pays per response at concurrency 1 (its ITL, genai-perf's), beside the
    decoder's own time a token and what Triton takes per response of a model that computes nothing."""
    decoder = result["first_yield"]["per_token_p50_ms"]
    floor = (result.get("per_response_floor") or {}).get("itl_p50_ms")
    rows = {}
    for name, entry in result.get("pipelines", {}).items():
        for m in entry["measurements"]:
            if m["concurrency"] == min(result["settings"]["concurrency"]) and m["itl_p50_ms"] is not None:
                rows[f"{name} {m['where']} {m['form']}"] = {
                    "itl_p50_ms": m["itl_p50_ms"], "gaps_p50_ms": m["gaps_p50_ms"],
                    "beyond_the_decoder_ms": m["itl_p50_ms"] - decoder}
    return {"decoder_per_token_ms": decoder, "triton_per_response_ms": floor, "forms": rows}


def target_check(result: dict[str, Any]) -> dict[str, Any]:
    """TTFT p50 at the lowest concurrency of the ensemble and fused forms against first yield + round trip."""
    low = min(result["settings"]["concurrency"])
    bound = result["first_yield"]["p50_ms"] + (result.get("round_trip", {}).get(low, {}).get("ttft_p50_ms") or 0.0)
    checks = {}
    for name, entry in result.get("pipelines", {}).items():
        for m in entry["measurements"]:
            if m["where"] == "server" and m["concurrency"] == low and m["form"] in ("ensemble", "fused"):
                ratio = m["ttft_p50_ms"] / bound if m["ttft_p50_ms"] else None
                checks[f"{name} {m['form']}"] = {"ttft_p50_ms": m["ttft_p50_ms"], "bound_ms": bound,
                                                 "ratio": ratio, "met": ratio is not None and ratio <= TARGET}
    return {"first_yield_plus_round_trip_ms": bound, "factor": TARGET, "checks": checks,
            "side_by_side": side_by_side_check(result)}


def side_by_side_check(result: dict[str, Any]) -> dict[str, Any] | None:
    """The target on the side-by-side figures, with two bounds: as the issue words it (the decoder's first
    yield, called back to back, plus one response's round trip to the identity), and for a stream of the
    same length (its first yield after a pause, as a request at concurrency 1 finds it, plus the first
    response of an identity that streams as many responses as the pipeline). The direct model shows what
    a form could at best do."""
    side = result.get("side_by_side")
    if not side:
        return None
    ttft = {m: v["ttft_p50_ms"] for m, v in side["models"].items()}
    first = result["first_yield"]
    bounds = {"as_written": first["p50_ms"] + ttft[IDENTITY],
              "same_length_stream": first["after_pause_p50_ms"] + ttft[BURST]}
    out: dict[str, Any] = {"bounds_ms": bounds, "factor": TARGET, "ttft_p50_ms": ttft, "checks": {}}
    for m in (DIRECT, *(n for n in ttft if n.endswith(("_fused", "_ensemble")))):
        out["checks"][m] = {kind: {"ratio": ttft[m] / b, "met": ttft[m] / b <= TARGET} for kind, b in bounds.items()}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
