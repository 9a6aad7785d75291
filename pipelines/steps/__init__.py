"""Reusable steps for yolov5-style pipelines, for numpy and CuPy arrays alike:
``letterbox`` -> a detector -> ``nms`` -> ``scale_boxes``.

Each step lives in the module of its name, and the package's attribute is that
module, never the step (a step must not shadow its module):
``from pipelines.steps.nms import nms`` is the step, ``pipelines.steps.nms`` the
module. The package re-exports the helpers, factories, ``onnx_detector`` and ``onnx_model``.
"""

from __future__ import annotations

from . import detector, letterbox, nms, scale_boxes
from ._xp import array_namespace, to_numpy
from .detector import CLASS_NAMES, PALETTE, OnnxRuntimeDetector, find_rectangles, onnx_detector, stand_in_output
from .letterbox import LETTERBOX_SIZE, PAD_VALUE, LetterboxGeometry, letterbox_geometry, letterbox_images
from .nms import CONF_THRESHOLD, IOU_THRESHOLD, MAX_DET, NonMaxSuppression, nms_step, non_max_suppression
from .onnx_step import OnnxRuntimeStandIn, onnx_model
from .scale_boxes import scale_boxes_step, scale_detections

__all__ = [
    "CLASS_NAMES",
    "CONF_THRESHOLD",
    "IOU_THRESHOLD",
    "LETTERBOX_SIZE",
    "MAX_DET",
    "PAD_VALUE",
    "PALETTE",
    "LetterboxGeometry",
    "NonMaxSuppression",
    "OnnxRuntimeDetector",
    "OnnxRuntimeStandIn",
    "array_namespace",
    "detector",
    "find_rectangles",
    "letterbox",
    "letterbox_geometry",
    "letterbox_images",
    "nms",
    "nms_step",
    "non_max_suppression",
    "onnx_detector",
    "onnx_model",
    "scale_boxes",
    "scale_boxes_step",
    "scale_detections",
    "stand_in_output",
    "to_numpy",
]
