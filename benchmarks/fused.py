"""The fused form against the ensemble and BLS, side by side in one run on the bundled server.

One repository (every pipeline compiled with ``"all"``), one server, three measurements:

1. **big**: four Python steps with 4 MiB intermediates (small request and answer);
   target: fused >= 1.5x the ensemble's throughput at concurrency 1 and 4;
2. **yolov5**: the example pipeline at concurrency 1, 4 and 16 (tables, verdict and
   plots of ``pipelines bench`` in ``OUT/yolov5``);
3. **diamond**: two 50 ms branches and a join; target: fused p50 latency <= 1.15 x 50 ms.

    .venv/bin/python benchmarks/fused.py --out bench-fused          # about 3 minutes
    .venv/bin/python benchmarks/fused.py --duration 0.5 --quick     # a smoke run

Figures on a machine busy with other work are noisy; the script prints the load
average before and after so a reader can judge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.bench import BenchSettings, run_benchmark
from pipelines.examples import yolov5
from pipelines.examples.basic import make_diamond
from pipelines.triton import TritonServer

N = 1 << 20  # FP32 elements: 4 MiB a row
SEED = TensorSpec("FP32", [16])
BIG = TensorSpec("FP32", [N])
FORMS = ("ensemble", "bls", "fused")
DIAMOND_MS = 50.0


@step(inputs={"seed": SEED}, outputs={"x": BIG})
def expand(seed):
    return {"x": np.tile(seed, (1, N // 16))}


@step(inputs={"x": BIG}, outputs={"y": BIG})
def scale(x):
    return {"y": x * np.float32(2)}


@step(inputs={"x": BIG}, outputs={"y": BIG})
def shift(x):
    return {"y": x - np.float32(1)}


@step(inputs={"x": BIG}, outputs={"y": SEED})
def reduce(x):
    return {"y": x.reshape(x.shape[0], -1, 16).mean(axis=1, dtype=np.float32)}


def big_pipeline() -> Pipeline:
    p = Pipeline("big", inputs={"seed": SEED}, max_batch_size=4)
    a = p.add(expand, seed=p.input("seed"))
    b = p.add(scale, x=a["x"])
    c = p.add(shift, x=b["y"])
    p.output("y", p.add(reduce, x=c["y"])["y"])
    return p


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def _settings(levels, args, url: str = "127.0.0.1:0") -> BenchSettings:
    return BenchSettings(
        concurrency=levels, local=False, url=url, protocol="http", forms=FORMS,
        duration=args.duration, warmup=args.warmup, max_trials=args.max_trials, stability=0.15,
    )


def _measure(target, server, out: Path, levels, args) -> dict:
    result = run_benchmark(target, _settings(levels, args, server.http_url), out=out, progress=False)
    return {(m.config.form, m.concurrency): m for m in result.measurements}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-fused", help="results, plots and the repository (default bench-fused)")
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per measurement window (default 1.5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of unmeasured load first (default 0.5)")
    parser.add_argument("--max-trials", type=int, default=3, help="windows at most per measurement, >= 3 (default 3)")
    parser.add_argument("--quick", action="store_true", help="yolov5 at concurrency 1 and 4 only")
    parser.add_argument("--fused-instance-count", type=int, default=1, metavar="N",
                        help="instances of each fused model (default 1, as compiled by default)")
    args = parser.parse_args(argv)
    _settings((1,), args)  # bad options fail here, before the server starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"before: {_load()}; fused models with {args.fused_instance_count} instance(s)")

    big, diamond = big_pipeline(), make_diamond(ms=DIAMOND_MS, name="diamond50")
    repos = [p.compile("all", fused_instance_count=args.fused_instance_count) for p in (big, yolov5.pipeline, diamond)]
    repo_dir = repos[0].merge(*repos[1:]).write(out / "model_repository")
    summary: dict = {}
    with TritonServer(repo_dir) as server:
        print(f"server ready after {time.monotonic() - started:.0f} s\n\n== big: four Python steps, 4 MiB intermediates")
        at = _measure(big, server, out / "big", (1, 4), args)
        summary["big"] = {f"{f}@{c}": at[(f, c)].throughput for f, c in at}
        for c in (1, 4):
            ratio = at[("fused", c)].throughput / at[("ensemble", c)].throughput
            verdict = "meets" if ratio >= 1.5 else "MISSES"
            print(f"  concurrency {c}: fused {at[('fused', c)].throughput:.1f} infer/s = {ratio:.2f}x the ensemble's "
                  f"{at[('ensemble', c)].throughput:.1f} ({verdict} the 1.5x target); bls {at[('bls', c)].throughput:.1f}")
            summary["big"][f"fused/ensemble@{c}"] = ratio

        print("\n== yolov5 example")
        levels = (1, 4) if args.quick else (1, 4, 16)
        at = _measure("pipelines.examples.yolov5:pipeline", server, out / "yolov5", levels, args)
        summary["yolov5"] = {f"{f}@{c}": {"throughput": m.throughput, "p50_ms": m.latency.p50_ms} for (f, c), m in at.items()}

        print(f"\n== diamond: two {DIAMOND_MS:.0f} ms branches and a join")
        at = _measure(diamond, server, out / "diamond", (1,), args)
        p50 = at[("fused", 1)].latency.p50_ms
        bound = 1.15 * DIAMOND_MS
        print(f"  fused p50 {p50:.1f} ms ({'within' if p50 <= bound else 'OVER'} 1.15 x {DIAMOND_MS:.0f} = {bound:.1f} ms); "
              f"ensemble {at[('ensemble', 1)].latency.p50_ms:.1f} ms, bls {at[('bls', 1)].latency.p50_ms:.1f} ms")
        summary["diamond"] = {f: at[(f, 1)].latency.p50_ms for f in FORMS}
    summary["load_after"] = _load()
    summary["seconds"] = round(time.monotonic() - started, 1)
    (out / "fused_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nafter: {_load()}; {summary['seconds']:.0f} s in all; summary in {out / 'fused_summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
