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
import warnings
from pathlib import Path

import numpy as np

from pipelines.examples.yolov5_skip_blank import (
    compare_on_server,
    comparison_table,
    pipeline,
    sample_inputs,
    unconditional,
)
from pipelines.forms import FormLeftOutWarning
from pipelines.triton import TritonServer

FORMS = ("bls", "fused")
TARGET = 1.6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement (default 8)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="frames a request (default 1; up to 8)")
    args = parser.parse_args(argv)

    requests = sample_inputs(args.batch, blank_share=0.5, count=8)
    blank = sum(bool(np.asarray(frame).std() < 2) for r in requests for frame in r["image"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormLeftOutWarning)
        repo = pipeline.compile("all").merge(unconditional.compile("all"))
    print(f"load average before: {os.getloadavg()[0]:.2f}; {blank} of {len(requests) * args.batch} frames blank")
    with tempfile.TemporaryDirectory() as tmp, TritonServer(repo.write(Path(tmp) / "repo")) as server:
        rows = compare_on_server(server, forms=FORMS, concurrency=args.concurrency, seconds=args.duration,
                                 batch=args.batch)
    print(f"\nconcurrency {args.concurrency}, {args.batch} frame(s) a request, half of the frames blank, "
          f"{args.duration:g} s each")
    print(comparison_table(rows))
    for r in rows:
        print(f"{r.form}: {r.ratio:.2f}x, {'meets' if r.ratio >= TARGET else 'misses'} the {TARGET}x target")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
