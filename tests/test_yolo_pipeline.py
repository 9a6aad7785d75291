"""The yolov5-style pipeline end to end, locally: sample images with known boxes
go in, and exactly those boxes (IoU >= 0.9, right class) come out.
"""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipelines.core.step import check_outputs
from pipelines.errors import PipelinesError
from pipelines.examples.yolov5 import (
    build_pipeline,
    class_names,
    compare_to_truth,
    draw_detections,
    make_sample,
    palette,
    pipeline,
)
from pipelines.runtime.local import MODES, run_many
from pipelines.steps import onnx_detector

# (seed, objects, (height, width)): landscape, portrait, tiny (upscaled), huge (downscaled), square.
SAMPLES = [
    (0, 6, (480, 640)),
    (1, 8, (1080, 1920)),
    (2, 5, (300, 200)),
    (3, 3, (64, 90)),
    (4, 10, (2000, 1500)),
    (5, 12, (640, 640)),
]


def run_plain(p, inputs):
    """The pipeline's steps called one after another as plain Python (``Step.__call__``)."""
    values = {(None, name): value for name, value in inputs.items()}
    for node in p:
        args = {i: values[(ref.node, ref.name)] for i, ref in node.bindings.items()}
        outputs = node.step(**args)
        check_outputs(node.step, outputs, batched=True, batch_size=len(next(iter(inputs.values()))))
        values.update({(node.name, k): v for k, v in outputs.items()})
    return {name: values[(ref.node, ref.name)] for name, ref in p.outputs.items()}


def assert_found_exactly(detections, sample):
    result = compare_to_truth(detections, sample["boxes"], sample["classes"], iou_threshold=0.9)
    assert not result.missed, f"true boxes {result.missed} not found: {sample['boxes'][list(result.missed)]}"
    assert not result.extra, f"extra detections above threshold: {detections[list(result.extra)]}"
    assert len(result.matches) == len(sample["boxes"])


@pytest.fixture(scope="module")
def samples():
    return [make_sample(seed, n, size) for seed, n, size in SAMPLES]


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[f"{h}x{w}" for _, _, (h, w) in SAMPLES])
def test_plain_steps_find_every_true_box_and_nothing_else(samples, index):
    sample = samples[index]
    out = run_plain(pipeline, {"image": sample["image"][None]})["detections"]
    assert out.shape == (1, 300, 6)
    assert_found_exactly(out[0], sample)
    assert (out[0, len(sample["boxes"]):] == np.array([0, 0, 0, 0, 0, -1], np.float32)).all()


@pytest.mark.parametrize("mode", MODES)
def test_local_runtime_finds_every_box_in_every_mode(samples, mode):
    # A batch of three images of one size, then single images of other sizes in one runtime.
    batch = [make_sample(10 + i, 4 + i, (360, 500)) for i in range(3)]
    out = pipeline.run({"image": np.stack([s["image"] for s in batch])}, mode=mode)["detections"]
    assert out.shape == (3, 300, 6)
    for detections, sample in zip(out, batch, strict=True):
        assert_found_exactly(detections, sample)
    singles = [samples[i] for i in (0, 2, 3)]
    results, _ = run_many(pipeline, [{"image": s["image"][None]} for s in singles], mode=mode, concurrency=3)
    for result, sample in zip(results, singles, strict=True):
        np.testing.assert_array_equal(result["detections"], run_plain(pipeline, {"image": sample["image"][None]})["detections"])
        assert_found_exactly(result["detections"][0], sample)


def test_a_non_batching_pipeline_takes_one_image_without_a_batch_dimension(samples):
    p = build_pipeline(max_batch_size=0, name="yolo_single")
    out = p.run({"image": samples[2]["image"]}, mode="bls-sync")["detections"]
    assert out.shape == (300, 6)
    assert_found_exactly(out, samples[2])


def test_make_sample_draws_what_it_reports():
    a, b = make_sample(42, 7, (400, 300)), make_sample(42, 7, (400, 300))
    for key in ("image", "boxes", "classes"):
        np.testing.assert_array_equal(a[key], b[key])  # same seed, same sample
    image, boxes, classes = a["image"], a["boxes"], a["classes"]
    assert image.shape == (400, 300, 3) and image.dtype == np.uint8
    assert boxes.shape == (7, 4) and classes.shape == (7,) and len(set(classes.tolist())) > 1
    covered = np.zeros((400, 300), bool)
    for (x1, y1, x2, y2), cls in zip(boxes.astype(int), classes, strict=True):
        assert 0 <= x1 < x2 <= 300 and 0 <= y1 < y2 <= 400
        assert not covered[y1:y2, x1:x2].any()  # objects do not overlap
        covered[y1:y2, x1:x2] = True
        assert (image[y1:y2, x1:x2] == palette[cls]).all()
    background = image[~covered]
    assert not any((background == colour).all(axis=1).any() for colour in palette)
    assert background.std() > 0  # textured, not flat
    with pytest.raises(PipelinesError, match="could not place 50 objects"):
        make_sample(0, 50, (64, 64))


def test_compare_to_truth_counts_misses_and_extras(samples):
    sample = samples[0]
    det = run_plain(pipeline, {"image": sample["image"][None]})["detections"][0].copy()
    assert compare_to_truth(det, sample["boxes"], sample["classes"]).exact
    det[0, 5] = (det[0, 5] + 1) % len(palette)  # wrong class: a miss and an extra
    det[1, :4] += 25  # far off: another miss and extra
    result = compare_to_truth(det, sample["boxes"], sample["classes"])
    assert len(result.missed) == 2 and sorted(result.extra) == [0, 1]


def test_draw_detections_draws_every_box(samples):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sample = samples[0]
    det = run_plain(pipeline, {"image": sample["image"][None]})["detections"][0]
    fig, ax = plt.subplots()
    draw_detections(ax, sample["image"], det, truth=sample["boxes"])
    assert len(ax.patches) == 2 * len(sample["boxes"])
    assert {t.get_text().rsplit(" ", 1)[0] for t in ax.texts} <= set(class_names)
    plt.close(fig)


def _yolo_onnx(path, *, n_classes=80):
    """A tiny ONNX 'detector' with yolov5's signature that finds one fixed box of class 2."""
    import onnx
    from onnx import TensorProto, helper

    width = 5 + n_classes
    row = np.zeros((25200, width), np.float32)
    row[123, :5] = (320, 320, 100, 60, 0.9)
    row[123, 7] = 0.9
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["images"], ["mean"], axes=[1, 2, 3], keepdims=1),  # [N, 1, 1, 1]
            helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
            helper.make_node("Reshape", ["nothing", "shape"], ["batch_zero"]),  # [N, 1, 1]
            helper.make_node("Add", ["batch_zero", "rows"], ["output0"]),
        ],
        "tiny_yolo",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 640, 640])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 25200, width])],
        initializer=[
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("shape", TensorProto.INT64, [3], [-1, 1, 1]),
            helper.make_tensor("rows", TensorProto.FLOAT, [1, 25200, width], row.ravel()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_onnx_detector_pipeline_runs_locally_and_compiles_to_onnxruntime(tmp_path):
    path = _yolo_onnx(tmp_path / "yolov5s.onnx")
    p = build_pipeline(detector=onnx_detector(path), name="yolo_onnx")
    image = np.full((2, 480, 640, 3), 128, np.uint8)
    out = p.run({"image": image}, mode="bls")["detections"]
    # The fixed box (270, 290)-(370, 350) in the letterbox is (270, 210)-(370, 270) in a 480x640 image.
    np.testing.assert_allclose(out[:, 0], [[270, 210, 370, 270, np.float32(0.81), 2]] * 2, rtol=1e-6)
    assert (out[:, 1:, 5] == -1).all()

    written = p.compile("ensemble").write(tmp_path / "repo")
    model_dir = written / "yolo_onnx__detector"
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.backend == "onnxruntime" and config.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in config.input] == [("images", [3, 640, 640])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("output0", [25200, 85])]
    assert (model_dir / "1" / "model.onnx").read_bytes() == path.read_bytes()
    ensemble = text_format.Parse((written / "yolo_onnx" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [
        "yolo_onnx__letterbox", "yolo_onnx__detector", "yolo_onnx__nms", "yolo_onnx__scale_boxes",
    ]


def test_build_pipeline_fits_nms_to_the_detectors_classes(tmp_path):
    path = _yolo_onnx(tmp_path / "three.onnx", n_classes=3)
    p = build_pipeline(detector=onnx_detector(path, num_classes=3), max_batch_size=4)
    assert p.nodes["nms"].step.inputs["candidates"].dims == (25200, 8)
    out = p.run({"image": np.full((1, 100, 100, 3), 128, np.uint8)}, mode="bls-sync")["detections"]
    # 100x100 is scaled by 6.4 with no padding: (270, 290)-(370, 350) comes back divided by 6.4.
    np.testing.assert_allclose(out[0, 0], [270 / 6.4, 290 / 6.4, 370 / 6.4, 350 / 6.4, 0.81, 2], rtol=1e-6)
    assert int((out[0, :, 5] >= 0).sum()) == 1


def test_the_built_in_pipeline_declares_what_users_send_and_get():
    assert [n.name for n in pipeline] == ["letterbox", "detector", "nms", "scale_boxes"]
    assert pipeline.max_batch_size == 8 and str(pipeline.inputs["image"]) == "UINT8 [-1, -1, 3]"
    assert str(pipeline.outputs["detections"].spec) == "FP32 [300, 6]"
    assert pipeline.nodes["nms"].step.options.parameters["conf_threshold"] == 0.25  # parameters keep their type
