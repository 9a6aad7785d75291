"""Soak the local runtime: concurrency 64 for a minute, memory must stay flat.

    python benchmarks/soak.py [--duration 60] [--concurrency 64] [--json OUT.json]

The pipeline has parallel branches, a dynamically batched step and a class step;
one request in ten is malformed and one in twenty makes a step raise, so the
error paths are soaked too. Memory (RSS) is sampled through the run; after the
warm-up (the first fifth) it must grow by less than 5 %. Every answer is checked.
Exits non-zero when memory grows, an answer is wrong, or an error is unexpected.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from typing import Any

import anyio
import numpy as np

from pipelines import InputError, Pipeline, StepError, TensorSpec, step
from pipelines.runtime import LocalRuntime

IMG = TensorSpec("FP32", [3, 16, 16])
VEC = TensorSpec("FP32", [4])


def soak_pipeline() -> Pipeline:
    @step(inputs={"image": IMG}, outputs={"image": IMG})
    def normalise(image):
        return {"image": image / 255.0}

    @step(inputs={"image": IMG}, outputs={"features": VEC}, max_batch_size=16,
          dynamic_batching={"max_queue_delay_us": 500}, instance_count=2)
    def detector(image):
        if (image < 0).any():
            raise ValueError("negative pixels")
        return {"features": image.reshape(image.shape[0], 3, -1).mean(axis=2)[:, :, None].repeat(2, 2)
                .reshape(image.shape[0], 6)[:, :4].astype(np.float32)}

    @step(inputs={"image": IMG}, outputs={"stats": VEC})
    def statistics(image):
        flat = image.reshape(image.shape[0], -1)
        return {"stats": np.stack([flat.min(1), flat.max(1), flat.mean(1), flat.std(1)], 1).astype(np.float32)}

    class Scale:
        def initialize(self, config):
            self.factor = np.float32(2.0)

        def execute(self, features, stats):
            return {"out": features * self.factor + stats}

    scale = step(Scale, inputs={"features": VEC, "stats": VEC}, outputs={"out": VEC}, name="scale")

    p = Pipeline("soak", inputs={"image": IMG}, max_batch_size=8)
    n = p.add(normalise, image=p.input("image"))
    d = p.add(detector, image=n["image"])
    s = p.add(statistics, image=n["image"])
    p.output("out", p.add(scale, features=d["features"], stats=s["stats"])["out"])
    return p


def reference(image: np.ndarray) -> np.ndarray:
    x = image / 255.0
    feats = x.reshape(x.shape[0], 3, -1).mean(axis=2)[:, :, None].repeat(2, 2).reshape(x.shape[0], 6)[:, :4]
    flat = x.reshape(x.shape[0], -1)
    stats = np.stack([flat.min(1), flat.max(1), flat.mean(1), flat.std(1)], 1)
    return (feats.astype(np.float32) * np.float32(2.0) + stats.astype(np.float32)).astype(np.float32)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def soak(duration: float, concurrency: int) -> dict[str, Any]:
    p = soak_pipeline()
    counts = {"served": 0, "input_errors": 0, "step_errors": 0, "wrong": 0, "unexpected": 0}
    samples: list[tuple[float, int]] = []
    warmup = duration / 5
    start = time.perf_counter()
    stop = start + duration

    async with LocalRuntime(p, "ensemble") as rt:

        async def client(c: int) -> None:
            rng = np.random.default_rng(c)
            k = 0
            while time.perf_counter() < stop:
                k += 1
                rows = int(rng.integers(1, 5))
                image = rng.integers(0, 256, size=(rows, 3, 16, 16)).astype(np.float32)
                kind = "good"
                if k % 10 == 0:
                    kind, image = "bad_input", image[:, :2]
                elif k % 20 == 7:
                    kind, image = "bad_step", -image - 1
                try:
                    out = await rt.infer({"image": image})
                except InputError:
                    counts["input_errors" if kind == "bad_input" else "unexpected"] += 1
                    continue
                except StepError:
                    counts["step_errors" if kind == "bad_step" else "unexpected"] += 1
                    continue
                if kind != "good":
                    counts["unexpected"] += 1
                elif not np.allclose(out["out"], reference(image), rtol=1e-5, atol=1e-5):
                    counts["wrong"] += 1
                counts["served"] += 1

        async def sampler() -> None:
            while time.perf_counter() < stop:
                gc.collect()
                samples.append((time.perf_counter() - start, rss_bytes()))
                await anyio.sleep(max(0.5, duration / 60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            for c in range(concurrency):
                tg.start_soon(client, c)
        gc.collect()
        samples.append((time.perf_counter() - start, rss_bytes()))
        report = rt.report()

    after_warmup = [rss for t, rss in samples if t >= warmup]
    base, end = after_warmup[0], after_warmup[-1]
    growth = (max(after_warmup) - base) / base
    return {
        "duration_s": duration,
        "concurrency": concurrency,
        **counts,
        "requests_per_s": counts["served"] / duration,
        "rss_after_warmup_mib": base / 2**20,
        "rss_end_mib": end / 2**20,
        "rss_peak_after_warmup_mib": max(after_warmup) / 2**20,
        "rss_growth_pct": growth * 100,
        "mean_batch_detector": report.step("detector").mean_batch,
        "latency_p50_ms": report.latency_p50_us / 1e3,
        "latency_p99_ms": report.latency_p99_us / 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run (default 60)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    figures = anyio.run(soak, args.duration, args.concurrency)
    print(
        f"soak {figures['duration_s']:.0f} s at concurrency {figures['concurrency']}: "
        f"{figures['served']} requests served ({figures['requests_per_s']:.0f}/s), "
        f"{figures['input_errors']} input errors and {figures['step_errors']} step errors as intended, "
        f"{figures['unexpected']} unexpected, {figures['wrong']} wrong answers\n"
        f"RSS {figures['rss_after_warmup_mib']:.1f} MiB after warm-up -> {figures['rss_end_mib']:.1f} MiB at the end "
        f"(peak growth {figures['rss_growth_pct']:.2f} %); latency p50 {figures['latency_p50_ms']:.2f} ms, "
        f"p99 {figures['latency_p99_ms']:.2f} ms; detector mean batch {figures['mean_batch_detector']:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    ok = figures["rss_growth_pct"] < 5 and not figures["wrong"] and not figures["unexpected"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
