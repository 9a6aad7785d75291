"""An ONNX file is checked when its step is declared (issue 60 §3).

``onnx_model`` reads the file's graph inputs and outputs and compares them with the declared
specs: a name the file lacks, an input of the file left out, another element type, another rank or
another static size is a declaration error at the line that declared the step, naming the file, the
tensor and both sides, as a wiring error does; not a failure when the step first runs. Declared
dims leave out the batch axis of a batching pipeline; ``-1`` and a symbolic dim match any size.
Whether the step's model batches is known when the pipeline compiles, which checks that too.
"""

from __future__ import annotations

import pytest
from test_onnx_stand_in import write_affine_onnx

from pipelines import (
    CompileError,
    DeclarationError,
    DtypeMismatchError,
    Pipeline,
    ShapeMismatchError,
    StepDeclarationError,
    TensorSpec,
    UnknownTensorError,
)
from pipelines.steps import onnx_model

X = TensorSpec("FP32", [4])
SCORES = TensorSpec("FP32", [3])
LABEL = TensorSpec("INT64", [1])


@pytest.fixture(scope="module")
def free(tmp_path_factory):
    """``x [batch, 4] -> scores [batch, 3], label [batch, 1]``, with a free batch axis."""
    return write_affine_onnx(tmp_path_factory.mktemp("onnx") / "affine.onnx")


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """The same with a fixed batch of 1, as a default export has."""
    return write_affine_onnx(tmp_path_factory.mktemp("onnx") / "one.onnx", batch=1)


def test_specs_that_match_the_file_declare_a_step(free, fixed):
    assert onnx_model("affine", free, inputs={"x": X}, outputs={"scores": SCORES, "label": LABEL}).is_external
    onnx_model("affine", free, inputs={"x": X}, outputs={"label": LABEL})  # a config may leave an output out
    onnx_model("affine", free, inputs={"x": TensorSpec("FP32", [-1])}, outputs={"scores": SCORES})
    onnx_model("affine", free, inputs={"x": TensorSpec("FP32", [-1, 4])}, outputs={"scores": TensorSpec("FP32", [-1, 3])},
               max_batch_size=0)  # a step that never batches declares the whole shape
    onnx_model("one", fixed, inputs={"x": X}, outputs={"scores": SCORES}, fixed_batch=1)
    onnx_model("one", fixed, inputs={"x": TensorSpec("FP32", [1, 4])}, outputs={"scores": TensorSpec("FP32", [1, 3])})


def test_a_name_the_file_does_not_have_names_the_file_and_its_names(free):
    with pytest.raises(UnknownTensorError) as info:
        onnx_model("affine", free, inputs={"images": X}, outputs={"scores": SCORES})
    assert str(info.value) == (
        f"step 'affine' declares input 'images', which {str(free)!r} does not have; its inputs are ['x']: "
        "declare the file's own names (Triton's onnxruntime backend maps tensors by name)"
    )
    assert (info.value.step, info.value.tensor) == ("affine", "images")
    with pytest.raises(UnknownTensorError, match=r"declares output 'probs', .* its outputs are \['scores', 'label'\]"):
        onnx_model("affine", free, inputs={"x": X}, outputs={"probs": SCORES})


def test_an_input_of_the_file_left_out_is_refused(free):
    with pytest.raises(UnknownTensorError) as info:
        onnx_model("affine", free, inputs={}, outputs={"scores": SCORES})
    assert f"{str(free)!r} has input 'x' FP32 [?, 4], which the step does not declare" in str(info.value)
    assert "onnxruntime must be fed every input of the file, so declare it in inputs=" in str(info.value)


def test_another_element_type_shows_both_sides_and_the_spec_to_declare(free):
    with pytest.raises(DtypeMismatchError) as info:
        onnx_model("affine", free, inputs={"x": TensorSpec("FP64", [4])}, outputs={"scores": SCORES})
    assert str(info.value) == (
        f"step 'affine': input 'x' is declared FP64 [4], but {str(free)!r} has it as FP32 [?, 4]; the element "
        "types differ, so declare TensorSpec('FP32', [4]) or export the file with FP64"
    )
    assert info.value.tensor == "x"
    with pytest.raises(DtypeMismatchError, match=r"output 'label' is declared INT32 \[1\], .* INT64 \[\?, 1\]"):
        onnx_model("affine", free, inputs={"x": X}, outputs={"label": TensorSpec("INT32", [1])})


@pytest.mark.parametrize(("inputs", "outputs", "options", "said"), [
    ({"x": TensorSpec("FP32", [5])}, {"scores": SCORES}, {},
     "input 'x' is declared FP32 [5], but {file} has it as FP32 [?, 4]; the fixed sizes differ (-1 matches any "
     "size), so declare TensorSpec('FP32', [4])"),
    ({"x": X}, {"scores": TensorSpec("FP32", [3, 1])}, {},
     "output 'scores' is declared FP32 [3, 1], but {file} has it as FP32 [?, 3]; the fixed sizes differ"),
    ({"x": TensorSpec("FP32", [2, 2, 4])}, {"scores": SCORES}, {},
     "input 'x' is declared FP32 [2, 2, 4], but {file} has it as FP32 [?, 4]; the ranks differ"),
    ({"x": X}, {"scores": SCORES}, {"max_batch_size": 0},
     "input 'x' is declared FP32 [4], but {file} has it as FP32 [?, 4]; the ranks differ, so declare "
     "TensorSpec('FP32', [-1, 4])"),
    ({"x": TensorSpec("FP32", [-1, 4])}, {"scores": TensorSpec("FP32", [-1, 3])}, {"max_batch_size": 8},
     "input 'x' is declared FP32 [-1, 4], but {file} has it as FP32 [?, 4]; the ranks differ: declared dims "
     "leave out the batch axis, which the file has first, so declare TensorSpec('FP32', [4])"),
])
def test_other_dims_show_both_sides(free, inputs, outputs, options, said):
    with pytest.raises(ShapeMismatchError) as info:
        onnx_model("affine", free, inputs=inputs, outputs=outputs, **options)
    assert said.format(file=repr(str(free))) in str(info.value)
    assert info.value.step == "affine"


def test_a_fixed_batch_in_the_file_asks_for_fixed_batch(fixed):
    with pytest.raises(ShapeMismatchError) as info:
        onnx_model("one", fixed, inputs={"x": X}, outputs={"scores": SCORES})
    assert ("has it as FP32 [1, 4]; its first axis is a fixed batch of 1, so pass fixed_batch=1 (or export the "
            "file with a dynamic batch axis)") in str(info.value)
    with pytest.raises(ShapeMismatchError, match=r"its first axis is a batch of 1, not fixed_batch=2: pass fixed_batch=1"):
        onnx_model("one", fixed, inputs={"x": X}, outputs={"scores": SCORES}, fixed_batch=2)


def test_a_missing_or_broken_file_is_a_declaration_error(tmp_path):
    with pytest.raises(StepDeclarationError, match=r"step 'affine': ONNX model file '.*nope.onnx' does not exist"):
        onnx_model("affine", tmp_path / "nope.onnx", inputs={"x": X}, outputs={"scores": SCORES})
    (tmp_path / "junk.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(DeclarationError, match=r"step 'affine': '.*junk.onnx' is not a readable ONNX model"):
        onnx_model("affine", tmp_path / "junk.onnx", inputs={"x": X}, outputs={"scores": SCORES})


def test_whether_the_pipeline_batches_is_checked_when_it_compiles(free, fixed):
    """A spec of the file's own rank declares a step for a pipeline that does not batch; in one
    that does, its model would fail to load on any Triton, so compiling refuses it."""
    whole = onnx_model("one", fixed, inputs={"x": TensorSpec("FP32", [1, 4])},
                       outputs={"scores": TensorSpec("FP32", [1, 3])})
    for max_batch_size in (0, 8):
        p = Pipeline("fixedp", inputs={"x": TensorSpec("FP32", [1, 4])}, max_batch_size=max_batch_size)
        p.output("s", p.add(whole, x=p.input("x"))["scores"])
        if max_batch_size == 0:
            p.compile("all")
            continue
        with pytest.raises(CompileError) as info:
            p.compile("all")
        assert str(info.value).startswith(
            "pipeline 'fixedp': step 'one', in a model that batches (max_batch_size 8): step 'one': input 'x' is "
            f"declared FP32 [1, 4], but {str(fixed)!r} has it as FP32 [1, 4]; the ranks differ: declared dims "
            "leave out the batch axis, which the file has first, so declare TensorSpec('FP32', [4]), and pass "
            "fixed_batch=1"
        )
        assert (info.value.pipeline, info.value.step, info.value.tensor) == ("fixedp", "one", "x")
    batching = onnx_model("affine", free, inputs={"x": X}, outputs={"scores": SCORES})
    p = Pipeline("flat", inputs={"x": X}, max_batch_size=0)
    p.output("s", p.add(batching, x=p.input("x"))["scores"])
    with pytest.raises(CompileError, match=r"in a model that does not batch \(max_batch_size 0\): .* the ranks "
                                           r"differ, so declare TensorSpec\('FP32', \[-1, 4\]\)"):
        p.compile("ensemble")
