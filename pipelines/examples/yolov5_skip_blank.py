"""The yolov5 example with a cascade in front of its detector: ``is_blank`` (the pixel
variance of a frame under a threshold) decides, frame by frame, whether the detector,
NMS and box scaling run at all. A blank frame gets no detections (every row padded
with class -1, as NMS pads); a batch of frames runs the detector once, on the
frames that are not blank, and not at all when every frame is blank.

``pipeline`` is the conditional one; ``unconditional`` the plain yolov5 pipeline,
for comparison (``benchmarks/conditional.py``).
"""

from __future__ import annotations

import numpy as np

from ..graph import Pipeline
from ..step import Step, step
from ..steps.detector import detector as stand_in_detector
from ..steps.letterbox import letterbox
from ..steps.nms import nms
from ..steps.scale_boxes import scale_boxes
from ..tensor import TensorSpec
from .yolov5 import MAX_BATCH_SIZE, build_pipeline, make_sample

__all__ = ["BLANK_VARIANCE", "build_pipeline_skipping_blanks", "is_blank", "pipeline", "sample_inputs",
           "unconditional"]

#: A frame whose pixel variance is under this is blank (a black, grey or frozen frame).
BLANK_VARIANCE = 4.0


@step(inputs={"image": TensorSpec("UINT8", [-1, -1, 3])}, outputs={"blank": TensorSpec("BOOL", [1])})
def is_blank(image):
    """One BOOL a frame: whether its pixels hardly vary (a few µs, against the detector's ms)."""
    rows = np.asarray(image).reshape(len(image), -1).astype(np.float32)
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
