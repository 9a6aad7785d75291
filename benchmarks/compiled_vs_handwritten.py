"""What the compiled models cost against hand-written minimal ones, on the bundled server.

    python benchmarks/compiled_vs_handwritten.py [--rounds 8] [--requests 100] [--json OUT.json]

Chains of 1 and 10 identity Python steps (FP32 [64], one row, max_batch_size 8),
each compiled by pipelines and hand-written: the same config.pbtxt files, with the
compiled repository's model.py replaced by the minimal one a person would write
(read the input, answer it; an async BLS that awaits each step in turn). The
ensemble and the async BLS of each are measured over HTTP at concurrency 1,
interleaved: every round runs each model in turn, so drift on a shared machine
hits all of them alike. Per step is the slope between the two chain lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from pipelines import Pipeline, TensorSpec, step
from pipelines.tables import format_table
from pipelines.triton import TritonServer

SPEC = TensorSpec("FP32", [64])
LENGTHS = (1, 10)

# The hand-written step: what a person writes for an identity model.
HAND_STEP = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
            for r in requests
        ]
'''

# The hand-written async BLS: each step awaited in turn, tensors passed by DLPack.
HAND_BLS = '''
import triton_python_backend_utils as pb_utils

MODELS = {models!r}


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "x")
            error = None
            for model in MODELS:
                call = pb_utils.InferenceRequest(
                    model_name=model, requested_output_names=["y"],
                    inputs=[pb_utils.Tensor.from_dlpack("x", tensor.to_dlpack())],
                )
                response = await call.async_exec()
                if response.has_error():
                    error = response.error().message()
                    break
                tensor = pb_utils.get_output_tensor_by_name(response, "y")
            if error is not None:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error)))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("y", tensor.to_dlpack())]))
        return responses
'''


def identity_chain(name: str, length: int) -> Pipeline:
    p = Pipeline(name, inputs={"x": SPEC}, max_batch_size=8)
    ref = p.input("x")
    for i in range(length):
        ident = step(_identity, name=f"id{i}", inputs={"x": SPEC}, outputs={"y": SPEC})
        ref = p.add(ident, x=ref)["y"]
    p.output("y", ref)
    return p


def _identity(x):
    return {"y": x}


def write_repository(root: Path) -> list[str]:
    """Compiled and hand-written chains side by side; the top-level model names, interleaving order."""
    models = []
    for length in LENGTHS:
        compiled, hand = f"compiled{length}", f"hand{length}"
        identity_chain(compiled, length).compile("both").write(root)
        identity_chain(hand, length).compile("both").write(root)
        for i in range(length):
            (root / f"{hand}__id{i}" / "1" / "model.py").write_text(HAND_STEP)
        chain = [f"{hand}__id{i}" for i in range(length)]
        (root / f"{hand}_bls" / "1" / "model.py").write_text(HAND_BLS.format(models=chain))
        models += [f"{compiled}_ensemble", f"{hand}_ensemble", f"{compiled}_bls", f"{hand}_bls"]
    return models


def measure(url: str, models: list[str], rounds: int, requests: int) -> dict[str, list[float]]:
    client = httpclient.InferenceServerClient(url)
    x = np.arange(64, dtype=np.float32)[None]
    given = httpclient.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x, binary_data=True)
    wanted = [httpclient.InferRequestedOutput("y", binary_data=True)]
    for model in models:  # warm-up: first calls load code paths and grow shared memory
        for _ in range(20):
            np.testing.assert_array_equal(client.infer(model, [given], outputs=wanted).as_numpy("y"), x)
    samples: dict[str, list[float]] = {m: [] for m in models}
    for round_ in range(rounds):
        # Every other round in reverse order, so no model always follows the same one.
        for model in models if round_ % 2 == 0 else models[::-1]:
            for _ in range(requests):
                start = time.perf_counter()
                client.infer(model, [given], outputs=wanted)
                samples[model].append(time.perf_counter() - start)
    client.close()
    return samples


def paired_ratios(samples: dict[str, list[float]], requests: int) -> dict[str, float]:
    """Compiled over hand-written per step, round by round (the two ran back to back), then the median.

    Less moved by a machine whose load drifts than the ratio of overall medians.
    """
    out = {}
    for form in ("ensemble", "bls"):
        per_round = []
        rounds = len(samples[f"compiled{LENGTHS[1]}_{form}"]) // requests
        for r in range(rounds):
            window = slice(r * requests, (r + 1) * requests)
            med = {m: statistics.median(v[window]) for m, v in samples.items() if m.endswith(f"_{form}")}
            slope = {k: med[f"{k}{LENGTHS[1]}_{form}"] - med[f"{k}{LENGTHS[0]}_{form}"] for k in ("compiled", "hand")}
            per_round.append(slope["compiled"] / slope["hand"])
        out[form] = statistics.median(per_round)
    return out


def step_model_times(statistics: dict) -> dict[str, float]:
    """Seconds per execution inside the ten step models of each kind, from Triton's own counters.

    Less noisy than the client's clock: it leaves out the network, the front end and the
    scheduler, and keeps what the step's stub does with a request (the adapter's cost).
    """
    out = {}
    for kind in ("compiled", "hand"):
        ns = count = 0
        for model in statistics["model_stats"]:
            if model["name"].startswith(f"{kind}{LENGTHS[1]}__id"):
                stats = model["inference_stats"]
                ns += sum(int(stats[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output"))
                count += int(model["execution_count"])
        out[kind] = ns / count / 1e9 if count else float("nan")
    return out


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median latency per model, per form and kind; per step is the slope from 1 to 10 steps."""
    med = {m: statistics.median(v) for m, v in samples.items()}
    out = {}
    for form in ("ensemble", "bls"):
        row = {}
        for kind in ("compiled", "hand"):
            t1, t10 = med[f"{kind}{LENGTHS[0]}_{form}"], med[f"{kind}{LENGTHS[1]}_{form}"]
            row[f"{kind}_10"] = t10
            row[f"{kind}_per_step"] = (t10 - t1) / (LENGTHS[1] - LENGTHS[0])
        out[form] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100, help="requests per model per round")
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        models = write_repository(root)
        with TritonServer(root) as server:
            samples = measure(server.http_url, models, args.rounds, args.requests)
            with server.client("http") as client:
                inside = step_model_times(client.statistics())
    summary = summarise(samples)
    rows = []
    for form, row in summary.items():
        rows.append([
            f"{form} (10 steps)", f"{row['compiled_10'] * 1e3:.2f} ms", f"{row['hand_10'] * 1e3:.2f} ms",
            f"{row['compiled_10'] / row['hand_10']:.2f}x",
        ])
        rows.append([
            f"{form} per step", f"{row['compiled_per_step'] * 1e6:.0f} us", f"{row['hand_per_step'] * 1e6:.0f} us",
            f"{row['compiled_per_step'] / row['hand_per_step']:.2f}x",
        ])
    print(format_table(["form", "compiled", "hand-written", "ratio"], rows))
    print(f"(median of {args.rounds} x {args.requests} interleaved HTTP requests per model, concurrency 1)")
    paired = paired_ratios(samples, args.requests)
    print("per step, compiled / hand-written, round by round then the median: "
          + ", ".join(f"{form} {ratio:.2f}x" for form, ratio in paired.items()))
    print(
        "inside a step model, per execution (Triton's statistics, input + infer + output, mean over the 10 steps): "
        f"compiled {inside['compiled'] * 1e6:.1f} us, hand-written {inside['hand'] * 1e6:.1f} us"
    )
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "paired": paired, "inside": inside, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
