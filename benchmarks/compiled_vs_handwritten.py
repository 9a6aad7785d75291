"""What the compiled models cost against hand-written minimal ones, on the bundled server.

    python benchmarks/compiled_vs_handwritten.py [--rounds 8] [--requests 100] [--json OUT.json]

Chains of 1 and 10 identity Python steps (FP32 [64], one row, max_batch_size 8),
each compiled by pipelines and hand-written: the same config.pbtxt files, with the
compiled repository's model.py replaced by the minimal one a person would write
(read the input, answer it; an async BLS that awaits each step in turn). Two chains:

- ``distinct``: ten step objects, ten models, compiled and hand-written alike;
- ``reused``: one step object at ten nodes, as hand-written ensembles reuse one model.
  Hand-written, it is that: one model that the ensemble names ten times (and the BLS
  calls ten times). Compiled by default, each node gets a model of its own, which names
  its node when it fails; compiled with ``share_model=True`` (``shared``), the ten nodes
  share one model, which learns its node from the name its input arrives under. Neither
  ensemble is gated (a chain: no step runs beside a failing one). ``gated`` is the shared
  chain's ensemble gated anyway, as a shared model's chain was before node aliases
  (failure tensors through every step, a gate model at the end): what the gate costs.

The ensemble and the async BLS of each are measured over HTTP at concurrency 1,
interleaved: every round runs each model in turn, so drift on a shared machine
hits all of them alike. Per step is the slope between the two chain lengths.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile import ModelRepository
from pipelines.compile.bound_plan import bind_plan
from pipelines.compile.configs import config_text, parse_config
from pipelines.compile.ensemble import compile_ensemble, layout_ensemble
from pipelines.compile.step_models import compile_step_model
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


#: The chains measured, by the prefix of their pipelines' names: (chain, how it is built, forms).
KINDS = {
    "compiled": ("distinct", "compiled", ("ensemble", "bls")),
    "hand": ("distinct", "hand-written", ("ensemble", "bls")),
    "reused": ("reused", "compiled", ("ensemble", "bls")),
    "shared": ("reused", "compiled, share_model=True", ("ensemble", "bls")),
    "gated": ("reused", "shared, gated anyway", ("ensemble",)),
    "reusedhand": ("reused", "hand-written, one model", ("ensemble", "bls")),
}
#: (compiled, hand-written) pairs whose ratio is reported. The compiled reused chain has a model
#: per node, as the distinct chain's hand-written one does: that is its hand-written twin too.
PAIRS = (("compiled", "hand"), ("reused", "hand"), ("reused", "reusedhand"), ("shared", "reusedhand"),
         ("gated", "reusedhand"))


def identity_chain(name: str, length: int) -> Pipeline:
    """Ten step objects, ``id0``..``id9``: a model each."""
    p = Pipeline(name, inputs={"x": SPEC}, max_batch_size=8)
    ref = p.input("x")
    for i in range(length):
        ident = step(_identity, name=f"id{i}", inputs={"x": SPEC}, outputs={"y": SPEC})
        ref = p.add(ident, x=ref)["y"]
    p.output("y", ref)
    return p


def reused_chain(name: str, length: int, *, share_model: bool | None = None) -> Pipeline:
    """One step object ``id`` at the nodes ``id0``..``id9``."""
    ident = step(_identity, name="id", inputs={"x": SPEC}, outputs={"y": SPEC}, share_model=share_model)
    p = Pipeline(name, inputs={"x": SPEC}, max_batch_size=8)
    ref = p.input("x")
    for i in range(length):
        ref = p.add(ident, name=f"id{i}", x=ref)["y"]
    p.output("y", ref)
    return p


def _identity(x):
    return {"y": x}


def _one_hand_model(root: Path, name: str, length: int) -> None:
    """``name``'s compiled models made what a person writes: one step model, ``<name>__id``, that
    the ensemble names ``length`` times and the BLS calls ``length`` times."""
    model = f"{name}__id"
    ensemble = parse_config((root / f"{name}_ensemble" / "config.pbtxt").read_text())
    nodes = [s.model_name for s in ensemble.ensemble_scheduling.step]
    step_config = parse_config((root / nodes[0] / "config.pbtxt").read_text())
    for node in set(nodes) - {model}:
        shutil.rmtree(root / node)
    step_config.name = model
    (root / model / "1").mkdir(parents=True, exist_ok=True)
    (root / model / "config.pbtxt").write_text(config_text(step_config))
    (root / model / "1" / "model.py").write_text(HAND_STEP)
    for s in ensemble.ensemble_scheduling.step:
        s.model_name = model
    (root / f"{name}_ensemble" / "config.pbtxt").write_text(config_text(ensemble))
    (root / f"{name}_bls" / "1" / "model.py").write_text(HAND_BLS.format(models=[model] * length))


def write_gated(root: Path, name: str, length: int) -> None:
    """The shared chain's ensemble (``<name>_ensemble``) gated anyway, with its step model and gate."""
    plan = bind_plan(reused_chain(name, length, share_model=True))
    layout = layout_ensemble(plan, gated=True)
    models = {m.name: compile_step_model(plan, m, layout.extras.get(m.name)) for m in plan.models}
    models.update({m.name: m for m in compile_ensemble(plan, f"{name}_ensemble", layout)})
    ModelRepository(models, top_level=(f"{name}_ensemble",)).write(root)


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
        reused, shared, reused_hand = f"reused{length}", f"shared{length}", f"reusedhand{length}"
        reused_chain(reused, length).compile("both").write(root)
        reused_chain(shared, length, share_model=True).compile("both").write(root)
        reused_chain(reused_hand, length).compile("both").write(root)
        _one_hand_model(root, reused_hand, length)
        write_gated(root, f"gated{length}", length)
        for kind, (_, _, forms) in KINDS.items():
            models += [f"{kind}{length}_{form}" for form in forms]
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


def paired_ratios(samples: dict[str, list[float]], requests: int) -> dict[str, dict[str, float]]:
    """Compiled over hand-written per step and for the whole 10-step chain, round by round
    (the two ran back to back), then the median; by pair (``reused/reusedhand``), then form.

    Less moved by a machine whose load drifts than the ratio of overall medians.
    """
    out: dict[str, dict[str, float]] = {}
    for compiled, hand in PAIRS:
        for form in KINDS[compiled][2]:
            per_step, whole = [], []
            rounds = len(samples[f"{compiled}{LENGTHS[1]}_{form}"]) // requests
            for r in range(rounds):
                window = slice(r * requests, (r + 1) * requests)
                med = {m: statistics.median(v[window]) for m, v in samples.items() if m.endswith(f"_{form}")}
                slope = {k: med[f"{k}{LENGTHS[1]}_{form}"] - med[f"{k}{LENGTHS[0]}_{form}"] for k in (compiled, hand)}
                per_step.append(slope[compiled] / slope[hand])
                whole.append(med[f"{compiled}{LENGTHS[1]}_{form}"] / med[f"{hand}{LENGTHS[1]}_{form}"])
            out.setdefault(f"{compiled}/{hand}", {})[form] = statistics.median(per_step)
            out[f"{compiled}/{hand}"][f"{form}_10"] = statistics.median(whole)
    return out


def step_model_times(statistics: dict) -> dict[str, float]:
    """Seconds per execution inside the step models of each kind's 10-step chain, from Triton's
    own counters.

    Less noisy than the client's clock: it leaves out the network, the front end and the
    scheduler, and keeps what the step's stub does with a request (the adapter's cost).
    """
    out = {}
    for kind in KINDS:
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
        for kind in (k for k, (_, _, forms) in KINDS.items() if form in forms):
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
    paired = paired_ratios(samples, args.requests)
    rows = []
    for compiled, hand in PAIRS:
        chain, how, forms = KINDS[compiled]
        for form in forms:
            row, ratios = summary[form], paired[f"{compiled}/{hand}"]
            rows.append([
                f"{chain}: {how}", f"{KINDS[hand][1]}, {KINDS[hand][0]}", form,
                f"{row[f'{compiled}_10'] * 1e3:.2f} ms", f"{row[f'{hand}_10'] * 1e3:.2f} ms",
                f"{row[f'{compiled}_10'] / row[f'{hand}_10']:.2f}x ({ratios[f'{form}_10']:.2f}x)",
                f"{row[f'{compiled}_per_step'] * 1e6:.0f} us", f"{row[f'{hand}_per_step'] * 1e6:.0f} us",
                f"{row[f'{compiled}_per_step'] / row[f'{hand}_per_step']:.2f}x ({ratios[form]:.2f}x)",
            ])
    print(format_table(["compiled", "against", "form", "10 steps", "hand-written", "ratio", "per step",
                        "hand-written", "ratio"], rows))
    print(f"(median of {args.rounds} x {args.requests} interleaved HTTP requests per model, concurrency 1; "
          "in brackets, the ratio taken round by round, then the median)")
    print("hand-written, distinct: the distinct chain's configs with minimal model.py files (ten models); "
          "hand-written, one model, reused: one minimal model that the ensemble names ten times")
    print(
        "inside a step model, per execution (Triton's statistics, input + infer + output, mean over the 10 steps): "
        + ", ".join(f"{kind} {inside[kind] * 1e6:.1f} us" for kind in KINDS)
    )
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "paired": paired, "inside": inside, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
