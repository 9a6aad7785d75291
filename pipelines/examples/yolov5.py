"""The built-in yolov5-style pipeline, and sample images whose true boxes are known.

``pipeline`` is letterbox -> detector -> nms -> scale_boxes with a batch of up
to 8, on the weight-free stand-in detector; ``build_pipeline(detector=
onnx_detector("yolov5s.onnx"))`` swaps in a real model. Its input ``image`` is
one HWC uint8 BGR image per request (``[1, H, W, 3]``; images in one batch
share a size); its output ``detections`` is ``[B, 300, 6]``: x1, y1, x2, y2 in
the original image's pixels, score, class, padded with class -1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.step import Step
from ..core.tensor import TensorSpec
from ..errors import PipelinesError
from ..pipeline import Pipeline
from ..steps.detector import CLASS_NAMES, PALETTE
from ..steps.detector import detector as stand_in_detector
from ..steps.letterbox import letterbox, letterbox_geometry
from ..steps.nms import NUM_CANDIDATES, NUM_CLASSES, nms, nms_step
from ..steps.scale_boxes import scale_boxes

__all__ = [
    "MAX_BATCH_SIZE",
    "Comparison",
    "build_pipeline",
    "class_names",
    "compare_to_truth",
    "draw_detections",
    "make_sample",
    "palette",
    "pipeline",
]

MAX_BATCH_SIZE = 8
#: Class ``i`` of the stand-in detector is a rectangle of BGR colour ``palette[i]``.
palette: tuple[tuple[int, int, int], ...] = PALETTE
class_names: tuple[str, ...] = CLASS_NAMES[: len(PALETTE)]

# Sample objects are at least this many pixels on their short side once
# letterboxed, so nearest-neighbour resizing moves an edge by at most 2% of it.
_MIN_LETTERBOXED_SIDE = 24
_PLACEMENT_TRIES = 500


def build_pipeline(*, detector: Step | None = None, name: str = "yolov5", max_batch_size: int = MAX_BATCH_SIZE) -> Pipeline:
    """letterbox -> ``detector`` (default: the stand-in) -> nms -> scale_boxes.

    ``detector`` takes one FP32 ``[3, 640, 640]`` input and gives one FP32
    ``[N, 5 + classes]`` output (yolov5's layout), e.g. :func:`~pipelines.steps.onnx_detector`.
    """
    det_step = stand_in_detector if detector is None else detector
    if len(det_step.inputs) != 1 or len(det_step.outputs) != 1:
        raise PipelinesError(
            f"pipeline {name!r}: detector step {det_step.name!r} has inputs {list(det_step.inputs)} and "
            f"outputs {list(det_step.outputs)}; a yolov5 detector takes one image tensor and gives one "
            "tensor of rows, as onnx_detector(...) declares",
            pipeline=name, step=det_step.name,
        )
    (det_in,) = det_step.inputs
    (det_out,) = det_step.outputs
    rows = det_step.outputs[det_out]
    p = Pipeline(name, inputs={"image": TensorSpec("UINT8", [-1, -1, 3])}, max_batch_size=max_batch_size)
    boxed = p.add(letterbox, image=p.input("image"))
    found = p.add(det_step, **{det_in: boxed["images"]})
    suppress = nms
    if rows.rank == 2 and rows.dims != (NUM_CANDIDATES, 5 + NUM_CLASSES) and rows.dims[1] > 5:
        suppress = nms_step(num_candidates=rows.dims[0], num_classes=rows.dims[1] - 5)
    kept = p.add(suppress, candidates=found[det_out])
    scaled = p.add(
        scale_boxes, detections=kept["detections"], ratio_pad=boxed["ratio_pad"], orig_size=boxed["orig_size"]
    )
    p.output("detections", scaled["detections"])
    return p.validate()


def make_sample(seed: int = 0, n_objects: int = 5, size: tuple[int, int] = (480, 640)) -> dict[str, np.ndarray]:
    """A BGR image of ``size`` (height, width) with ``n_objects`` solid palette rectangles.

    Returns ``image`` (HWC uint8), ``boxes`` (``[N, 4]`` FP32 x1, y1, x2, y2
    pixel edges in the image) and ``classes`` (``[N]`` int64). Rectangles do
    not touch, are big enough to survive the letterbox, and sit on a noisy
    mid-grey background that is no palette colour.
    """
    height, width = (int(v) for v in size)
    if height < 8 or width < 8 or n_objects < 0:
        raise PipelinesError(
            f"make_sample: size {size!r} and n_objects {n_objects!r} are invalid; "
            "use a size of at least (8, 8) and n_objects >= 0"
        )
    rng = np.random.default_rng(seed)
    geo = letterbox_geometry(height, width)
    gain = min(geo.gain_x, geo.gain_y)
    min_side = max(4, math.ceil(_MIN_LETTERBOXED_SIDE / gain))
    gap = max(2, math.ceil(3 / gain))  # still a gap of >= 2 pixels once letterboxed
    max_w, max_h = max(min_side, width // 3), max(min_side, height // 3)

    base = rng.integers(100, 150, size=3)
    image = np.clip(base + rng.integers(-25, 26, size=(height, width, 3)), 70, 185).astype(np.uint8)
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(n_objects):
        for _ in range(_PLACEMENT_TRIES):
            bw = int(rng.integers(min_side, max_w + 1))
            bh = int(rng.integers(min_side, max_h + 1))
            if bw > width or bh > height:
                continue
            x1 = int(rng.integers(0, width - bw + 1))
            y1 = int(rng.integers(0, height - bh + 1))
            box = (x1, y1, x1 + bw, y1 + bh)
            if all(_apart(box, other, gap) for other in boxes):
                boxes.append(box)
                break
        else:
            raise PipelinesError(
                f"make_sample: could not place {n_objects} objects of at least {min_side} pixels "
                f"apart in a {height}x{width} image; ask for fewer objects or a larger size"
            )
    classes = rng.integers(0, len(PALETTE), size=len(boxes))
    for (x1, y1, x2, y2), cls in zip(boxes, classes, strict=True):
        image[y1:y2, x1:x2] = PALETTE[cls]
    return {
        "image": image,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "classes": classes.astype(np.int64),
    }


def _apart(a: tuple[int, ...], b: tuple[int, ...], gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


@dataclass(frozen=True)
class Comparison:
    """How detections compare with the true boxes of one image.

    ``matches`` holds ``(truth index, detection index, IoU)`` for each true box
    found with the right class; ``missed`` the true boxes not found; ``extra``
    the detections that match no true box.
    """

    matches: tuple[tuple[int, int, float], ...]
    missed: tuple[int, ...]
    extra: tuple[int, ...]

    @property
    def exact(self) -> bool:
        """Every true box found, and nothing else."""
        return not self.missed and not self.extra

    @property
    def min_iou(self) -> float:
        return min((iou for _, _, iou in self.matches), default=1.0)


def compare_to_truth(
    detections: Any, boxes: Any, classes: Any, *, iou_threshold: float = 0.9
) -> Comparison:
    """Match one image's ``[D, 6]`` detections (padding rows ignored) to its true boxes.

    A true box is found by the best-overlapping detection of its class whose
    IoU is at least ``iou_threshold``; each detection matches at most one box.
    """
    det = np.asarray(detections, dtype=np.float64).reshape(-1, 6)
    valid = np.flatnonzero(det[:, 5] >= 0)
    truth = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    classes = np.asarray(classes).reshape(-1)
    ious = _box_iou(truth, det[valid, :4])
    same = classes[:, None] == det[valid, 5][None, :].astype(np.int64)
    ious = np.where(same, ious, 0.0)
    used: set[int] = set()
    matches, missed = [], []
    for t in range(truth.shape[0]):
        order = [int(j) for j in np.argsort(-ious[t], kind="stable") if int(j) not in used]
        if order and ious[t, order[0]] >= iou_threshold:
            used.add(order[0])
            matches.append((t, int(valid[order[0]]), float(ious[t, order[0]])))
        else:
            missed.append(t)
    extra = tuple(int(valid[j]) for j in range(valid.shape[0]) if j not in used)
    return Comparison(tuple(matches), tuple(missed), extra)


def _box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    iw = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    ih = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = iw * ih
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def draw_detections(ax: Any, image: Any, detections: Any, *, truth: Any = None, names: Any = None) -> Any:
    """Show a BGR ``image`` on a matplotlib ``ax`` with its ``[D, 6]`` detections (and true boxes, dashed)."""
    from matplotlib.patches import Rectangle

    names = class_names if names is None else names
    ax.imshow(np.asarray(image)[:, :, ::-1])
    for x1, y1, x2, y2 in np.asarray(truth if truth is not None else np.zeros((0, 4))).reshape(-1, 4):
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, ls="--", lw=1, ec="white"))
    for x1, y1, x2, y2, score, cls in np.asarray(detections).reshape(-1, 6):
        if cls < 0:
            continue
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=2, ec="lime"))
        label = names[int(cls)] if int(cls) < len(names) else str(int(cls))
        ax.text(x1, y1, f"{label} {score:.2f}", color="black", fontsize=8, va="bottom",
                bbox={"facecolor": "lime", "alpha": 0.8, "pad": 1, "lw": 0})
    ax.set_axis_off()
    return ax


#: The built-in pipeline on the stand-in detector (``pipelines compile pipelines.examples.yolov5:pipeline``).
pipeline = build_pipeline()
