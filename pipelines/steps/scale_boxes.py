"""``scale_boxes``: map ``nms`` detections from the 640x640 letterbox back onto
the original image's pixels, clipped to the image; padding rows stay padding.
"""

from __future__ import annotations

from typing import Any

from ..core.step import step
from ..core.tensor import TensorSpec
from ._xp import array_namespace
from .nms import MAX_DET

__all__ = ["scale_boxes", "scale_boxes_step", "scale_detections"]


def scale_detections(detections: Any, ratio_pad: Any, orig_size: Any) -> Any:
    """Undo the letterbox on ``[B, D, 6]`` detections (or one ``[D, 6]``).

    ``ratio_pad`` is ``[B, 4]`` (gain_x, gain_y, pad_x, pad_y) and
    ``orig_size`` ``[B, 2]`` (height, width), as ``letterbox`` returns them.
    Rows with class ``-1`` are padding and come back unchanged.
    """
    xp = array_namespace(detections, ratio_pad, orig_size)
    single = detections.ndim == 2
    det = detections[None] if single else detections
    rp = (ratio_pad[None] if single else ratio_pad).astype(xp.float32)
    size = (orig_size[None] if single else orig_size).astype(xp.float32)
    gain_x, gain_y = rp[:, 0:1], rp[:, 1:2]
    pad_x, pad_y = rp[:, 2:3], rp[:, 3:4]
    height, width = size[:, 0:1], size[:, 1:2]
    zero = xp.float32(0)
    x1 = xp.clip((det[:, :, 0] - pad_x) / gain_x, zero, width)
    y1 = xp.clip((det[:, :, 1] - pad_y) / gain_y, zero, height)
    x2 = xp.clip((det[:, :, 2] - pad_x) / gain_x, zero, width)
    y2 = xp.clip((det[:, :, 3] - pad_y) / gain_y, zero, height)
    scaled = xp.stack([x1, y1, x2, y2], axis=2)
    valid = (det[:, :, 5] >= 0)[:, :, None]
    out = det.copy()
    out[:, :, :4] = xp.where(valid, scaled, det[:, :, :4])
    return out[0] if single else out


def scale_boxes_step(*, name: str = "scale_boxes", max_det: int = MAX_DET, **options: Any):
    """A ``scale_boxes`` step for ``[max_det, 6]`` detections; ``options`` are model options."""
    return step(
        _scale_boxes,
        name=name,
        inputs={
            "detections": TensorSpec("FP32", [max_det, 6]),
            "ratio_pad": TensorSpec("FP32", [4]),
            "orig_size": TensorSpec("INT32", [2]),
        },
        outputs={"detections": TensorSpec("FP32", [max_det, 6])},
        **options,
    )


def _scale_boxes(detections: Any, ratio_pad: Any, orig_size: Any) -> dict[str, Any]:
    return {"detections": scale_detections(detections, ratio_pad, orig_size)}


#: Detections in original-image pixels, for ``nms``'s 300 rows.
scale_boxes = scale_boxes_step()
