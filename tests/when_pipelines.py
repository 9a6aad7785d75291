"""Conditional pipelines (``when`` blocks) shared by the fast tests and the server tests."""

from __future__ import annotations

import numpy as np

from pipelines import Pipeline, TensorSpec, external_model, step

ROW = TensorSpec("FP32", [4])
FLAG = TensorSpec("BOOL", [1])

# A Python-backend model standing in for a detector (the bundled server has only the Python
# backend): the branch's step whose executions Triton counts. A row holding 666 fails it.
DETECTOR_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            if (x == 666).any():
                out.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError("detector: marker row")))
                continue
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x * 10).astype(np.float32))]))
        return out
"""


def _detector_stand_in(x):
    if (x == 666).any():
        raise ValueError("detector: marker row")
    return {"y": (x * 10).astype(np.float32)}


@step(inputs={"x": ROW}, outputs={"ok": FLAG, "big": FLAG})
def check(x):
    return {"ok": x[:, :1] > 0, "big": x[:, 1:2] > 0}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def plus_one(x):
    return {"y": x + 1}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def minus_one(x):
    return {"y": x - 1}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def doubled(x):
    return {"y": x * 2}


@step(inputs={"x": ROW}, outputs={"label": TensorSpec("BYTES", [1])})
def label(x):
    return {"label": np.array([[b"pos:%d" % int(r[0])] for r in x], dtype=object)}


def gated_pipeline(model_file: str | None = None, name: str = "gated") -> Pipeline:
    """Rows whose first value is positive run the detector and what follows it; rows whose
    second value is positive too run a nested block; the others take a light path."""
    detector = external_model(
        "detector", inputs={"x": ROW}, outputs={"y": ROW}, backend="python", model_file=model_file,
        model_filename="model.py", stand_in=_detector_stand_in,
    )
    p = Pipeline(name, inputs={"x": ROW}, max_batch_size=8)
    c = p.add(check, x=p.input("x"))
    with p.when(c["ok"]):
        d = p.add(detector, x=p.input("x"))
        post = p.add(plus_one, x=d["y"])
        named = p.add(label, x=d["y"])
        with p.when(c["big"]):
            bonus = p.add(doubled, x=post["y"])
    with p.when(~c["ok"]):
        light = p.add(minus_one, x=p.input("x"))
    p.output("y", post["y"], otherwise=-1)
    p.output("z", p.select(c["ok"], then=post["y"], otherwise=light["y"]))
    p.output("w", bonus["y"], otherwise=np.zeros(4, np.float32))
    p.output("label", named["label"], otherwise=b"neg")
    p.output("flag", c["ok"])
    return p


def expected(x: np.ndarray) -> dict[str, np.ndarray]:
    """What ``gated_pipeline`` answers, row by row, in plain numpy."""
    ok = x[:, :1] > 0
    big = x[:, 1:2] > 0
    post = x * 10 + 1
    return {
        "y": np.where(ok, post, -1).astype(np.float32),
        "z": np.where(ok, post, x - 1).astype(np.float32),
        "w": np.where(ok & big, post * 2, 0).astype(np.float32),
        "label": np.array([[b"pos:%d" % int(v) if o else b"neg"] for v, o in zip(x[:, 0] * 10, ok[:, 0], strict=True)],
                          dtype=object),
        "flag": ok,
    }


def rows(true: int, false: int, seed: int = 0) -> np.ndarray:
    """``true`` rows that run the branch (first value > 0), then ``false`` rows that do not."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2.0, size=(true + false, 4)).astype(np.float32)
    x[true:, 0] *= -1
    x[::2, 1] *= -1  # every other row skips the nested block
    return x
