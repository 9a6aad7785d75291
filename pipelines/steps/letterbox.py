"""``letterbox``: yolov5's pre-processing, for numpy and CuPy images alike.

An HWC ``uint8`` BGR image of any size is resized keeping its aspect ratio to
fit 640x640, padded with grey 114, turned RGB, CHW and scaled to [0, 1] FP32.
It also returns the geometry that :mod:`~pipelines.steps.scale_boxes` needs
to map boxes back onto the original image.

Batching: a batch is one array ``[B, H, W, 3]``, so every image in it shares
one size; a request usually carries one image (``B = 1``) and Triton's dynamic
batcher only groups requests whose shapes agree. Resizing is nearest-neighbour
by integer index gathers (no OpenCV or PIL): solid colours stay exact, which
the stand-in detector relies on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.step import step
from ..core.tensor import TensorSpec
from ..errors import StepError
from ._xp import array_namespace

__all__ = ["LETTERBOX_SIZE", "PAD_VALUE", "LetterboxGeometry", "letterbox", "letterbox_geometry", "letterbox_images"]

#: The square side the detector expects, as yolov5's default export.
LETTERBOX_SIZE = 640
#: yolov5 pads with this grey; it is no palette colour of the stand-in detector.
PAD_VALUE = 114


@dataclass(frozen=True)
class LetterboxGeometry:
    """Where an image of ``height`` x ``width`` lands in the square.

    A point ``x`` of the original image lands at ``x * gain_x + left``.
    ``gain_x`` and ``gain_y`` differ from the ideal ratio only by the rounding
    of the resized size, and keeping both makes :func:`scale_boxes` exact.
    """

    height: int
    width: int
    new_height: int
    new_width: int
    top: int
    left: int

    @property
    def gain_x(self) -> float:
        return self.new_width / self.width

    @property
    def gain_y(self) -> float:
        return self.new_height / self.height

    def ratio_pad(self) -> tuple[float, float, float, float]:
        """``(gain_x, gain_y, pad_x, pad_y)``, the ``ratio_pad`` tensor's row."""
        return (self.gain_x, self.gain_y, float(self.left), float(self.top))


def letterbox_geometry(height: int, width: int, *, size: int = LETTERBOX_SIZE) -> LetterboxGeometry:
    """The letterbox of an image of ``height`` x ``width`` into ``size`` x ``size``."""
    ratio = min(size / height, size / width)
    new_h = min(size, max(1, round(height * ratio)))
    new_w = min(size, max(1, round(width * ratio)))
    # yolov5 splits odd padding as round(d - 0.1) / round(d + 0.1): the smaller half goes first.
    return LetterboxGeometry(height, width, new_h, new_w, (size - new_h) // 2, (size - new_w) // 2)


def letterbox_images(image: Any, *, size: int = LETTERBOX_SIZE, step_name: str = "letterbox") -> dict[str, Any]:
    """Letterbox ``[B, H, W, 3]`` (or one ``[H, W, 3]``) uint8 BGR images; see the module docstring.

    Returns ``images`` FP32 ``[B, 3, size, size]``, ``ratio_pad`` FP32 ``[B, 4]``
    (gain_x, gain_y, pad_x, pad_y) and ``orig_size`` INT32 ``[B, 2]`` (height, width);
    without a batch dimension in, none comes out.
    """
    xp = array_namespace(image)
    single = image.ndim == 3
    batch = image[None] if single else image
    if batch.ndim != 4 or batch.shape[-1] != 3 or batch.shape[1] == 0 or batch.shape[2] == 0:
        raise StepError(
            f"step {step_name!r} input 'image' has shape {list(image.shape)}; expected HWC BGR images "
            "[H, W, 3] (or [B, H, W, 3]) with H, W > 0",
            step=step_name, tensor="image",
        )
    if batch.dtype != xp.uint8:
        raise StepError(
            f"step {step_name!r} input 'image' has dtype {batch.dtype}; expected uint8 (UINT8), "
            "as OpenCV loads images",
            step=step_name, tensor="image",
        )
    n, height, width = int(batch.shape[0]), int(batch.shape[1]), int(batch.shape[2])
    geo = letterbox_geometry(height, width, size=size)
    # Source row of each target row, sampled at pixel centres, in exact integer arithmetic.
    ys = ((2 * xp.arange(geo.new_height) + 1) * height) // (2 * geo.new_height)
    xs = ((2 * xp.arange(geo.new_width) + 1) * width) // (2 * geo.new_width)
    resized = batch[:, ys[:, None], xs[None, :], ::-1]  # [B, h, w, 3], BGR -> RGB
    images = xp.full((n, 3, size, size), PAD_VALUE, dtype=xp.float32)
    images[:, :, geo.top : geo.top + geo.new_height, geo.left : geo.left + geo.new_width] = resized.transpose(0, 3, 1, 2)
    images /= 255.0
    ratio_pad = xp.asarray([geo.ratio_pad()] * n, dtype=xp.float32)
    orig_size = xp.asarray([[height, width]] * n, dtype=xp.int32)
    if single:
        return {"images": images[0], "ratio_pad": ratio_pad[0], "orig_size": orig_size[0]}
    return {"images": images, "ratio_pad": ratio_pad, "orig_size": orig_size}


@step(
    inputs={"image": TensorSpec("UINT8", [-1, -1, 3])},
    outputs={
        "images": TensorSpec("FP32", [3, LETTERBOX_SIZE, LETTERBOX_SIZE]),
        "ratio_pad": TensorSpec("FP32", [4]),
        "orig_size": TensorSpec("INT32", [2]),
    },
)
def letterbox(image: Any) -> dict[str, Any]:
    """yolov5's letterbox: 640x640 RGB CHW FP32 in [0, 1], plus the geometry to undo it."""
    return letterbox_images(image)
