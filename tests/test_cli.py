"""The command line teaches itself (--help) and names what is wrong in one line."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from pipelines.cli import build_parser, load_pipeline, main
from pipelines.errors import PipelinesError


def test_graph_prints_mermaid_dot_and_stages(capsys):
    assert main(["graph", "pipelines.examples.basic:diamond"]) == 0
    assert capsys.readouterr().out.startswith("flowchart LR")
    assert main(["graph", "pipelines.examples.basic:diamond", "--format", "dot"]) == 0
    assert '"branch_0" -> "join_0"' in capsys.readouterr().out
    assert main(["graph", "pipelines.examples.basic:diamond", "--format", "text"]) == 0
    assert "stage 0: branch_0, branch_1" in capsys.readouterr().out


def test_a_pipeline_from_a_file_and_from_a_factory(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from pipelines.examples.basic import make_chain\nbuild = lambda: make_chain(steps=2, name='two')\n")
    assert load_pipeline(f"{f}:build").name == "two"


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "is not MODULE:ATTR"),
    ("pipelines.examples.basic:nope", "has no attribute 'nope'; pipelines there: ['chain', 'diamond']"),
    ("no.such.module:x", "cannot import module 'no.such.module'"),
    ("pipelines.examples.basic:make_chain.__name__", "has no attribute"),
])
def test_bad_pipeline_names_are_explained(spec, message, capsys):
    with pytest.raises(PipelinesError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_pipeline(spec)
    assert main(["graph", spec]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("import no_such_dependency\n", r"importing '.*mine\.py' failed \(line 1\): ModuleNotFoundError: No module named 'no_such_dependency'"),
    ("x = 1\np = (\n", r"importing '.*mine\.py' failed \(line 2\): SyntaxError"),
    ("def p(n):\n    return n\n", r"'.*mine\.py:p' is a callable that cannot be called without arguments \(missing a required argument: 'n'\)"),
])
def test_a_file_that_cannot_give_a_pipeline_says_why_and_where(tmp_path, text, message, capsys):
    f = tmp_path / "mine.py"
    f.write_text(text)
    with pytest.raises(PipelinesError, match=message):
        load_pipeline(f"{f}:p")
    if "importing" in message:
        assert "mine" not in sys.modules  # a failed import leaves no half-made module behind
    sys.modules.pop("mine", None)
    assert main(["graph", f"{f}:p"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err


def test_help_lists_every_command_with_examples():
    out = subprocess.run([sys.executable, "-m", "pipelines", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("graph", "compile", "run", "serve", "bench"):
        assert cmd in out
    assert "examples:" in out and "MODULE:ATTR" in out
    for cmd in ("graph", "compile", "remove", "run", "serve", "bench", "calibrate"):
        text = subprocess.run([sys.executable, "-m", "pipelines", cmd, "--help"], capture_output=True, text=True,
                              check=True).stdout
        assert f"examples:\n  pipelines {cmd} " in text, (cmd, text)
        for line in text.split("examples:\n", 1)[1].splitlines():  # each example is a valid command line
            if line.startswith("  pipelines "):
                build_parser().parse_args(shlex.split(line.split("|")[0])[1:])


def test_compile_writes_a_repository_and_refuses_a_foreign_directory(tmp_path, capsys):
    out = tmp_path / "repo"
    assert main(["compile", "pipelines.examples.basic:diamond", "--target", "both", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "diamond_ensemble" in printed and "diamond_bls_sync" in printed
    assert (out / "diamond_ensemble" / "config.pbtxt").is_file()
    assert (out / "diamond__add" / "1" / "model.py").is_file()
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    assert main(["compile", "pipelines.examples.basic:chain", "--out", str(foreign)]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert (foreign / "todo.txt").read_text() == "mine"


def test_run_reads_npy_inputs_and_writes_npy_outputs(tmp_path, capsys):
    import numpy as np

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    for mode in ("ensemble", "bls", "bls-sync"):
        out = tmp_path / mode
        args = ["run", "pipelines.examples.basic:chain", "--mode", mode, "--input", f"x={tmp_path / 'x.npy'}",
                "--out", str(out), "--report"]
        assert main(args) == 0
        np.testing.assert_array_equal(np.load(out / "y.npy"), x * 8)  # three steps that double
        assert "y: float32 [2, 3]" in capsys.readouterr().out
    assert main(["run", "pipelines.examples.basic:chain", "--input", f"y={tmp_path / 'x.npy'}"]) == 2
    err = capsys.readouterr().err
    assert "'x'" in err and "'y'" in err  # the missing input and the unknown one are both named
    (tmp_path / "x.txt").write_text("1 2 3\n")
    assert main(["run", "pipelines.examples.basic:chain", "--input", f"x={tmp_path / 'x.txt'}"]) == 2
    assert "is not a .npy file" in capsys.readouterr().err  # not "an object array", as np.load would have it


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", "repo", "--http-port", "99999"], "expected a TCP port from 0 to 65535"),
    (["run", "pipelines.examples.basic:chain", "--out", "{file}"], "--out '{file}' is a file; give a directory"),
])
def test_outputs_and_ports_that_cannot_be_are_refused_before_any_work(tmp_path, capsys, argv, said):
    a_file = tmp_path / "taken"
    a_file.write_text("mine\n")
    argv = [a.replace("{file}", str(a_file)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2 and said.replace("{file}", str(a_file)) in capsys.readouterr().err
    assert a_file.read_text() == "mine\n"
