"""``repo.write(path)``: atomic, all-or-nothing, careful with what is already
there, and never writing outside ``path``, whatever names it is given."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

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

F4 = TensorSpec("FP32", [4])
_LOCK = threading.Lock()  # cloudpickle cannot export a lock


@step(inputs={"x": F4}, outputs={"y": F4})
def double(x):
    return {"y": x * 2}


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


def test_write_lays_out_a_model_repository(tmp_path):
    repo = pipeline().compile("both")
    target = repo.write(tmp_path / "models")
    assert target == tmp_path / "models"
    assert sorted(os.listdir(target)) == repo.names
    for name, model in repo.models.items():
        assert (target / name / "config.pbtxt").read_text() == repo.config_text(name)
        assert (target / name / "1").is_dir()
        for rel, data in model.files.items():
            assert (target / name / rel).read_bytes() == data
    assert os.listdir(tmp_path) == ["models"]  # no staging directory left beside it


def test_an_existing_model_repository_is_replaced_whole(tmp_path):
    target = pipeline("first").compile("ensemble").write(tmp_path / "models")
    pipeline("second").compile("ensemble").write(target)
    assert sorted(os.listdir(target)) == ["second", "second__double"]
    assert sorted(os.listdir(tmp_path)) == ["models"]


def test_a_directory_that_is_not_a_repository_needs_overwrite(tmp_path):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "todo.txt").write_text("keep me")
    with pytest.raises(RepositoryWriteError, match="overwrite=True"):
        pipeline().compile("bls").write(target)
    assert snapshot(target) == {"todo.txt": b"keep me"}
    pipeline().compile("bls").write(target, overwrite=True)
    assert sorted(os.listdir(target)) == ["demo", "demo__double"]


def test_a_file_in_the_way_needs_overwrite(tmp_path):
    target = tmp_path / "models"
    target.write_text("a file")
    with pytest.raises(RepositoryWriteError, match="not a directory"):
        pipeline().compile("bls").write(target)
    assert target.read_text() == "a file"
    pipeline().compile("bls").write(target, overwrite=True)
    assert target.is_dir()


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
    assert sorted(os.listdir(target)) == repo.names
