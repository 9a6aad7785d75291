"""Detectors with yolov5's output layout ``[B, 25200, 85]``.

- ``detector``, a deterministic stand-in for yolov5 that needs no weights: it
  finds solid rectangles of the :data:`PALETTE` colours (colour = class) and
  writes them into yolov5's raw head rows, each with a crowd of overlapping,
  less confident candidates around it and low-confidence noise everywhere
  else, so NMS has the work it has on a real model's output.
- :func:`onnx_detector`, a real yolov5 ``.onnx`` file as an external Triton
  model (backend ``onnxruntime``) that runs locally through onnxruntime.

Row layout, as yolov5's Detect head: strides 8, 16, 32 on a 640 input; per
stride 3 anchors x the grid (80x80, 40x40, 20x20), row-major; each row is
cx, cy, w, h in input pixels, objectness, then 80 class scores.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StepDeclarationError, StepError
from ..step import Step, external_model, step
from ..tensor import TensorSpec
from ._xp import array_namespace, to_numpy
from .letterbox import LETTERBOX_SIZE
from .nms import NUM_CANDIDATES, NUM_CLASSES

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


class OnnxRuntimeDetector:
    """The local stand-in of :func:`onnx_detector`: an onnxruntime session on the file.

    :func:`onnx_detector` subclasses it with the file and tensor names set. A
    model with a fixed batch gets batches of exactly that size: the local
    runtime cuts larger ones (see :class:`~pipelines.step.ExternalModel`).
    """

    model_file: str = ""
    input_name: str = "images"
    output_name: str = "output0"
    input_dtype: str = "float32"
    providers: tuple[str, ...] | None = None
    step_name: str = "detector"

    def initialize(self, config: Mapping[str, Any] | None = None) -> None:
        try:
            import onnxruntime
        except ImportError:
            raise StepError(
                f"step {self.step_name!r} runs {self.model_file!r} locally through onnxruntime, which is "
                "not installed; install it with `pip install 'pipelines[onnx]'` (or onnxruntime-gpu)",
                step=self.step_name,
            ) from None
        if not os.path.exists(self.model_file):
            raise StepError(
                f"step {self.step_name!r}: ONNX model file {self.model_file!r} does not exist",
                step=self.step_name,
            )
        providers = list(self.providers) if self.providers else ["CPUExecutionProvider"]
        self.session = onnxruntime.InferenceSession(self.model_file, providers=providers)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if self.input_name not in inputs or self.output_name not in outputs:
            raise StepError(
                f"step {self.step_name!r}: {self.model_file!r} has inputs {inputs} and outputs "
                f"{outputs}, but the step declares input {self.input_name!r} and output {self.output_name!r}; "
                "pass input_name=... and output_name=... to onnx_detector",
                step=self.step_name,
            )

    def execute(self, **inputs: Any) -> dict[str, Any]:
        images = inputs[self.input_name]
        xp = array_namespace(images)
        host = np.ascontiguousarray(to_numpy(images), dtype=self.input_dtype)
        single = host.ndim == 3
        batch = host[None] if single else host
        result = np.asarray(self.session.run([self.output_name], {self.input_name: batch})[0])
        result = result[0] if single else result
        return {self.output_name: result if xp is np else xp.asarray(result)}

    def finalize(self) -> None:
        self.session = None


@dataclass(frozen=True)
class OnnxTensor:
    """One input or output of an ONNX file: its dtype and dims (``None`` where not a fixed size)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | None, ...]


def read_onnx_signature(model_file: str | os.PathLike[str]) -> tuple[list[OnnxTensor], list[OnnxTensor]]:
    """The graph inputs and outputs an ONNX file declares, read with ``onnx`` (weights are not loaded)."""
    path = os.fspath(model_file)
    try:
        import onnx
    except ImportError:
        raise StepDeclarationError(
            f"reading the input and output shapes of {path!r} needs the onnx package; "
            "install it with `pip install 'pipelines[onnx]'`"
        ) from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError… for a file that is not ONNX
        raise StepDeclarationError(f"{path!r} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    initializers = {t.name for t in model.graph.initializer}  # old exports list weights as inputs too

    def tensors(values: Any) -> list[OnnxTensor]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
            out.append(OnnxTensor(v.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
        return out

    return tensors(model.graph.input), tensors(model.graph.output)


def _pick(tensors: list[OnnxTensor], name: str | None, what: str, path: str, step_name: str) -> OnnxTensor:
    names = [t.name for t in tensors]
    if name is None:
        if len(tensors) != 1:
            raise StepDeclarationError(
                f"step {step_name!r}: {path!r} has {what}s {names}; name the image one with {what}_name=...",
                step=step_name,
            )
        return tensors[0]
    for t in tensors:
        if t.name == name:
            return t
    raise StepDeclarationError(
        f"step {step_name!r}: {path!r} has {what}s {names}, not {name!r}; pass {what}_name=... with one of them",
        step=step_name,
    )


def _batch_of(images: OnnxTensor, rows: OnnxTensor, path: str, step_name: str) -> int | None:
    """The fixed batch both tensors share, or None for a dynamic batch axis."""
    if len(images.dims) != 4 or len(rows.dims) != 3:
        raise StepDeclarationError(
            f"step {step_name!r}: {path!r} maps {images.name} {_shape(images)} to {rows.name} {_shape(rows)}; "
            "a yolov5 detector maps images [batch, 3, height, width] to rows [batch, candidates, 5 + classes]",
            step=step_name,
        )
    a, b = images.dims[0], rows.dims[0]
    if a != b:
        raise StepDeclarationError(
            f"step {step_name!r}: {path!r} has a batch of {a or 'any size'} in {images.name} but "
            f"{b or 'any size'} in {rows.name}; the two must agree",
            step=step_name,
        )
    return a


def _shape(t: OnnxTensor) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in t.dims) + "]"


def onnx_detector(
    model_file: str | os.PathLike[str],
    *,
    name: str = "detector",
    input_name: str | None = None,
    output_name: str | None = None,
    num_candidates: int | None = None,
    num_classes: int | None = None,
    providers: Sequence[str] | None = None,
    **options: Any,
) -> Step:
    """A yolov5 ``.onnx`` file as a detector step, declared from the file's own shapes.

    The file's one input (``images [batch, 3, 640, 640]``) and one output
    (``output0 [batch, 25200, 85]``) are read with ``onnx``; name them with
    ``input_name``/``output_name`` when there are several. A dynamic batch axis
    (``python export.py --dynamic``) compiles to a batching ``onnxruntime``
    model; a fixed one (the default export's batch of 1) compiles to
    ``max_batch_size: 0`` with the file's exact dims, and runs locally that many
    rows at a time. ``num_candidates``/``num_classes`` fill dims the file leaves
    open, and must match the ones it fixes. Locally it runs through onnxruntime
    (``pip install 'pipelines[onnx]'``), imported when the step is initialised.
    ``options`` are the step's model options.
    """
    path = os.path.abspath(os.fspath(model_file))
    if not os.path.isfile(path):
        raise StepDeclarationError(f"step {name!r}: ONNX model file {path!r} does not exist", step=name)
    file_inputs, file_outputs = read_onnx_signature(path)
    images = _pick(file_inputs, input_name, "input", path, name)
    rows = _pick(file_outputs, output_name, "output", path, name)
    fixed_batch = _batch_of(images, rows, path, name)
    candidates, width = rows.dims[1], rows.dims[2]
    for given, found, what in ((num_candidates, candidates, "num_candidates"),
                               (num_classes, None if width is None else width - 5, "num_classes")):
        if given is not None and found is not None and given != found:
            raise StepDeclarationError(
                f"step {name!r}: {what}={given} but {path!r} gives {rows.name} {_shape(rows)}; drop {what}",
                step=name,
            )
    if num_candidates is not None:
        candidates = num_candidates
    if num_classes is not None:
        width = 5 + num_classes
    stand_in = type(
        "OnnxDetector",
        (OnnxRuntimeDetector,),
        {
            "__module__": __name__,
            "model_file": path,
            "input_name": images.name,
            "output_name": rows.name,
            "input_dtype": images.dtype.name,
            "providers": tuple(providers) if providers else None,
            "step_name": name,
        },
    )
    return external_model(
        name,
        inputs={images.name: TensorSpec(images.dtype, [-1 if d is None else d for d in images.dims[1:]])},
        outputs={rows.name: TensorSpec(rows.dtype, [-1 if candidates is None else candidates,
                                                    -1 if width is None else width])},
        backend="onnxruntime",
        model_file=path,
        stand_in=stand_in,
        fixed_batch=fixed_batch,
        **options,
    )
