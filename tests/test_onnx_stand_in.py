"""An ONNX step on the bundled server, which has only the Python backend (issue 43 §3).

A pipeline of a Python pre-step, an ONNX model (MatMul, Add, Relu, and an ArgMax) and a
Python post-step compiles to a repository that keeps ``backend: "onnxruntime"`` for a full
Triton; the bundled server serves the ONNX model through a labelled Python stand-in running
onnxruntime, so every form of the pipeline loads and answers what onnxruntime itself computes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx  # the onnx extra, which `make test` installs: these tests run, never skip
import onnxruntime
import pytest
from onnx_steps import SCORES, X, post, pre

from pipelines import Pipeline, StepError, TensorSpec
from pipelines.compile.configs import parse_config
from pipelines.serving import OnnxFileError, OnnxSession, Spec
from pipelines.steps import onnx_model
from pipelines.triton import TritonServer
from pipelines.triton.model_state import ModelsUnavailableWarning
from pipelines.triton.models.onnx_stand_in import ONNX_FILE_PARAMETER, STAND_IN_PARAMETER
from pipelines.triton.stand_ins import ServedRepository

FORMS = ("ensemble", "bls", "bls_sync", "fused")
PROTOCOLS = ("http", "grpc")
LABEL = TensorSpec("INT64", [1])
W = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5.0) / 10.0
B = np.array([0.5, -0.25, 0.0], np.float32)


def write_affine_onnx(path: Path, batch: str | int = "batch") -> Path:
    """``scores = relu(x @ W + b)`` and ``label = argmax(scores)``; a free batch axis, or a fixed one."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["scores"]),
            helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=1),
        ],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, 3]),
            helper.make_tensor_value_info("label", TensorProto.INT64, [batch, 1]),
        ],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")],
    )
    # An opset and IR version every onnxruntime of the extra (1.17 on) reads.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def affine_pipelines(model_file: Path) -> dict[str, Pipeline]:
    """A chain (pre -> affine -> post), and one that exposes the model's own outputs too, which
    the ensemble can only do through its gate (an external model cannot copy an output)."""
    affine = onnx_model("affine", model_file, inputs={"x": X}, outputs={"scores": SCORES, "label": LABEL})
    chain = Pipeline("onnxchain", inputs={"x": X}, max_batch_size=8)
    scored = chain.add(affine, x=chain.add(pre, x=chain.input("x"))["x2"])
    chain.output("z", chain.add(post, scores=scored["scores"])["z"])

    # Its own dynamic batcher, so that requests sent together reach the stand-in as one list.
    batching = onnx_model("affine", model_file, inputs={"x": X}, outputs={"scores": SCORES, "label": LABEL},
                          dynamic_batching={"max_queue_delay_us": 20_000})
    raw = Pipeline("onnxraw", inputs={"x": X}, max_batch_size=8)
    scored = raw.add(batching, x=raw.add(pre, x=raw.input("x"))["x2"])
    raw.output("z", raw.add(post, scores=scored["scores"])["z"])
    raw.output("scores", scored["scores"])
    raw.output("label", scored["label"])
    return {"onnxchain": chain, "onnxraw": raw}


def onnxruntime_answers(model_file: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """What the pipelines compute, with onnxruntime called directly on the file (a row at a
    time for a file with a fixed batch of 1)."""
    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    fixed = session.get_inputs()[0].shape[0] == 1
    rows = [x[i : i + 1] for i in range(len(x))] if fixed else [x]
    scores, label = (np.concatenate(parts) for parts in zip(*(session.run(["scores", "label"], {"x": r * 2})
                                                                for r in rows), strict=True))
    return {"z": scores + 1, "scores": scores, "label": label}


def tree_digest(root: Path) -> str:
    """Every file's bytes and every link's target under ``root``: what the server must not change."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_affine_onnx(tmp_path_factory.mktemp("onnx") / "affine.onnx")


@pytest.fixture(scope="module")
def pipelines(model_file):
    return affine_pipelines(model_file)


@pytest.fixture(scope="module")
def repository(pipelines, model_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx_repo") / "models"
    chain, raw = pipelines.values()
    path = chain.compile("all").merge(raw.compile("all")).write(root)
    # A hand-written onnxruntime model whose config drifted from its file (FP64 for FP32).
    drifted = path / "drifted"
    (drifted / "1").mkdir(parents=True)
    (drifted / "1" / "model.onnx").write_bytes(model_file.read_bytes())
    (drifted / "config.pbtxt").write_text(textwrap.dedent("""\
        name: "drifted"
        backend: "onnxruntime"
        max_batch_size: 8
        input { name: "x" data_type: TYPE_FP64 dims: 4 }
        output { name: "scores" data_type: TYPE_FP32 dims: 3 }
        """))
    return path


def batch(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


# ------------------------------------------------------------------ the repository for a full Triton


def test_the_repository_keeps_the_onnxruntime_model_for_a_full_triton(repository, model_file):
    for name in ("onnxchain__affine", "onnxraw__affine"):
        config = parse_config((repository / name / "config.pbtxt").read_text())
        assert config.backend == "onnxruntime" and config.default_model_filename == "model.onnx"
        assert STAND_IN_PARAMETER not in config.parameters  # nothing of the stand-in is written here
        assert (repository / name / "1" / "model.onnx").read_bytes() == model_file.read_bytes()
        assert not (repository / name / "1" / "model.py").exists()


def test_the_local_runtime_runs_the_onnx_step_through_the_same_session(pipelines, model_file):
    x = batch(5)
    want = onnxruntime_answers(model_file, x)
    for form in ("ensemble", "bls", "bls-sync", "fused"):
        got = pipelines["onnxraw"].run({"x": x}, mode=form)
        for name in ("z", "scores", "label"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=f"{form} {name}")


# ------------------------------------------------------------------ the server's copy, without a server


def test_the_server_gets_a_labelled_stand_in_in_a_copy_and_the_repository_is_untouched(repository, tmp_path):
    before = tree_digest(repository)
    served = ServedRepository.build(repository, tmp_path / "served")
    assert served is not None and tree_digest(repository) == before
    assert set(served.stand_ins) == {"onnxchain__affine", "onnxraw__affine", "drifted"}
    original = parse_config((repository / "onnxraw__affine" / "config.pbtxt").read_text())
    stand_in = parse_config((served.folder / "onnxraw__affine" / "config.pbtxt").read_text())
    assert stand_in.backend == "python" and not stand_in.platform and not stand_in.default_model_filename
    assert "stand" in stand_in.parameters[STAND_IN_PARAMETER].string_value.lower()
    assert "onnxruntime" in stand_in.parameters[STAND_IN_PARAMETER].string_value
    assert stand_in.parameters[ONNX_FILE_PARAMETER].string_value == "model.onnx"
    # What the ensembles and BLS models that call it see is the same model.
    assert stand_in.input == original.input and stand_in.output == original.output
    assert stand_in.max_batch_size == original.max_batch_size and stand_in.dynamic_batching == original.dynamic_batching
    version = served.folder / "onnxraw__affine" / "1"
    assert (version / "model.onnx").resolve() == (repository / "onnxraw__affine" / "1" / "model.onnx").resolve()
    import pipelines.triton.models.onnx_stand_in as module

    assert (version / "model.py").read_bytes() == Path(module.__file__).read_bytes()  # the package's own module
    assert (version / "serving" / "onnx_session.py").is_file()
    # Every other entry is a link to the repository's own.
    assert os.readlink(served.folder / "onnxchain_bls") == str(repository / "onnxchain_bls")


def test_no_stand_in_needed_means_no_copy(tmp_path):
    p = Pipeline("plain", inputs={"x": X}, max_batch_size=8)
    p.output("x2", p.add(pre, x=p.input("x"))["x2"])
    path = p.compile("all").write(tmp_path / "models")
    assert ServedRepository.build(path, tmp_path / "served") is None
    assert not (tmp_path / "served").exists()


def test_the_stand_in_model_imports_like_the_other_in_server_models(repository, tmp_path):
    """As the stub imports it: only the standard library, numpy and its own folder (onnxruntime
    is imported when the model loads, not when its file is imported)."""
    served = ServedRepository.build(repository, tmp_path / "served")
    script = textwrap.dedent("""
        import json, sys, types
        model_dir = sys.argv[1]
        sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
        sys.path += [model_dir + "/1", model_dir]
        import numpy
        before = set(sys.modules)
        import importlib
        module = importlib.import_module("1.model")
        new = sorted({m.partition(".")[0] for m in set(sys.modules) - before})
        print(json.dumps({"new": new, "stdlib": sorted(sys.stdlib_module_names), "model": hasattr(module, "TritonPythonModel")}))
        """)
    out = subprocess.run([sys.executable, "-c", script, str(served.folder / "onnxchain__affine")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["model"] and set(seen["new"]) - set(seen["stdlib"]) - {"numpy", "1"} == set(), seen["new"]


# ------------------------------------------------------------------ the checks of a file against its config


def test_a_config_that_drifted_from_its_file_is_refused_with_both_sides(model_file):
    with pytest.raises(OnnxFileError, match=r"input 'x' is FP64 in the config but FP32"):
        OnnxSession(model_file, {"x": Spec("FP64", (4,))}, {"scores": Spec("FP32", (3,))}, max_batch_size=8)
    with pytest.raises(OnnxFileError, match=r"output 'scores' has dims \[-1, 3\] .* declares \[-1, 5\]"):
        OnnxSession(model_file, {"x": Spec("FP32", (4,))}, {"scores": Spec("FP32", (5,))}, max_batch_size=8)
    with pytest.raises(OnnxFileError, match=r"declares output 'probs', which .* does not have; its outputs are"):
        OnnxSession(model_file, {"x": Spec("FP32", (4,))}, {"probs": Spec("FP32", (3,))}, max_batch_size=8)
    with pytest.raises(OnnxFileError, match=r"has input 'x', which the config does not declare"):
        OnnxSession(model_file, {}, {"scores": Spec("FP32", (3,))}, max_batch_size=8)
    # A config may leave an output of the file out, as Triton's onnxruntime backend allows.
    session = OnnxSession(model_file, {"x": Spec("FP32", (4,))}, {"label": Spec("INT64", (1,))}, max_batch_size=8)
    assert session.run({"x": batch(2)})["label"].shape == (2, 1)


def test_a_model_exported_with_a_fixed_batch_runs_locally_a_row_at_a_time(tmp_path):
    path = write_affine_onnx(tmp_path / "one.onnx", batch=1)
    one = onnx_model("one", path, inputs={"x": X}, outputs={"scores": SCORES, "label": LABEL}, fixed_batch=1)
    p = Pipeline("fixed", inputs={"x": X}, max_batch_size=4)
    p.output("z", p.add(post, scores=p.add(one, x=p.add(pre, x=p.input("x"))["x2"])["scores"])["z"])
    x = batch(3)
    np.testing.assert_allclose(p.run({"x": x})["z"], onnxruntime_answers(path, x)["z"], rtol=1e-6)


def test_a_local_onnx_step_that_drifted_fails_as_its_step(model_file, tmp_path):
    # The file changed after the step was declared (declaring checks it: tests/test_onnx_declared.py).
    drifting = tmp_path / "affine.onnx"
    drifting.write_bytes(model_file.read_bytes())
    wrong = onnx_model("affine", drifting, inputs={"x": X}, outputs={"scores": SCORES})
    from onnx import TensorProto, helper

    wide = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 5]) for n in ("x", "scores")]
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["scores"])], "wide",
                                                  wide[:1], wide[1:]),
                                opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(drifting))
    with pytest.raises(StepError, match=r"step 'affine': input 'x' has dims \[-1, 5\]") as info:
        wrong.instantiate()
    assert info.value.step == "affine"


def test_pipelines_compile_says_which_models_the_bundled_server_stands_in_for(model_file, tmp_path):
    spec = tmp_path / "onnx_pipeline.py"
    spec.write_text(textwrap.dedent(f"""
        from pipelines import Pipeline, TensorSpec
        from pipelines.steps import onnx_model

        X = TensorSpec("FP32", [4])
        affine = onnx_model("affine", {str(model_file)!r}, inputs={{"x": X}},
                            outputs={{"scores": TensorSpec("FP32", [3]), "label": TensorSpec("INT64", [1])}})
        pipeline = Pipeline("onnxcli", inputs={{"x": X}}, max_batch_size=4)
        pipeline.output("scores", pipeline.add(affine, x=pipeline.input("x"))["scores"])
        """))
    from pipelines.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["compile", f"{spec}:pipeline", "--target", "all", "--out", str(tmp_path / "models")]) == 0
    text = out.getvalue()
    assert "onnxcli__affine  (backend onnxruntime: on the bundled server, a Python stand-in)" in text
    assert "--url" in text
    assert parse_config((tmp_path / "models" / "onnxcli__affine" / "config.pbtxt").read_text()).backend == "onnxruntime"


# ------------------------------------------------------------------ on the bundled server


@pytest.fixture(scope="module")
def server(repository):
    running = TritonServer(repository)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        running.start()
    try:
        running.start_warnings = [w for w in said if issubclass(w.category, ModelsUnavailableWarning)]
        yield running
    finally:
        running.stop()


@pytest.mark.server
def test_the_server_says_each_stand_in(server):
    assert set(server.stand_ins) == {"onnxchain__affine", "onnxraw__affine", "drifted"}
    log = Path(server.log_path).read_text()
    assert "model 'onnxchain__affine' is served by a STAND-IN" in log  # ours, at the start
    assert "model 'onnxchain__affine' is a STAND-IN" in log  # the stub's, when the model loaded
    with server.client("http") as client:
        config = client.model_config("onnxraw__affine")
    assert config["backend"] == "python"
    assert "onnxruntime" in config["parameters"][STAND_IN_PARAMETER]["string_value"]


@pytest.mark.server
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["onnxchain", "onnxraw"])
def test_every_form_answers_what_onnxruntime_computes(server, model_file, name, form, protocol):
    x = batch(3, seed=len(form))
    want = onnxruntime_answers(model_file, x)
    with server.client(protocol, timeout=60) as client:
        got = client.infer(f"{name}_{form}", {"x": x})
    assert set(got) == ({"z"} if name == "onnxchain" else {"z", "scores", "label"})
    for output, value in got.items():
        assert value.dtype == want[output].dtype
        np.testing.assert_allclose(value, want[output], rtol=1e-6, err_msg=f"{name}_{form} {output}")


@pytest.mark.server
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("outputs", [["label"], ["scores"], ["z", "label"]])
def test_a_subset_of_outputs_answers_in_every_form(server, model_file, form, outputs):
    x = batch(2, seed=7)
    want = onnxruntime_answers(model_file, x)
    with server.client("grpc", timeout=60) as client:
        got = client.infer(f"onnxraw_{form}", {"x": x}, outputs=outputs)
    assert set(got) == set(outputs)
    for output in outputs:
        np.testing.assert_allclose(got[output], want[output], rtol=1e-6)


@pytest.mark.server
def test_requests_sent_together_run_as_one_batch_and_each_gets_its_rows(server, model_file):
    xs = [batch(rows, seed=rows) for rows in (1, 2, 3, 1, 2, 3, 1, 2)]
    before = _counts(server, "onnxraw__affine")

    def call(x):
        with server.client("grpc", timeout=60) as client:
            return client.infer("onnxraw__affine", {"x": x * 2})

    with ThreadPoolExecutor(len(xs)) as pool:
        results = list(pool.map(call, xs))
    for x, got in zip(xs, results, strict=True):
        want = onnxruntime_answers(model_file, x)
        np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-6)
        np.testing.assert_array_equal(got["label"], want["label"])
    rows, executions = (a - b for a, b in zip(_counts(server, "onnxraw__affine"), before, strict=True))
    assert rows == sum(len(x) for x in xs) and executions < len(xs)  # some shared one onnxruntime run


@pytest.mark.server
def test_a_stand_in_whose_config_drifted_from_its_file_does_not_load_and_says_why(server):
    assert "drifted" in server.unavailable
    assert "input 'x' is FP64 in the config but FP32" in server.unavailable["drifted"]
    assert any("drifted" in str(w.message) for w in server.start_warnings)
    # The pipelines' own models all loaded.
    assert not {n for n in server.unavailable if n.startswith("onnx")}


def _counts(server, model):
    """Rows inferred (Triton's ``inference_count``) and executions of ``model`` so far."""
    with server.client("grpc") as client:
        entry = client.statistics(model)["model_stats"][0]
    return int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0))
