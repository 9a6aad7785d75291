"""Soak the compiled failing diamond on the bundled tritonserver: half the requests fail in one branch.

    python benchmarks/failing_branch_soak.py [--seconds 60] [--forms ensemble,bls,bls_sync]
                                             [--groups http:16,http:64,grpc:16,grpc:64]
                                             [--expose-branch | --chain [--share-model]]

Four client groups run at the same time for the whole window: HTTP and gRPC, 16 and 64
concurrent clients each, every client cycling over the forms, every other client sending
requests that `brittle` refuses. Every request must get its answer or its own error (named
by its tag), none may hang, and the server must be alive at the end. The test suite runs the
same load for a shorter window (tests/test_server_failures.py, FAILING_BRANCH_WINDOW_S).
``--chain`` soaks a chain that reuses the failing step instead: its ensemble is not gated, so
the failing node answers with its own error response, which 2.51 survives where no sibling runs.
Exits non-zero on any hang, wrong answer or death.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import anyio

from pipelines.compile import compile_pipeline
from pipelines.core.plan import gated_ensemble
from pipelines.core.planning import plan_of
from pipelines.examples.failing_branch import (
    expected_answer,
    expected_chain_answer,
    hammer_groups,
    make_failing_chain,
    make_failing_diamond,
)
from pipelines.triton import TritonServer

GROUPS = [("http", 16), ("http", 64), ("grpc", 16), ("grpc", 64)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--forms", default="ensemble,bls,bls_sync")
    parser.add_argument("--groups", default=",".join(f"{p}:{n}" for p, n in GROUPS),
                        help="protocol:clients, comma-separated; all run at the same time")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--expose-branch", action="store_true",
                       help="expose a branch's output too, so the ensemble answers through a gate model")
    shape.add_argument("--chain", action="store_true",
                       help="soak a chain that reuses the failing step (brittle, plus_one, brittle again), "
                       "whose ensemble is not gated, instead of the diamond")
    parser.add_argument("--share-model", action="store_true",
                        help="with --chain: the reused step declared share_model=True (one model, node aliases)")
    args = parser.parse_args()
    if args.share_model and not args.chain:
        parser.error("--share-model goes with --chain")
    groups = [(g.split(":")[0], int(g.split(":")[1])) for g in args.groups.split(",")]
    forms = args.forms.split(",")
    p = (make_failing_chain(share_model=args.share_model or None) if args.chain
         else make_failing_diamond(expose_branch=args.expose_branch))
    expected = expected_chain_answer if args.chain else expected_answer
    with tempfile.TemporaryDirectory() as tmp:
        root = compile_pipeline(p, "both").write(Path(tmp) / "repo")
        with TritonServer(root, exit_timeout=1) as server:
            started = time.monotonic()
            models = [f"{p.name}_{form}" for form in forms]
            tallies = anyio.run(functools.partial(hammer_groups, expected=expected), server, models, groups,
                                args.seconds)
            elapsed = time.monotonic() - started
            alive = True
            try:
                server.check_alive()
            except Exception as exc:
                alive = False
                print("server died:", exc)
    bad = not alive
    gated = gated_ensemble(plan_of(p, warn=False))
    print(f"{elapsed:.0f} s, pipeline {p.name!r} (ensemble {'gated' if gated else 'not gated'}), "
          f"forms {', '.join(forms)}")
    for (protocol, clients), t in tallies.items():
        print(f"{protocol:>4} x {clients:>2}: {t.total:>6} requests, {t.answered} answered, "
              f"{t.own_errors} own errors, {t.hung} hung, {len(t.wrong)} wrong")
        for line in t.wrong[:3]:
            print("   ", line)
        bad |= bool(t.hung or t.wrong)
    print("server alive at the end:", alive)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
