"""What the ensemble's workarounds cost on the happy path, at concurrency 1 on the bundled server.

    python benchmarks/ensemble_constructions.py [--requests 500] [--elements 4,262144] [--protocol grpc]

Two pipelines, each served twice from one repository over the same step models:

- ``copy``: a chain ``x -> inc -> scale`` exposing both ``a`` (inc's output, also read by
  scale) and ``b``. Compiled, inc returns ``a`` twice (the output copy that keeps every
  subset of outputs answering); the plain config maps inc's output straight to ``a`` and to
  scale, as one would by hand, which deadlocks on a subset but answers when all are asked.
- ``join_gate``: a diamond ``x -> inc, x -> scale -> join``, every output from the join.
  Compiled, the branches also return their ``__err__``, which the join reads: it answers
  for them; the plain config has none of it.
- ``gate``: the same diamond exposing ``inc``'s output too, so no one step produces every
  output: each step returns its ``__err__`` and a gate model answers last.

Requests alternate between the two configs of a pair, asking for all outputs, so drift on a
busy machine hits both alike. Prints median and p90 latency in ms and the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile import compile_pipeline
from pipelines.compile.bound_plan import bind_plan
from pipelines.compile.configs import add_io
from pipelines.compile.repository import CompiledModel, ModelRepository
from pipelines.triton import TritonServer

V = TensorSpec("FP32", [-1])


@step(inputs={"x": V}, outputs={"y": V})
def inc(x):
    return {"y": x + 1}


@step(inputs={"x": V}, outputs={"y": V})
def scale(x):
    return {"y": x * 3}


@step(inputs={"a": V, "b": V}, outputs={"y": V})
def join(a, b):
    return {"y": a + b}


def copy_pipeline() -> Pipeline:
    p = Pipeline("copy", inputs={"x": V}, max_batch_size=8)
    a = p.add(inc, x=p.input("x"))
    b = p.add(scale, x=a["y"])
    p.output("a", a["y"])
    p.output("b", b["y"])
    return p


def diamond_pipeline(name: str, *, expose_branch: bool) -> Pipeline:
    p = Pipeline(name, inputs={"x": V}, max_batch_size=8)
    a = p.add(inc, x=p.input("x"))
    b = p.add(scale, x=p.input("x"))
    p.output("y", p.add(join, a=a["y"], b=b["y"])["y"])
    if expose_branch:
        p.output("a", a["y"])
    return p


def plain_ensemble(p: Pipeline, name: str) -> CompiledModel:
    """The ensemble as one writes it by hand: no output copy, no failure gate."""
    plan = bind_plan(p)
    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=p.max_batch_size)
    add_io(config, p.inputs, p.output_specs)
    for node in plan.nodes:
        s = config.ensemble_scheduling.step.add(model_name=node.model, model_version=-1)
        for key, value in node.inputs.items():
            s.input_map[key] = value
        for key, value in node.outputs.items():
            s.output_map[key] = value
    return CompiledModel(name, config, {})


def measure(client, models: list[str], x: np.ndarray, requests: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in models}
    for m in models:  # warm up
        for _ in range(20):
            client.infer(m, {"x": x})
    for _ in range(requests):
        for m in models:
            started = time.perf_counter()
            client.infer(m, {"x": x})
            times[m].append((time.perf_counter() - started) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--elements", default="4,262144", help="FP32 elements per row, comma-separated")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="grpc")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    models: dict[str, CompiledModel] = {}
    pipelines = (
        copy_pipeline(),
        diamond_pipeline("join_gate", expose_branch=False),
        diamond_pipeline("gate", expose_branch=True),
    )
    for p in pipelines:
        models.update(compile_pipeline(p, "ensemble").models)
        plain = plain_ensemble(p, f"{p.name}_plain")
        models[plain.name] = plain
    repo = ModelRepository(models, top_level=tuple(n for p in pipelines for n in (p.name, f"{p.name}_plain")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = repo.write(Path(tmp) / "repo")
        with TritonServer(root, exit_timeout=1) as server, server.client(args.protocol, timeout=60) as client:
            for elements in (int(e) for e in args.elements.split(",")):
                x = np.random.default_rng(0).standard_normal((1, elements)).astype(np.float32)
                for construction in (p.name for p in pipelines):
                    times = measure(client, [f"{construction}_plain", construction], x, args.requests)
                    plain, built = times[f"{construction}_plain"], times[construction]
                    rows.append({
                        "construction": construction, "elements": elements,
                        "plain_median_ms": statistics.median(plain), "median_ms": statistics.median(built),
                        "plain_p90_ms": float(np.percentile(plain, 90)), "p90_ms": float(np.percentile(built, 90)),
                    })
    print(f"{args.protocol}, concurrency 1, {args.requests} requests each, batch 1")
    print(f"{'construction':<13}{'elements':>9}{'plain p50':>11}{'with p50':>10}{'+ms':>8}{'plain p90':>11}{'with p90':>10}")
    for r in rows:
        print(f"{r['construction']:<13}{r['elements']:>9}{r['plain_median_ms']:>11.3f}{r['median_ms']:>10.3f}"
              f"{r['median_ms'] - r['plain_median_ms']:>8.3f}{r['plain_p90_ms']:>11.3f}{r['p90_ms']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
