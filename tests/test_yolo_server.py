"""The yolov5-style pipeline, compiled to "all" and served by the real Triton server:
every true box is found with the right class and nothing else, through the ensemble
and both BLS forms, over HTTP and gRPC, and the answers equal the local runtime's."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.examples import yolov5
from pipelines.triton import TritonServer

SIZES = [(480, 640), (720, 1280), (640, 480), (333, 500), (1000, 300)]
FORMS = ("ensemble", "bls", "bls_sync", "fused")


# A model exported with a fixed batch of 1, as yolov5's default ONNX export is; Python
# here because the bundled server has only the Python backend. Its config is what
# onnx_detector compiles for such a file: max_batch_size 0, the batch of 1 in its dims.
_FIXED_BATCH_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            assert x.shape == (1, 4), x.shape
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x + 1).astype(np.float32))]))
        return out
"""


def fixed_batch_pipeline(model_file):
    from pipelines import Pipeline, TensorSpec, external_model, step

    row = TensorSpec("FP32", [4])

    @step(inputs={"x": row}, outputs={"y": row})
    def twice(x):
        return {"y": x * 2}

    one_at_a_time = external_model(
        "one_at_a_time", inputs={"x": row}, outputs={"y": row}, backend="python", model_file=model_file,
        model_filename="model.py", fixed_batch=1, stand_in=lambda x: {"y": x + 1},
    )
    p = Pipeline("fixed", inputs={"x": row}, max_batch_size=4)
    p.output("y", p.add(twice, name="after", x=p.add(one_at_a_time, x=p.add(twice, x=p.input("x"))["y"])["y"])["y"])
    return p


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("yolo")
    model_file = root / "fixed_model.py"
    model_file.write_text(_FIXED_BATCH_MODEL)
    path = yolov5.pipeline.compile("all").write(root / "models")
    fixed_batch_pipeline(model_file).compile("all").write(path)  # one repository, one server, both pipelines
    with TritonServer(path) as server:
        yield server


@pytest.fixture(scope="module")
def samples():
    out = []
    for seed, size in enumerate(SIZES):
        s = yolov5.make_sample(seed, n_objects=3 + seed, size=size)
        s["local"] = yolov5.pipeline.run({"image": s["image"][None]}, mode="ensemble")["detections"][0]
        out.append(s)
    return out


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("form", FORMS)
def test_every_true_box_is_found_on_the_server(served, samples, form, protocol):
    with served.client(protocol) as client:
        for s in samples:
            det = client.infer(f"yolov5_{form}", {"image": s["image"][None]})["detections"]
            assert det.shape == (1, 300, 6)
            cmp = yolov5.compare_to_truth(det[0], s["boxes"], s["classes"])
            assert not cmp.missed, f"{form}: missed true boxes {cmp.missed} in a {s['image'].shape} image"
            assert not cmp.extra, f"{form}: extra detections {cmp.extra}"
            assert cmp.min_iou >= 0.9
            np.testing.assert_allclose(det[0], s["local"], atol=1e-4)


@pytest.mark.server
def test_a_batch_of_same_sized_images_is_answered_per_image(served, samples):
    same = [yolov5.make_sample(seed, n_objects=4, size=(480, 640)) for seed in range(10, 13)]
    batch = np.stack([s["image"] for s in same])
    with served.client("http") as client:
        for form in FORMS:
            det = client.infer(f"yolov5_{form}", {"image": batch})["detections"]
            assert det.shape == (3, 300, 6)
            for row, s in zip(det, same, strict=False):
                assert yolov5.compare_to_truth(row, s["boxes"], s["classes"]).exact


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_fixed_batch_model_serves_inside_a_batching_pipeline(served, protocol, tmp_path):
    # Triton takes a composing model with max_batch_size 0 and dims [1, 4] in an ensemble that
    # batches up to 4, since the shapes agree once the batch axis is added; BLS passes [1, 4] as is.
    x = np.arange(4, dtype=np.float32)[None]
    with served.client(protocol) as client:
        config = client.model_config("fixed__one_at_a_time")
        assert int(config.get("max_batch_size", 0)) == 0
        assert [int(d) for d in config["input"][0]["dims"]] == [1, 4]
        for form in FORMS:
            np.testing.assert_array_equal(client.infer(f"fixed_{form}", {"x": x})["y"], (x * 2 + 1) * 2)
    (tmp_path / "model.py").write_text(_FIXED_BATCH_MODEL)
    local = fixed_batch_pipeline(tmp_path / "model.py")
    two = np.stack([x[0], x[0] + 10])
    np.testing.assert_array_equal(local.run({"x": two})["y"], (two * 2 + 1) * 2)  # locally, row by row
