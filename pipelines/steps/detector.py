"""Detectors with yolov5's output layout ``[B, 25200, 85]``.

- ``detector``, a deterministic stand-in for yolov5 that needs no weights: it
  finds solid rectangles of the :data:`PALETTE` colours (colour = class) and
  writes them into yolov5's raw head rows, each with a crowd of overlapping,
  less confident candidates around it and low-confidence noise everywhere
  else, so NMS has the work it has on a real model's output.
- :func:`onnx_detector` (:mod:`pipelines.steps.onnx_file`), a real yolov5 ``.onnx`` file
  as an external Triton model (backend ``onnxruntime``) that runs locally through onnxruntime.

Row layout, as yolov5's Detect head: strides 8, 16, 32 on a 640 input; per
stride 3 anchors x the grid (80x80, 40x40, 20x20), row-major; each row is
cx, cy, w, h in input pixels, objectness, then 80 class scores.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..core.step import step
from ..core.tensor import TensorSpec
from ..errors import StepError
from ._xp import array_namespace
from .letterbox import LETTERBOX_SIZE
from .nms import NUM_CANDIDATES, NUM_CLASSES

# Re-exported for their importers; none is in what the stand-in's by-value export carries.
from .onnx_file import OnnxRuntimeDetector, OnnxTensor, onnx_detector, read_onnx_signature

__all__ = [
    "ANCHORS",
    "CLASS_NAMES",
    "PALETTE",
    "STRIDES",
    "OnnxRuntimeDetector",
    "OnnxTensor",
    "detector",
    "find_rectangles",
    "onnx_detector",
    "read_onnx_signature",
    "stand_in_output",
]

STRIDES = (8, 16, 32)
#: yolov5s anchors (w, h) in input pixels, per stride.
ANCHORS = (
    ((10, 13), (16, 30), (33, 23)),
    ((30, 61), (62, 45), (59, 119)),
    ((116, 90), (156, 198), (373, 326)),
)
_GRIDS = tuple(LETTERBOX_SIZE // s for s in STRIDES)
_OFFSETS = (0, 3 * _GRIDS[0] ** 2, 3 * (_GRIDS[0] ** 2 + _GRIDS[1] ** 2))
assert _OFFSETS[2] + 3 * _GRIDS[2] ** 2 == NUM_CANDIDATES

#: The stand-in's classes, as BGR colours: class ``i`` is ``PALETTE[i]``. Each
#: colour has a channel at 0 or 255, so no mid-grey background or the 114
#: padding can be mistaken for one.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (0, 0, 255),      # red
    (0, 255, 0),      # green
    (255, 0, 0),      # blue
    (0, 255, 255),    # yellow
    (255, 0, 255),    # magenta
    (255, 255, 0),    # cyan
    (0, 128, 255),    # orange
    (255, 0, 128),    # violet
    (128, 255, 0),    # spring green
    (0, 0, 128),      # maroon
    (0, 128, 0),      # dark green
    (128, 0, 0),      # navy
    (255, 255, 255),  # white
    (0, 0, 0),        # black
)

#: yolov5's 80 COCO class names, in its class order.
CLASS_NAMES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange",
    "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant",
    "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush",
)
assert len(CLASS_NAMES) == NUM_CLASSES

# The stand-in's scores. A found object's own row has confidence 0.93 * 0.97;
# its candidates stay below that, so NMS keeps the exact box. The noise stays
# below the 0.25 threshold: most of it far below, every 101st row just below.
_OBJECT_OBJ, _OBJECT_CLS = 0.93, 0.97
_CANDIDATE_CLS, _OTHER_CLS = 0.9, 0.2
_NEAR_MISS_EVERY, _NEAR_MISS_OBJ, _NEAR_MISS_CLS = 101, 0.45, 0.5
# Neighbouring cells (and the cell itself) whose rows get candidates, at every stride and anchor.
_CELL_SHIFTS = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))


@functools.lru_cache(maxsize=1)
def _template() -> np.ndarray:
    """The noise every image starts from: anchor boxes on the grid, scores below threshold."""
    parts = []
    for s, g, anchors in zip(STRIDES, _GRIDS, ANCHORS, strict=True):
        gy, gx = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
        for aw, ah in anchors:
            xywh = np.stack(
                [(gx.ravel() + 0.5) * s, (gy.ravel() + 0.5) * s, np.full(g * g, aw), np.full(g * g, ah)], axis=1
            )
            parts.append(xywh)
    xywh = np.concatenate(parts)
    i = np.arange(NUM_CANDIDATES, dtype=np.float64)
    k = np.arange(NUM_CLASSES, dtype=np.float64)
    # Low-discrepancy fractions: deterministic, varied, and free of any RNG's version.
    obj = 0.002 + 0.03 * ((i * 0.7548776662) % 1.0)
    cls = 0.01 + 0.2 * ((i[:, None] * 0.5698402910 + k[None, :] * 0.3819660113) % 1.0)
    near = np.arange(0, NUM_CANDIDATES, _NEAR_MISS_EVERY)
    obj[near] = _NEAR_MISS_OBJ
    cls[near, near % NUM_CLASSES] = _NEAR_MISS_CLS
    out = np.concatenate([xywh, obj[:, None], cls], axis=1).astype(np.float32)
    out.setflags(write=False)
    return out


_device_templates: dict[tuple[str, int], Any] = {}


def _template_like(xp: Any, images: Any) -> Any:
    if xp is np:
        return _template()
    key = (xp.__name__, int(getattr(getattr(images, "device", None), "id", 0)))
    cached = _device_templates.get(key)
    if cached is None:
        cached = _device_templates[key] = xp.asarray(_template())
    return cached


def _palette_codes(xp: Any) -> tuple[Any, Any]:
    """Palette colours as sorted 24-bit RGB codes, and the class of each."""
    codes = np.array([(r << 16) | (g << 8) | b for b, g, r in PALETTE], dtype=np.int32)
    order = np.argsort(codes)
    return xp.asarray(codes[order]), xp.asarray(order.astype(np.int32))


def _labels(images: Any) -> Any:
    """Per pixel, the palette class of its colour or -1: ``[B, H, W]`` int32."""
    xp = array_namespace(images)
    q = xp.rint(images * 255).astype(xp.int32)
    code = (q[:, 0] << 16) | (q[:, 1] << 8) | q[:, 2]
    codes, classes = _palette_codes(xp)
    idx = xp.minimum(xp.searchsorted(codes, code), codes.shape[0] - 1)
    return xp.where(codes[idx] == code, classes[idx], xp.int32(-1))


def _run_lengths(lab: Any, b: Any, row: Any, col: Any) -> Any:
    """Length of the run of equal labels that starts at each ``(b, row, col)`` along a row.

    Row ends are forced breaks, so one cumulative sum over the whole batch finds
    every run's end with one binary search.
    """
    xp = array_namespace(lab)
    n, h, w = lab.shape
    breaks = xp.ones((n, h, w + 1), dtype=bool)
    breaks[:, :, 1:w] = lab[:, :, 1:] != lab[:, :, :-1]
    count = xp.cumsum(breaks.ravel(), dtype=xp.int64)
    start = (b * h + row) * (w + 1) + col
    return xp.searchsorted(count, count[start] + 1) - start


def find_rectangles(images: Any) -> tuple[Any, Any, Any]:
    """Solid palette-coloured rectangles in letterboxed ``[B, 3, H, W]`` RGB images in [0, 1].

    Returns ``batch`` (int), ``boxes`` (``[K, 4]`` FP32 x1, y1, x2, y2 pixel
    edges) and ``classes`` (int). A region is found by its top-left corner and
    the runs of its colour from there, so non-rectangular blobs come back as
    several boxes; regions thinner than 2 pixels are ignored.
    """
    xp = array_namespace(images)
    lab = _labels(images)
    up = xp.full_like(lab, -2)
    up[:, 1:] = lab[:, :-1]
    left = xp.full_like(lab, -2)
    left[:, :, 1:] = lab[:, :, :-1]
    b, y, x = xp.nonzero((lab >= 0) & (lab != up) & (lab != left))
    width = _run_lengths(lab, b, y, x)
    height = _run_lengths(xp.ascontiguousarray(lab.transpose(0, 2, 1)), b, x, y)
    big = (width >= 2) & (height >= 2)
    b, y, x, width, height = b[big], y[big], x[big], width[big], height[big]
    boxes = xp.stack([x, y, x + width, y + height], axis=1).astype(xp.float32)
    return b, boxes, lab[b, y, x]


def _row_index(xp: Any, si: Any, anchor: Any, gy: Any, gx: Any) -> Any:
    grids = xp.asarray(_GRIDS)[si]
    return xp.asarray(_OFFSETS)[si] + anchor * grids * grids + gy * grids + gx


def _fill_rows(template: Any, rows: Any, boxes: Any, obj: Any, cls: Any, score: Any, other: Any) -> Any:
    """Template rows with their box, objectness and two class scores replaced."""
    xp = array_namespace(template)
    vals = template[rows]
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    vals[:, 0], vals[:, 1] = cx, cy
    vals[:, 2], vals[:, 3] = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    vals[:, 4] = obj
    at = xp.arange(rows.shape[0])
    vals[at, 5 + (cls + 1 + at % 3) % NUM_CLASSES] = other
    vals[at, 5 + cls] = score
    return vals


@functools.lru_cache(maxsize=1)
def _jitter() -> np.ndarray:
    """Per candidate slot: x shift, y shift (fractions of w, h), w and h scale, objectness.

    A shift of <= 4% and a scale of <= 6% keep every candidate's IoU with its
    object above 0.6, so NMS at 0.45 suppresses all of them.
    """
    j = np.arange(len(STRIDES) * len(_CELL_SHIFTS) * 3, dtype=np.float64)
    return np.stack(
        [
            0.04 * np.sin(1.7 * j + 0.3),
            0.04 * np.cos(2.3 * j + 0.1),
            1 + 0.06 * np.sin(0.9 * j + 0.5),
            1 + 0.06 * np.cos(1.3 * j),
            0.25 + 0.55 * ((j * 0.6180339887) % 1.0),
        ],
        axis=1,
    ).astype(np.float32)


def stand_in_output(images: Any) -> Any:
    """The stand-in detector's raw ``[B, 25200, 85]`` rows for ``[B, 3, 640, 640]`` images."""
    xp = array_namespace(images)
    single = images.ndim == 3
    batch = images[None] if single else images
    if tuple(batch.shape[1:]) != (3, LETTERBOX_SIZE, LETTERBOX_SIZE):
        raise StepError(
            f"step 'detector' input 'images' has shape {list(images.shape)}; expected "
            f"[B, 3, {LETTERBOX_SIZE}, {LETTERBOX_SIZE}] letterboxed RGB images in [0, 1]",
            step="detector", tensor="images",
        )
    template = _template_like(xp, batch)
    out = xp.broadcast_to(template, (batch.shape[0],) + template.shape).copy()
    b, boxes, cls = find_rectangles(batch)
    k = int(b.shape[0])
    if k:
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        strides = xp.asarray(STRIDES, dtype=xp.float32)
        grids = xp.asarray(_GRIDS)
        anchors = xp.asarray(ANCHORS, dtype=xp.float32)  # [3 strides, 3 anchors, (w, h)]

        # The object's own row: the coarsest stride no larger than its short side
        # (so no two disjoint objects share a cell), the best-shaped anchor there.
        side = xp.minimum(w, h)
        si = (side >= 16).astype(xp.int64) + (side >= 32).astype(xp.int64)
        aw, ah = anchors[si, :, 0], anchors[si, :, 1]
        mismatch = xp.maximum(
            xp.maximum(w[:, None] / aw, aw / w[:, None]), xp.maximum(h[:, None] / ah, ah / h[:, None])
        )
        anchor = xp.argmin(mismatch, axis=1)
        gx = (cx / strides[si]).astype(xp.int64)
        gy = (cy / strides[si]).astype(xp.int64)
        main_rows = _row_index(xp, si, anchor, xp.minimum(gy, grids[si] - 1), xp.minimum(gx, grids[si] - 1))
        main_keys = b * NUM_CANDIDATES + main_rows

        # Candidates: every stride x nearby cell x anchor, jittered, less confident.
        n_slots = len(STRIDES) * len(_CELL_SHIFTS) * 3
        slot_si = xp.repeat(xp.arange(len(STRIDES)), len(_CELL_SHIFTS) * 3)
        shifts = xp.asarray(_CELL_SHIFTS)
        slot_dx = xp.tile(xp.repeat(shifts[:, 0], 3), len(STRIDES))
        slot_dy = xp.tile(xp.repeat(shifts[:, 1], 3), len(STRIDES))
        slot_anchor = xp.tile(xp.arange(3), len(STRIDES) * len(_CELL_SHIFTS))
        g = grids[slot_si][None, :]
        cgx = xp.clip((cx[:, None] / strides[slot_si][None, :]).astype(xp.int64) + slot_dx[None, :], 0, g - 1)
        cgy = xp.clip((cy[:, None] / strides[slot_si][None, :]).astype(xp.int64) + slot_dy[None, :], 0, g - 1)
        cand_rows = _row_index(xp, slot_si[None, :], slot_anchor[None, :], cgy, cgx).ravel()
        cand_b = xp.repeat(b, n_slots)
        jit = xp.asarray(_jitter())
        jcx = (cx[:, None] + jit[None, :, 0] * w[:, None]).ravel()
        jcy = (cy[:, None] + jit[None, :, 1] * h[:, None]).ravel()
        jw = (w[:, None] * jit[None, :, 2]).ravel()
        jh = (h[:, None] * jit[None, :, 3]).ravel()
        cand_boxes = xp.stack([jcx - jw / 2, jcy - jh / 2, jcx + jw / 2, jcy + jh / 2], axis=1)
        cand_obj = xp.tile(jit[:, 4], k)
        cand_cls = xp.repeat(cls, n_slots)

        # One value per row, so the writes are deterministic on GPU too: an
        # object's own row always wins, and among candidates the first one does.
        keys = cand_b * NUM_CANDIDATES + cand_rows
        keys = xp.where(xp.isin(keys, main_keys), -1, keys)
        uniq, first = xp.unique(keys, return_index=True)
        first = first[uniq >= 0]
        cand = _fill_rows(
            template, cand_rows[first], cand_boxes[first], cand_obj[first], cand_cls[first],
            xp.float32(_CANDIDATE_CLS), xp.float32(_OTHER_CLS),
        )
        out[cand_b[first], cand_rows[first]] = cand
        own = _fill_rows(
            template, main_rows, boxes, xp.float32(_OBJECT_OBJ), cls,
            xp.float32(_OBJECT_CLS), xp.float32(_OTHER_CLS),
        )
        out[b, main_rows] = own
    return out[0] if single else out


@step(
    inputs={"images": TensorSpec("FP32", [3, LETTERBOX_SIZE, LETTERBOX_SIZE])},
    outputs={"output0": TensorSpec("FP32", [NUM_CANDIDATES, 5 + NUM_CLASSES])},
)
def detector(images: Any) -> dict[str, Any]:
    """A weight-free yolov5 stand-in: palette rectangles in, yolov5's raw rows out."""
    return {"output0": stand_in_output(images)}
