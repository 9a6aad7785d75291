"""Proof, before a repository is written, that every step's code loads on a server: a clean
interpreter (``python -I -S``, run on :mod:`.import_probe`) loads each step as its stub would, from a
copy of the files that travel, with only the standard library and the distributions that
``requirements.txt`` names (and what they depend on) to import from; never the user's folder, never
``pipelines``. A step that would fail to load is a :class:`CompileError`, and nothing is written.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.metadata
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import CompileError
from .requirements import one_line_each

__all__ = ["check_steps_import"]

_PROBE = Path(__file__).with_name("import_probe.py")
_PLAN = "step.json"
_FUSED = "1/fused.json"
#: A step file that does real work when imported (loads weights, say) may take a while; a hung one must not hang compile.
_TIMEOUT_S = 300


@dataclass(frozen=True)
class _Load:
    """One step's code to load: the model and step that hold it, its ``impl`` record, its files."""

    pipeline: str
    step: str
    model: str
    source: str
    impl: dict[str, Any]
    files: dict[str, bytes]



def _process_key(process: list[_Load]) -> str:
    return json.dumps([load.impl for load in process], sort_keys=True)


#: The model processes proven in this process, with the requirements they were proven under.
_PROVEN: set[tuple[str, tuple[str, ...]]] = set()


def check_steps_import(models: Mapping[str, Any]) -> None:
    """Raise :class:`CompileError` for the first step of ``models`` (a repository's compiled models
    by name) whose code would not load on a server."""
    requirements = one_line_each({r for m in models.values() for r in _needs(m)})
    # What loaded once loads again: the record holds the digest of every file, and the same
    # requirements give the same modules (tests and notebooks write one pipeline many times).
    processes = [p for p in _processes(models) if (_process_key(p), tuple(requirements)) not in _PROVEN]
    if not processes:
        return
    with tempfile.TemporaryDirectory(prefix="pipelines-import-check-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        jobs: dict[str, list[dict[str, Any]]] = {}
        for index, process in enumerate(processes):
            jobs[str(index)] = []
            for position, load in enumerate(process):
                folder = f"m{index}/s{position}"
                for rel, data in load.files.items():
                    (root / folder / rel).parent.mkdir(parents=True, exist_ok=True)
                    (root / folder / rel).write_bytes(data)
                jobs[str(index)].append({"folder": folder, "impl": load.impl})
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result.json"
        job.write_text(json.dumps({
            "root": str(root), "serving": str(_PROBES.serving()), "sites": _sites(),
            "allowed": sorted(_allowed_modules(tuple(requirements))), "processes": jobs, "result": str(result),
        }))
        try:
            code, stderr = _PROBES.run(job)
        except subprocess.TimeoutExpired:
            raise CompileError(
                f"loading the steps' code as a server would took over {_TIMEOUT_S} s (pipelines "
                f"{', '.join(sorted({p[0].pipeline for p in processes}))}); a step's file must not do long work "
                "when imported: move it under `if __name__ == \"__main__\":` or into initialize(). Nothing was written"
            ) from None
        if code != 0 or not result.is_file():
            raise CompileError(
                f"the check that every step's code loads on a server could not run ({sys.executable} -I -S "
                f"exited with {code}): {stderr.strip()[-2000:]}. Nothing was written"
            )
        failures = json.loads(result.read_text())
    _PROVEN.update((_process_key(p), tuple(requirements)) for i, p in enumerate(processes) if str(i) not in failures)
    for index in sorted(failures, key=int):
        failure = failures[index]
        raise _error(processes[int(index)][failure["position"]], failure, requirements)


class _Probes:
    """Runs probe jobs: through one warm ``import_probe.py --serve`` process that forks a fresh
    child per job (numpy imported once), or, where it cannot (no fork, or it died), one
    ``python -I -S`` process per job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen[str] | None = None
        self._key: tuple[str, ...] = ()
        self._home: str | None = None

    def serving(self) -> Path:
        """The folder that holds this process's copy of ``serving/``, made once (and its bytecode with it)."""
        with self._lock:
            if self._home is None:
                home = tempfile.mkdtemp(prefix="pipelines-import-check-")
                (Path(home) / "serving").mkdir()
                for module in resources.files("pipelines.serving").iterdir():
                    if module.name.endswith(".py"):
                        (Path(home) / "serving" / module.name).write_bytes(module.read_bytes())
                self._home = home
            return Path(self._home)

    def run(self, job: Path) -> tuple[int, str]:
        """The probe's exit status for ``job``, and what it wrote to stderr."""
        with self._lock:
            if hasattr(os, "fork"):
                answer = self._served(job)
                if answer is not None:
                    return answer
            ran = subprocess.run([sys.executable, "-I", "-S", str(_PROBE), str(job)], capture_output=True,
                                 text=True, timeout=_TIMEOUT_S, cwd=job.parent, stdin=subprocess.DEVNULL)
            return ran.returncode, ran.stderr

    def _served(self, job: Path) -> tuple[int, str] | None:
        sites = _sites()
        key = (sys.executable, *sites)
        if self._server is None or self._server.poll() is not None or self._key != key:
            self.stop()
            self._server = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_PROBE), "--serve", json.dumps(sites), str(self._home)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tempfile.gettempdir(),
                start_new_session=True,  # a timeout ends it and the child it forked, together
            )
            self._key = key
        server = self._server
        assert server.stdin is not None and server.stdout is not None
        try:
            server.stdin.write(f"{job}\n")
            server.stdin.flush()
        except OSError:
            self.stop()
            return None
        ready, _, _ = select.select([server.stdout], [], [], _TIMEOUT_S)
        if not ready:
            self.stop()
            raise subprocess.TimeoutExpired(str(_PROBE), _TIMEOUT_S)
        line = server.stdout.readline()
        if not line.strip().lstrip("-").isdigit():  # it died: run the job on its own instead
            self.stop()
            return None
        err = Path(f"{job}.err")
        return int(line), err.read_text(errors="replace") if err.is_file() else ""

    def close(self) -> None:
        """Stop the warm process and remove the copy of ``serving/`` (at exit)."""
        self.stop()
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if server.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        for pipe in (server.stdin, server.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


_PROBES = _Probes()
atexit.register(_PROBES.close)


def _needs(model: Any) -> tuple[str, ...]:
    try:
        return model.server_needs().requirements
    except CompileError:  # a step that cannot be exported by value: the write says so, in its own words
        return ()


def _processes(models: Mapping[str, Any]) -> list[list[_Load]]:
    """The steps each distinct model of ``models`` loads in its one Python process: a step model's
    one, a fused model's every step (in one process, their modules meet); a fused model's step
    alone carries the same as the step's own model, and is loaded once."""
    found: dict[str, list[_Load]] = {}
    for name in sorted(models):
        model = models[name]
        process = []
        for rel in sorted((r for r in model.files if r.rpartition("/")[2] == _PLAN), key=_load_order(model)):
            folder = rel.rpartition("/")[0]
            try:
                plan = json.loads(model.files[rel])
                impl = plan["impl"]
                wanted = list(impl["sha256"]) if "path" in impl else [impl["pickle"]] if "pickle" in impl else []
                files = {w: model.files[f"{folder}/{w}"] for w in wanted}
            except CompileError:
                continue  # a step that cannot be exported by value: the write says so, in its own words
            process.append(_Load(plan.get("pipeline") or model.pipeline or name, plan.get("step") or name,
                                 name, plan.get("source", "module"), impl, files))
        if process:
            found.setdefault(_process_key(process), process)
    return list(found.values())


def _load_order(model: Any) -> Any:
    """How a model orders the plans of its steps as it loads them: a fused model, in its plan's order."""
    if _FUSED not in model.files:
        return lambda rel: (0, rel)
    try:
        data = json.loads(model.files[_FUSED])
        nodes = [data["nodes"].get(n["name"]) or {} for n in data["plan"]["nodes"]]
    except (KeyError, TypeError, AttributeError, ValueError):  # another layout: the plans' own order
        nodes = []
    folders = [f"1/{node['folder']}/{_PLAN}" for node in nodes if node.get("folder")]  # external steps have none
    return lambda rel: (folders.index(rel), rel) if rel in folders else (len(folders), rel)


def _sites() -> list[str]:
    """The site-packages this Python imports installed distributions from (no user folder, no editable path)."""
    paths = sysconfig.get_paths()
    candidates = [*sys.path, paths.get("purelib", ""), paths.get("platlib", "")]
    parts = ("site-packages", "dist-packages")
    return list(dict.fromkeys(p for p in candidates if p and any(x in Path(p).parts for x in parts)
                              and os.path.isdir(p)))


_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=32)
def _allowed_modules(requirements: tuple[str, ...]) -> frozenset[str]:
    """The top-level modules that ``pip install`` of ``requirements`` gives a server: those of the
    distributions named, and of what they require (extras left out), as installed here."""
    todo = [m.group(1) for m in map(_NAME.match, requirements) if m]
    seen: set[str] = set()
    while todo:
        dist = _key(todo.pop())
        if dist in seen:
            continue
        seen.add(dist)
        try:
            needs = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [m.group(1) for m in map(_NAME.match, (r for r in needs if "extra ==" not in r.replace("'", '"')
                                                          and "extra==" not in r)) if m]
    return frozenset(top for top, dists in _top_levels().items() if any(_key(d) in seen for d in dists))


@functools.lru_cache(maxsize=1)
def _top_levels() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _error(load: _Load, failure: dict[str, Any], requirements: Iterable[str]) -> CompileError:
    where = (f"{Path(failure['file']).name}, line {failure['line']} (`{failure['code']}`)" if failure.get("file")
             else "loading it")
    travels = {"file": f"as its file{'s' if len(load.files) > 1 else ''} "
                       f"{', '.join(Path(f).name for f in load.files)}",
               "pickle": "by value in step.pkl",
               }.get(load.source, f"by reference to the installed module {load.impl.get('module')!r}")
    required = ", ".join(requirements) or "nothing"
    module = failure.get("module")
    if module and failure.get("installed"):
        fix = (f"{module!r} is installed here, but only an import at the top of a travelling file (or in the "
               f"step's code) puts its distribution into requirements.txt: import {module} at the top of "
               f"{Path(failure.get('file') or 'the file').name}")
    elif module:
        fix = (f"the server has only the files that travel and what requirements.txt installs, so {module!r} "
               f"must be one of them: pip install it here as a distribution (requirements.txt then names it), "
               f"or make it a single-file module beside the step's file, or import it inside the step's "
               f"function instead of when the file is imported")
    else:
        fix = "make the file import on a server: keep the script's own work under `if __name__ == \"__main__\":`"
    return CompileError(
        f"pipeline {load.pipeline!r}: step {load.step!r} (model {load.model!r}) would fail to load on the "
        f"server: its code travels {travels}, and loading it failed at {where} with {failure['error']}. "
        f"requirements.txt installs {required}; {fix}. Nothing was written",
        pipeline=load.pipeline, step=load.step,
    )
