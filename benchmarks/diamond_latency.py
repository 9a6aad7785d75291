"""Latency of ``_ensemble``, ``_bls`` and ``_bls_sync`` on a diamond whose two
branches each take 50 ms, on the embedded Triton server, in one run.

    python benchmarks/diamond_latency.py [--requests 30] [--protocol http|grpc]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pipelines.examples.basic import make_diamond
from pipelines.triton import TritonServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    args = parser.parse_args()

    x = np.ones((2, 4), np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_diamond(ms=50, branches=2).compile("both").write(Path(tmp) / "repo")
        with TritonServer(repo) as server, server.client(args.protocol, timeout=60) as client:
            print(f"diamond, two 50 ms branches, batch [2, 4] FP32, {args.protocol}, {args.requests} requests each")
            print(f"{'model':<20} {'median ms':>10} {'mean ms':>10} {'p90 ms':>10}")
            for name in ("diamond_ensemble", "diamond_bls", "diamond_bls_sync"):
                for _ in range(3):
                    client.infer(name, {"x": x})
                times = []
                for _ in range(args.requests):
                    start = time.perf_counter()
                    client.infer(name, {"x": x})
                    times.append((time.perf_counter() - start) * 1000)
                times.sort()
                p90 = times[int(0.9 * (len(times) - 1))]
                print(f"{name:<20} {statistics.median(times):>10.1f} {statistics.fmean(times):>10.1f} {p90:>10.1f}")


if __name__ == "__main__":
    main()
