"""Which models of a repository are ours: the marker in each model directory we write.

Every model directory written here holds a small marker file,
``<model>/.pipelines-model.json``, naming the pipeline that owns it and the
model it was written as: a directory copied or renamed by hand carries the
marker along, and under another name it is the user's, not the pipeline's. A marker
inside the model directory, rather than one manifest per pipeline at the root,
moves with the model in the very rename that installs it: after a crash the
owner recorded and the content on disk can never disagree. A model without a
marker (hand-made, or written by another tool) belongs to nobody here and is
never replaced unless the caller asks for it (``overwrite=True``). The marker also
lists the files the write put there, so files a user added are never dropped unasked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import RepositoryWriteError

__all__ = [
    "MARKER_FILE",
    "REQUIREMENTS_FILE",
    "marker_owners",
    "owner_in",
    "read_marker",
    "read_markers",
    "refuse_to_drop_users_files",
    "write_marker",
]

MARKER_FILE = ".pipelines-model.json"
REQUIREMENTS_FILE = "requirements.txt"
_MARKER_FORMAT = 1


def marker_owners(markers: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str | None]:
    """Each entry of a scan (:func:`read_markers`) -> the pipeline that owns it (``None``: not ours)."""
    return {name: owner_in(marker, name) for name, marker in markers.items()}


def read_markers(target: Path) -> dict[str, dict[str, Any] | None]:
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
        found[entry.name] = read_marker(Path(entry.path))
    return found


def owner_in(marker: Mapping[str, Any] | None, name: str) -> str | None:
    """The pipeline a model directory's ``marker`` names, if it was written under this very ``name``
    (markers written before names were recorded are taken at their word)."""
    if marker is None or marker.get("model", name) != name:
        return None
    return marker["pipeline"]


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker in ``model_dir``; ``None`` where there is none, or one that names no pipeline."""
    try:
        data = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pipeline"), str) else None


def write_marker(model_dir: Path, model: Any, *, owner: str, write_id: str) -> None:
    """Mark a staged model directory as ``owner``'s, written by the write ``write_id``; last, as it lists the files."""
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


def refuse_to_drop_users_files(
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
