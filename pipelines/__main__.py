"""``python -m pipelines`` is the ``pipelines`` command.

``python -m`` puts the current directory first on ``sys.path``, so a folder there named
``pipelines`` (empty, or holding anything but this package) can be imported in this package's
place; it is named here, before the user's own file fails on it with Python's "unknown location".
"""

from __future__ import annotations

import os
import sys


def _shadowing() -> str | None:
    """Why the ``pipelines`` in ``sys.modules`` is not this package, and what to do; None: it is.

    Only a folder without ``__init__.py`` (a namespace package) can get here: a folder with one,
    or a ``pipelines.py``, would have been run by ``-m`` instead of this file.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    imported = sys.modules.get("pipelines")
    origin = getattr(imported, "__file__", None)
    if imported is None or (origin is not None and os.path.dirname(os.path.abspath(origin)) == here):
        return None
    folders = [os.path.abspath(p) for p in getattr(imported, "__path__", ()) if os.path.abspath(p) != here]
    if not folders:
        return None
    return (
        f"the folder {folders[0]} shadows the pipelines package (installed at {here}): Python imports a "
        "folder named 'pipelines' that comes first on sys.path (the script's directory, or the current one "
        "for python -m), even an empty one, in the package's place, and `from pipelines import Pipeline` then "
        "fails with \"cannot import name 'Pipeline' from 'pipelines' (unknown location)\"; rename or move that "
        "folder, or run from another directory"
    )


if __name__ == "__main__":
    why = _shadowing()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)

    from .cli import main

    sys.exit(main())
