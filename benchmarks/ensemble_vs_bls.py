"""Benchmark every form of a pipeline (ensemble, bls, bls-sync, fused; default pipeline: the
yolov5 example), locally and on the embedded Triton server; the same code as ``pipelines bench``.
The verdict names the fastest form at each concurrency, and by how much.

    python benchmarks/ensemble_vs_bls.py pipelines.examples.basic:diamond --concurrency 1,4,16 --out bench-results
"""

from __future__ import annotations

import sys

from pipelines.bench.command import run

if __name__ == "__main__":
    sys.exit(run())
