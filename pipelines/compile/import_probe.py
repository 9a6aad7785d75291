"""Run by the compiler as ``python -I -S import_probe.py JOB``, apart from the package: loads each
step's code as a server's stub would, from a copy of the files that travel, with only the standard
library and the distributions ``requirements.txt`` names to import from; writes what failed as JSON.

It imports nothing of ``pipelines`` but the copy of ``serving/`` that travels beside every model.
``--serve SITES SERVING``: one process that imports ``serving`` (and numpy) once and forks a
fresh child for each job path read from stdin, answering each with the child's exit status.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import sys
import traceback
from typing import Any


class _NotRequired(ModuleNotFoundError):
    """A module installed here that a server holding only ``requirements.txt`` would not have."""


class _OnlyRequired:
    """Refuses a top-level module that would come from site-packages but no required distribution
    provides: a server's Python, holding only ``requirements.txt``, would not have it."""

    def __init__(self, sites: list[str], allowed: set[str]) -> None:
        self.sites = [os.path.realpath(s) + os.sep for s in sites]
        self.allowed = allowed

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if "." in fullname or fullname in self.allowed:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, sys.path)
        where = None if spec is None else spec.origin if spec.has_location else next(
            iter(spec.submodule_search_locations or ()), None)
        if where and any(os.path.realpath(where).startswith(site) for site in self.sites):
            raise _NotRequired(
                f"No module named {fullname!r} (installed here, but no line of requirements.txt installs it)",
                name=fullname,
            )
        return None


def _failure(exc: BaseException, folder: str) -> dict[str, Any]:
    """Where loading failed: the deepest line of a travelling file, and the module that was missing."""
    cause = exc.__cause__ or exc
    frames = [f for f in traceback.extract_tb(cause.__traceback__)
              if os.path.realpath(f.filename).startswith(os.path.realpath(folder) + os.sep)]
    last = frames[-1] if frames else None
    return {
        "error": f"{'ModuleNotFoundError' if isinstance(cause, _NotRequired) else type(cause).__name__}: {cause}",
        "module": getattr(cause, "name", None) if isinstance(cause, ImportError) else None,
        "installed": isinstance(cause, _NotRequired),
        "file": os.path.relpath(last.filename, folder).replace(os.sep, "/") if last else None,
        "line": last.lineno if last else None,
        "code": (last.line or "").strip() if last else None,
    }


def main(job_path: str) -> None:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    root = job["root"]
    if job["serving"] not in sys.path:
        sys.path.insert(0, job["serving"])  # the copy of serving/, as beside each model.py
    sys.path += [s for s in job["sites"] if s not in sys.path]
    sys.meta_path.insert(0, _OnlyRequired(job["sites"], set(job["allowed"])))  # type: ignore[arg-type]
    import serving  # the copy: standard library and numpy only
    from serving import sources

    failures = {}
    for key, steps in job["processes"].items():
        # Each model is its own stub process; a fused model loads all its steps in its one.
        path, modules = sys.path[:], set(sys.modules)
        try:
            for position, step in enumerate(steps):
                folder = os.path.join(root, step["folder"])
                try:
                    serving.load_impl(step["impl"], folder)
                except BaseException as exc:  # noqa: BLE001 - whatever the file raises, a stub would fail to load
                    failures[key] = {**_failure(exc, folder), "position": position}
                    break
        finally:
            # Forget what this model imported from its files, as its process would end.
            sys.path[:] = path
            sources._LOADED.clear()
            for name in set(sys.modules) - modules:
                file = getattr(sys.modules[name], "__file__", None) or ""
                if name.partition(".")[0] == "pipelines" or name.startswith("_pipelines_source_") or (
                        os.path.realpath(file).startswith(os.path.realpath(root) + os.sep)):
                    del sys.modules[name]
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(failures, f)


def serve(sites: list[str], serving_folder: str) -> None:
    """Answer each job path on stdin with the exit status of a child that ran it.

    A step model imports ``serving`` (and so numpy, which ``requirements.txt`` always names)
    before its step: imported here once, so that a check costs a fork, not their imports.
    """
    sys.path += sites
    sys.path.insert(0, serving_folder)
    importlib.import_module("serving.sources")

    for line in sys.stdin:
        job = line.strip()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(os.path.dirname(job))
                # What the step's files print must not reach the answers on stdout.
                with open(os.devnull, "wb") as null, open(job + ".err", "wb") as err:
                    os.dup2(null.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                main(job)
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the exit status and the .err file
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main(sys.argv[1])
