"""The code that runs inside Triton (the ``pipelines/serving/`` package and the two ``model.py`` files):
light to import, one error wire format written and read by the same module, BF16 by DLPack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile import compile_pipeline
from pipelines.serving import (
    Contract,
    Refused,
    Spec,
    WireError,
    bf16_from_dlpack,
    bf16_to_dlpack,
    bfloat16,
    config_declares,
    parse_error,
)

F4 = TensorSpec("FP32", [4])


@step(inputs={"x": F4}, outputs={"y": F4})
def plus_one(x):
    return {"y": x + 1}


# What the stub does (python_backend's pb_stub.cc): append the version folder and the model
# folder to sys.path, then import "<version>.model". A stand-in pb_utils is all it gets here.
_IMPORT_LIKE_THE_STUB = textwrap.dedent(
    """
    import json, sys, time, types
    model_dir = sys.argv[1]
    sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
    sys.path += [model_dir + "/1", model_dir]
    import numpy
    before = set(sys.modules)
    start = time.perf_counter()
    import importlib
    module = importlib.import_module("1.model")
    took = time.perf_counter() - start
    assert hasattr(module, "TritonPythonModel")
    new = sorted({m.partition(".")[0] for m in set(sys.modules) - before})
    print(json.dumps({"modules": sorted(sys.modules), "new": new, "stdlib": sorted(sys.stdlib_module_names),
                      "seconds": took, "serving": module.serving.__file__}))
    """
)


@step(inputs={"x": F4}, outputs={"y": F4})
def twice(x):
    return {"y": x * 2}


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    # Two branches side by side, so the ensemble has its gate; "all" adds the fused form.
    p = Pipeline("light", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(plus_one, x=p.input("x"))["y"])
    p.output("z", p.add(twice, x=p.input("x"))["y"])
    root = tmp_path_factory.mktemp("repo")
    compile_pipeline(p, "all").write(root)
    return root


IN_SERVER = {"step_model": "light__plus_one", "bls_model": "light_bls", "gate_model": "light_ensemble__gate",
             "fused_model": "light_fused"}


@pytest.mark.parametrize("model", list(IN_SERVER.values()), ids=list(IN_SERVER))
def test_a_model_py_imports_neither_the_package_nor_networkx_nor_anyio(repository, model):
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_LIKE_THE_STUB, str(repository / model)],
        capture_output=True, text=True, timeout=120, cwd=repository,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    modules = set(seen["modules"])
    assert "networkx" not in modules and "anyio" not in modules
    assert not {m for m in modules if m == "pipelines" or m.startswith("pipelines.")}, "the package was imported"
    # Only the standard library, numpy and the model's own folder ("1": model.py, serving/).
    assert set(seen["new"]) - set(seen["stdlib"]) - {"numpy", "1"} == set(), seen["new"]
    assert seen["serving"] == str(repository / model / "1" / "serving" / "__init__.py")  # the copy beside model.py


def test_the_serving_copy_is_the_packages_folder_byte_for_byte(repository):
    import pipelines.serving

    ours = Path(pipelines.serving.__file__).parent
    copy = repository / "light__plus_one" / "1" / "serving"
    assert sorted(p.name for p in copy.glob("*.py")) == sorted(p.name for p in ours.glob("*.py"))
    for module in ours.glob("*.py"):
        assert (copy / module.name).read_bytes() == module.read_bytes(), module.name


# ------------------------------------------------------------------ the error wire format

WIRE_CASES = [
    WireError("StepError", "p", "raised ValueError: no\nsecond line: 'x'", node="fragile", step="explode"),
    WireError("InputError", "p", "input 'x' expects rank 2 FP32 [batch, 4] but was given shape [4]", tensor="x"),
    WireError("StepError", "p.v1", "output 'y' has dtype float64; it declares FP32 (float32)", "n-1", "s", "y"),
    WireError("StepTimeoutError", "p", "ran past 2 s", step="slow"),
]


@pytest.mark.parametrize("error", WIRE_CASES, ids=lambda e: e.kind)
def test_the_wire_format_reads_back_what_it_wrote_even_inside_tritons_words(error):
    assert parse_error(error.text()) == error
    # An ensemble adds its own words before the model's; the client adds its own after parsing.
    assert parse_error(f"in ensemble 'p_ensemble', {error.text()}") == error


def test_the_wire_format_reads_as_a_sentence():
    text = WIRE_CASES[0].text()
    assert text.startswith("StepError in pipeline 'p', node 'fragile', step 'explode': raised ValueError: no")


def test_text_that_is_not_the_wire_format_is_not_parsed():
    assert parse_error("Stub process 'x_0' is not healthy.") is None
    assert parse_error("pipeline 'p' step 's' raised ValueError") is None


# ------------------------------------------------------------------ checks prepared once


def test_a_contract_says_yes_quietly_and_no_in_the_checks_words():
    contract = Contract({"x": Spec("FP32", (4,)), "k": Spec("INT32", (1,))}, max_batch_size=4)
    ok = {"x": np.zeros((2, 4), np.float32), "k": np.zeros((2, 1), np.int32)}
    assert contract.check_inputs(ok) == 2
    with pytest.raises(Refused, match=r"input 'k' expects dtype INT32 \(int32\) but was given int64") as info:
        contract.check_inputs({**ok, "k": np.zeros((2, 1), np.int64)})
    assert info.value.tensor == "k"
    with pytest.raises(Refused, match="have batch sizes 2 and 3"):
        contract.check_inputs({**ok, "k": np.zeros((3, 1), np.int32)})
    with pytest.raises(Refused, match="max_batch_size is 4"):
        contract.check_inputs({"x": np.zeros((5, 4), np.float32), "k": np.zeros((5, 1), np.int32)})
    contract.check_outputs(ok, 2)
    with pytest.raises(Refused, match=r"output 'x' has shape \[1, 4\]; expected the batch dimension 2 first"):
        contract.check_outputs({**ok, "x": np.zeros((1, 4), np.float32)}, 2)


# ------------------------------------------------------------------ BF16 through DLPack


def test_bf16_goes_into_a_dlpack_capsule_and_comes_back_bit_for_bit():
    values = np.array([[1.5, -2.25, 3e38, np.nan]], dtype=np.float32).astype(bfloat16())
    capsule = bf16_to_dlpack(values)
    back = bf16_from_dlpack(capsule)
    assert back.dtype == bfloat16() and back.shape == (1, 4)
    np.testing.assert_array_equal(back.view(np.uint16), values.view(np.uint16))
    del values  # the capsule keeps the memory alive, not the caller's array
    assert back.view(np.uint16)[0, 0] == np.array([1.5], np.float32).astype(bfloat16()).view(np.uint16)[0]


def test_a_capsule_of_another_dtype_is_refused():
    with pytest.raises(Refused, match="expected a host BF16 tensor"):
        bf16_from_dlpack(np.zeros(3, np.float32).__dlpack__())


def test_inputs_are_left_to_triton_only_where_its_config_declares_exactly_them():
    specs = {"x": Spec("FP32", (4,)), "t": Spec("BYTES", (-1,))}
    config = {
        "max_batch_size": 4,
        "input": [
            {"name": "x", "data_type": "TYPE_FP32", "dims": ["4"], "optional": False},
            {"name": "t", "data_type": "TYPE_STRING", "dims": [-1]},
        ],
    }
    assert config_declares(config, specs, 4)
    assert not config_declares(config, specs, 8)
    assert not config_declares({**config, "input": config["input"][:1]}, specs, 4)
    assert not config_declares({**config, "input": [{**config["input"][0], "dims": [5]}, config["input"][1]]}, specs, 4)
    assert not config_declares({**config, "input": [{**config["input"][0], "optional": True}, config["input"][1]]}, specs, 4)
    assert not config_declares(None, specs, 4)
    trusted = Contract(specs, 4, checked_by_triton=True)
    assert trusted.check_inputs({"x": np.zeros((3, 4), np.float32), "t": np.zeros((3, 2), object)}) == 3
    with pytest.raises(Refused):  # outputs are always checked
        trusted.check_outputs({"x": np.zeros((3, 4), np.float64), "t": np.zeros((3, 2), object)}, 3)
