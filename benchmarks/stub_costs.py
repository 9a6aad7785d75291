"""What a Python step's stub costs on the bundled server, by where its output goes and by
whether the stub is warm: the two facts `pipelines calibrate` prices stubs by
(docs/calibration_internals.md and docs/design_notes.md).

Two-step ensembles of identity-like steps over one UINT8 tensor (4 and 12 MiB):
``ident`` returns its input, ``busy`` works 0.5 ms first (as the calibration probes
do), ``fresh`` returns a new array (``x + 1``). For each, Triton's statistics of the
first step (whose output feeds the second) and of the last (whose output is the
ensemble's answer), measured two ways:

- back to back: each model's requests one after another, as a pipeline under load
  sends them;
- interleaved: one request per model in turn, as calibration timed its probes
  before it warmed each one.

    .venv/bin/python benchmarks/stub_costs.py [--requests 30]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.tables import format_table
from pipelines.triton import TritonServer
from pipelines.triton.statistics import breakdown, parse_statistics

BYTES = TensorSpec("UINT8", [-1])
SIZES = (4 << 20, 12 << 20)


@step(inputs={"x": BYTES}, outputs={"y": BYTES}, name="ident")
def ident(x):
    return {"y": x}


@step(inputs={"x": BYTES}, outputs={"y": BYTES}, name="busy")
def busy(x):
    end = perf_counter() + 0.0005
    while perf_counter() < end:
        pass
    return {"y": x}


@step(inputs={"x": BYTES}, outputs={"y": BYTES}, name="fresh")
def fresh(x):
    return {"y": x + np.uint8(1)}


def chain_of_two(s, name: str) -> Pipeline:
    p = Pipeline(name, inputs={"x": BYTES}, max_batch_size=8)
    first = p.add(s, x=p.input("x"))
    last = p.add(s.with_options(), name=f"{s.name}_last", x=first["y"])
    p.output("y", last["y"])
    return p


PIPELINES = {"ident": chain_of_two(ident, "c_ident"), "busy": chain_of_two(busy, "c_busy"),
             "fresh": chain_of_two(fresh, "c_fresh")}
BUSY_MS = {"ident": 0.0, "busy": 0.5, "fresh": 0.0}


def held_ms(rows, model: str, busy_ms: float) -> tuple[float, float, float]:
    """(compute input, infer less the step's own work, output) of ``model``, ms per execution."""
    (row,) = [r for r in rows if r.model == model]
    return row.compute_input_us / 1e3, row.compute_infer_us / 1e3 - busy_ms, row.compute_output_us / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="timed requests per model and way (default: 30)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        first, *rest = (p.compile("ensemble") for p in PIPELINES.values())
        repo = Path(tmp) / "repo"
        first.merge(*rest).write(repo)
        rows = []
        with TritonServer(repo) as server:
            client = server.client("http")
            for size in SIZES:
                x = {"x": np.zeros((1, size), np.uint8)}
                for way in ("back to back", "interleaved"):
                    for p in PIPELINES.values():  # warm every stub first
                        for _ in range(3):
                            client.infer(p.name, x)
                    before = parse_statistics(client.statistics(""))
                    if way == "back to back":
                        for p in PIPELINES.values():
                            for _ in range(args.requests):
                                client.infer(p.name, x)
                    else:
                        for _ in range(args.requests):
                            for p in PIPELINES.values():
                                client.infer(p.name, x)
                    between = breakdown(before, parse_statistics(client.statistics("")))
                    for kind, p in PIPELINES.items():
                        for which, model in (("first", f"{p.name}__{kind}"), ("last", f"{p.name}__{kind}_last")):
                            c_in, c_infer, c_out = held_ms(between, model, BUSY_MS[kind])
                            rows.append([f"{size >> 20} MiB", way, kind, which, f"{c_in:.2f}", f"{c_infer:.2f}",
                                         f"{c_out:.2f}", f"{c_in + c_infer + c_out:.2f}"])
    print(format_table(["size", "measured", "step", "in chain", "compute input ms", "infer ms (less its work)",
                        "compute output ms", "stub ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
