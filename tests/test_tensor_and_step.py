"""TensorSpec reads like Triton's config; @step carries the per-model options and the
lifecycle of Triton's Python backend."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from pipelines import DATATYPES, DynamicBatching, StepDeclarationError, StepError, TensorSpec, step
from pipelines.core.step import check_outputs


def test_tensorspec_normalises_and_reads_like_the_declaration():
    spec = TensorSpec("fp32", [3, -1])
    assert spec == TensorSpec("TYPE_FP32", (3, -1)) == TensorSpec(np.float32, [3, -1])
    assert hash(spec) == hash(TensorSpec("FP32", [3, -1]))
    assert repr(spec) == "TensorSpec('FP32', [3, -1])"
    assert eval(repr(spec)) == spec
    assert TensorSpec("TYPE_STRING", []).dtype == "BYTES"
    with pytest.raises(ValueError, match="unknown datatype 'FLOAT'"):
        TensorSpec("FLOAT", [1])
    with pytest.raises(ValueError, match="-1 for variable"):
        TensorSpec("FP32", [-2])


@pytest.mark.parametrize("name", list(DATATYPES))
def test_datatype_tables_are_complete_and_agree_with_triton(name):
    spec = TensorSpec(name, [1])
    assert model_config_pb2.DataType.Value(spec.config_dtype)  # every name maps to a real TYPE_* enum
    assert np.dtype(triton_to_np_dtype(name)) == spec.numpy_dtype  # the same numpy carrier as tritonclient
    if name != "BF16":
        assert np_to_triton_dtype(spec.numpy_dtype) == name


def test_bf16_is_carried_bit_for_bit():
    spec = TensorSpec("BF16", [2])
    x = np.array([1.5, -2.25], dtype=np.float32).astype(spec.numpy_dtype)
    assert x.dtype.itemsize == 2 and x.astype(np.float32).tolist() == [1.5, -2.25]


def test_dims_compatibility():
    assert TensorSpec("FP32", [-1, 85]).dims_compatible(TensorSpec("FP32", [25200, 85]))
    assert not TensorSpec("FP32", [-1, 85]).dims_compatible(TensorSpec("FP32", [25200, 6]))
    assert not TensorSpec("FP32", [4]).dims_compatible(TensorSpec("FP32", [4, 1]))


@step(inputs={"x": TensorSpec("INT64", [-1])}, outputs={"y": TensorSpec("INT64", [-1])},
      max_batch_size=16, instance_count=2, instance_kind="cpu",
      dynamic_batching={"preferred_batch_sizes": [4, 8], "max_queue_delay_us": 100},
      device="cpu", parameters={"k": 3}, timeout=2.5)
class AddK:
    def initialize(self, config):
        self.k = int(config["parameters"]["k"])
        self.finalized = False

    def execute(self, x):
        return {"y": x + self.k}

    def finalize(self):
        FINALIZED.append(self.k)


FINALIZED: list[int] = []


def test_class_step_lifecycle_and_options():
    o = AddK.options
    assert (o.max_batch_size, o.instance_count, o.config_instance_kind) == (16, 2, "KIND_CPU")
    assert o.dynamic_batching == DynamicBatching((4, 8), 100)
    assert dict(o.parameters) == {"k": 3} and o.timeout == 2.5
    inst = AddK.instantiate({"parameters": {"k": "5"}})
    assert inst.execute({"x": np.array([1, 2])})["y"].tolist() == [6, 7]
    inst.finalize()
    assert FINALIZED == [5]
    assert AddK(x=np.array([1]))["y"].tolist() == [4]  # plain call: initialise from options, finalise after


def test_outputs_are_normalised_and_checked():
    one = step(lambda x: x + 1, name="inc", inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])})
    assert set(one(x=np.zeros(2, np.float32))) == {"y"}  # a lone array becomes the only output
    broken = step(lambda x: {"z": x}, name="broken", inputs={"x": TensorSpec("FP32", [2])},
                  outputs={"y": TensorSpec("FP32", [2])})
    with pytest.raises(StepError, match=r"step 'broken' did not return output\(s\) \['y'\]"):
        broken(x=np.zeros(2, np.float32))
    with pytest.raises(StepError, match="has dtype float64; it declares FP32"):
        check_outputs(one, {"y": np.zeros((1, 2))}, batched=True, batch_size=1)
    with pytest.raises(StepError, match=r"has shape \[1, 3\]; it declares \[1, 2\]"):
        check_outputs(one, {"y": np.zeros((1, 3), np.float32)}, batched=True, batch_size=1)
    with pytest.raises(StepError, match="batch dimension 2 first"):
        check_outputs(one, {"y": np.zeros((1, 2), np.float32)}, batched=True, batch_size=2)


def test_bad_step_declarations():
    with pytest.raises(StepDeclarationError, match="expected a TensorSpec"):
        step(lambda x: x, name="f", inputs={"x": "FP32"}, outputs={"y": TensorSpec("FP32", [1])})
    with pytest.raises(StepDeclarationError, match="declares no outputs"):
        step(lambda x: x, name="f", inputs={"x": TensorSpec("FP32", [1])}, outputs={})
    with pytest.raises(StepDeclarationError, match="instance_count"):
        step(lambda x: x, name="f", inputs={}, outputs={"y": TensorSpec("FP32", [1])}, instance_count=0)
    with pytest.raises(StepDeclarationError, match="device"):
        step(lambda x: x, name="f", inputs={}, outputs={"y": TensorSpec("FP32", [1])}, device="tpu")
    with pytest.raises(StepDeclarationError, match="give it a name"):
        step(lambda x: x, inputs={}, outputs={"y": TensorSpec("FP32", [1])})


def test_a_bad_tensor_spec_is_a_pipelines_error_and_still_a_value_error():
    from pipelines import PipelinesError, TensorSpecError

    for bad in (lambda: TensorSpec("FP33", [1]), lambda: TensorSpec("FP32", [-2]), lambda: TensorSpec("FP32", "3")):
        with pytest.raises(TensorSpecError) as info:
            bad()
        assert isinstance(info.value, PipelinesError) and isinstance(info.value, ValueError)
