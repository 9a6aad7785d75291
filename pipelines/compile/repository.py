"""``ModelRepository``: compiled models held in memory, and their write to disk.

``repo.write(path)`` writes this repository's models into the model repository
at ``path`` and leaves every other model there as it was: see
:mod:`pipelines.compile.repository_disk` for ownership, atomicity and locking.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import cast

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import CompileError, InvalidNameError, NotFoundError, RepositoryWriteError
from .configs import config_text
from .import_check import check_steps_import
from .repository_disk import REQUIREMENTS_FILE, remove_pipelines, repository_pipelines, write_repository
from .requirements import ServerNeeds

__all__ = ["CompiledModel", "FileCopy", "ModelRepository", "remove_pipelines", "repository_pipelines"]


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
    """One model of a repository: its ``ModelConfig`` and its files (paths relative to the model dir).

    ``pipeline`` owns the model on disk (``None``: the model owns itself); ``needs``
    says what the server's Python needs for it, or computes that when the files
    are written (a step exported by value is known only then).
    """

    name: str
    config: mc.ModelConfig
    files: Mapping[str, bytes] = field(default_factory=dict)
    pipeline: str | None = None
    needs: ServerNeeds | Callable[[], ServerNeeds] = field(default_factory=ServerNeeds)

    def server_needs(self) -> ServerNeeds:
        return self.needs() if callable(self.needs) else self.needs

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
        if REQUIREMENTS_FILE in self._models:
            owner = self._models[REQUIREMENTS_FILE].pipeline or REQUIREMENTS_FILE
            raise InvalidNameError(
                f"pipeline {owner!r} would compile to a model named {REQUIREMENTS_FILE!r}, the file a written "
                "repository keeps beside its models (what the server's Python needs); rename the pipeline",
                pipeline=owner,
            )

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
            raise NotFoundError(f"no model {name!r} in this repository; it holds {self.names}")
        return self._models[name].config_text

    @property
    def pipelines(self) -> list[str]:
        """The pipelines that own this repository's models."""
        return sorted({m.pipeline or m.name for m in self._models.values()})

    def merge(self, *others: ModelRepository) -> ModelRepository:
        """One repository holding the models of this one and ``others`` (to serve several pipelines).

        A name held by two repositories must hold the same model in both. Each
        model keeps its owner, so writing the merged repository replaces the
        models of each pipeline in it, as writing them one by one would.
        """
        models = dict(self._models)
        top = list(self.top_level)
        for other in others:
            for name, model in other._models.items():
                mine = models.get(name)
                if mine is not None and mine is not model and (
                    mine.config_text != model.config_text
                    or _sources(mine) != _sources(model)
                ):
                    raise CompileError(
                        f"two different models are both named {name!r}; rename one of the pipelines "
                        "(model names start with the pipeline's name)",
                    )
                models[name] = model
            top += [t for t in other.top_level if t not in top]
        return ModelRepository(models, top_level=tuple(top))

    def write(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write this repository's models into the model repository at ``path``; return the path.

        Only the models of the pipelines written here are replaced (and those
        models of theirs that no longer exist are removed); every other model is
        left byte for byte. A model of the same name that this write does not
        own, or a ``path`` that is a file or a non-repository directory, is
        refused unless ``overwrite=True``. Each model is swapped in atomically; a
        write that fails or is killed leaves every model old or new, and the next
        write finishes or discards what was left. Before anything is written, each step's code
        is loaded in a clean interpreter as a server would load it; a step that would fail to
        load is a :class:`CompileError` naming its file, line and missing module.
        """
        return write_models(self, path, overwrite=overwrite)


def write_models(
    repo: ModelRepository, path: str | os.PathLike[str], *, overwrite: bool = False, overwrite_hint: str | None = "overwrite=True"
) -> Path:
    """:meth:`ModelRepository.write`, where a refusal names ``overwrite_hint`` as the way to ask (``None``: no way).

    First every step's code is loaded as a server would load it (:mod:`.import_check`): a step
    that would fail to load is refused before anything is written.
    """
    check_steps_import(repo.models)
    return write_repository(repo.models, path, top_level=repo.top_level, overwrite=overwrite,
                            overwrite_hint=overwrite_hint, write_model=_write_model)


def _sources(model: CompiledModel) -> dict[str, FileSource]:
    """Where each file of ``model`` comes from (its files are a ``_Files`` once it is made)."""
    files = cast(_Files, model.files)
    return {rel: files.source(rel) for rel in files}


def _write_model(root: Path, model: CompiledModel) -> None:
    """Lay out ``model`` as ``root/<name>/``."""
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
