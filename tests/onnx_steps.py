"""The Python steps around the ONNX model of tests/test_onnx_stand_in.py, in a module that imports
only the package's public names, so that they travel into the repository as a user's would."""

from __future__ import annotations

from pipelines import TensorSpec, step

X = TensorSpec("FP32", [4])
SCORES = TensorSpec("FP32", [3])


@step(inputs={"x": X}, outputs={"x2": X})
def pre(x):
    return {"x2": x * 2}


@step(inputs={"scores": SCORES}, outputs={"z": SCORES})
def post(scores):
    return {"z": scores + 1}
