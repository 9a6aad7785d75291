"""Conditional steps on the bundled server: ``yolov5_skip_blank`` (``is_blank`` in front of the
detector, issue 44) against the unconditional yolov5 pipeline, half of the frames blank.

One repository (both pipelines compiled with ``"all"``; the conditional one without its
ensemble), one server. For the BLS and fused forms it measures throughput at concurrency 4
(requests of one frame, every other frame blank) and reads the detector's execution and
inference counts from Triton's statistics (the BLS forms call the detector's own model; the
fused form runs it in its own process, where Triton cannot count it).

Target: the conditional pipeline's throughput >= 1.6x the unconditional one's, BLS and fused.

    .venv/bin/python benchmarks/conditional.py                 # about a minute
    .venv/bin/python benchmarks/conditional.py --duration 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from pipelines.examples.yolov5_skip_blank import pipeline, sample_inputs, unconditional
from pipelines.forms import FormLeftOutWarning
from pipelines.triton import TritonServer

FORMS = ("bls", "fused")
TARGET = 1.6


def _throughput(server, model: str, requests: list[dict], concurrency: int, seconds: float) -> float:
    """Requests answered per second by ``concurrency`` clients, each sending in a loop."""
    done = [0] * concurrency
    stop = time.perf_counter() + seconds
    errors: list[BaseException] = []

    def client(k: int) -> None:
        with server.client("grpc", timeout=120) as c:
            i = k
            while time.perf_counter() < stop:
                try:
                    c.infer(model, requests[i % len(requests)])
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
                done[k] += 1
                i += concurrency

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done) / (time.perf_counter() - start)


def _counts(server, model: str) -> tuple[int, int]:
    entry = server.client("grpc").statistics(model)["model_stats"][0]
    return int(entry.get("execution_count", 0)), int(entry.get("inference_count", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement (default 8)")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)

    requests = sample_inputs(1, blank_share=0.5, count=8)
    blank = sum(bool(np.asarray(r["image"]).std() < 2) for r in requests)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormLeftOutWarning)
        repo = pipeline.compile("all").merge(unconditional.compile("all"))
    print(f"load average before: {os.getloadavg()[0]:.2f}; {blank} of {len(requests)} frames blank")
    with tempfile.TemporaryDirectory() as tmp, TritonServer(repo.write(Path(tmp) / "repo")) as server:
        rows = []
        for form in FORMS:
            figures = {}
            for p in (unconditional, pipeline):
                model = f"{p.name}_{form}"
                detector = f"{p.name}__detector"
                _throughput(server, model, requests, args.concurrency, 1.0)  # warm-up
                before = _counts(server, detector)
                rps = _throughput(server, model, requests, args.concurrency, args.duration)
                after = _counts(server, detector)
                figures[p.name] = (rps, after[0] - before[0], after[1] - before[1])
            base, cond = figures[unconditional.name], figures[pipeline.name]
            ratio = cond[0] / base[0]
            rows.append((form, base, cond, ratio))
        print(f"\nconcurrency {args.concurrency}, one frame a request, half of them blank, {args.duration:g} s each")
        print(f"{'form':<6} {'always req/s':>13} {'skip_blank req/s':>17} {'ratio':>6}  detector executions "
              "(always -> skip_blank; inferences)")
        for form, base, cond, ratio in rows:
            counted = (f"{base[1]} -> {cond[1]} ({base[2]} -> {cond[2]} rows)" if form != "fused"
                       else "in the fused model's own process: not in Triton's statistics")
            verdict = "meets" if ratio >= TARGET else "misses"
            print(f"{form:<6} {base[0]:>13.1f} {cond[0]:>17.1f} {ratio:>5.2f}x  {counted}  [{verdict} {TARGET}x]")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
