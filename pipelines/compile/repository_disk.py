"""A model repository on disk that several pipelines and hand-made models share.

**Ownership** (:mod:`pipelines.compile.repository_markers`). A marker in each
model directory names the pipeline that owns it; a model without one is never
replaced unless the caller asks for it (``overwrite=True``), nor is one that a
user added files to.

**Atomicity** (:mod:`pipelines.compile.repository_journal`). A write stages the
new models beside the repository and swaps each one in atomically, after a
journal that lets the next write finish one killed part-way.

**Concurrency.** Writers of one repository are serialised by ``flock`` on
``<repository>/.pipelines.lock``, a file (Triton ignores files at the root).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import RepositoryWriteError
from ..repository_files import ensemble_steps
from .repository_journal import RepositoryWarning, discard, make_staging, recover, transact
from .repository_markers import (
    MARKER_FILE,
    REQUIREMENTS_FILE,
    marker_owners,
    read_markers,
    refuse_to_drop_users_files,
    write_marker,
)

__all__ = [
    "LOCK_FILE",
    "MARKER_FILE",
    "REQUIREMENTS_FILE",
    "RepositoryWarning",
    "remove_pipelines",
    "repository_pipelines",
    "write_repository",
]

LOCK_FILE = ".pipelines.lock"
#: How long a writer waits for another writer of the same repository before giving up.
LOCK_TIMEOUT_S = 300.0


# ------------------------------------------------------------------ public operations


def write_repository(
    models: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    top_level: Sequence[str] = (),
    overwrite: bool = False,
    overwrite_hint: str | None = "overwrite=True",
    write_model: Callable[[Path, Any], None],
) -> Path:
    """Write ``models`` (compiled models by name; ``top_level``: those that call the others) into
    the repository at ``path``; see the module docstring.

    ``overwrite_hint`` is how the refusal tells the user to ask for replacement
    (the CLI says ``--overwrite``; ``None`` where the caller offers no way to). ``write_model(root, model)`` lays out one model.
    """
    names = sorted(models)
    target = Path(os.path.abspath(os.fspath(path)))
    _prepare_target(target, overwrite=overwrite, hint=overwrite_hint)
    with _locked(target), _os_errors(f"writing into the model repository {str(target)!r}"):
        recover(target)
        markers = read_markers(target)
        existing = marker_owners(markers)
        owners = {name: owner_of(models[name]) for name in names}
        collisions = [
            f"{name!r} ({_describe_owner(markers[name], existing[name])})"
            for name in names
            if name in existing and existing[name] != owners[name]
        ]
        if collisions and not overwrite:
            raise RepositoryWriteError(
                f"{str(target)!r} already holds models that this write does not own: {', '.join(collisions)}; "
                f"they were left as they were. Rename the pipeline, or {_remedy(overwrite_hint, 'replace them')}"
            )
        stale = sorted(n for n, o in existing.items() if o in set(owners.values()) and n not in owners)
        # A model the pipeline no longer has, that a model staying here still calls (a hand-made
        # ensemble over one of its steps), is kept: without it Triton would fail to load that one.
        used = _users_of(target, stale, staying=[n for n in existing if n not in owners and n not in stale])
        if used:
            stale = [n for n in stale if n not in used]
            warnings.warn(
                f"kept {', '.join(f'{n!r} (used by {_names(used[n])})' for n in sorted(used))} in {str(target)!r}: "
                f"pipeline {_names(sorted({existing[n] for n in used}))} no longer has "
                f"{'it' if len(used) == 1 else 'them'}, but Triton would fail to load a model that calls a "
                "missing one. Point those models elsewhere, then remove the pipeline's stale models by "
                "writing it again",
                RepositoryWarning,
                stacklevel=3,
            )
        replaced = [n for n in names if n in existing and existing[n] == owners[n]]
        if not overwrite:
            refuse_to_drop_users_files(target, markers, replaced + stale, doing="the write would replace them",
                                        undo="or write to another directory" if overwrite_hint is None else
                                        f"or {_remedy(overwrite_hint, 'replace the models without them')}")
        write_id = uuid.uuid4().hex
        stage = make_staging(target)
        try:
            models_dir = stage / "models"
            models_dir.mkdir()
            for name in names:
                write_model(models_dir, models[name])
                write_marker(models_dir / name, models[name], owner=owners[name], write_id=write_id)
        except BaseException as exc:
            discard(stage, target)
            if isinstance(exc, RepositoryWriteError) or not isinstance(exc, Exception):
                raise
            raise RepositoryWriteError(
                f"writing the models into {str(target)!r} failed, and the repository was left as it was: {exc}",
                pipeline=getattr(exc, "pipeline", None), step=getattr(exc, "step", None),
            ) from exc
        # Composing models first, top-level ones last: a server that polls the repository
        # meanwhile finds a new ensemble or BLS model's composing models already new.
        top = [n for n in names if n in set(top_level)]
        journal = {
            "target": str(target),
            "write": write_id,
            "owners": sorted(set(owners.values())),
            "install": [n for n in names if n not in top] + top,
            "remove": stale,
        }
        transact(target, stage, journal)
    return target


def remove_pipelines(path: str | os.PathLike[str], pipelines: Sequence[str]) -> list[str]:
    """Remove the models owned by ``pipelines`` from the repository at ``path``; return their names.

    Every other model is left as it was. The removal is atomic per model and
    finished by the next write if it is killed part-way.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if not target.is_dir():
        raise RepositoryWriteError(f"{str(target)!r} is not a model repository directory")
    wanted = list(dict.fromkeys(pipelines))
    if not wanted:
        raise RepositoryWriteError("name at least one pipeline whose models to remove")
    with _locked(target), _os_errors(f"removing models from {str(target)!r}"):
        recover(target)
        markers = read_markers(target)
        existing = marker_owners(markers)
        present = {o for o in existing.values() if o is not None}
        missing = [p for p in wanted if p not in present]
        if missing:
            raise RepositoryWriteError(
                f"{str(target)!r} holds no model of pipeline {', '.join(map(repr, missing))}; nothing was removed. "
                f"Pipelines there: {', '.join(map(repr, sorted(present))) or 'none'}"
            )
        names = sorted(n for n, o in existing.items() if o in wanted)
        used = _users_of(target, names, staying=[n for n in existing if n not in names])
        if used:
            raise RepositoryWriteError(
                f"{', '.join(f'{n!r} is used by {_names(used[n])}' for n in sorted(used))}, which would stay in "
                f"{str(target)!r}: Triton would fail to load a model that calls a missing one. Nothing was removed. "
                "Point those models elsewhere (or remove them first), then remove again"
            )
        refuse_to_drop_users_files(target, markers, names, doing="removing them would delete those files",
                                    undo="then remove again")
        stage = make_staging(target)
        journal = {"target": str(target), "write": uuid.uuid4().hex, "owners": wanted, "install": [], "remove": names}
        transact(target, stage, journal)
    return names


def repository_pipelines(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The pipelines whose models the repository at ``path`` holds: pipeline -> model names."""
    found: dict[str, list[str]] = {}
    for name, owner in sorted(marker_owners(read_markers(Path(path))).items()):
        if owner is not None:
            found.setdefault(owner, []).append(name)
    return found


def owner_of(model: Any) -> str:
    """The pipeline that owns an in-memory model (a model built by hand owns itself)."""
    return model.pipeline or model.name


# ------------------------------------------------------------------ the target and its lock


@contextlib.contextmanager
def _os_errors(doing: str) -> Iterator[None]:
    """An OSError (disk full, permissions, a file removed by hand meanwhile) as a RepositoryWriteError."""
    try:
        yield
    except OSError as exc:
        raise RepositoryWriteError(
            f"{doing} failed: {exc}. Each model is whole (old or new); the next write finishes or discards "
            "what this one left"
        ) from exc


def _remedy(hint: str | None, to: str) -> str:
    """How a refusal tells the user to ask for it anyway, where the caller offers a way."""
    if hint is None:
        return "move what is there out of the way, or write to another directory (this command replaces nothing)"
    return f"pass {hint} to {to}"


def _prepare_target(target: Path, *, overwrite: bool, hint: str | None) -> None:
    if os.path.lexists(target) and (target.is_symlink() or not target.is_dir()):
        what = "a symbolic link" if target.is_symlink() else "not a directory"
        if not overwrite:
            raise RepositoryWriteError(
                f"{str(target)!r} exists and is {what}; {_remedy(hint, 'replace it (a link is replaced, never followed)')}"
            )
        try:
            target.unlink()
        except OSError as exc:
            raise RepositoryWriteError(f"cannot replace {str(target)!r}: {exc}") from exc
    if not target.exists():
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RepositoryWriteError(f"cannot create the model repository {str(target)!r}: {exc}") from exc
        return
    if overwrite:
        return
    try:
        entries = [e for e in os.scandir(target) if not e.name.startswith(".") and e.name != REQUIREMENTS_FILE]
    except OSError as exc:
        raise RepositoryWriteError(f"cannot read the model repository {str(target)!r}: {exc}") from exc
    if entries and not any(e.is_dir() and os.path.isfile(os.path.join(e.path, "config.pbtxt")) for e in entries):
        raise RepositoryWriteError(
            f"{str(target)!r} is a non-empty directory that is not a model repository "
            f"(no <model>/config.pbtxt in it); {_remedy(hint, 'write the models into it anyway (what is there stays)')}"
        )


@contextlib.contextmanager
def _locked(target: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the repository's write lock; wait for another writer, or give up with a clear error."""
    timeout = LOCK_TIMEOUT_S if timeout is None else timeout
    lock_path = target / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RepositoryWriteError(f"cannot open the lock file {str(lock_path)!r}: {exc}") from exc
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = lock_path.read_text(encoding="utf-8", errors="replace").strip() or "unknown"
                    raise RepositoryWriteError(
                        f"another process (pid {holder}) is writing the model repository {str(target)!r} "
                        f"(it holds {str(lock_path)!r}); gave up after {timeout:g} s. Wait for it, then write again"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message of a writer that waits too long
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ------------------------------------------------------------------ models in use, and messages


def _users_of(target: Path, names: Sequence[str], *, staying: Sequence[str]) -> dict[str, list[str]]:
    """Which of ``names`` the ensembles among ``staying`` call (a step's ``model_name``): name -> callers.

    A BLS model's calls are in its code, which is not read; a config that does not parse is not
    an ensemble Triton would load either.
    """
    wanted = set(names)
    users: dict[str, list[str]] = {}
    if not wanted:
        return users
    for model in sorted(staying):
        for called in ensemble_steps(target / model) & wanted:
            users.setdefault(called, []).append(model)
    return users


def _names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names))


def _describe_owner(marker: Mapping[str, Any] | None, owner: str | None) -> str:
    if owner:
        return f"owned by pipeline {owner!r}"
    if marker is not None:
        return f"owned by no pipeline: a copy of model {marker.get('model')!r}, whose {MARKER_FILE} it carries"
    # No marker: made by hand, by another tool, or by a version of pipelines that recorded no owner.
    return f"owned by no pipeline: no {MARKER_FILE} in it"
