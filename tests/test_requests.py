"""check_request: every malformed request is refused with an InputError that names the
tensor, what was expected and what was given; good arrays pass through uncopied."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import InputError, TensorSpec
from pipelines.core.requests import check_request

SPECS = {"image": TensorSpec("FP32", [3, -1]), "ids": TensorSpec("INT64", [2])}


def good(batch: int = 2) -> dict[str, np.ndarray]:
    return {"image": np.zeros((batch, 3, 5), np.float32), "ids": np.zeros((batch, 2), np.int64)}


def refuse(inputs, *, max_batch_size: int = 4, specs=SPECS, step=None) -> InputError:
    with pytest.raises(InputError) as info:
        check_request(inputs, specs, pipeline="det", max_batch_size=max_batch_size, step=step)
    err = info.value
    assert err.pipeline == "det"
    assert "pipeline 'det'" in str(err)
    return err


def test_good_request_passes_the_same_arrays_through():
    inputs = good()
    out = check_request(inputs, SPECS, pipeline="det", max_batch_size=4)
    assert list(out) == ["image", "ids"]
    assert all(out[k] is inputs[k] for k in out)


def test_array_like_objects_pass_through_uncopied():
    class DeviceArray:  # what CuPy exposes: shape, dtype, DLPack; no numpy conversion wanted
        def __init__(self, a):
            self._a, self.shape, self.dtype = a, a.shape, a.dtype

        def __dlpack__(self, stream=None):
            return self._a.__dlpack__()

        def __dlpack_device__(self):
            return (2, 0)

    arr = DeviceArray(np.zeros((2, 2), np.int64))
    out = check_request({"image": good()["image"], "ids": arr}, SPECS, pipeline="det", max_batch_size=4)
    assert out["ids"] is arr


def test_lists_are_turned_into_arrays():
    out = check_request({"x": [[1.0, 2.0]]}, {"x": TensorSpec("FP64", [2])}, pipeline="det", max_batch_size=1)
    assert isinstance(out["x"], np.ndarray) and out["x"].shape == (1, 2)


def test_misnamed_input_suggests_the_closest_name():
    inputs = good()
    inputs["imagee"] = inputs.pop("image")
    err = refuse(inputs)
    assert err.tensor == "imagee"
    assert "did you mean 'image'" in str(err)


def test_extra_input():
    err = refuse({**good(), "mask": np.zeros((2, 1), np.float32)})
    assert err.tensor == "mask" and "not declared" in str(err)


def test_missing_input():
    inputs = good()
    del inputs["ids"]
    err = refuse(inputs)
    assert err.tensor == "ids" and "missing" in str(err) and "INT64 [2]" in str(err)


def test_wrong_dtype_names_expected_and_given():
    err = refuse({**good(), "image": np.zeros((2, 3, 5), np.float64)})
    assert err.tensor == "image"
    assert "FP32" in str(err) and "float64" in str(err)


def test_bytes_payload_where_numbers_are_expected():
    payload = np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object)
    err = refuse({**good(), "ids": payload})
    assert err.tensor == "ids" and "BYTES payload" in str(err) and "INT64" in str(err)
    err = refuse({**good(), "ids": np.array([["a", "b"], ["c", "d"]])})
    assert "BYTES payload" in str(err)


def test_numbers_where_bytes_are_expected():
    specs = {"text": TensorSpec("BYTES", [1])}
    err = refuse({"text": np.zeros((1, 1), np.float32)}, specs=specs)
    assert err.tensor == "text" and "BYTES" in str(err)
    ok = check_request({"text": np.array([[b"hi"]], dtype=object)}, specs, pipeline="det", max_batch_size=4)
    assert ok["text"][0, 0] == b"hi"


def test_wrong_rank_hints_at_the_missing_batch_dimension():
    err = refuse({**good(), "ids": np.zeros((2,), np.int64)})
    assert err.tensor == "ids" and "rank 2" in str(err) and "[2]" in str(err) and "batch dimension" in str(err)
    err = refuse({**good(), "image": np.zeros((2, 3, 5, 1), np.float32)})
    assert "rank 3" in str(err) and "rank 4" in str(err)


def test_wrong_fixed_dimension():
    err = refuse({**good(), "image": np.zeros((2, 4, 5), np.float32)})
    assert err.tensor == "image" and "dimension 1 is 4, expected 3" in str(err)


def test_variable_dimension_takes_any_size():
    check_request({**good(), "image": np.zeros((2, 3, 99), np.float32)}, SPECS, pipeline="det", max_batch_size=4)


def test_batch_above_max_batch_size():
    err = refuse(good(batch=5), max_batch_size=4)
    assert "batch size 5" in str(err) and "max_batch_size is 4" in str(err)


def test_empty_batch():
    err = refuse(good(batch=0))
    assert err.tensor == "image" and "empty batch" in str(err)


def test_mismatched_batch_sizes():
    err = refuse({"image": np.zeros((2, 3, 5), np.float32), "ids": np.zeros((3, 2), np.int64)})
    assert err.tensor == "ids" and "2 and 3" in str(err)


def test_non_batching_pipeline_has_no_batch_dimension():
    specs = {"x": TensorSpec("FP32", [4])}
    check_request({"x": np.zeros(4, np.float32)}, specs, pipeline="det", max_batch_size=0)
    err = refuse({"x": np.zeros((1, 4), np.float32)}, specs=specs, max_batch_size=0)
    assert "rank 1" in str(err)


def test_step_is_named_when_given():
    err = refuse({**good(), "ids": np.zeros((2, 2), np.int32)}, step="nms")
    assert err.step == "nms" and "step 'nms'" in str(err)


def test_request_that_is_not_a_dict():
    err = refuse([np.zeros(3)])
    assert "dict" in str(err)
