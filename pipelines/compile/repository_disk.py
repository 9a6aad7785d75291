"""A model repository on disk that several pipelines and hand-made models share.

**Ownership.** Every model directory written here holds a small marker file,
``<model>/.pipelines-model.json``, naming the pipeline that owns it and the
model it was written as: a directory copied or renamed by hand carries the
marker along, and under another name it is the user's, not the pipeline's. A marker
inside the model directory, rather than one manifest per pipeline at the root,
moves with the model in the very rename that installs it: after a crash the
owner recorded and the content on disk can never disagree. A model without a
marker (hand-made, or written by another tool) belongs to nobody here and is
never replaced unless the caller asks for it (``overwrite=True``).

**Atomicity.** A write builds the new models in a staging directory, then
swaps each one in with ``renameat2(RENAME_EXCHANGE)``, so at every instant
each model directory is the old one or the new one. Before the swaps start, a
journal is written into the staging directory; a write killed part-way (even by
SIGKILL) is finished by the next write or removal into the same repository,
which also deletes whatever staging directory was left. A swap that fails (a
directory the writer may not move) is not left for the next write, which would
fail alike: the swaps before it are put back at once. Triton 2.51 tries to
load *every* subdirectory of the repository, dot-directories included (a
leftover ``.pipelines-staging-x/`` made it fail to start; verified with the
bundled server, see ``docs/triton_model_repository.md``), so staging lives *beside* the
repository, in its parent directory. Only when the parent is on another file
system (the repository is a mount point) or not writable does it live inside.

**Concurrency.** Writers of one repository are serialised by ``flock`` on
``<repository>/.pipelines.lock``, a file (Triton ignores files at the root).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import platform
import shutil
import stat
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RepositoryWriteError
from ..repository_files import STAGING_PREFIX as _STAGING
from ..repository_files import ensemble_steps
from .requirements import render_requirements

if TYPE_CHECKING:
    from .repository import ModelRepository

__all__ = [
    "LOCK_FILE",
    "MARKER_FILE",
    "REQUIREMENTS_FILE",
    "RepositoryWarning",
    "remove_pipelines",
    "repository_pipelines",
    "write_repository",
]

MARKER_FILE = ".pipelines-model.json"
LOCK_FILE = ".pipelines.lock"
REQUIREMENTS_FILE = "requirements.txt"
_MARKER_FORMAT = 1
#: How long a writer waits for another writer of the same repository before giving up.
LOCK_TIMEOUT_S = 300.0


class RepositoryWarning(UserWarning):
    """A write did what it was asked, and left something the user should know about: a model
    kept because another model still uses it, a staging directory it could not remove."""


# ------------------------------------------------------------------ public operations


def write_repository(
    repo: ModelRepository,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    overwrite_hint: str | None = "overwrite=True",
    write_model: Callable[[Path, Any], None],
) -> Path:
    """Write ``repo``'s models into the repository at ``path``; see the module docstring.

    ``overwrite_hint`` is how the refusal tells the user to ask for replacement
    (the CLI says ``--overwrite``; ``None`` where the caller offers no way to). ``write_model(root, model)`` lays out one model.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    _prepare_target(target, overwrite=overwrite, hint=overwrite_hint)
    with _locked(target), _os_errors(f"writing into the model repository {str(target)!r}"):
        _recover(target)
        markers = _markers(target)
        existing = _owners(markers)
        owners = {name: owner_of(repo[name]) for name in repo.names}
        collisions = [
            f"{name!r} ({_describe_owner(markers[name], existing[name])})"
            for name in repo.names
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
        replaced = [n for n in repo.names if n in existing and existing[n] == owners[n]]
        if not overwrite:
            _refuse_to_drop_users_files(target, markers, replaced + stale, doing="the write would replace them",
                                        undo="or write to another directory" if overwrite_hint is None else
                                        f"or {_remedy(overwrite_hint, 'replace the models without them')}")
        write_id = uuid.uuid4().hex
        stage = _make_staging(target)
        try:
            models_dir = stage / "models"
            models_dir.mkdir()
            for name in repo.names:
                write_model(models_dir, repo[name])
                _write_marker(models_dir / name, repo[name], owner=owners[name], write_id=write_id)
        except BaseException as exc:
            _discard(stage, target)
            if isinstance(exc, RepositoryWriteError) or not isinstance(exc, Exception):
                raise
            raise RepositoryWriteError(
                f"writing the models into {str(target)!r} failed, and the repository was left as it was: {exc}",
                pipeline=getattr(exc, "pipeline", None), step=getattr(exc, "step", None),
            ) from exc
        # Composing models first, top-level ones last: a server that polls the repository
        # meanwhile finds a new ensemble or BLS model's composing models already new.
        top = [n for n in repo.names if n in set(repo.top_level)]
        journal = {
            "target": str(target),
            "write": write_id,
            "owners": sorted(set(owners.values())),
            "install": [n for n in repo.names if n not in top] + top,
            "remove": stale,
        }
        _transact(target, stage, journal)
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
        _recover(target)
        markers = _markers(target)
        existing = _owners(markers)
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
        _refuse_to_drop_users_files(target, markers, names, doing="removing them would delete those files",
                                    undo="then remove again")
        stage = _make_staging(target)
        journal = {"target": str(target), "write": uuid.uuid4().hex, "owners": wanted, "install": [], "remove": names}
        _transact(target, stage, journal)
    return names


def repository_pipelines(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The pipelines whose models the repository at ``path`` holds: pipeline -> model names."""
    found: dict[str, list[str]] = {}
    for name, owner in sorted(_scan(Path(path)).items()):
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


def _scan(target: Path) -> dict[str, str | None]:
    """Each model-like entry of the repository -> the pipeline that owns it (``None``: not ours)."""
    return _owners(_markers(target))


def _owners(markers: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str | None]:
    """Each entry of a scan (:func:`_markers`) -> the pipeline that owns it (``None``: not ours)."""
    return {name: _owner_in(marker, name) for name, marker in markers.items()}


def _markers(target: Path) -> dict[str, dict[str, Any] | None]:
    """Each model-like entry of the repository -> its marker (``None``: a link, a file, or no marker)."""
    found: dict[str, dict[str, Any] | None] = {}
    try:
        entries = list(os.scandir(target))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_symlink() or not entry.is_dir():
            if entry.is_symlink() or entry.name != REQUIREMENTS_FILE:
                found[entry.name] = None  # a link or a file in a model's place is not ours either
            continue
        found[entry.name] = _read_marker(Path(entry.path))
    return found


def _owner_in(marker: Mapping[str, Any] | None, name: str) -> str | None:
    """The pipeline a model directory's ``marker`` names, if it was written under this very ``name``
    (markers written before names were recorded are taken at their word)."""
    if marker is None or marker.get("model", name) != name:
        return None
    return marker["pipeline"]


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


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pipeline"), str) else None


def _describe_owner(marker: Mapping[str, Any] | None, owner: str | None) -> str:
    if owner:
        return f"owned by pipeline {owner!r}"
    if marker is not None:
        return f"owned by no pipeline: a copy of model {marker.get('model')!r}, whose {MARKER_FILE} it carries"
    # No marker: made by hand, by another tool, or by a version of pipelines that recorded no owner.
    return f"owned by no pipeline: no {MARKER_FILE} in it"


def _write_marker(model_dir: Path, model: Any, *, owner: str, write_id: str) -> None:
    needs = model.server_needs()
    data = {
        "format": _MARKER_FORMAT,
        "pipeline": owner,
        "model": model.name,
        "write": write_id,
        "requirements": list(needs.requirements),
        "python": needs.python,
        "files": _files_in(model_dir),  # what is ours in it: anything else a user put there
    }
    (model_dir / MARKER_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _files_in(model_dir: Path) -> list[str]:
    """Every file (and link) below ``model_dir``, relative and '/'-separated; Python's caches aside."""
    found = []
    for root, dirs, files in os.walk(model_dir):
        rel = Path(root).relative_to(model_dir)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # not walked into: listed
        dirs[:] = [d for d in dirs if d != "__pycache__" and d not in links]
        found += [(rel / f).as_posix() for f in files + links if not f.endswith(".pyc")]
    return sorted(found)


def _users_files(model_dir: Path, marker: Mapping[str, Any] | None) -> list[str]:
    """The files in one of our model directories that no write of ours put there."""
    written = marker.get("files") if marker is not None else None
    if not isinstance(written, list):
        return []  # a marker from before markers listed their files: nothing to tell apart
    ours = {*written, MARKER_FILE}
    return [f for f in _files_in(model_dir) if f not in ours]


def _refuse_to_drop_users_files(
    target: Path, markers: Mapping[str, Any], names: Sequence[str], *, doing: str, undo: str
) -> None:
    """Raise before a model directory holding files a user added (notes, a tuned version) is replaced or removed."""
    found = {name: files for name in names if (files := _users_files(target / name, markers.get(name)))}
    if not found:
        return
    listed = "; ".join(
        f"{name!r}: {', '.join(files[:5])}" + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        for name, files in sorted(found.items())
    )
    owners = sorted({markers[name]["pipeline"] for name in found})
    raise RepositoryWriteError(
        f"{str(target)!r}: models of pipeline {', '.join(map(repr, owners))} hold files that no write of it put "
        f"there ({listed}); "
        f"{doing}, so nothing was changed. Move them out (into a model of your own, or outside the "
        f"repository), {undo}"
    )


# ------------------------------------------------------------------ staging, journal, swaps


def _staging_home(target: Path) -> tuple[Path, str]:
    """Where staging directories live, and their name prefix: beside the repository if possible."""
    parent = target.parent
    try:
        same_fs = os.stat(parent).st_dev == os.stat(target).st_dev
    except OSError:
        same_fs = False
    if same_fs and os.access(parent, os.W_OK | os.X_OK):
        return parent, f".{target.name}{_STAGING}"
    # A mount point: only the repository itself is on its file system. Triton would try
    # to load a directory left here by a killed write; the next write removes it.
    return target, _STAGING


def _make_staging(target: Path) -> Path:
    home, prefix = _staging_home(target)
    try:
        stage = Path(tempfile.mkdtemp(prefix=prefix, dir=home))
        (stage / "target").write_text(str(target), encoding="utf-8")
        os.chmod(stage, _mode_for(target))
    except OSError as exc:
        raise RepositoryWriteError(f"cannot create a staging directory in {str(home)!r}: {exc}") from exc
    return stage


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return 0o755


def _transact(target: Path, stage: Path, journal: Mapping[str, Any]) -> None:
    """Record the journal, apply it, refresh requirements.txt, and drop the staging directory.

    A swap that fails (an immutable or root-owned model directory, a file system gone
    read-only) puts back the swaps made before it, so the repository is as it was; the
    next write would meet the same failure, so leaving the journal for it would only
    block every later write. Only a write that is killed part-way is finished later.
    """
    tmp = stage / "journal.json.tmp"
    tmp.write_text(json.dumps(journal, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, stage / "journal.json")  # from here on, a killed write is finished by the next one
    done: list[tuple[str, Path, Path]] = []
    try:
        _apply(target, stage, journal, done=done)
    except OSError as exc:
        doing = "swapping the new models into" if journal["install"] else "removing models from"
        what = f"{doing} {str(target)!r} failed at {exc.filename or 'a model'!r}: {exc.strerror or exc}"
        moved = "swapped in" if journal["install"] else "removed"
        try:
            _undo(done)
        except OSError as undo_exc:
            raise RepositoryWriteError(
                f"{what}; putting back the {len(done)} model(s) {moved} before it failed too ({undo_exc}). Each "
                f"model is whole (old or new); the next write or removal into this repository finishes this "
                f"one (its journal is in {str(stage)!r}) once the cause is mended"
            ) from exc
        (stage / "journal.json").unlink()
        _discard(stage, target)
        raise RepositoryWriteError(
            f"{what}. The {len(done)} model(s) {moved} before it were put back: the repository is as it "
            f"was. Mend the cause (the directory's owner, permissions or attributes) and "
            f"{'write' if journal['install'] else 'remove them'} again"
        ) from exc
    _refresh_requirements(target)
    _discard(stage, target)


def _apply(
    target: Path, stage: Path, journal: Mapping[str, Any], *, done: list[tuple[str, Path, Path]] | None = None
) -> None:
    """Carry out a journal; safe to run again after it was interrupted at any point.

    ``done`` collects each rename made, for :func:`_undo`.
    """
    done = [] if done is None else done
    write_id = journal["write"]
    for name in journal["install"]:
        dest, new = target / name, stage / "models" / name
        current = _read_marker(dest) if not dest.is_symlink() else None
        if current is not None and current.get("write") == write_id:
            continue  # swapped in before an interruption
        if os.path.lexists(dest):
            aside = stage / "aside" / name
            _exchange(new, dest, aside=aside)
            done.append(("exchanged", new, dest) if os.path.lexists(new) else ("replaced", aside, dest))
        else:
            os.rename(new, dest)
            done.append(("moved", new, dest))
    owners = set(journal["owners"])
    for name in journal["remove"]:
        dest = target / name
        marker = _read_marker(dest) if not dest.is_symlink() else None
        if _owner_in(marker, name) in owners and marker.get("write") != write_id:
            (stage / "removed").mkdir(exist_ok=True)
            os.rename(dest, stage / "removed" / name)
            done.append(("moved", dest, stage / "removed" / name))


def _undo(done: Sequence[tuple[str, Path, Path]]) -> None:
    """Put back, last first, what :func:`_apply` did (``done``)."""
    for kind, source, dest in reversed(done):
        if kind == "exchanged":  # the old model sits where the new one was staged
            _exchange(source, dest, aside=source.parent.parent / "aside" / dest.name)
        elif kind == "replaced":  # the old model sits aside, the new one at dest
            os.rename(dest, source.parent.parent / "models" / dest.name)
            os.rename(source, dest)
        else:
            os.rename(dest, source)


def _discard(stage: Path, target: Path) -> None:
    """Remove a staging directory; one that cannot be removed is named in a warning.

    It holds a model swapped out (or never swapped in), whose files may belong to
    another user (a ``__pycache__`` a server running as root wrote). Beside the
    repository it is only litter; inside one (a mount point) a Triton that exits on a
    model it cannot load (its default; not ``TritonServer``'s) refuses to start on it,
    so the warning says what to remove.
    """
    try:
        shutil.rmtree(stage)
    except FileNotFoundError:
        return
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if not os.path.lexists(stage):
            return
        inside = stage.parent == target
        warnings.warn(
            f"the staging directory {str(stage)!r} could not be removed ({exc}); "
            + ("it is inside the model repository, where a Triton started with its default --exit-on-error "
               "refuses to start until it is removed. "
               if inside else "it is litter beside the model repository, not part of it. ")
            + "Remove it as a user who may (its files' owner, or root)",
            RepositoryWarning,
            stacklevel=2,
        )


def _recover(target: Path) -> None:
    """Finish (journal present) or discard (no journal) what killed writers left behind."""
    recovered = False
    for home, prefix in {_staging_home(target), (target, _STAGING)}:
        try:
            leftovers = [Path(e.path) for e in os.scandir(home) if e.name.startswith(prefix) and e.is_dir()]
        except OSError:
            continue
        for stage in leftovers:
            try:
                recorded = (stage / "target").read_text(encoding="utf-8")
            except OSError:
                recorded = None
            if recorded is not None and recorded != str(target):
                continue  # another repository's
            journal_path = stage / "journal.json"
            if journal_path.is_file():
                journal = json.loads(journal_path.read_text(encoding="utf-8"))
                try:
                    _apply(target, stage, journal)
                except OSError as exc:
                    raise RepositoryWriteError(
                        f"cannot finish an interrupted write into {str(target)!r} (left in {str(stage)!r}): {exc}"
                    ) from exc
                recovered = True
            _discard(stage, target)
    for entry in os.scandir(target):
        if entry.name.startswith(f".{REQUIREMENTS_FILE}.") and entry.is_file():
            os.unlink(entry.path)
    if recovered:
        _refresh_requirements(target)


# Linux renameat2(2); glibc >= 2.28 exports it, older ones need the raw syscall.
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def _renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        return fn
    number = _SYSCALL_RENAMEAT2.get(platform.machine())
    if number is None or not hasattr(libc, "syscall"):
        return None
    return lambda *args: libc.syscall(number, *args)


_RENAMEAT2 = _renameat2()


def _exchange(new: Path, dest: Path, *, aside: Path) -> None:
    """Swap ``new`` into ``dest`` atomically; the old content ends where ``new`` was.

    Where the file system cannot exchange (not Linux, or it says EINVAL), two
    renames are used: for an instant ``dest`` is missing, and a crash in that
    instant is repaired by the next write, which renames ``new`` in.
    """
    if _RENAMEAT2 is not None:
        rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(dest), _RENAME_EXCHANGE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(dest))
    aside.parent.mkdir(exist_ok=True)
    os.rename(dest, aside)
    os.rename(new, dest)


# ------------------------------------------------------------------ requirements.txt


def _refresh_requirements(target: Path) -> None:
    """Rewrite the repository's requirements.txt from the markers of every model in it (a copy of
    a pipeline's model, the user's now, still needs what it needed). A requirements.txt that is
    a link to a shared file stays a link: the file it points to is rewritten."""
    found = _markers(target)
    markers = [found[name] for name in sorted(found) if found[name] is not None]
    path = link = target / REQUIREMENTS_FILE
    if link.is_symlink() and link.exists():
        path = link.resolve()
    try:
        previous = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        previous = None
    text = render_requirements(markers, previous)
    if text == previous:
        return
    tmp = path.parent / f".{REQUIREMENTS_FILE}.{uuid.uuid4().hex}"
    try:
        if text is None:
            link.unlink(missing_ok=True)  # a link goes, never the shared file it points to
            return
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        # The models are in by now: a file that lists what they need is no reason to call the
        # write failed (nor to leave a journal that every later write would retry).
        tmp.unlink(missing_ok=True)
        warnings.warn(
            f"the models are written, but {str(path)!r} could not be "
            + ("removed" if text is None else "rewritten")
            + f" ({exc.strerror or exc}); it should "
            + ("be gone: no model in the repository needs a package" if text is None
               else "read:\n" + text)
            + "Mend its permissions or attributes; the next write rewrites it",
            RepositoryWarning,
            stacklevel=3,
        )
