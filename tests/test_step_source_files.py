"""A step written in a script travels to the server as that script (and the module beside it that it
imports), not as a pickle: no cloudpickle and no Python-version pin, so a server of another Python
serves it. A step typed into ``__main__`` with no file still travels by value, and compiling says so.
On the server the script is imported under its own name: its ``__main__`` block does not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from pipelines import CompileError, InferenceError, StepError
from pipelines.commands.loading import load_pipeline
from pipelines.compile.step_models import StepByValueWarning
from pipelines.forms import model_name
from pipelines.runtime import MODES

SCRIPT = '''\
"""A user's pipeline script: two steps, a helper module beside it, the pipeline, and its main block."""

import sys
from pathlib import Path

import numpy as np

import scaling_helpers
from pipelines import Pipeline, TensorSpec, step

F4 = TensorSpec("FP32", [4])


@step(inputs={"x": F4}, outputs={"y": F4})
def scaled(x):
    if (x < 0).any():
        raise ValueError("no negative input, please")
    return {"y": scaling_helpers.scale(x)}


@step(inputs={"x": F4}, outputs={"y": F4}, parameters={"offset": 3})
class Shift:
    def initialize(self, config):
        self.offset = np.float32(config["parameters"]["offset"])

    def execute(self, x):
        return {"y": x + self.offset}


pipeline = Pipeline("scripted", inputs={"x": F4}, max_batch_size=4)
pipeline.output("y", pipeline.add(Shift, x=pipeline.add(scaled, x=pipeline.input("x"))["y"])["y"])

if __name__ == "__main__":
    Path(__file__).with_name("MAIN_BLOCK_RAN").write_text("the script's main block ran here")
    pipeline.compile("all").write(sys.argv[1])
'''

HELPER = '''\
import numpy as np


def scale(x):
    return (x * 10).astype(np.float32)
'''

X = np.array([[0.5, 1.0, 2.0, 4.0], [1.0, 0.0, 3.0, 8.0]], np.float32)
EXPECTED = X * 10 + 3


def write_script(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scaling_helpers.py").write_text(HELPER)
    script = folder / "scripted_steps.py"
    script.write_text(SCRIPT)
    return script


@pytest.fixture(autouse=True)
def forget_the_scripts():
    """Each test imports its own copy of the scripts: a module left from another would be the one used."""
    names = ("scripted_steps", "scaling_helpers", "uses_spec", "internal_steps", "computes")
    for name in names:
        sys.modules.pop(name, None)
    path = sys.path[:]  # loading a file puts its folder first, as `python file.py` does
    yield
    sys.path[:] = path
    for name in names:
        sys.modules.pop(name, None)


def requirement_lines(root: Path) -> list[str]:
    return [line for line in (root / "requirements.txt").read_text().splitlines() if line and line[0] != "#"]


def test_a_step_in_a_script_travels_as_its_file_with_no_pickle_and_no_python_pin(tmp_path):
    script = write_script(tmp_path / "project")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = load_pipeline(f"{script}:pipeline")  # how `pipelines compile scripted_steps.py:pipeline` loads it
        root = p.compile("all").write(tmp_path / "models")
    assert not [w for w in caught if issubclass(w.category, StepByValueWarning)]
    assert not list(root.rglob("step.pkl"))
    for model in ("scripted__scaled", "scripted__Shift"):
        version = root / model / "1"
        assert (version / "steps_src" / "scripted_steps.py").read_bytes() == script.read_bytes()
        assert (version / "steps_src" / "scaling_helpers.py").read_text() == HELPER  # the module it imports
        plan = json.loads((version / "step.json").read_text())
        assert plan["source"] == "file"
        assert plan["impl"]["path"] == "steps_src/scripted_steps.py" and plan["impl"]["module"] == "scripted_steps"
        assert sorted(plan["impl"]["sha256"]) == ["steps_src/scaling_helpers.py", "steps_src/scripted_steps.py"]
    assert json.loads((root / "scripted__Shift" / "1" / "step.json").read_text())["impl"]["qualname"] == "Shift"
    # The fused model carries the same files for each of its steps.
    assert (root / "scripted_fused" / "1" / "steps" / "scripted__scaled" / "steps_src" / "scripted_steps.py").is_file()
    text = (root / "requirements.txt").read_text()
    assert not any(line.startswith("cloudpickle") for line in requirement_lines(root))
    assert "exactly" not in text and "any version" in text
    assert [line for line in requirement_lines(root) if line.startswith("numpy")]


def test_pipelines_compile_of_a_script_beside_its_helper_writes_both(tmp_path, capsys):
    from pipelines.cli import main

    script = write_script(tmp_path / "project")
    assert main(["compile", f"{script}:pipeline", "--target", "ensemble", "--out", str(tmp_path / "models")]) == 0
    assert "wrote 3 models of pipeline 'scripted'" in capsys.readouterr().out
    copied = tmp_path / "models" / "scripted__scaled" / "1" / "steps_src"
    assert sorted(p.name for p in copied.iterdir()) == ["scaling_helpers.py", "scripted_steps.py"]


def test_imported_on_its_own_the_copy_skips_the_main_block_and_needs_no_pipelines(tmp_path):
    script = write_script(tmp_path / "project")
    root = load_pipeline(f"{script}:pipeline").compile("ensemble").write(tmp_path / "models")
    version = root / "scripted__scaled" / "1"
    # What the step model does in a stub: `serving` beside it, no `pipelines` imported.
    probe = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(version)!r})
        import serving
        fn = serving.load_impl(json.load(open({str(version / "step.json")!r}))["impl"], {str(version)!r})
        print(fn(np.ones(4, np.float32))["y"].tolist(), type(sys.modules["pipelines"]).__name__)
    """)
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert ran.stdout.split() == ["[10.0,", "10.0,", "10.0,", "10.0]", "_StandIn"]
    assert not (version / "steps_src" / "MAIN_BLOCK_RAN").exists()


def test_top_level_code_that_computes_with_pipelines_fails_to_load_and_says_where_to_move_it(tmp_path):
    folder = tmp_path / "computes"
    folder.mkdir()
    (folder / "computes.py").write_text(textwrap.dedent("""
        import numpy as np
        from pipelines import Pipeline, TensorSpec, step

        F4 = TensorSpec("FP32", [4])
        DIMS = tuple(F4.dims)  # a value, not a declaration: on a server F4 is a stand-in

        @step(inputs={"x": F4}, outputs={"y": F4})
        def reshaped(x):
            return {"y": x.reshape((-1, *DIMS))}

        p = Pipeline("computes", inputs={"x": F4}, max_batch_size=4)
        p.output("y", p.add(reshaped, x=p.input("x"))["y"])
    """))
    # Compiling loads the file as a server would (issue 60): it refuses, and writes nothing.
    with pytest.raises(CompileError) as refused:
        load_pipeline(f"{folder / 'computes.py'}:p").compile("ensemble").write(tmp_path / "models")
    assert ("step 'reshaped' (model 'computes__reshaped') would fail to load on the server" in str(refused.value)
            and "computes.py, line 6 (`DIMS = tuple(F4.dims)" in str(refused.value))
    assert ("RuntimeError: pipelines.TensorSpec(...).dims was used as a value") in str(refused.value)
    assert "move that code under `if __name__ == '__main__':` or into a function" in str(refused.value)
    assert not (tmp_path / "models").exists()


def test_a_step_typed_into_main_still_travels_by_value_and_compiling_says_so(tmp_path):
    typed = textwrap.dedent(f"""
        from pipelines import Pipeline, TensorSpec, step

        F4 = TensorSpec("FP32", [4])

        @step(inputs={{"x": F4}}, outputs={{"y": F4}})
        def typed_in(x):
            return {{"y": x + 1}}

        p = Pipeline("typed", inputs={{"x": F4}}, max_batch_size=4)
        p.output("y", p.add(typed_in, x=p.input("x"))["y"])
        p.compile("ensemble").write({str(tmp_path / "models")!r})
    """)
    # `python -` reads the program from stdin, as an interactive session does: __main__ has no file.
    ran = subprocess.run([sys.executable, "-"], input=typed, capture_output=True, text=True, cwd=tmp_path, check=True)
    assert "StepByValueWarning: pipeline 'typed' step 'typed_in' ('typed_in') travels by value in step.pkl" in ran.stderr
    assert "defined in __main__, which has no .py file" in ran.stderr
    version = tmp_path / "models" / "typed__typed_in" / "1"
    assert json.loads((version / "step.json").read_text())["source"] == "pickle"
    assert (version / "step.pkl").is_file() and not (version / "steps_src").exists()
    root = tmp_path / "models"
    assert any(line.startswith("cloudpickle~=") for line in requirement_lines(root))
    assert f"# Python {sys.version_info.major}.{sys.version_info.minor} exactly" in (root / "requirements.txt").read_text()


def test_a_file_whose_step_code_uses_pipelines_travels_by_value_and_says_why(tmp_path, monkeypatch):
    folder = tmp_path / "uses"
    folder.mkdir()
    (folder / "uses_spec.py").write_text(textwrap.dedent("""
        import numpy as np
        from pipelines import Pipeline, TensorSpec, step

        F4 = TensorSpec("FP32", [4])

        @step(inputs={"x": F4}, outputs={"y": F4})
        def zeros_like_spec(x):
            return {"y": np.zeros((len(x), *F4.dims), np.float32)}

        p = Pipeline("uses", inputs={"x": F4}, max_batch_size=4)
        p.output("y", p.add(zeros_like_spec, x=p.input("x"))["y"])
    """))
    p = load_pipeline(f"{folder / 'uses_spec.py'}:p")
    with pytest.warns(StepByValueWarning, match=r"because the step's code uses F4 \(a TensorSpec of pipelines\)"):
        repo = p.compile("ensemble")
    assert json.loads(repo["uses__zeros_like_spec"].files["1/step.json"])["source"] == "pickle"


def test_a_file_that_imports_pipelines_internals_travels_by_value_and_says_why(tmp_path):
    folder = tmp_path / "internal"
    folder.mkdir()
    (folder / "internal_steps.py").write_text(textwrap.dedent("""
        from pipelines import Pipeline, TensorSpec, step
        from pipelines.forms import model_name

        F4 = TensorSpec("FP32", [4])

        @step(inputs={"x": F4}, outputs={"y": F4})
        def ident(x):
            return {"y": x}

        p = Pipeline("internal", inputs={"x": F4}, max_batch_size=4)
        p.output("y", p.add(ident, x=p.input("x"))["y"])
    """))
    p = load_pipeline(f"{folder / 'internal_steps.py'}:p")
    with pytest.warns(StepByValueWarning, match=r"internal_steps.py imports from pipelines.forms; on a server"):
        repo = p.compile("ensemble")
    assert "1/step.pkl" in repo["internal__ident"].files


def test_a_script_that_compiles_when_imported_travels_by_value_and_says_how_to_travel_as_a_file(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.replace('if __name__ == "__main__":\n    ', "if True:\n    ").replace(
        "import scaling_helpers\n", "").replace("scaling_helpers.scale(x)", "x * 10"))
    ran = subprocess.run([sys.executable, str(script), str(tmp_path / "models")], capture_output=True, text=True,
                         cwd=tmp_path, check=True)
    assert ("because unguarded.py does its work when imported (pipeline.compile('all').write(...) at line 34, "
            'outside `if __name__ == "__main__":`)' in ran.stderr
            and "move that work under the guard and the step travels as its file" in ran.stderr)
    assert (tmp_path / "models" / "scripted__scaled" / "1" / "step.pkl").is_file()


# ------------------------------------------------------------------ on the server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The script run as ``python scripted_steps.py DIR`` (its main block compiles), served from a fresh
    environment of another Python (when there is one) that holds only what requirements.txt names."""
    from test_repository_server import base_python, fresh_environment, other_python

    from pipelines.triton import TritonServer

    project = write_script(tmp_path_factory.mktemp("project"))
    root = tmp_path_factory.mktemp("served") / "models"
    subprocess.run([sys.executable, str(project), str(root)], check=True, cwd=project.parent)
    assert (project.parent / "MAIN_BLOCK_RAN").exists()  # it ran where the script was run, as it should
    other = other_python()
    python, extra = (base_python(), {}) if other is None else (other[0], _libdir_env(other[0]))
    env = fresh_environment(python, root / "requirements.txt", tmp_path_factory.mktemp("env") / "venv")
    path = sys.path[:]
    try:
        local = load_pipeline(f"{project}:pipeline")
    finally:
        sys.path[:] = path
    with TritonServer(root, python_env=env, env=extra) as server:
        yield root, server, local, other


def _libdir_env(python: str) -> dict[str, str]:
    """The stub links against libpython of its version; a pyenv build keeps it in its own lib/."""
    libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}


@pytest.mark.server
def test_the_script_run_as_main_wrote_its_file_not_a_pickle(served):
    root, _, _, _ = served
    plan = json.loads((root / "scripted__scaled" / "1" / "step.json").read_text())
    assert plan["source"] == "file" and plan["impl"]["module"] == "scripted_steps"  # not __main__
    assert not list(root.rglob("step.pkl"))


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_each_form_served_by_another_python_answers_what_the_local_runtime_answers(served, mode):
    _, server, local, _ = served
    expected = local.run({"x": X}, mode=mode)["y"]
    np.testing.assert_array_equal(expected, EXPECTED)
    with server.client("http") as client:
        np.testing.assert_array_equal(client.infer(model_name("scripted", mode), {"x": X})["y"], expected)


@pytest.mark.server
@pytest.mark.parametrize("mode", ["ensemble", "bls"])
def test_a_failing_step_names_its_script_and_line_on_the_server_as_locally(served, mode):
    _, server, local, _ = served
    bad = -X
    with pytest.raises(StepError) as here:
        local.run({"x": bad}, mode=mode)
    with server.client("http") as client, pytest.raises(InferenceError) as there:
        client.infer(model_name("scripted", mode), {"x": bad})
    reason = "raised ValueError: no negative input, please (at scripted_steps.py:17)"
    assert reason in str(here.value) and reason in str(there.value)


@pytest.mark.server
def test_the_main_block_did_not_run_on_the_server(served):
    root, server, _, _ = served
    with server.client("http") as client:
        for mode in MODES:  # every model has imported the script by now
            client.infer(model_name("scripted", mode), {"x": X})
    copies = list(root.rglob("scripted_steps.py"))
    assert len(copies) == 4  # two step models, and the fused model's two steps
    assert not list(root.rglob("MAIN_BLOCK_RAN"))
