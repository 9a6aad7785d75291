"""``ModelRepository``: compiled models held in memory, and their atomic write to disk.

``repo.write(path)`` builds the whole tree in a temporary directory beside
``path`` and swaps it in with renames, so a failure part-way leaves the
previous repository exactly as it was, and nothing outside ``path`` changes.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import CompileError, RepositoryWriteError
from .configs import config_text

__all__ = ["CompiledModel", "FileCopy", "ModelRepository"]


@dataclass(frozen=True)
class FileCopy:
    """A file (or directory) copied into the repository when it is written, not before.

    Model files can be gigabytes, so they are read only when needed; ``what``
    names them in errors.
    """

    source: str
    what: str


#: Where a model file's content comes from: bytes, a copy, or a function run at write time.
FileSource = bytes | FileCopy | Callable[[], bytes]


class _Files(Mapping[str, bytes]):
    """A model's files by relative path; copies and exports are produced on first read."""

    def __init__(self, sources: Mapping[str, FileSource]) -> None:
        self._sources = dict(sources)
        self._cache: dict[str, bytes] = {}

    def __getitem__(self, path: str) -> bytes:
        if path not in self._cache:
            source = self._sources[path]
            if isinstance(source, bytes):
                return source
            if isinstance(source, FileCopy):
                src = Path(source.source)
                if src.is_dir():
                    raise CompileError(f"{source.what} is the directory {str(src)!r}; write the repository to copy it")
                return _read(source)
            self._cache[path] = source()
        return self._cache[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def source(self, path: str) -> FileSource:
        return self._sources[path]


def _read(copy: FileCopy) -> bytes:
    try:
        return Path(copy.source).read_bytes()
    except OSError as exc:
        raise CompileError(f"{copy.what} {copy.source!r} could not be read: {exc}") from exc


@dataclass(frozen=True, eq=False)
class CompiledModel:
    """One model of a repository: its ``ModelConfig`` and its files (paths relative to the model dir)."""

    name: str
    config: mc.ModelConfig
    files: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.files, _Files):
            object.__setattr__(self, "files", _Files(self.files))

    @property
    def config_text(self) -> str:
        return config_text(self.config)

    def __repr__(self) -> str:
        kind = self.config.platform or self.config.backend
        return f"<CompiledModel {self.name!r} ({kind}), files {sorted(self.files)}>"


class ModelRepository:
    """Compiled Triton models by name, in memory until :meth:`write`."""

    def __init__(self, models: Mapping[str, CompiledModel] | None = None, *, top_level: tuple[str, ...] = ()) -> None:
        self._models = dict(models or {})
        self.top_level = tuple(top_level)

    @property
    def models(self) -> Mapping[str, CompiledModel]:
        return MappingProxyType(self._models)

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def __getitem__(self, name: str) -> CompiledModel:
        return self._models[name]

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._models))

    def __len__(self) -> int:
        return len(self._models)

    def __repr__(self) -> str:
        return f"<ModelRepository top-level {list(self.top_level)}, {len(self._models)} models>"

    def config_text(self, name: str) -> str:
        """The ``config.pbtxt`` of model ``name``, exactly as :meth:`write` writes it."""
        if name not in self._models:
            raise KeyError(f"no model {name!r} in this repository; it holds {self.names}")
        return self._models[name].config_text

    def merge(self, *others: ModelRepository) -> ModelRepository:
        """One repository holding the models of this one and ``others`` (to serve several pipelines).

        A name held by two repositories must hold the same model in both.
        """
        models = dict(self._models)
        top = list(self.top_level)
        for other in others:
            for name, model in other._models.items():
                mine = models.get(name)
                if mine is not None and mine is not model and (
                    mine.config_text != model.config_text
                    or {k: mine.files.source(k) for k in mine.files} != {k: model.files.source(k) for k in model.files}
                ):
                    raise CompileError(
                        f"two different models are both named {name!r}; rename one of the pipelines "
                        "(model names start with the pipeline's name)",
                    )
                models[name] = model
            top += [t for t in other.top_level if t not in top]
        return ModelRepository(models, top_level=tuple(top))

    def write(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the repository to ``path`` atomically; return the path.

        An existing model repository at ``path`` is replaced; any other
        non-empty directory, or a file, is replaced only with ``overwrite=True``.
        On failure the previous content of ``path`` is left as it was.
        """
        target = Path(os.path.abspath(os.fspath(path)))
        _check_target(target, overwrite=overwrite)
        parent = target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".pipelines-staging-", dir=parent))
        except OSError as exc:
            raise RepositoryWriteError(f"cannot create a staging directory beside {str(target)!r}: {exc}") from exc
        try:
            os.chmod(staging, _mode_for(target))
            for name in sorted(self._models):
                _write_model(staging, self._models[name])
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, RepositoryWriteError):
                raise
            raise RepositoryWriteError(
                f"writing the model repository {str(target)!r} failed, and it was left as it was: {exc}",
                pipeline=getattr(exc, "pipeline", None), step=getattr(exc, "step", None),
            ) from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _swap_in(staging, target)
        return target


def _check_target(target: Path, *, overwrite: bool) -> None:
    if not os.path.lexists(target) or overwrite:
        return
    if target.is_symlink() or not target.is_dir():
        what = "a symbolic link" if target.is_symlink() else "not a directory"
        raise RepositoryWriteError(
            f"{str(target)!r} exists and is {what}; pass overwrite=True to replace it "
            "(a link is replaced, never followed)"
        )
    entries = list(target.iterdir())
    if entries and not any((e / "config.pbtxt").is_file() for e in entries if e.is_dir()):
        raise RepositoryWriteError(
            f"{str(target)!r} is a non-empty directory that is not a model repository "
            "(no <model>/config.pbtxt in it); pass overwrite=True to replace it"
        )


def _mode_for(target: Path) -> int:
    try:
        if target.is_dir() and not target.is_symlink():
            return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        pass
    return 0o755


def _write_model(root: Path, model: CompiledModel) -> None:
    model_dir = _inside(root, model.name)
    model_dir.mkdir()
    (model_dir / "config.pbtxt").write_text(model.config_text, encoding="utf-8")
    files: _Files = model.files  # type: ignore[assignment]
    for rel in sorted(files):
        dest = _inside(root, f"{model.name}/{rel}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        source = files.source(rel)
        if isinstance(source, FileCopy):
            src = Path(source.source)
            if not src.exists():
                raise CompileError(f"{source.what} {source.source!r} does not exist; it must exist when writing")
            if src.is_dir():
                shutil.copytree(src, dest)
            else:
                shutil.copyfile(src, dest)
        else:
            dest.write_bytes(files[rel])
    # Triton needs the version directory even when it holds no file yet.
    (model_dir / "1").mkdir(exist_ok=True)


def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refusing any path that would leave ``root``."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise RepositoryWriteError(f"refusing to write {rel!r}: it would leave the repository")
    dest = root.joinpath(*parts)
    if os.path.commonpath([os.path.abspath(dest), os.path.abspath(root)]) != os.path.abspath(root):
        raise RepositoryWriteError(f"refusing to write {rel!r}: it would leave the repository")
    return dest


def _swap_in(staging: Path, target: Path) -> None:
    old = None
    if os.path.lexists(target):
        old = target.parent / f".pipelines-old-{uuid.uuid4().hex}"
        try:
            os.rename(target, old)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise RepositoryWriteError(f"cannot move the previous {str(target)!r} aside: {exc}; it was left as it was") from exc
    try:
        os.rename(staging, target)
    except OSError as exc:
        if old is not None:
            os.rename(old, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise RepositoryWriteError(f"cannot move the new repository into {str(target)!r}: {exc}; it was left as it was") from exc
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
