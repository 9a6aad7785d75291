"""A user declares steps and wires them; each wrong wire fails at the call that made it,
with an error that names the pipeline, the step and the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import (
    BatchingMismatchError,
    CycleError,
    DeclarationError,
    DtypeMismatchError,
    DuplicateNameError,
    InvalidNameError,
    Pipeline,
    PipelinesError,
    ShapeMismatchError,
    StepDeclarationError,
    TensorProducedTwiceError,
    TensorSpec,
    UnboundInputError,
    UnknownTensorError,
    external_model,
    step,
)


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def double(x):
    return {"y": x * 2}


@step(inputs={"candidates": TensorSpec("FP32", [-1, 85])}, outputs={"boxes": TensorSpec("FP32", [300, 6])})
def nms(candidates):
    return {"boxes": candidates[:, :300, :6]}


@step(inputs={"images": TensorSpec("FP32", [3, 640, 640])}, outputs={"output": TensorSpec("FP16", [25200, 85])})
def detector(images):
    raise NotImplementedError


def demo() -> Pipeline:
    return Pipeline("demo", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)


def test_the_design_example_works_as_written():
    p = demo()
    a = p.add(double, x=p.input("x"))
    b = p.add(double, name="double2", x=a["y"])
    p.output("y", b["y"])
    p.validate()
    assert p.topological_order() == ["double", "double2"]
    assert a["y"].spec == TensorSpec("FP32", [4])
    assert b.bindings["x"] == a["y"]
    assert p.nodes["double2"].step is double
    assert p.nodes["double2"].max_batch_size == 8  # a step with no max_batch_size follows the pipeline


def test_dtype_mismatch_names_both_ends_and_the_fix():
    p = Pipeline("yolov5", inputs={"images": TensorSpec("FP32", [3, 640, 640])}, max_batch_size=4)
    det = p.add(detector, images=p.input("images"))
    with pytest.raises(DtypeMismatchError) as err:
        p.add(nms, candidates=det["output"])
    assert str(err.value) == (
        "pipeline 'yolov5': step 'nms' input 'candidates' expects FP32 [-1, 85] but 'detector.output' "
        "is FP16 [25200, 85]; cast it or change the step's declared dtype"
    )
    assert (err.value.pipeline, err.value.step, err.value.tensor) == ("yolov5", "nms", "candidates")
    assert "nms" not in p.nodes  # a refused add leaves nothing behind


def test_rank_mismatch():
    p = Pipeline("p", inputs={"x": TensorSpec("FP32", [4, 85])}, max_batch_size=4)
    with pytest.raises(ShapeMismatchError, match=r"step 'double' input 'x' expects FP32 \[4\] but 'x' is FP32 \[4, 85\]; the rank"):
        p.add(double, x=p.input("x"))


def test_fixed_dim_mismatch_but_minus_one_matches_any_size():
    p = Pipeline("p", inputs={"x": TensorSpec("FP32", [5]), "v": TensorSpec("FP32", [-1])}, max_batch_size=4)
    with pytest.raises(ShapeMismatchError) as err:
        p.add(double, x=p.input("x"))
    assert err.value.step == "double" and err.value.tensor == "x"
    assert "FP32 [5]" in str(err.value) and "FP32 [4]" in str(err.value)
    p.add(double, x=p.input("v"))  # -1 meets 4


def test_batching_mismatch_between_pipeline_and_step():
    unbatched = double.with_options(max_batch_size=0)
    with pytest.raises(BatchingMismatchError, match="step 'double' has max_batch_size 0 but the pipeline has 8"):
        demo().add(unbatched, x=demo().input("x"))
    p0 = Pipeline("flat", inputs={"x": TensorSpec("FP32", [4])})
    with pytest.raises(BatchingMismatchError, match="set the step's max_batch_size to 0"):
        p0.add(double.with_options(max_batch_size=4), x=p0.input("x"))
    p = demo()
    with pytest.raises(BatchingMismatchError, match="at least 8") as err:
        p.add(double.with_options(max_batch_size=2), x=p.input("x"))
    assert err.value.step == "double"


def test_unknown_input_output_and_pipeline_input_names():
    p = demo()
    with pytest.raises(UnknownTensorError, match=r"step 'double' has no input 'z'; its inputs are \['x'\]"):
        p.add(double, z=p.input("x"))
    node = p.add(double, x=p.input("x"))
    with pytest.raises(UnknownTensorError, match=r"step 'double' has no output 'out'; its outputs are \['y'\]") as err:
        node["out"]
    assert err.value.tensor == "out"
    with pytest.raises(UnknownTensorError, match=r"has no input 'images'; its inputs are \['x'\]"):
        p.input("images")


def test_reference_from_another_pipeline_is_refused():
    other = Pipeline("other", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    with pytest.raises(UnknownTensorError, match="pipeline 'other'"):
        demo().add(double, x=other.input("x"))


def test_unbound_input_at_output_compile_and_run():
    p = demo()
    node = p.add(double)  # wired later, or forgotten
    with pytest.raises(UnboundInputError) as err:
        p.output("y", node["y"])
    assert (err.value.step, err.value.tensor) == ("double", "x")
    assert "p.bind('double', x=...)" in str(err.value)
    p.bind(node, x=p.input("x"))
    p.output("y", node["y"])
    p2 = demo()
    a = p2.add(double, x=p2.input("x"))
    p2.output("y", a["y"])
    p2.add(double, name="dangling")
    with pytest.raises(UnboundInputError, match="step 'dangling' input 'x'"):
        p2.validate()
    with pytest.raises(UnboundInputError, match="step 'dangling' input 'x'"):
        p2.compile("ensemble")
    with pytest.raises(UnboundInputError, match="step 'dangling' input 'x'"):
        p2.run({"x": np.ones((1, 4), np.float32)})


def test_duplicate_step_names_and_bindings():
    p = demo()
    p.add(double, x=p.input("x"))
    with pytest.raises(DuplicateNameError, match="already has a step named 'double'.*name='double2'"):
        p.add(double, x=p.input("x"))
    node = p.add(double, name="again", x=p.input("x"))
    with pytest.raises(DuplicateNameError, match="input 'x' is already bound"):
        p.bind(node, x=p.input("x"))
    # a node may share its pipeline's name: models are named after steps, never nodes
    named = demo()
    named.output("y", named.add(double, name="demo", x=named.input("x"))["y"])
    assert "demo__double" in named.compile("ensemble")
    np.testing.assert_array_equal(named.run({"x": np.ones((1, 4), np.float32)})["y"], np.full((1, 4), 2, np.float32))


def test_output_named_like_an_input_is_a_duplicate_tensor_name():
    p = demo()
    node = p.add(double, x=p.input("x"))
    with pytest.raises(DuplicateNameError, match="output 'x' has the name of a pipeline input") as err:
        p.output("x", node["y"])
    assert err.value.tensor == "x"


def test_a_tensor_produced_twice():
    p = demo()
    a = p.add(double, x=p.input("x"))
    b = p.add(double, name="b", x=p.input("x"))
    p.output("y", a["y"])
    with pytest.raises(TensorProducedTwiceError, match="output 'y' is already produced by 'double.y'") as err:
        p.output("y", b["y"])
    assert err.value.tensor == "y"


def test_a_cycle_is_refused_when_it_would_be_made():
    p = demo()
    a = p.add(double, name="a")
    b = p.add(double, name="b", x=a["y"])
    c = p.add(double, name="c", x=b["y"])
    with pytest.raises(CycleError, match=r"a -> b -> c -> a") as err:
        p.bind(a, x=c["y"])
    assert (err.value.step, err.value.tensor) == ("a", "x")
    assert a.unbound == ["x"]  # the refused wire was not kept
    with pytest.raises(CycleError):
        p.bind(a, x=a["y"])


@pytest.mark.parametrize(
    "bad", ["", "..", "../escape", "a/b", "a\\b", "tab\there", "nul\x00", "-leading", " space", "é", "x" * 129, "a..b"]
)
def test_names_that_break_tritons_rules_or_escape_a_directory(bad):
    with pytest.raises(InvalidNameError):
        Pipeline(bad, inputs={"x": TensorSpec("FP32", [4])})
    with pytest.raises(InvalidNameError):
        Pipeline("ok", inputs={bad: TensorSpec("FP32", [4])})
    with pytest.raises(InvalidNameError):
        demo().add(double, name=bad)
    with pytest.raises(InvalidNameError):
        step(lambda x: x, name=bad, inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
    with pytest.raises(InvalidNameError):
        step(lambda x: x, name="f", inputs={bad: TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})


def test_every_error_has_one_root():
    for cls in (DtypeMismatchError, CycleError, InvalidNameError, StepDeclarationError):
        assert issubclass(cls, DeclarationError) and issubclass(cls, PipelinesError)


def test_pass_through_output_and_non_step_are_refused_clearly():
    p = demo()
    with pytest.raises(DeclarationError, match="cannot pass an input straight through"):
        p.output("z", p.input("x"))
    with pytest.raises(StepDeclarationError, match="decorate it with @step"):
        p.add(lambda x: x, x=p.input("x"))
    with pytest.raises(DeclarationError, match="expected a tensor reference"):
        p.add(double, x=np.ones(4))
    with pytest.raises(DeclarationError, match="has no outputs"):
        demo().validate()


def test_external_model_declaration(tmp_path):
    model = tmp_path / "yolo.onnx"
    model.write_bytes(b"onnx")
    det = external_model(
        "detector",
        inputs={"images": TensorSpec("FP32", [3, 640, 640])},
        outputs={"output0": TensorSpec("FP32", [25200, 85])},
        backend="onnxruntime",
        model_file=model,
        instance_count=2,
    )
    assert det.is_external and not det.runnable
    assert det.external.model_filename == "model.onnx"
    assert det.options.instance_count == 2
    with pytest.raises(StepDeclarationError, match="does not exist"):
        external_model("d", inputs={}, outputs={"y": TensorSpec("FP32", [1])}, backend="onnxruntime",
                       model_file=tmp_path / "missing.onnx")
    with pytest.raises(StepDeclarationError, match="backend"):
        external_model("d", inputs={}, outputs={"y": TensorSpec("FP32", [1])})
