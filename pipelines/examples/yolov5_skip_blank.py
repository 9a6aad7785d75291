"""The yolov5 example with a cascade in front of its detector: ``is_blank`` (the pixel
variance of a frame under a threshold) decides, frame by frame, whether the detector,
NMS and box scaling run at all. A blank frame gets no detections (every row padded
with class -1, as NMS pads); a batch of frames runs the detector once, on the
frames that are not blank, and not at all when every frame is blank.

``pipeline`` is the conditional one; ``unconditional`` the plain yolov5 pipeline,
for comparison (``benchmarks/conditional.py``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.step import Step, step
from ..core.tensor import TensorSpec
from ..pipeline import Pipeline
from ..steps.detector import detector as stand_in_detector
from ..steps.letterbox import letterbox
from ..steps.nms import nms
from ..steps.scale_boxes import scale_boxes
from .yolov5 import MAX_BATCH_SIZE, build_pipeline, make_sample

__all__ = ["BLANK_VARIANCE", "SkipBlankComparison", "build_pipeline_skipping_blanks", "compare_on_server",
           "comparison_table", "is_blank", "pipeline", "sample_inputs", "unconditional"]

#: A frame whose pixel variance is under this is blank (a black, grey or frozen frame).
BLANK_VARIANCE = 4.0


@step(inputs={"image": TensorSpec("UINT8", [-1, -1, 3])}, outputs={"blank": TensorSpec("BOOL", [1])})
def is_blank(image):
    """One BOOL a frame: whether its pixels hardly vary. Every 16th value is enough to tell (an
    object 6 pixels wide is seen), and costs 50 µs a 640×480 frame where all of them cost 0.5 ms."""
    rows = np.asarray(image).reshape(len(image), -1)[:, ::16].astype(np.float32)
    return {"blank": (rows.var(axis=1) < BLANK_VARIANCE)[:, None]}


def build_pipeline_skipping_blanks(
    *, detector: Step | None = None, name: str = "yolov5_skip_blank", max_batch_size: int = MAX_BATCH_SIZE
) -> Pipeline:
    """``is_blank``; then, for the frames that are not blank, letterbox -> ``detector`` -> nms -> scale_boxes."""
    det_step = stand_in_detector if detector is None else detector
    (det_in,) = det_step.inputs
    (det_out,) = det_step.outputs
    p = Pipeline(name, inputs={"image": TensorSpec("UINT8", [-1, -1, 3])}, max_batch_size=max_batch_size)
    blank = p.add(is_blank, image=p.input("image"))
    with p.when(~blank["blank"]):  # a blank frame needs no letterbox either
        boxed = p.add(letterbox, image=p.input("image"))
        found = p.add(det_step, **{det_in: boxed["images"]})
        kept = p.add(nms, candidates=found[det_out])
        scaled = p.add(
            scale_boxes, detections=kept["detections"], ratio_pad=boxed["ratio_pad"], orig_size=boxed["orig_size"]
        )
    spec = scaled.step.outputs["detections"]
    none = np.zeros(spec.dims, np.float32)
    none[:, 5] = -1  # no detection: padded as NMS pads
    p.output("detections", scaled["detections"], otherwise=none)
    return p.validate()


def sample_inputs(batch: int = 1, *, blank_share: float = 0.5, count: int = 8) -> list[dict[str, np.ndarray]]:
    """``count`` requests of ``batch`` frames each; ``blank_share`` of all frames are blank (grey)."""
    requests, frame = [], 0
    for i in range(count):
        images = []
        for _ in range(batch):
            # Spread evenly: frame f is blank when the blank count so far falls behind the share.
            if int((frame + 1) * blank_share) > int(frame * blank_share):
                images.append(np.full((480, 640, 3), 114, np.uint8))
            else:
                image = make_sample(seed=i)["image"]
                images.append(image[0] if image.ndim == 4 else image)
            frame += 1
        requests.append({"image": np.stack(images)})
    return requests


pipeline = build_pipeline_skipping_blanks()
unconditional = build_pipeline(name="yolov5_always")


@dataclass(frozen=True)
class SkipBlankComparison:
    """One form on the server: the unconditional pipeline against the one that skips blank frames.

    ``*_executions`` and ``*_rows`` are the detector model's execution and inference counts
    from Triton's statistics over the measurement; ``None`` in the fused form, whose detector
    runs inside the fused model's own process, where Triton does not count it.
    """

    form: str
    always_per_s: float
    skipping_per_s: float
    always_executions: int | None
    skipping_executions: int | None
    always_rows: int | None
    skipping_rows: int | None

    @property
    def ratio(self) -> float:
        return self.skipping_per_s / self.always_per_s


def _throughput(server: Any, model: str, requests: list[dict[str, Any]], concurrency: int, seconds: float) -> float:
    """Requests answered per second by ``concurrency`` clients, each sending the next when answered."""
    done = [0] * concurrency
    errors: list[BaseException] = []
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        with server.client("grpc", timeout=120) as c:
            i = k
            while time.perf_counter() < stop:
                try:
                    c.infer(model, requests[i % len(requests)])
                except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
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


def _detector_counts(server: Any, model: str) -> tuple[int, int]:
    with server.client("grpc") as client:
        entry = client.statistics(model)["model_stats"][0]
    return int(entry.get("execution_count", 0)), int(entry.get("inference_count", 0))


def compare_on_server(server: Any, *, always: Pipeline | None = None, forms: tuple[str, ...] = ("bls", "fused"),
                      concurrency: int = 4, seconds: float = 8.0, blank_share: float = 0.5,
                      batch: int = 1) -> list[SkipBlankComparison]:
    """Measure ``always`` (default ``unconditional``) and ``pipeline`` side by side on ``server`` (a
    :class:`~pipelines.triton.TritonServer` serving both, compiled with ``"all"``): throughput of each form at
    ``concurrency``, ``batch`` frames a request, ``blank_share`` of the frames blank, and the detector's
    executions."""
    always = unconditional if always is None else always
    requests = sample_inputs(batch, blank_share=blank_share, count=8)
    rows = []
    for form in forms:
        figures = {}
        for p in (always, pipeline):
            model, detector = f"{p.name}_{form}", f"{p.name}__detector"
            _throughput(server, model, requests, concurrency, min(1.0, seconds))  # warm-up
            before = _detector_counts(server, detector)
            per_s = _throughput(server, model, requests, concurrency, seconds)
            after = _detector_counts(server, detector)
            counted = form != "fused"
            figures[p.name] = (per_s, after[0] - before[0] if counted else None, after[1] - before[1] if counted else None)
        base, skipping = figures[always.name], figures[pipeline.name]
        rows.append(SkipBlankComparison(form, base[0], skipping[0], base[1], skipping[1], base[2], skipping[2]))
    return rows


def comparison_table(rows: list[SkipBlankComparison]) -> str:
    lines = [f"{'form':<6} {'always req/s':>13} {'skip_blank req/s':>17} {'ratio':>6}  detector executions (rows)"]
    for r in rows:
        counted = (f"{r.always_executions} -> {r.skipping_executions} ({r.always_rows} -> {r.skipping_rows} rows)"
                   if r.always_executions is not None else "inside the fused model: not in Triton's statistics")
        lines.append(f"{r.form:<6} {r.always_per_s:>13.1f} {r.skipping_per_s:>17.1f} {r.ratio:>5.2f}x  {counted}")
    return "\n".join(lines)
