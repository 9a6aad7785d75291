"""The yolov5-style pipeline, compiled to "both" and served by the real Triton server:
every true box is found with the right class and nothing else, through the ensemble
and both BLS forms, over HTTP and gRPC, and the answers equal the local runtime's."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.examples import yolov5
from pipelines.triton import TritonServer

SIZES = [(480, 640), (720, 1280), (640, 480), (333, 500), (1000, 300)]
FORMS = ("ensemble", "bls", "bls_sync")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = yolov5.pipeline.compile("both")
    path = repo.write(tmp_path_factory.mktemp("yolo") / "models")
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
