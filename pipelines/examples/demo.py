"""``make demo``: the yolov5-style pipeline end to end.

It runs the pipeline in the local runtime in every mode, compiles it to
``"all"`` (ensemble, bls, bls-sync and fused side by side), serves the repository
on the bundled Triton server, checks every answer against the ground truth of
the sample images, and sets the forms side by side, locally and on the server.
Then the same detector behind a conditional step (``yolov5_skip_blank``: the
detector runs only for frames that are not blank) against the plain pipeline,
on a stream half blank: throughput and the detector's executions on the server.
Last, on the same server, a pipeline that streams (``pipelines.examples.demo_streams``):
the textgen example in every form, token by token, checked against the local
runtime, then the benchmark's streaming table (``--no-stream`` leaves it out).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from ..forms import FORMS, FormLeftOutWarning
from ..runtime import compare, run_many
from . import demo_streams, yolov5, yolov5_skip_blank

SIZES = ((480, 640), (720, 1280), (640, 480), (333, 500))


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    return [yolov5.make_sample(seed, n_objects=3 + seed % 4, size=SIZES[seed % len(SIZES)]) for seed in range(n)]


def _verdict(detections: np.ndarray, sample: dict[str, np.ndarray]) -> str:
    cmp = yolov5.compare_to_truth(detections, sample["boxes"], sample["classes"])
    mark = "exact" if cmp.exact else f"MISSED {len(cmp.missed)}, EXTRA {len(cmp.extra)}"
    return f"{len(cmp.matches)}/{len(sample['boxes'])} true boxes found, min IoU {cmp.min_iou:.3f}, {mark}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4, help="sample images to run (default 4)")
    parser.add_argument("--requests", type=int, default=24, help="requests per form for the timing (default 24)")
    parser.add_argument("--out", default=None, help="where to write the model repository (default: a temp dir)")
    parser.add_argument("--skip-seconds", type=float, default=3.0,
                        help="seconds per measurement of the blank-frame cascade on the server (0: leave it out)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="leave out the streaming part (the textgen example, every form, and its benchmark)")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    p = yolov5.pipeline
    print(f"== the pipeline\n{p!r}")
    for i, group in enumerate(p.parallel_groups()):
        print(f"  stage {i}: {', '.join(group)}")
    samples = _samples(args.images)
    requests = [{"image": s["image"][None]} for s in samples]

    print("\n== local runtime (no server)")
    reference = None
    reports = {}
    for mode in FORMS:
        outs, _ = run_many(p, requests, mode=mode, concurrency=1)
        # server_copies: copy tensors where a Triton server moves them between processes,
        # so the report shows the bytes each form moves.
        timed, reports[mode] = run_many(
            p, requests * max(1, args.requests // len(requests)), mode=mode, concurrency=1, server_copies=True
        )
        if reference is None:
            reference = [o["detections"][0] for o in outs]
        for i, (o, s) in enumerate(zip(outs, samples, strict=False)):
            print(f"  {mode:9s} image {i} {s['image'].shape[1]}x{s['image'].shape[0]}: {_verdict(o['detections'][0], s)}")
    print("\n== ensemble against BLS in the local runtime, copying tensors where a server would")
    print(compare(reports["ensemble"], reports["bls"]))

    from ..triton import TritonServer

    streamed_alike = True
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "model_repository"
        with warnings.catch_warnings():  # the cascade has no ensemble form: said below
            warnings.simplefilter("ignore", FormLeftOutWarning)
            repo = p.compile("all").merge(yolov5_skip_blank.pipeline.compile("all"))
            if args.stream:  # one server for both parts: it starts once
                repo = repo.merge(demo_streams.compile_streams())
        repo.write(out)
        print(f"\n== compiled to {out}: {', '.join(sorted(repo.models))}")
        print("\n== starting the bundled Triton server ...", flush=True)
        with TritonServer(out) as server:
            print(f"  ready at http://{server.http_url} and grpc://{server.grpc_url}")
            client = server.client("http")
            latencies = {}
            for form in FORMS.values():
                model = form.model_name(p.name, side_by_side=True)
                for i, (req, s) in enumerate(zip(requests, samples, strict=False)):
                    det = client.infer(model, req)["detections"][0]
                    agree = np.allclose(det, reference[i], atol=1e-3)
                    print(f"  {model:15s} image {i}: {_verdict(det, s)}; "
                          f"{'equals' if agree else 'DIFFERS FROM'} the local runtime")
                t0 = time.perf_counter()
                for k in range(args.requests):
                    client.infer(model, requests[k % len(requests)])
                latencies[form.name] = (time.perf_counter() - t0) / args.requests * 1e3
            client.close()
            rows = (yolov5_skip_blank.compare_on_server(server, always=p, seconds=args.skip_seconds)
                    if args.skip_seconds > 0 else [])
            _summary(reports, latencies, rows, args.skip_seconds)
            if args.stream:
                streamed_alike = demo_streams.run_streaming_part(server.grpc_url)
            print("\n== stopping the server ...", flush=True)
    print(f"\nthe demo took {time.perf_counter() - started:.0f} s")
    if not streamed_alike:
        print("a form of the streaming pipeline streamed another text than the local runtime: see above")
        return 1
    return 0


def _summary(reports: dict, latencies: dict[str, float], rows: list, skip_seconds: float) -> None:
    """The yolov5 part's tables: every form's latency, locally and on the server, and the blank-frame cascade."""
    print("\n== every form, one request at a time (mean latency)")
    print(f"  {'form':10s} {'local (ms)':>12s} {'server (ms)':>12s}")
    for mode in FORMS:
        local_ms = reports[mode].latency_us / 1e3
        print(f"  {mode:10s} {local_ms:12.2f} {latencies[mode]:12.2f}")
    ratio = latencies["ensemble"] / latencies["bls"]
    print(f"  server ensemble / bls latency: {ratio:.2f}"
          f" ({'ensemble' if ratio < 1 else 'BLS'} is faster for this pipeline at concurrency 1)")
    fastest = min(latencies, key=latencies.get)
    ranked = sorted(latencies.values())
    print(f"  fastest on the server at concurrency 1: {fastest}"
          + (f", {ranked[1] / ranked[0]:.2f}x faster than the next form" if len(ranked) > 1 else ""))
    if skip_seconds > 0:
        print(f"\n== skipping blank frames: {yolov5_skip_blank.pipeline.name} (is_blank, then the detector only "
              "for the frames that are not blank) against yolov5,\n   on a stream in which half of the frames "
              f"are blank, 4 requests in flight, {skip_seconds:g} s each (an ensemble cannot skip a step, "
              "so BLS and fused)")
        print("  " + yolov5_skip_blank.comparison_table(rows).replace("\n", "\n  "))
    print("\nFor throughput and percentiles under load: pipelines bench pipelines.examples.yolov5:pipeline --server")

if __name__ == "__main__":
    sys.exit(main())
