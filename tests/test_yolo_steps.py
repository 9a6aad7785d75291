"""The yolov5 steps one by one: letterbox, the stand-in and ONNX detectors, nms, scale_boxes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.core.step import check_outputs
from pipelines.errors import StepDeclarationError, StepError
from pipelines.examples.yolov5 import make_sample
from pipelines.steps import (
    PALETTE,
    array_namespace,
    find_rectangles,
    letterbox_geometry,
    nms_step,
    non_max_suppression,
    onnx_detector,
    scale_detections,
)
from pipelines.steps.detector import ANCHORS, STRIDES, detector
from pipelines.steps.letterbox import letterbox
from pipelines.steps.nms import nms
from pipelines.steps.scale_boxes import scale_boxes

F32 = np.float32


# --------------------------------------------------------------------------- reference NMS


def reference_nms(pred: np.ndarray, conf_threshold: float, iou_threshold: float, max_det: int) -> np.ndarray:
    """Greedy class-aware NMS written the slow, obvious way: loops over rows, classes and kept boxes.

    It computes in float32 scalars, as the step does, so the two agree bit for bit.
    """
    ct, it = F32(conf_threshold), F32(iou_threshold)
    candidates = []
    for i in range(pred.shape[0]):
        row = pred[i]
        if not row[4] > ct:
            continue
        best, best_class = None, -1
        for c in range(pred.shape[1] - 5):
            score = row[5 + c] * row[4]
            if best is None or score > best:
                best, best_class = score, c
        if best > ct:
            hw, hh = row[2] / F32(2), row[3] / F32(2)
            candidates.append((best, (row[0] - hw, row[1] - hh, row[0] + hw, row[1] + hh), best_class))
    candidates.sort(key=lambda c: -c[0])  # stable: equal scores keep row order

    def iou(a, b):
        iw = max(F32(0), min(a[2], b[2]) - max(a[0], b[0]))
        ih = max(F32(0), min(a[3], b[3]) - max(a[1], b[1]))
        inter = iw * ih
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / max(union, F32(1e-9))

    kept = []
    for score, box, cls in candidates:
        if all(k[2] != cls or not iou(k[1], box) > it for k in kept):
            kept.append((score, box, cls))
    out = np.zeros((max_det, 6), F32)
    out[:, 5] = -1
    for r, (score, box, cls) in enumerate(kept[:max_det]):
        out[r] = (*box, score, cls)
    return out


@st.composite
def predictions(draw):
    """Raw rows in clusters of similar boxes, so suppression chains and class clashes are common.

    Coordinates are multiples of 0.5 and scores of 1/16: float32 holds every
    product exactly, so only the order of operations could make two NMS differ.
    """
    n_classes = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 2))
    clusters = draw(st.lists(st.tuples(st.integers(16, 112), st.integers(16, 112), st.integers(8, 48),
                                       st.integers(8, 48)), min_size=1, max_size=3))
    jitter = st.integers(-12, 12).map(lambda v: v / 2)
    grow = st.integers(-16, 16).map(lambda v: v / 2)
    prob = st.integers(0, 16).map(lambda v: v / 16)
    row = st.tuples(st.sampled_from(clusters), jitter, jitter, grow, grow, st.lists(prob, min_size=n_classes + 1,
                                                                                    max_size=n_classes + 1))
    images = [draw(st.lists(row, min_size=4, max_size=48)) for _ in range(batch)]
    pred = np.zeros((batch, max(1, *map(len, images)), 5 + n_classes), F32)
    for b, rows in enumerate(images):
        for i, ((cx, cy, w, h), dx, dy, dw, dh, scores) in enumerate(rows):
            pred[b, i] = (cx + dx, cy + dy, max(0.5, w + dw), max(0.5, h + dh), *scores)
    return pred


@settings(max_examples=80, deadline=None)
@given(
    pred=predictions(),
    conf=st.sampled_from([0.1, 0.25, 0.5]),
    iou=st.sampled_from([0.3, 0.45, 0.7]),
    max_det=st.sampled_from([1, 3, 300]),
)
def test_nms_equals_brute_force_reference(pred, conf, iou, max_det):
    got = non_max_suppression(pred, conf_threshold=conf, iou_threshold=iou, max_det=max_det)
    assert got.shape == (pred.shape[0], max_det, 6) and got.dtype == np.float32
    for b in range(pred.shape[0]):
        np.testing.assert_array_equal(got[b], reference_nms(pred[b], conf, iou, max_det))


@settings(max_examples=40, deadline=None)
@given(pred=predictions(), iou=st.sampled_from([0.3, 0.45]))
def test_nms_classes_are_independent(pred, iou):
    # One-hot class scores: each row belongs to one class whatever the others hold.
    pred = pred[:1].copy()
    n_classes = pred.shape[2] - 5
    owner = np.arange(pred.shape[1]) % n_classes
    pred[0, :, 5:] = np.eye(n_classes, dtype=F32)[owner]
    together = non_max_suppression(pred, iou_threshold=iou)[0]
    for c in range(n_classes):
        alone = pred.copy()
        alone[0, owner != c, 4] = 0  # only class c's rows
        mine = non_max_suppression(alone, iou_threshold=iou)[0]
        np.testing.assert_array_equal(together[together[:, 5] == c], mine[mine[:, 5] == c])


def test_nms_is_greedy_a_suppressed_box_suppresses_nothing():
    # A overlaps B, B overlaps C, A hardly overlaps C: greedy NMS drops B and so keeps C
    # (a one-pass "Fast NMS" would drop C too).
    pred = np.zeros((3, 6), F32)
    pred[:, 0] = (5, 8, 11)  # x-centres of 10x10 boxes: IoU(A,B) = IoU(B,C) = 7/13, IoU(A,C) = 1/4
    pred[:, 1:4] = (5, 10, 10)
    pred[:, 4] = 1.0
    pred[:, 5] = (0.9, 0.8, 0.7)
    out = non_max_suppression(pred)
    np.testing.assert_array_equal(out[:3, :5], F32([[0, 0, 10, 10, 0.9], [6, 0, 16, 10, 0.7], [0, 0, 0, 0, 0]]))


def test_nms_keeps_identical_boxes_of_different_classes_and_pads():
    pred = np.zeros((4, 7), F32)
    pred[:, :4] = (100, 100, 50, 50)
    pred[:, 4] = 1.0
    pred[0, 5], pred[1, 5], pred[2, 6], pred[3, 5] = 0.9, 0.8, 0.7, 0.1  # two class-0 twins, one class-1
    out = non_max_suppression(pred)
    assert out.shape == (300, 6)
    np.testing.assert_array_equal(out[:2], [[75, 75, 125, 125, F32(0.9), 0], [75, 75, 125, 125, F32(0.7), 1]])
    np.testing.assert_array_equal(out[2:], np.tile(np.array([0, 0, 0, 0, 0, -1], F32), (298, 1)))


def test_nms_truncates_to_max_det_by_score():
    n = 12
    pred = np.zeros((n, 6), F32)
    pred[:, 0] = np.arange(n) * 100  # disjoint boxes
    pred[:, 1:4] = (50, 20, 20)
    pred[:, 4] = 1.0
    pred[:, 5] = np.linspace(0.3, 0.9, n, dtype=F32)
    out = non_max_suppression(pred, max_det=5)
    np.testing.assert_array_equal(out[:, 4], pred[::-1, 5][:5])


def test_nms_step_reads_thresholds_from_config_like_triton_and_the_runtime():
    pred = np.zeros((1, 25200, 85), F32)
    pred[0, :2, :4] = [(100, 100, 40, 40), (104, 100, 40, 40)]  # IoU ~0.82
    pred[0, :2, 4] = 1.0
    pred[0, 0, 5], pred[0, 1, 5] = 0.9, 0.4
    triton = {"model_config": json.dumps({"parameters": {"iou_threshold": {"string_value": "0.9"}}})}
    runtime = {"parameters": {"conf_threshold": "0.5"}}
    for config, kept in [(None, 1), (triton, 2), (runtime, 1)]:
        instance = nms.instantiate(config)
        out = instance.execute({"candidates": pred})["detections"]
        check_outputs(nms, {"detections": out}, batched=True, batch_size=1)
        assert int((out[0, :, 5] >= 0).sum()) == kept, config
    with pytest.raises(StepDeclarationError, match="iou_threshold"):
        nms.instantiate({"parameters": {"iou_threshold": "high"}})


def test_nms_step_factory_declares_its_shapes_and_parameters():
    custom = nms_step(name="nms_small", max_det=10, num_candidates=-1, num_classes=3, conf_threshold=0.5)
    assert custom.outputs["detections"].dims == (10, 6)
    assert custom.inputs["candidates"].dims == (-1, 8)
    assert dict(custom.options.parameters)["conf_threshold"] == 0.5  # kept a float
    pred = np.zeros((1, 5, 8), F32)
    pred[0, :, 0] = np.arange(5) * 50
    pred[0, :, 2:5] = 10, 10, 1.0
    pred[0, :, 5] = [0.4, 0.6, 0.7, 0.2, 0.9]
    out = custom.instantiate({"parameters": dict(custom.options.parameters)}).execute({"candidates": pred})
    assert out["detections"].shape == (1, 10, 6)
    np.testing.assert_array_equal(out["detections"][0, :3, 4], F32([0.9, 0.7, 0.6]))


# ------------------------------------------------------------------------------ letterbox


@pytest.mark.parametrize(
    ("size", "new", "pad"),
    [((480, 640), (480, 640), (80, 0)), ((1080, 1920), (360, 640), (140, 0)), ((300, 200), (640, 427), (0, 106)),
     ((64, 90), (455, 640), (92, 0)), ((640, 640), (640, 640), (0, 0))],
)
def test_letterbox_geometry(size, new, pad):
    geo = letterbox_geometry(*size)
    assert (geo.new_height, geo.new_width) == new and (geo.top, geo.left) == pad


def test_letterbox_output_layout_colours_and_padding():
    image = np.zeros((2, 100, 200, 3), np.uint8)
    image[:, :, :100] = (255, 0, 0)  # BGR blue on the left
    image[:, :, 100:] = (0, 0, 200)  # dark red on the right
    out = letterbox(image=image)
    check_outputs(letterbox, out, batched=True, batch_size=2)
    images = out["images"]
    assert images.shape == (2, 3, 640, 640) and images.dtype == np.float32
    # 100x200 -> 320x640, 160 rows of padding above and below.
    np.testing.assert_array_equal(images[:, :, :160], F32(114 / 255))
    np.testing.assert_array_equal(images[:, :, 480:], F32(114 / 255))
    np.testing.assert_array_equal(images[0, :, 160:480, :320].reshape(3, -1).max(1), F32([0, 0, 1]))  # RGB
    np.testing.assert_array_equal(images[0, :, 160:480, 320:].reshape(3, -1).min(1), F32([200 / 255, 0, 0]))
    np.testing.assert_allclose(out["ratio_pad"], [[3.2, 3.2, 0, 160]] * 2)
    np.testing.assert_array_equal(out["orig_size"], [[100, 200]] * 2)
    single = letterbox(image=image[0])  # a non-batching pipeline passes no batch dimension
    np.testing.assert_array_equal(single["images"], images[0])


def test_letterbox_rejects_what_is_not_an_image():
    with pytest.raises(StepError, match=r"'image' has shape \[10, 10\]"):
        letterbox(image=np.zeros((10, 10), np.uint8))
    with pytest.raises(StepError, match="float32.*uint8"):
        letterbox(image=np.zeros((1, 10, 10, 3), np.float32))


@settings(max_examples=40, deadline=None)
@given(
    height=st.integers(16, 2000),
    width=st.integers(16, 2000),
    corners=st.tuples(*[st.floats(0, 1)] * 4),
)
def test_letterbox_then_scale_boxes_is_the_identity(height, width, corners):
    # A rectangle drawn on an image, found again in the letterboxed image and
    # mapped back, lands where it was: within a pixel of the image it was
    # drawn on, or of the letterboxed one when that is coarser.
    geo = letterbox_geometry(height, width)
    gain = min(geo.gain_x, geo.gain_y)
    side = int(np.ceil(4 / gain))  # 4+ pixels once letterboxed, so it survives the resize
    fx1, fy1, fx2, fy2 = corners
    x1 = int(fx1 * (width - side))
    y1 = int(fy1 * (height - side))
    x2 = x1 + side + int(fx2 * (width - side - x1))
    y2 = y1 + side + int(fy2 * (height - side - y1))
    image = np.full((1, height, width, 3), 128, np.uint8)
    image[0, y1:y2, x1:x2] = PALETTE[3]
    boxed = letterbox(image=image)
    b, found, cls = find_rectangles(boxed["images"])
    assert found.shape == (1, 4) and int(cls[0]) == 3
    det = np.zeros((1, 300, 6), F32)
    det[0, :, 5] = -1
    det[0, 0] = (*found[0], 0.9, 3)
    back = scale_boxes(detections=det, ratio_pad=boxed["ratio_pad"], orig_size=boxed["orig_size"])["detections"]
    tolerance = max(1.0, 0.5 / gain + 1e-3)
    np.testing.assert_allclose(back[0, 0, :4], [x1, y1, x2, y2], atol=tolerance)
    np.testing.assert_array_equal(back[0, 1:], det[0, 1:])  # padding rows stay padding
    # And the mapping itself inverts the letterbox's geometry exactly.
    gx, gy, px, py = boxed["ratio_pad"][0]
    forward = np.array([[x1 * gx + px, y1 * gy + py, x2 * gx + px, y2 * gy + py, 0.9, 3]], F32)
    np.testing.assert_allclose(
        scale_detections(forward, boxed["ratio_pad"][0], boxed["orig_size"][0])[0, :4], [x1, y1, x2, y2], atol=1e-2
    )


def test_scale_boxes_clips_to_the_image():
    det = np.array([[[-50, 10, 700, 630, 0.9, 1]]], F32)
    ratio_pad = np.array([[1.0, 1.0, 0, 80]], F32)  # 480x640 image
    out = scale_detections(det, ratio_pad, np.array([[480, 640]], np.int32))
    np.testing.assert_array_equal(out[0, 0], F32([0, 0, 640, 480, 0.9, 1]))


# ------------------------------------------------------------------------------ detectors


def test_stand_in_detector_speaks_yolov5s_layout():
    sample = make_sample(seed=7, n_objects=6, size=(720, 1280))
    boxed = letterbox(image=sample["image"][None])
    raw = detector(images=boxed["images"])
    check_outputs(detector, raw, batched=True, batch_size=1)
    out = raw["output0"]
    assert out.shape == (1, 25200, 85) and out.dtype == np.float32 and out.nbytes == 25200 * 85 * 4
    np.testing.assert_array_equal(out, detector(images=boxed["images"])["output0"])  # deterministic

    conf = out[0, :, 4:5] * out[0, :, 5:]
    best = conf.max(1)
    above = np.flatnonzero(best > 0.25)
    assert len(above) >= 10 * len(sample["boxes"])  # crowds of candidates: NMS has work to do
    assert ((best > 0.2) & (best <= 0.25)).sum() > 100  # and near misses below the threshold
    # Each object's most confident row sits in yolov5's block for its stride and anchor, in the cell of its centre.
    _, found, _ = find_rectangles(boxed["images"])
    offsets = np.cumsum([0] + [3 * (640 // s) ** 2 for s in STRIDES])
    for x1, y1, x2, y2 in found:
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        mine = above[(np.abs(out[0, above, 0] - cx) < 1e-3) & (np.abs(out[0, above, 1] - cy) < 1e-3)]
        row = int(mine[np.argmax(best[mine])])
        si = int(np.searchsorted(offsets, row, side="right") - 1)
        g = 640 // STRIDES[si]
        anchor, cell = divmod(row - offsets[si], g * g)
        assert 0 <= anchor < len(ANCHORS[si])
        assert divmod(cell, g) == (int(cy // STRIDES[si]), int(cx // STRIDES[si]))
        np.testing.assert_array_equal(out[0, row, 2:4], [x2 - x1, y2 - y1])


def test_stand_in_detector_finds_nothing_on_a_blank_image():
    out = detector(images=letterbox(image=np.full((1, 300, 400, 3), 128, np.uint8))["images"])["output0"]
    assert (out[0, :, 4:5] * out[0, :, 5:]).max() <= 0.25
    assert (nms(candidates=out)["detections"][0, :, 5] == -1).all()


def test_nms_equals_reference_on_real_detector_output():
    sample = make_sample(seed=3, n_objects=8, size=(500, 700))
    raw = detector(images=letterbox(image=sample["image"][None])["images"])["output0"]
    got = nms(candidates=raw)["detections"]
    np.testing.assert_array_equal(got[0], reference_nms(raw[0], 0.25, 0.45, 300))


_CORES_BETWEEN_CALLS = """
import resource, time
import numpy as np
from pipelines.examples.yolov5 import make_sample
from pipelines.steps.detector import detector
from pipelines.steps.letterbox import letterbox
from pipelines.steps.nms import nms
raw = detector(images=letterbox(image=make_sample(seed=3, n_objects=8)["image"][None])["images"])["output0"]
nms(candidates=raw)
cpu = lambda who: sum(resource.getrusage(who)[:2])  # user + system seconds
process, caller = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_THREAD)
for _ in range(60):
    nms(candidates=raw)
    time.sleep(0.005)  # idle between requests, as a served step is
# CPU seconds of the calling thread, and of every other thread of the process (a pool's workers)
print(cpu(resource.RUSAGE_THREAD) - caller, cpu(resource.RUSAGE_SELF) - process - (cpu(resource.RUSAGE_THREAD) - caller))
"""


def test_nms_leaves_the_cores_alone_between_calls():
    # A float matrix product hands NMS's rounds to OpenBLAS, whose threads then spin: a step
    # called every few milliseconds kept more than a whole core busy (on the server too, in its
    # stub), for about a millisecond of work per call.
    import subprocess

    run = subprocess.run([sys.executable, "-c", _CORES_BETWEEN_CALLS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    caller, others = (float(v) for v in run.stdout.split()[-2:])
    # CPU time, not a wall-clock rate: spinning workers burn through every idle gap between calls,
    # several times the caller's own work; idle ones burn none of it
    assert others < caller, f"other threads used {others:.3f} s of CPU to the caller's {caller:.3f} s"


def _tiny_yolo_onnx(path, *, batch):
    """An ONNX graph with yolov5's signature: output0[b, r, k] = images.flat[b, r] * (k + 1)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["images", "flat_shape"], ["flat"]),
            helper.make_node("Slice", ["flat", "starts", "ends", "axes"], ["head"]),
            helper.make_node("Unsqueeze", ["head", "last"], ["column"]),
            helper.make_node("Mul", ["column", "ramp"], ["output0"]),
        ],
        "tiny_yolo",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, 640, 640])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [batch, 25200, 85])],
        initializer=[
            helper.make_tensor("flat_shape", TensorProto.INT64, [2], [0, -1]),
            helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
            helper.make_tensor("ends", TensorProto.INT64, [1], [25200]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
            helper.make_tensor("last", TensorProto.INT64, [1], [2]),
            helper.make_tensor("ramp", TensorProto.FLOAT, [85], np.arange(1, 86, dtype=np.float32)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("batch", ["batch", 1])
def test_onnx_detector_runs_through_onnxruntime_locally(tmp_path, batch):
    path = _tiny_yolo_onnx(tmp_path / "yolov5s.onnx", batch=batch)
    step_ = onnx_detector(path, dynamic_batching=True)
    assert step_.is_external and step_.external.backend == "onnxruntime"
    assert step_.external.model_filename == "model.onnx"
    assert dict(step_.inputs) == dict(detector.inputs) and dict(step_.outputs) == dict(detector.outputs)
    assert step_.options.dynamic_batching is not None
    images = np.random.default_rng(0).random((2, 3, 640, 640), dtype=np.float32)
    out = step_(images=images)
    check_outputs(step_, out, batched=True, batch_size=2)
    expected = images.reshape(2, -1)[:, :25200, None] * np.arange(1, 86, dtype=np.float32)
    np.testing.assert_allclose(out["output0"], expected, rtol=1e-6)


def test_onnx_detector_errors_name_the_step_and_the_fix(tmp_path, monkeypatch):
    path = _tiny_yolo_onnx(tmp_path / "m.onnx", batch="batch")
    with pytest.raises(StepDeclarationError, match=r"outputs \['output0'\], not 'output'; pass output_name="):
        onnx_detector(path, output_name="output")
    with pytest.raises(StepDeclarationError, match=r"num_classes=3 but .* gives output0 \[\?, 25200, 85\]"):
        onnx_detector(path, num_classes=3)
    with pytest.raises(StepDeclarationError, match="does not exist"):
        onnx_detector(tmp_path / "absent.onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if the optional extra were not installed
    with pytest.raises(StepError, match=r"step 'yolo'.*pip install 'pipelines\[onnx\]'"):
        onnx_detector(path, name="yolo").instantiate()


def test_array_namespace_of_numpy_is_numpy():
    assert array_namespace(np.zeros(3)) is np
    assert array_namespace(1.0, np.zeros(3)) is np


@pytest.mark.gpu
def test_steps_give_the_same_answers_on_cupy_arrays_and_stay_on_the_device():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no usable CUDA driver")
    sample = make_sample(seed=11, n_objects=7, size=(600, 900))
    images = np.stack([sample["image"], sample["image"][::-1].copy()])
    cpu, gpu = {"image": images}, {"image": cupy.asarray(images)}
    for step_, names in [(letterbox, None), (detector, {"images": "images"}), (nms, {"candidates": "output0"})]:
        cpu_out = step_(**{k: cpu[v] for k, v in (names or {"image": "image"}).items()})
        gpu_out = step_(**{k: gpu[v] for k, v in (names or {"image": "image"}).items()})
        for name, value in gpu_out.items():
            assert array_namespace(value) is cupy, f"{step_.name}.{name} left the device"
            np.testing.assert_allclose(cupy.asnumpy(value), cpu_out[name], rtol=1e-6, atol=1e-5)
        cpu.update(cpu_out)
        gpu.update(gpu_out)
    back = scale_boxes(detections=gpu["detections"], ratio_pad=gpu["ratio_pad"], orig_size=gpu["orig_size"])
    assert array_namespace(back["detections"]) is cupy
    result = cupy.asnumpy(back["detections"][0])
    from pipelines.examples.yolov5 import compare_to_truth

    assert compare_to_truth(result, sample["boxes"], sample["classes"]).exact


# --------------------------------------------------------------------------- ONNX files' own shapes


def _yolov5_shaped_onnx(path, *, batch, n_classes=80, size=640):
    """yolov5's tensor names and shapes at almost no cost: output0[b, :, :] = mean(images[b]).

    ``batch`` is 1 for the default export (a fixed batch) or a name for ``--dynamic``.
    """
    import onnx
    from onnx import TensorProto, helper

    width = 5 + n_classes
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["images"], ["mean"], axes=[1, 2, 3], keepdims=1),  # [b, 1, 1, 1]
            helper.make_node("Reshape", ["mean", "per_row"], ["column"]),  # [b, 1, 1]
            helper.make_node("ConstantOfShape", ["rows_shape"], ["zeros"],
                             value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),  # [1, 25200, width]
            helper.make_node("Add", ["column", "zeros"], ["output0"]),  # [b, 25200, width]
        ],
        "yolov5_shapes",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [batch, 25200, width])],
        initializer=[
            helper.make_tensor("per_row", TensorProto.INT64, [3], [-1, 1, 1]),
            helper.make_tensor("rows_shape", TensorProto.INT64, [3], [1, 25200, width]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _config(repo, name):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    return text_format.Parse(repo.config_text(name), mc.ModelConfig())


def test_a_fixed_batch_export_compiles_to_max_batch_size_0_with_the_files_dims(tmp_path):
    from pipelines.examples.yolov5 import build_pipeline

    path = _yolov5_shaped_onnx(tmp_path / "yolov5s.onnx", batch=1)
    step_ = onnx_detector(path, dynamic_batching=True)
    assert step_.external.fixed_batch == 1
    assert dict(step_.inputs) == dict(detector.inputs) and dict(step_.outputs) == dict(detector.outputs)
    p = build_pipeline(detector=step_, name="fixed", max_batch_size=8)
    repo = p.compile("both")
    config = _config(repo, "fixed__detector")
    assert config.backend == "onnxruntime" and config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")  # Triton allows no batcher without max_batch_size
    assert [(i.name, list(i.dims)) for i in config.input] == [("images", [1, 3, 640, 640])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("output0", [1, 25200, 85])]
    assert "max_batch_size: 0" in repo.config_text("fixed__detector")
    assert _config(repo, "fixed__nms").max_batch_size == 8  # the rest of the pipeline still batches
    # Locally a batch of 3 is fed to the model one row at a time (onnxruntime refuses [3, ...]).
    images = np.stack([np.full((3, 640, 640), v, np.float32) for v in (0.25, 0.5, 0.75)])
    out = step_(images=images)["output0"]
    assert out.shape == (3, 25200, 85)
    np.testing.assert_allclose(out[:, 0, 0], [0.25, 0.5, 0.75], rtol=1e-6)
    frames = np.full((3, 48, 64, 3), 128, np.uint8)
    for mode in ("ensemble", "bls"):
        assert p.run({"image": frames}, mode=mode)["detections"].shape == (3, 300, 6)


def test_a_fixed_batch_of_two_runs_in_chunks_padded_at_the_end(tmp_path):
    path = _yolov5_shaped_onnx(tmp_path / "two.onnx", batch=2, n_classes=3, size=32)
    step_ = onnx_detector(path)
    assert step_.external.fixed_batch == 2
    assert step_.inputs["images"].dims == (3, 32, 32) and step_.outputs["output0"].dims == (25200, 8)
    images = np.stack([np.full((3, 32, 32), v, np.float32) for v in (1, 2, 3, 4, 5)])
    out = step_(images=images)["output0"]
    assert out.shape == (5, 25200, 8)
    np.testing.assert_allclose(out[:, 7, 7], [1, 2, 3, 4, 5])


def test_a_dynamic_batch_export_keeps_batching(tmp_path):
    from pipelines.examples.yolov5 import build_pipeline

    path = _yolov5_shaped_onnx(tmp_path / "dynamic.onnx", batch="batch", n_classes=3)
    step_ = onnx_detector(path, dynamic_batching=True)
    assert step_.external.fixed_batch is None
    assert step_.outputs["output0"].dims == (25200, 8)  # the classes come from the file
    p = build_pipeline(detector=step_, name="dyn", max_batch_size=4)
    assert p.nodes["nms"].step.inputs["candidates"].dims == (25200, 8)
    config = _config(p.compile("ensemble"), "dyn__detector")
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [list(i.dims) for i in config.input] == [[3, 640, 640]]
    assert [list(o.dims) for o in config.output] == [[25200, 8]]


def test_a_fixed_batch_model_in_a_non_batching_pipeline_is_refused_at_compile(tmp_path):
    from pipelines import CompileError, Pipeline, TensorSpec

    path = _yolov5_shaped_onnx(tmp_path / "one.onnx", batch=1, size=32)
    det = onnx_detector(path)
    p = Pipeline("flat", inputs={"images": TensorSpec("FP32", [3, 32, 32])}, max_batch_size=0)
    p.output("rows", p.add(det, images=p.input("images"))["output0"])
    with pytest.raises(CompileError, match=r"fixed batch of 1 .* batching pipeline .* dynamic batch axis"):
        p.compile("ensemble")


def test_an_onnx_file_without_yolov5s_shapes_is_explained(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "flat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "flat.onnx"))
    with pytest.raises(StepDeclarationError, match=r"maps x \[1, 10\] to y \[1, 10\]; a yolov5 detector maps images"):
        onnx_detector(tmp_path / "flat.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(StepDeclarationError, match="is not a readable ONNX model"):
        onnx_detector(tmp_path / "junk.onnx")
