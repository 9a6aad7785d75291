"""How a write reaches the disk atomically: staging, a journal, and one swap per model.

A write builds the new models in a staging directory, then swaps each one in
with ``renameat2(RENAME_EXCHANGE)``, so at every instant each model directory
is the old one or the new one. Before the swaps start, a journal is written
into the staging directory; a write killed part-way (even by SIGKILL) is
finished by the next write or removal into the same repository, which also
deletes whatever staging directory was left. A swap that fails (a directory
the writer may not move) is not left for the next write, which would fail
alike: the swaps before it are put back at once. Triton 2.51 tries to load
*every* subdirectory of the repository, dot-directories included (a leftover
``.pipelines-staging-x/`` made it fail to start; verified with the bundled
server, see ``docs/triton_model_repository.md``), so staging lives *beside*
the repository, in its parent directory. Only when the parent is on another
file system (the repository is a mount point) or not writable does it live
inside. After each change the repository's ``requirements.txt`` is rewritten
from the markers of the models in it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import shutil
import stat
import tempfile
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import RepositoryWriteError
from ..repository_files import STAGING_PREFIX as _STAGING
from .repository_markers import REQUIREMENTS_FILE, owner_in, read_marker, read_markers
from .requirements import render_requirements

__all__ = ["RepositoryWarning", "discard", "make_staging", "recover", "transact"]


class RepositoryWarning(UserWarning):
    """A write did what it was asked, and left something the user should know about: a model
    kept because another model still uses it, a staging directory it could not remove."""


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


def make_staging(target: Path) -> Path:
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


def transact(target: Path, stage: Path, journal: Mapping[str, Any]) -> None:
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
        discard(stage, target)
        raise RepositoryWriteError(
            f"{what}. The {len(done)} model(s) {moved} before it were put back: the repository is as it "
            f"was. Mend the cause (the directory's owner, permissions or attributes) and "
            f"{'write' if journal['install'] else 'remove them'} again"
        ) from exc
    _refresh_requirements(target)
    discard(stage, target)


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
        current = read_marker(dest) if not dest.is_symlink() else None
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
        marker = read_marker(dest) if not dest.is_symlink() else None
        if owner_in(marker, name) in owners and marker.get("write") != write_id:
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


def discard(stage: Path, target: Path) -> None:
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


def recover(target: Path) -> None:
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
            discard(stage, target)
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
    found = read_markers(target)
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
