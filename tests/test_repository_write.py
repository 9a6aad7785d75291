"""``repo.write(path)``: only the models a pipeline owns are replaced, every other
model is left byte for byte, each model is whole at every instant (even across
SIGKILL), writers are serialised, and nothing is written outside ``path``,
whatever names it is given. Also ``remove_pipelines`` and requirements.txt."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines import (
    DeclarationError,
    Pipeline,
    RepositoryWriteError,
    TensorSpec,
    external_model,
    step,
)
from pipelines.cli import main as cli_main
from pipelines.compile import remove_pipelines, repository_pipelines
from pipelines.compile import repository_disk as disk
from pipelines.compile.step_models import step_reference

HERE = Path(__file__).resolve().parent

F4 = TensorSpec("FP32", [4])
_LOCK = threading.Lock()  # cloudpickle cannot export a lock


@step(inputs={"x": F4}, outputs={"y": F4})
def double(x):
    return {"y": x * 2}


@step(inputs={"x": F4}, outputs={"y": F4})
def ident(x):
    return {"y": x}


@step(inputs={"x": F4}, outputs={"y": F4})
def locked(x):
    with _LOCK:
        return {"y": x}


def pipeline(name: str = "demo", the_step=double) -> Pipeline:
    p = Pipeline(name, inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(the_step, x=p.input("x"))["y"])
    return p


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for directories)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, root)] = Path(full).read_bytes()
    return out


def models_in(root: Path) -> list[str]:
    """The model directories of a repository (not our lock file or requirements.txt)."""
    return sorted(e for e in os.listdir(root) if not e.startswith(".") and e != "requirements.txt")


def hand_made(root: Path, name: str = "resnet50") -> Path:
    """A model written by hand, with weights: nothing of ours may touch it."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    (root / name / "1" / "model.onnx").write_bytes(os.urandom(4096))
    return root / name


def test_write_lays_out_a_model_repository(tmp_path):
    repo = pipeline().compile("both")
    target = repo.write(tmp_path / "models")
    assert target == tmp_path / "models"
    assert models_in(target) == repo.names
    for name, model in repo.models.items():
        assert (target / name / "config.pbtxt").read_text() == repo.config_text(name)
        assert (target / name / "1").is_dir()
        for rel, data in model.files.items():
            assert (target / name / rel).read_bytes() == data
        assert json.loads((target / name / disk.MARKER_FILE).read_text())["pipeline"] == "demo"
    assert os.listdir(tmp_path) == ["models"]  # no staging directory left beside it
    assert repository_pipelines(target) == {"demo": repo.names}


def test_pipelines_share_a_repository_and_a_rewrite_replaces_only_its_own_models(tmp_path):
    target = tmp_path / "models"
    target.mkdir()
    resnet = hand_made(target)
    before = snapshot(resnet)
    pipeline("first").compile("ensemble").write(target)
    pipeline("second").compile("both").write(target)
    second = snapshot(target / "second_bls")
    assert models_in(target) == ["first", "first__double", "resnet50", "second__double", "second_bls",
                                 "second_bls_sync", "second_ensemble"]
    # Rewritten as one form only: its other forms are its own, so they go; nobody else's do.
    pipeline("first").compile("bls").write(target)
    pipeline("second").compile("ensemble").write(target)
    assert models_in(target) == ["first", "first__double", "resnet50", "second", "second__double"]
    assert snapshot(resnet) == before
    assert second != snapshot(target / "second")
    assert sorted(os.listdir(tmp_path)) == ["models"]


def test_a_name_collision_with_a_model_not_ours_is_refused_unless_asked(tmp_path):
    target = tmp_path / "models"
    target.mkdir()
    theirs = hand_made(target, "demo")
    other = pipeline("other").compile("ensemble").write(target)
    before = snapshot(target)
    with pytest.raises(RepositoryWriteError, match="'demo' \\(owned by no pipeline: no .pipelines-model.json in it\\).*overwrite=True"):
        pipeline("demo").compile("ensemble").write(target)
    assert snapshot(target) == before
    # A model named like another pipeline's is that pipeline's, not ours.
    from pipelines.compile import CompiledModel, ModelRepository

    impostor = ModelRepository({"other": CompiledModel("other", pipeline().compile("ensemble")["demo"].config,
                                                       pipeline="impostor")})
    with pytest.raises(RepositoryWriteError, match="owned by pipeline 'other'"):
        impostor.write(other)
    pipeline("demo").compile("ensemble").write(target, overwrite=True)
    assert json.loads((theirs / disk.MARKER_FILE).read_text())["pipeline"] == "demo"
    assert not (theirs / "1" / "model.onnx").exists()


def test_a_model_copied_or_renamed_by_hand_is_the_users_not_the_pipelines(tmp_path):
    """The marker travels with a copied directory; under another name it no longer makes the
    model the pipeline's, so a rewrite or a removal of the pipeline never takes it."""
    import shutil

    target = pipeline("demo").compile("both").write(tmp_path / "models")
    shutil.copytree(target / "demo_bls", target / "demo_tuned")  # to hand-tune it
    os.rename(target / "demo_bls_sync", target / "kept_bls_sync")
    (target / "demo_tuned" / "config.pbtxt").write_text(
        (target / "demo_tuned" / "config.pbtxt").read_text().replace('"demo_bls"', '"demo_tuned"'))
    tuned, kept = snapshot(target / "demo_tuned"), snapshot(target / "kept_bls_sync")
    pipeline("demo").compile("ensemble").write(target)  # its BLS forms are stale now: only its own go
    assert models_in(target) == ["demo", "demo__double", "demo_tuned", "kept_bls_sync"]
    assert repository_pipelines(target) == {"demo": ["demo", "demo__double"]}
    assert remove_pipelines(target, ["demo"]) == ["demo", "demo__double"]
    assert models_in(target) == ["demo_tuned", "kept_bls_sync"]
    assert snapshot(target / "demo_tuned") == tuned and snapshot(target / "kept_bls_sync") == kept
    # and a pipeline that would write under the copy's name is told whose it is
    with pytest.raises(RepositoryWriteError, match="'demo_tuned' \\(owned by no pipeline: a copy of model "
                                                   "'demo_bls', whose .pipelines-model.json it carries\\)"):
        pipeline("demo_tuned").compile("ensemble").write(target)


def test_a_directory_that_is_not_a_repository_needs_overwrite(tmp_path):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "todo.txt").write_text("keep me")
    with pytest.raises(RepositoryWriteError, match="overwrite=True"):
        pipeline().compile("bls").write(target)
    assert snapshot(target) == {"todo.txt": b"keep me"}
    pipeline().compile("bls").write(target, overwrite=True)
    assert models_in(target) == ["demo", "demo__double", "todo.txt"]  # written into; what was there stays
    assert (target / "todo.txt").read_text() == "keep me"


def test_the_cli_says_overwrite_as_a_command_line_option(tmp_path, capsys):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "todo.txt").write_text("keep me")
    assert cli_main(["compile", "pipelines.examples.basic:diamond", "--target", "ensemble", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert cli_main(["compile", "pipelines.examples.basic:diamond", "--target", "ensemble", "--out", str(target),
                     "--overwrite"]) == 0
    assert (target / "todo.txt").read_text() == "keep me"


def test_a_file_in_the_way_needs_overwrite(tmp_path):
    target = tmp_path / "models"
    target.write_text("a file")
    with pytest.raises(RepositoryWriteError, match="not a directory"):
        pipeline().compile("bls").write(target)
    assert target.read_text() == "a file"
    pipeline().compile("bls").write(target, overwrite=True)
    assert target.is_dir() and models_in(target) == ["demo", "demo__double"]


def test_an_empty_directory_is_written_into(tmp_path):
    (tmp_path / "models").mkdir()
    pipeline().compile("ensemble").write(tmp_path / "models")
    assert (tmp_path / "models" / "demo" / "config.pbtxt").is_file()


def test_a_step_that_cannot_be_exported_leaves_the_previous_repository_unchanged(tmp_path):
    target = pipeline().compile("both").write(tmp_path / "models")
    before = snapshot(tmp_path)
    bad = pipeline("demo", locked).compile("both")  # compiles; the export runs while writing
    with pytest.raises(RepositoryWriteError) as info:
        bad.write(target)
    assert "locked" in str(info.value) and "cloudpickle" in str(info.value)
    assert info.value.step == "locked"
    assert snapshot(tmp_path) == before


def test_a_missing_external_model_file_leaves_the_previous_repository_unchanged(tmp_path):
    model_file = tmp_path / "m.onnx"
    model_file.write_bytes(b"onnx")
    ext = external_model("detector", inputs={"x": F4}, outputs={"y": F4}, backend="onnxruntime", model_file=model_file)
    target = pipeline().compile("ensemble").write(tmp_path / "models")
    before = snapshot(target)
    repo = pipeline("demo", ext).compile("ensemble")
    model_file.unlink()
    with pytest.raises(RepositoryWriteError, match="does not exist"):
        repo.write(target)
    assert snapshot(target) == before
    assert sorted(os.listdir(tmp_path)) == ["models"]


def test_a_symlinked_target_is_replaced_not_followed(tmp_path):
    elsewhere = pipeline("elsewhere").compile("ensemble").write(tmp_path / "elsewhere")
    before = snapshot(elsewhere)
    link = tmp_path / "models"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RepositoryWriteError, match="overwrite=True"):
        pipeline().compile("ensemble").write(link)
    pipeline().compile("ensemble").write(link, overwrite=True)
    assert not link.is_symlink() and (link / "demo").is_dir()
    assert snapshot(elsewhere) == before


def test_merged_repositories_refuse_two_different_models_under_one_name(tmp_path):
    from pipelines import CompileError

    a = pipeline("same").compile("ensemble")
    b = pipeline("same", locked).compile("ensemble")
    with pytest.raises(CompileError, match="named 'same'"):
        a.merge(b)
    merged = a.merge(pipeline("other").compile("ensemble"))
    assert merged.names == ["other", "other__double", "same", "same__double"]


_hostile = st.one_of(
    st.sampled_from(["..", ".", "../x", "a/b", "a\\b", "/abs", "~", "", " ", "a\x00b", "con", "x" * 300,
                     ".hidden", "-dash", "ok_name", "ok.name", "a..b", "名前", "a\nb"]),
    st.text(min_size=0, max_size=20),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slot=st.sampled_from(["pipeline", "step", "tensor"]), name=_hostile)
def test_hostile_names_are_refused_or_written_inside_the_target(tmp_path, slot, name):
    names = {"pipeline": "pipe", "step": "work", "tensor": "x", slot: name}
    tensor = names["tensor"]
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    target = root / "models"
    try:
        spec = {tensor: F4}
        s = step(lambda **kw: {tensor: next(iter(kw.values()))}, name=names["step"], inputs=spec, outputs=spec)
        p = Pipeline(names["pipeline"], inputs={"in": F4}, max_batch_size=2)
        p.output("out", p.add(s, **{tensor: p.input("in")})[tensor])
        repo = p.compile("both")
    except DeclarationError as exc:
        assert name in str(exc) or repr(name) in str(exc) or len(name) > 100
        assert os.listdir(root) == []
        return
    repo.write(target)
    assert os.listdir(root) == ["models"]
    for dirpath, _, filenames in os.walk(target):
        for f in filenames:
            full = os.path.realpath(os.path.join(dirpath, f))
            assert full.startswith(str(target.resolve()) + os.sep)
    assert models_in(target) == repo.names


# ------------------------------------------------------------------ crashes and concurrent writers

# A child process that writes pipeline "demo" with a given scale; with KILL_AFTER_SWAPS=n it
# SIGKILLs itself right after the n-th model swap, as a crash in the middle of a write would.
_WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from pipelines.compile import repository_journal as journal
    from test_repository_write import scaled_pipeline

    kill_after = int(os.environ.get("KILL_AFTER_SWAPS", "0"))
    if kill_after:
        real, done = journal._exchange, []
        def exchange(new, dest, *, aside):
            real(new, dest, aside=aside)
            done.append(dest)
            if len(done) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        journal._exchange = exchange
    name, scale, rounds = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    for _ in range(rounds):
        scaled_pipeline(name, scale).compile("both").write(sys.argv[1])
""")


def scaled_pipeline(name: str, scale: float) -> Pipeline:
    """A pipeline whose every model's config depends on ``scale`` (through a parameter)."""
    s = step(lambda x: {"y": x * scale}, name="scale", inputs={"x": F4}, outputs={"y": F4},
             parameters={"scale": scale})
    p = Pipeline(name, inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(s, x=p.input("x"))["y"])
    return p


def run_writer(target: Path, name: str, scale: float, rounds: int = 1, **env: str) -> subprocess.Popen:
    script = _WRITER.format(tests=str(HERE))
    return subprocess.Popen([sys.executable, "-c", script, str(target), name, str(scale), str(rounds)],
                            env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)


def scales(target: Path) -> dict[str, str]:
    """Each model of ours -> the write it came from (the id in its ownership marker)."""
    out = {}
    for name in models_in(target):
        if (target / name / disk.MARKER_FILE).exists():
            out[name] = json.loads((target / name / disk.MARKER_FILE).read_text())["write"]
    return out


def test_a_write_killed_between_two_swaps_leaves_whole_models_and_the_next_write_finishes_it(tmp_path):
    target = tmp_path / "models"
    scaled_pipeline("demo", 1.0).compile("both").write(target)
    hand_made(target)
    before = snapshot(target / "resnet50")
    old = scales(target)
    writer = run_writer(target, "demo", 2.0, KILL_AFTER_SWAPS="2")
    assert writer.wait(timeout=60) == -signal.SIGKILL
    now = scales(target)
    assert set(now) == set(old)  # every model is there, whole: 2 new, the others old
    assert sum(now[n] != old[n] for n in now) == 2
    leftover = [e for e in os.listdir(tmp_path) if e != "models"]
    assert leftover and leftover[0].startswith(".models.pipelines-write-")  # beside, never inside
    # Another pipeline's write finishes the interrupted one, then cleans up.
    scaled_pipeline("other", 3.0).compile("ensemble").write(target)
    done = scales(target)
    assert len({done[n] for n in done if n.startswith("demo")}) == 1 and done["demo_bls"] != old["demo_bls"]
    assert os.listdir(tmp_path) == ["models"]
    assert snapshot(target / "resnet50") == before


@contextlib.contextmanager
def immutable(path: Path, *, may_move_within: Path | None = None):
    """``chattr +i`` on ``path``: nobody, root included, may rename or delete it (or what is in it).

    A file inside a directory that is moved is found again by its name under ``may_move_within``.
    """
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system with attributes)")
    try:
        yield path
    finally:
        found = list(may_move_within.rglob(path.name)) if may_move_within is not None else [path]
        for each in found:
            subprocess.run(["chattr", "-i", str(each)], check=True)


def test_a_swap_that_fails_part_way_puts_back_the_swaps_before_it_and_later_writes_work(tmp_path):
    target = tmp_path / "models"
    scaled_pipeline("demo", 1.0).compile("both").write(target)
    hand_made(target)
    before = snapshot(target)
    # Top-level models are swapped in last: the composing step model goes first, and is put back.
    with immutable(target / "demo_ensemble"):
        with pytest.raises(RepositoryWriteError) as info:
            scaled_pipeline("demo", 2.0).compile("both").write(target)
        message = str(info.value)
        assert "demo_ensemble" in message and "put back: the repository is as it was" in message
        assert snapshot(target) == before
        assert os.listdir(tmp_path) == ["models"]  # no staging, no journal left for a later write
        # Another pipeline's write is not held up by the failed one.
        scaled_pipeline("other", 3.0).compile("ensemble").write(target)
        assert {"other", "other__scale", "demo_ensemble", "resnet50"} <= set(models_in(target))
    scaled_pipeline("demo", 2.0).compile("both").write(target)  # the cause mended: the write goes through
    assert len(set(scales(target)[n] for n in models_in(target) if n.startswith("demo"))) == 1


def test_a_staging_directory_that_cannot_be_removed_is_named_in_a_warning(tmp_path):
    target = tmp_path / "models"
    scaled_pipeline("demo", 1.0).compile("ensemble").write(target)
    first = scales(target)["demo"]
    # A file in a model that the writer may not delete (a server run as root left its __pycache__).
    cache = target / "demo" / "__pycache__"
    cache.mkdir()
    (cache / "stuck.pyc").write_bytes(b"x")
    with immutable(cache / "stuck.pyc", may_move_within=tmp_path):
        with pytest.warns(disk.RepositoryWarning, match=r"could not be removed .*beside the model repository"):
            scaled_pipeline("demo", 2.0).compile("ensemble").write(target)
        assert scales(target)["demo"] != first  # the write itself went through
        assert not (target / "demo" / "__pycache__").exists()
        left = [e for e in os.listdir(tmp_path) if e != "models"]
        assert len(left) == 1 and left[0].startswith(".models.pipelines-write-")
        with pytest.warns(disk.RepositoryWarning):  # the next write tries again, and says so again
            scaled_pipeline("demo", 3.0).compile("ensemble").write(target)
    scaled_pipeline("demo", 4.0).compile("ensemble").write(target)
    assert os.listdir(tmp_path) == ["models"]


def test_a_removal_that_fails_part_way_puts_back_what_it_removed_and_says_so(tmp_path):
    target = tmp_path / "models"
    scaled_pipeline("demo", 1.0).compile("both").write(target)
    hand_made(target)
    before = snapshot(target)
    with immutable(target / "demo_ensemble"):
        with pytest.raises(RepositoryWriteError, match=r"removing models from .* failed at .*demo_ensemble.*"
                           r"removed before it were put back: the repository is as it was.* remove them again"):
            remove_pipelines(target, ["demo"])
        assert snapshot(target) == before
    assert "demo_ensemble" in remove_pipelines(target, ["demo"])
    assert models_in(target) == ["resnet50"]


def test_a_requirements_txt_that_cannot_be_rewritten_warns_and_the_write_stands(tmp_path):
    target = tmp_path / "models"
    target.mkdir()
    (target / "requirements.txt").write_text("tritonclient==2.51.0\n")  # the user's, kept immutable
    with immutable(target / "requirements.txt"):
        with pytest.warns(disk.RepositoryWarning, match=r"(?s)the models are written, but .*requirements\.txt' "
                          r"could not be rewritten .*cloudpickle"):
            pipeline("first").compile("ensemble").write(target)
        assert models_in(target) == ["first", "first__double"]
        assert sorted(os.listdir(target)) == [".pipelines.lock", "first", "first__double", "requirements.txt"]
        assert os.listdir(tmp_path) == ["models"]  # no staging, no journal for later writes to retry
        with pytest.warns(disk.RepositoryWarning):  # a later write goes through too, and says so again
            pipeline("second", locked_free_step()).compile("ensemble").write(target)
        assert models_in(target) == ["first", "first__double", "second", "second__plus"]
    pipeline("third").compile("ensemble").write(target)  # mended: rewritten
    assert "cloudpickle" in (target / "requirements.txt").read_text()


def test_sigterm_to_pipelines_compile_discards_its_staging_as_ctrl_c_does(tmp_path, monkeypatch):
    target = tmp_path / "models"
    target.mkdir()
    hand_made(target)
    before = snapshot(tmp_path)
    real = disk.write_marker

    def terminated(model_dir, model, **kwargs):  # the signal arrives while the models are being staged
        real(model_dir, model, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(disk, "write_marker", terminated)
    assert cli_main(["compile", "pipelines.examples.basic:diamond", "--out", str(target)]) == 130
    after = snapshot(tmp_path)
    after.pop(os.path.join("models", disk.LOCK_FILE))
    assert after == before  # the hand-made model as it was, and no staging directory left
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # and SIGTERM is as it was


def test_a_reader_never_sees_a_model_missing_while_writes_are_killed_between_swaps(tmp_path):
    target = tmp_path / "models"
    scaled_pipeline("demo", 1.0).compile("both").write(target)
    names = models_in(target)
    missing = []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            for name in names:
                if not (target / name / "config.pbtxt").is_file():
                    missing.append(name)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i, after in enumerate((3, 0)):
            writer = run_writer(target, "demo", 2.0 + i, rounds=1, **({"KILL_AFTER_SWAPS": str(after)} if after else {}))
            writer.wait(timeout=60)
    finally:
        stop.set()
        reader.join()
    assert missing == []
    assert models_in(target) == names and os.listdir(tmp_path) == ["models"]


def test_concurrent_writers_are_serialised(tmp_path):
    target = tmp_path / "models"
    writers = [run_writer(target, name, 1.0, rounds=2) for name in ("alpha", "beta", "gamma")]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0], errors
    assert sorted(repository_pipelines(target)) == ["alpha", "beta", "gamma"]
    assert os.listdir(tmp_path) == ["models"]


def test_a_writer_that_cannot_get_the_lock_says_who_holds_it(tmp_path, monkeypatch):
    target = pipeline().compile("ensemble").write(tmp_path / "models")
    monkeypatch.setattr(disk, "LOCK_TIMEOUT_S", 0.3)
    with open(target / disk.LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        with pytest.raises(RepositoryWriteError, match="another process \\(pid 4242\\) is writing"):
            pipeline().compile("ensemble").write(target)
    pipeline().compile("ensemble").write(target)


# ------------------------------------------------------------------ removing a pipeline


def test_remove_pipelines_removes_only_their_models(tmp_path, capsys):
    target = tmp_path / "models"
    target.mkdir()
    resnet = hand_made(target)
    before = snapshot(resnet)
    pipeline("first").compile("both").write(target)
    pipeline("second", locked_free_step()).compile("ensemble").write(target)
    assert "cloudpickle" in (target / "requirements.txt").read_text()
    assert remove_pipelines(target, ["first"]) == ["first__double", "first_bls", "first_bls_sync", "first_ensemble"]
    assert models_in(target) == ["resnet50", "second", "second__plus"]
    with pytest.raises(RepositoryWriteError, match="no model of pipeline 'first'.*'second'"):
        remove_pipelines(target, ["first"])
    assert cli_main(["remove", str(target), "second"]) == 0
    assert "second__plus" in capsys.readouterr().out
    assert models_in(target) == ["resnet50"]
    assert snapshot(resnet) == before
    assert not (target / "requirements.txt").exists()  # nothing of ours left to need anything
    assert os.listdir(tmp_path) == ["models"]


def locked_free_step():
    return step(lambda x: {"y": x + 1}, name="plus", inputs={"x": F4}, outputs={"y": F4})


# ------------------------------------------------------------------ what the server needs


def users_ensemble(root: Path, calls: str, name: str = "my_ens") -> Path:
    """A hand-made ensemble whose one step is ``calls``, a model a pipeline wrote."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 4\n'
        'input { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }\noutput { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }\n'
        f'ensemble_scheduling {{ step {{ model_name: "{calls}" model_version: -1 '
        'input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } }\n'
    )
    return root / name


def test_a_stale_model_that_a_users_ensemble_calls_is_kept_with_a_warning(tmp_path, capsys):
    target = tmp_path / "models"
    pipeline("demo", double).compile("ensemble").write(target)
    users_ensemble(target, calls="demo__double")
    before = snapshot(target / "demo__double")
    # The step is another one now: demo__double is stale, but my_ens would not load without it.
    with pytest.warns(disk.RepositoryWarning, match=r"kept 'demo__double' \(used by 'my_ens'\).*pipeline 'demo'"):
        pipeline("demo", ident).compile("ensemble").write(target)
    assert models_in(target) == ["demo", "demo__double", "demo__ident", "my_ens"]
    assert snapshot(target / "demo__double") == before
    # Removing the pipeline would break my_ens: refused, nothing removed.
    with pytest.raises(RepositoryWriteError, match=r"'demo__double' is used by 'my_ens'.*Nothing was removed"):
        remove_pipelines(target, ["demo"])
    assert models_in(target) == ["demo", "demo__double", "demo__ident", "my_ens"]
    # Pointed elsewhere, the stale model goes with the next write, and the command says which it removed.
    users_ensemble(tmp_path / "elsewhere", calls="demo__ident")
    (target / "my_ens" / "config.pbtxt").write_bytes((tmp_path / "elsewhere" / "my_ens" / "config.pbtxt").read_bytes())
    capsys.readouterr()
    (tmp_path / "demo.py").write_text(textwrap.dedent("""
        from pipelines import Pipeline, TensorSpec, step

        @step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
        def ident(x):
            return {"y": x}

        p = Pipeline("demo", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=4)
        p.output("y", p.add(ident, x=p.input("x"))["y"])
    """))
    assert cli_main(["compile", f"{tmp_path / 'demo.py'}:p", "--target", "ensemble", "--out", str(target)]) == 0
    out = capsys.readouterr().out
    assert "removed 1 models the pipeline no longer has:\n  demo__double\n" in out
    assert "demo__double" not in models_in(target) and "my_ens" in models_in(target)


def test_requirements_txt_states_what_the_server_needs_and_keeps_the_users_lines(tmp_path):
    target = tmp_path / "models"
    target.mkdir()
    (target / "requirements.txt").write_text("tritonclient==2.51.0\n")
    pipeline().compile("both").write(target)  # a step from this test module: by value
    text = (target / "requirements.txt").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    import cloudpickle

    major_minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert text.startswith("tritonclient==2.51.0\n")
    assert "numpy<2" in lines and f"cloudpickle~={cloudpickle.__version__}" in lines
    assert f"# Python {major_minor} exactly" in text
    assert not any(line.split("=")[0].split("<")[0].split("~")[0].strip() == "pipelines" for line in lines)


def test_files_a_user_added_to_a_pipelines_models_are_never_deleted_without_being_asked(tmp_path):
    target = tmp_path / "models"
    pipeline().compile("both").write(target)
    (target / "demo_bls" / "NOTES.md").write_text("why we tuned this\n")
    (target / "demo__double" / "2").mkdir()
    (target / "demo__double" / "2" / "model.py").write_text("# a hand-tuned version\n")
    (target / "demo__double" / "1" / "__pycache__").mkdir()  # what the server's Python leaves: not the user's
    (target / "demo__double" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    before = snapshot(target)
    with pytest.raises(RepositoryWriteError, match=r"'demo__double': 2/model.py; 'demo_bls': NOTES.md\); "
                                                   r"the write would replace them, so nothing was changed") as info:
        pipeline().compile("both").write(target)
    assert "__pycache__" not in str(info.value)
    with pytest.raises(RepositoryWriteError, match=r"'demo_bls': NOTES.md\); removing them would delete"):
        remove_pipelines(target, ["demo"])
    assert snapshot(target) == before
    # a pipeline that no longer has a model: its stale directory is checked as well
    (target / "demo__double" / "2" / "model.py").unlink()
    (target / "demo__double" / "2").rmdir()
    with pytest.raises(RepositoryWriteError, match="'demo_bls': NOTES.md"):
        pipeline().compile("ensemble").write(target)
    pipeline().compile("both").write(target, overwrite=True)  # asked for: replaced without them
    assert not (target / "demo_bls" / "NOTES.md").exists()
    pipeline().compile("both").write(target)  # nothing of the user's left: rewritten as ever


@pytest.mark.parametrize("target", ["ensemble", "bls", "bls-sync", "fused"])
def test_a_pipeline_whose_model_would_be_the_requirements_file_is_refused_before_anything_is_written(target):
    p = Pipeline("requirements.txt", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(locked_free_step(), x=p.input("x"))["y"])
    with pytest.raises(DeclarationError, match="would compile to a model named 'requirements.txt'.*rename the pipeline"):
        p.compile(target)
    assert "requirements.txt_bls" in p.compile("both")  # beside other forms its models carry a suffix


def test_a_requirements_txt_linked_to_a_shared_file_stays_a_link(tmp_path):
    shared = tmp_path / "shared-requirements.txt"
    shared.write_text("tritonclient==2.51.0\n")
    target = tmp_path / "models"
    target.mkdir()
    (target / "requirements.txt").symlink_to(shared)
    pipeline().compile("both").write(target)
    assert (target / "requirements.txt").is_symlink() and (target / "requirements.txt").resolve() == shared
    assert shared.read_text().startswith("tritonclient==2.51.0\n") and "numpy<2" in shared.read_text().splitlines()
    assert sorted(os.listdir(tmp_path)) == ["models", "shared-requirements.txt"]  # no temporary file left
    # A copy of one of its models still needs what it needed once the pipeline is gone.
    import shutil

    shutil.copytree(target / "demo_bls", target / "demo_tuned")
    remove_pipelines(target, ["demo"])
    assert models_in(target) == ["demo_tuned"] and "numpy<2" in shared.read_text().splitlines()


def test_a_step_imported_from_an_installed_package_requires_its_distribution(tmp_path):
    import importlib.metadata

    import numpy as np

    sort = step(np.sort, name="sort", inputs={"a": F4}, outputs={"sorted": F4})
    p = Pipeline("ref", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(sort, a=p.input("x"))["sorted"])
    target = p.compile("ensemble").write(tmp_path / "models")
    text = (target / "requirements.txt").read_text()
    (numpy_line,) = [line for line in text.splitlines() if line.startswith("numpy")]  # one line per distribution
    assert f"=={importlib.metadata.version('numpy')}" in numpy_line[len("numpy"):].split(",")
    assert "cloudpickle" not in text and "any version" in text


def test_a_module_beside_the_script_named_like_the_standard_library_travels_by_value(tmp_path, monkeypatch):
    import importlib.util

    source = tmp_path / "pipes.py"
    source.write_text("def shout(x):\n    return {'y': x * 10}\n")
    spec = importlib.util.spec_from_file_location("pipes", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pipes", module)
    spec.loader.exec_module(module)
    s = step(module.shout, name="shout", inputs={"x": F4}, outputs={"y": F4})
    assert step_reference(s) is None
    p = Pipeline("local", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(s, x=p.input("x"))["y"])
    plan = json.loads(p.compile("ensemble")["local__shout"].files["1/step.json"])
    assert plan["impl"]["pickle"] == "step.pkl"


def test_bench_out_writes_beside_the_users_models_and_deletes_nothing_it_did_not_write(tmp_path):
    from contextlib import ExitStack

    from pipelines.bench.runner import write_bench_repository

    repo_dir = tmp_path / "model_repository"
    repo_dir.mkdir()
    resnet = hand_made(repo_dir)
    (repo_dir / "NOTES.md").write_text("my weights, do not delete")
    before = snapshot(repo_dir)
    with ExitStack() as stack:
        for _ in range(2):  # a second bench run into the same --out replaces only its own models
            assert write_bench_repository(pipeline(), tmp_path, stack) == repo_dir
    after = snapshot(repo_dir)
    assert {k: v for k, v in after.items() if k in before} == before
    assert models_in(repo_dir) == sorted(["NOTES.md", "resnet50", *repository_pipelines(repo_dir)["demo"]])
    assert "demo_ensemble" in repository_pipelines(repo_dir)["demo"]
    assert resnet.is_dir()
    # A user's model named like one of the bench's is refused, never replaced.
    theirs = hand_made(tmp_path / "other" / "model_repository", "demo_bls")
    before = snapshot(theirs)
    with ExitStack() as stack, pytest.raises(RepositoryWriteError, match="'demo_bls' \\(owned by no pipeline: no .pipelines-model.json in it\\)"):
        write_bench_repository(pipeline(), tmp_path / "other", stack)
    assert snapshot(theirs) == before


def test_a_module_beside_the_script_named_like_an_installed_distribution_travels_by_value(tmp_path, monkeypatch):
    import importlib.metadata
    import importlib.util

    # A top-level name an installed distribution provides, not imported in this process.
    name = next(n for n in sorted(importlib.metadata.packages_distributions())
                if n.isidentifier() and n not in sys.modules and not n.startswith("_"))
    source = tmp_path / f"{name}.py"
    source.write_text("def shout(x):\n    return {'y': x * 10}\n")
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert step_reference(step(module.shout, name="shout", inputs={"x": F4}, outputs={"y": F4})) is None


@functools.lru_cache(maxsize=2)
def _cached_table():
    return np.arange(4, dtype=np.float32)


class _Marker:
    def __reduce__(self):
        return "MARKER"  # pickled by name: test_repository_write.MARKER, which a server cannot import


MARKER = _Marker()


def test_a_cached_helper_travels_by_value_and_a_by_name_object_is_refused_at_compile(tmp_path):
    from pipelines.compile.step_models import _names_imported_by

    cached = step(lambda x: {"y": x + _cached_table()}, name="cached", inputs={"x": F4}, outputs={"y": F4})
    repo = pipeline("cache", cached).compile("ensemble")
    data = repo["cache__cached"].files["1/step.pkl"]
    assert __name__ not in _names_imported_by(data)  # by value, rebuilt as lru_cache(maxsize=2)(...)
    fn = pickle.loads(data)
    np.testing.assert_array_equal(fn(np.zeros(4, np.float32))["y"], np.arange(4))
    marked = step(lambda x: {"y": x if MARKER else x}, name="marked", inputs={"x": F4}, outputs={"y": F4})
    with pytest.raises(RepositoryWriteError, match=f"refers by name to something in '{__name__}'"):
        pipeline("mark", marked).compile("ensemble").write(tmp_path / "models")
