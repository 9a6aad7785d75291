"""A repository that compiles cleanly loads on the server (issue 60 §1).

A user's steps file that declares an ONNX file with the library's own helper
(``from pipelines.steps import onnx_model``) travels as its file, not as a pickle pinned to this
Python; with the import at the top or inside a function, its models load and answer on a server
whose Python has no ``pipelines``. And compiling proves that every step's code loads there before it
writes: a step that would fail is a ``CompileError`` naming the step, the file, the line and the
missing module, and the repository is left byte for byte as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_onnx_stand_in import onnxruntime_answers, tree_digest, write_affine_onnx

from pipelines import CompileError
from pipelines.commands.loading import load_pipeline
from pipelines.compile.step_models import StepByValueWarning
from pipelines.runtime import MODES

STEPS = '''\
from pathlib import Path

from pipelines import Pipeline, TensorSpec, step
{top_import}
X = TensorSpec("FP32", [4])
SCORES = TensorSpec("FP32", [3])


@step(inputs={{"x": X}}, outputs={{"x2": X}})
def pre(x):
    return {{"x2": x * 2}}


@step(inputs={{"scores": SCORES}}, outputs={{"z": SCORES}})
def post(scores):
    return {{"z": scores + 1}}


def classifier():
{inner_import}    return onnx_model("affine", Path(__file__).with_name("affine.onnx"), inputs={{"x": X}},
                      outputs={{"scores": SCORES, "label": TensorSpec("INT64", [1])}})


pipeline = Pipeline("{name}", inputs={{"x": X}}, max_batch_size=8)
scored = pipeline.add(classifier(), x=pipeline.add(pre, x=pipeline.input("x"))["x2"])
pipeline.output("z", pipeline.add(post, scores=scored["scores"])["z"])
'''

#: The user's first file: the helper imported at the top. Their second: imported inside a function.
AT_TOP = STEPS.format(name="ontop", top_import="from pipelines.steps import onnx_model\n", inner_import="")
INSIDE = STEPS.format(name="inside", top_import="",
                      inner_import="    from pipelines.steps import onnx_model\n\n")
#: A file that uses one of the library's own steps: it travels as its module, not as a pickle.
LIBRARY = '''\
from pipelines import Pipeline, TensorSpec, step
from pipelines.steps import nms_step

ROWS = TensorSpec("FP32", [-1, 7])


@step(inputs={"raw": ROWS}, outputs={"candidates": ROWS})
def sharpen(raw):
    return {"candidates": raw * 1}


pipeline = Pipeline("library", inputs={"raw": ROWS}, max_batch_size=4)
candidates = pipeline.add(sharpen, raw=pipeline.input("raw"))["candidates"]
nms = nms_step(num_candidates=-1, num_classes=2, max_det=5, conf_threshold=0.3)
pipeline.output("detections", pipeline.add(nms, candidates=candidates)["detections"])
'''
NAMES = ("ontop_steps", "inside_steps", "library_steps", "unloadable", "unrequired")


@pytest.fixture(autouse=True)
def forget_the_scripts():
    for name in NAMES:
        sys.modules.pop(name, None)
    path = sys.path[:]
    yield
    sys.path[:] = path
    for name in NAMES:
        sys.modules.pop(name, None)


def project(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_affine_onnx(folder / "affine.onnx")
    (folder / "ontop_steps.py").write_text(AT_TOP)
    (folder / "inside_steps.py").write_text(INSIDE)
    (folder / "library_steps.py").write_text(LIBRARY)
    return folder


def candidates(rows: int = 6) -> np.ndarray:
    """Two images' yolo rows: box centre and size, objectness, two class scores."""
    rng = np.random.default_rng(5)
    boxes = np.concatenate([rng.uniform(20, 60, (2, rows, 2)), rng.uniform(5, 30, (2, rows, 2))], axis=2)
    return np.concatenate([boxes, rng.uniform(0, 1, (2, rows, 3))], axis=2).astype(np.float32)


def compiled(folder: Path, script: str, root: Path, form: str = "all") -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepByValueWarning)  # no step of these files goes by value
        return load_pipeline(f"{folder / script}:pipeline").compile(form).write(root)


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


# ------------------------------------------------------------------ the files travel, not a pickle


def test_onnx_model_imported_at_the_top_leaves_the_files_steps_travelling_as_their_file(tmp_path):
    folder = project(tmp_path / "project")
    root = compiled(folder, "ontop_steps.py", tmp_path / "models")
    assert not list(root.rglob("step.pkl"))
    for step in ("pre", "post"):
        plan = json.loads((root / f"ontop__{step}" / "1" / "step.json").read_text())
        assert plan["source"] == "file" and plan["impl"]["path"] == "steps_src/ontop_steps.py"
    lines = (root / "requirements.txt").read_text()
    assert "no step travels by value" in lines and "cloudpickle" not in lines
    assert (root / "ontop__affine" / "1" / "model.onnx").read_bytes() == (folder / "affine.onnx").read_bytes()


def test_a_library_step_travels_as_its_modules_with_no_pickle_and_no_python_pin(tmp_path):
    folder = project(tmp_path / "project")
    root = compiled(folder, "library_steps.py", tmp_path / "models")
    assert not list(root.rglob("step.pkl"))
    plan = json.loads((root / "library__nms" / "1" / "step.json").read_text())
    assert plan["source"] == "file" and plan["impl"]["module"] == "pipelines.steps.nms"
    assert sorted(plan["impl"]["sha256"]) == [f"steps_src/pipelines/steps/{name}.py" for name in ("_config", "_xp", "nms")]
    copied = root / "library__nms" / "1" / "steps_src" / "pipelines" / "steps" / "nms.py"
    import pipelines.steps.nms as module

    assert copied.read_bytes() == Path(module.__file__).read_bytes()
    assert "no step travels by value" in (root / "requirements.txt").read_text()


@pytest.mark.parametrize("script", ["ontop_steps.py", "inside_steps.py"])
def test_the_copy_loads_in_a_python_without_pipelines(tmp_path, script):
    """What a stub does, in an interpreter that cannot import pipelines: ``-I -S`` and a sys.path
    of the model's own folder and site-packages, where no .pth file puts the package."""
    folder = project(tmp_path / "project")
    root = compiled(folder, script, tmp_path / "models", form="ensemble")
    version = next(root.glob("*__pre")) / "1"
    probe = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(version)!r}]
        sys.path.append({site_packages()!r})
        try:
            import pipelines
        except ImportError:
            pass
        else:
            raise SystemExit("pipelines is importable here: the probe proves nothing")
        import numpy as np
        import serving
        pre = serving.load_impl(json.load(open({str(version / "step.json")!r}))["impl"], {str(version)!r})
        print(pre.__qualname__, pre(np.ones(4, np.float32))["x2"].tolist())
    """)
    ran = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["pre", "[2.0,", "2.0,", "2.0,", "2.0]"]


def test_a_file_may_name_the_helpers_module_but_not_the_internals(tmp_path):
    folder = tmp_path / "names"
    folder.mkdir()
    (folder / "unloadable.py").write_text(textwrap.dedent("""
        import pipelines.steps as helpers
        from pipelines import Pipeline, TensorSpec, step
        from pipelines.steps._xp import to_numpy

        X = TensorSpec("FP32", [4])
        NMS = helpers.nms_step

        @step(inputs={"x": X}, outputs={"y": X})
        def ident(x):
            return {"y": x}

        pipeline = Pipeline("names", inputs={"x": X}, max_batch_size=4)
        pipeline.output("y", pipeline.add(ident, x=pipeline.input("x"))["y"])
    """))
    with pytest.warns(StepByValueWarning, match=r"unloadable.py imports from pipelines.steps._xp; on a server"):
        load_pipeline(f"{folder / 'unloadable.py'}:pipeline").compile("ensemble")


# ------------------------------------------------------------------ compile proves the load, or writes nothing

UNLOADABLE = '''\
from pipelines import Pipeline, TensorSpec, step

X = TensorSpec("FP32", [4])


def factor():
    import scalers

    return scalers.FACTOR


FACTOR = factor()


@step(inputs={"x": X}, outputs={"y": X})
def scaled(x):
    return {"y": x * FACTOR}


pipeline = Pipeline("unloadable", inputs={"x": X}, max_batch_size=4)
pipeline.output("y", pipeline.add(scaled, x=pipeline.input("x"))["y"])
'''


def unloadable(folder: Path) -> Path:
    """A script that, when imported, reaches a package beside it through a function: it runs
    here, where the folder is on sys.path, but the package does not travel (only single files do)."""
    (folder / "scalers").mkdir(parents=True)
    (folder / "scalers" / "__init__.py").write_text("FACTOR = 3\n")
    (folder / "unloadable.py").write_text(UNLOADABLE)
    return folder / "unloadable.py"


def test_a_step_that_would_not_load_on_the_server_is_refused_and_nothing_is_written(tmp_path):
    root = compiled(project(tmp_path / "project"), "ontop_steps.py", tmp_path / "models")
    before = tree_digest(root)
    script = unloadable(tmp_path / "bad")
    p = load_pipeline(f"{script}:pipeline")
    assert p.run({"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[3.0] * 4]  # it runs here
    with pytest.raises(CompileError) as refused:
        p.compile("all").write(root)
    message = str(refused.value)
    assert refused.value.pipeline == "unloadable" and refused.value.step == "scaled"
    assert "step 'scaled' (model 'unloadable__scaled') would fail to load on the server" in message
    assert "unloadable.py, line 7 (`import scalers`)" in message
    assert "ModuleNotFoundError: No module named 'scalers'" in message
    assert "make it a single-file module beside the step's file" in message
    assert tree_digest(root) == before
    with pytest.raises(CompileError, match="No module named 'scalers'"):
        p.compile("all").write(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_pipelines_compile_refuses_it_too(tmp_path, capsys):
    from pipelines.cli import main

    script = unloadable(tmp_path / "bad")
    assert main(["compile", f"{script}:pipeline", "--out", str(tmp_path / "models")]) != 0
    assert "No module named 'scalers'" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


def test_a_module_installed_here_but_not_in_requirements_is_refused(tmp_path):
    folder = tmp_path / "unrequired"
    folder.mkdir()
    (folder / "unrequired.py").write_text(UNLOADABLE.replace("import scalers\n\n    return scalers.FACTOR",
                                                             "import onnx\n\n    return len(onnx.__name__)"))
    with pytest.raises(CompileError) as refused:
        load_pipeline(f"{folder / 'unrequired.py'}:pipeline").compile("ensemble").write(tmp_path / "models")
    message = str(refused.value)
    assert "unrequired.py, line 7 (`import onnx`)" in message
    assert "No module named 'onnx' (installed here, but no line of requirements.txt installs it)" in message
    assert "import onnx at the top of unrequired.py" in message
    assert not (tmp_path / "models").exists()


# ------------------------------------------------------------------ on the server


def python_without_pipelines(where: Path) -> Path:
    """A virtual environment of this Python that sees this one's site-packages through a plain path
    (a .pth line), so that the .pth file of our editable install is not run: no ``pipelines``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (where / "lib" / version / "site-packages" / "outer.pth").write_text(site_packages() + "\n")
    python = where / "bin" / "python"
    assert subprocess.run([python, "-c", "import numpy, onnxruntime"], capture_output=True, cwd=where).returncode == 0
    assert subprocess.run([python, "-c", "import pipelines"], capture_output=True, cwd=where).returncode != 0
    return where


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from pipelines.triton import TritonServer

    folder = project(tmp_path_factory.mktemp("project"))
    root = tmp_path_factory.mktemp("served") / "models"
    for script in ("ontop_steps.py", "inside_steps.py", "library_steps.py"):
        compiled(folder, script, root)
    env = python_without_pipelines(tmp_path_factory.mktemp("env") / "venv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bundled server's stand-in for the onnxruntime backend says so
        with TritonServer(root, python_env=env) as server:
            yield folder, server


@pytest.mark.server
@pytest.mark.parametrize("name", ["ontop", "inside"])
def test_every_form_loads_and_answers_on_a_server_without_pipelines(served, name):
    folder, server = served
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    want = onnxruntime_answers(folder / "affine.onnx", x)["z"]
    with server.client("http", timeout=60) as client:
        for mode in MODES:
            model = f"{name}_{mode}" if mode != "bls-sync" else f"{name}_bls_sync"
            np.testing.assert_allclose(client.infer(model, {"x": x})["z"], want, rtol=1e-6, err_msg=model)


# ------------------------------------------------------------------ the recipe of docs/onnx.md


def test_the_recipe_in_the_docs_runs_compiles_and_writes_what_the_docs_say(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    page = (Path(__file__).resolve().parent.parent / "docs" / "onnx.md").read_text()
    script = next(block for block in page.split("```python\n")[1:] if block.startswith('"""classify.py'))
    folder = tmp_path / "recipe"
    folder.mkdir()
    (folder / "classify.py").write_text(script.split("```")[0])
    weights = np.random.default_rng(0).standard_normal((3 * 32 * 32, 10)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["flat"], axis=1), helper.make_node("MatMul", ["flat", "w"], ["logits"])],
        "classifier", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(weights, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              str(folder / "classifier.onnx"))
    ran = subprocess.run([sys.executable, "classify.py"], cwd=folder, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    sys.modules.pop("classify", None)
    try:
        root = compiled(folder, "classify.py", tmp_path / "models")
    finally:
        sys.modules.pop("classify", None)
    for path in ("classify__classifier/1/model.onnx", "classify__normalize/1/steps_src/classify.py",
                 "classify__top5/1/steps_src/classify.py",
                 "classify_fused/1/steps/classify__normalize/steps_src/classify.py"):
        assert (root / path).is_file(), path
    assert not list(root.rglob("step.pkl"))
    lines = (root / "requirements.txt").read_text().splitlines()
    assert lines[1] == "# Python: any version the packages below support (no step travels by value)"
    assert [line.split("<")[0] for line in lines[2:]] == ["numpy"]


@pytest.mark.server
def test_a_library_step_answers_on_a_server_without_pipelines_as_locally(served):
    folder, server = served
    sys.modules.pop("library_steps", None)
    try:
        local = load_pipeline(f"{folder / 'library_steps.py'}:pipeline")
    finally:
        sys.modules.pop("library_steps", None)
    x = candidates()
    with server.client("http", timeout=60) as client:
        for mode in MODES:
            model = f"library_{mode}" if mode != "bls-sync" else "library_bls_sync"
            want = local.run({"raw": x}, mode=mode)["detections"]
            assert want[..., 4].max() > 0  # some boxes came through
            np.testing.assert_allclose(client.infer(model, {"raw": x})["detections"], want, rtol=1e-6, err_msg=model)
