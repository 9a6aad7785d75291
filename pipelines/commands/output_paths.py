"""Where a command will write, checked before it does any work: a run of minutes must not
end in "that is a directory" and lose what it measured, nor write over a user's file."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArgumentError

__all__ = ["output_dir", "output_file", "replace_text", "same_file"]


def output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory to write into, made if missing; ``ArgumentError`` naming ``what``
    and the path if it is a file or cannot be made or written to."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{what} {str(path)!r} is a file; give a directory (it is made if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArgumentError(f"cannot make {what} {str(path)!r}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgumentError(f"cannot write into {what} {str(path)!r}: permission denied")
    return path


def output_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a file to write (its directory made if missing); ``ArgumentError`` naming
    ``what`` and the path if it is a directory or cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ArgumentError(f"{what} {str(path)!r} is a directory; give a file name")
    output_dir(path.parent, f"the directory of {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ArgumentError(f"cannot write {what} {str(path)!r}: permission denied")
    return path


def replace_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file that then replaces it, so a write
    that fails (a full disk) or is interrupted leaves the previous copy whole, never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file (through links too), existing or not."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()
