"""The models of an embedded server: which could not load and why, which a caller requires, which
ensembles hold which steps, and the loads and unloads to replay after a restart.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PipelinesError, ServerStartError
from ..repository_files import models_called
from .launch import ServerProcess

if TYPE_CHECKING:
    from .client import TritonClient

__all__ = ["ModelState", "ModelsUnavailableWarning", "unload"]


class ModelsUnavailableWarning(UserWarning):
    """The server started, but some models of its repository failed to load."""


class ModelState:
    """What one server's models are: ``unavailable`` (failed to load at the start -> why),
    ``ensemble_steps`` (ensemble -> its step models), and ``loaded_later`` (loads, True, and
    unloads since the start, in the order of the last call for each model)."""

    def __init__(self, process: ServerProcess) -> None:
        self._process = process
        self.unavailable: dict[str, str] = {}
        self.ensemble_steps: dict[str, frozenset[str]] = {}
        self.loaded_later: dict[str, bool] = {}
        # Held while a load or unload through this package is under way: Triton swaps stubs meanwhile.
        self.changing = threading.Lock()

    @property
    def repository(self) -> Path:
        return self._process.repository

    def remember(self, name: str, *, loaded: bool) -> None:
        """A load or unload since the start, replayed in the order of the last call."""
        self.loaded_later.pop(name, None)
        self.loaded_later[name] = loaded

    def find_unavailable(self) -> None:
        """After the start: the models asked for that cannot answer, and why, said in a warning.

        Asked for: every model folder of the repository (modes none and poll, explicit with
        '*'), or the models named in ``load_models``. One cannot answer when the repository
        index does not say READY (poll mode retries a failed model: LOADING), when the index
        leaves it out (Triton refused it before loading: no version folder, a version policy
        naming none there; or a name the repository does not hold), or when it is ready but calls
        a model that did not load (a compiled BLS model's step). Triton's reason is the index's,
        else the log's line for the model.
        """
        from .client import TritonClient

        with TritonClient(self._process.http_url, timeout=30) as client:
            index = client.repository_index()
        states = {m["name"]: m for m in index}
        arguments = self._process.arguments
        everything = arguments.load_models == ("*",) or arguments.model_control_mode != "explicit"
        asked = (set(states) | set(_model_folders(self.repository))) if everything else set(arguments.load_models)
        said = self._process.log.load_failures()
        failed = {}
        for name in asked:
            entry = states.get(name) or {}
            if entry.get("state") == "READY":
                continue
            failed[name] = (entry.get("reason") or "").strip() or said.get(name, "")
        down = failed.keys() | {n for n, m in states.items() if m.get("state") != "READY"}
        for name in sorted(failed):
            state = (states[name].get("state") or "") if name in states else None
            failed[name] = failed[name] or self._why_not_loaded(name, down, state=state)
        for name in sorted(n for n in asked if n not in failed):  # ready, but a model it calls is not
            culprits = sorted(models_called(self.repository / name) & down)
            if culprits:
                failed[name] = (f"loaded, but it calls {', '.join(map(repr, culprits))}, which failed to load: "
                                "every request to it fails")
        self.unavailable = dict(sorted(failed.items()))
        if self.unavailable:
            warnings.warn(
                f"the Triton server for {self.repository} serves its other models, but "
                f"{len(self.unavailable)} cannot answer: "
                + "; ".join(f"{name!r}: {why}" for name, why in self.unavailable.items())
                + ". Requests to them fail; fix them and start the server again (or load them)",
                ModelsUnavailableWarning,
                stacklevel=4,
            )

    def _why_not_loaded(self, name: str, down: Set[str], *, state: str | None) -> str:
        """Why a model that Triton gave no reason for did not load (``state``: the index's; None: unlisted)."""
        folder = self.repository / name
        if not folder.is_dir():
            return f"the repository holds no model {name!r}"
        if not (folder / "config.pbtxt").is_file():
            return "not loaded: its folder holds no config.pbtxt"
        culprits = sorted(models_called(folder) & down)
        if culprits:
            return f"not loaded: an ensemble calling {', '.join(map(repr, culprits))}, which failed to load"
        if state is None:
            return "not loaded: Triton refused it before loading it (see the server log)"
        return f"not loaded (state {state or 'none'}; see the server log)"

    def require(self, models: Sequence[str]) -> None:
        """Fail (``ServerStartError``) if any of ``models`` cannot answer: one that did not load at the
        start (named with Triton's reason), or one the server does not serve now."""
        from .client import TritonClient

        missing = {name: self.unavailable[name] for name in models if name in self.unavailable}
        with TritonClient(self._process.http_url, timeout=30) as client:
            ready = {m["name"] for m in client.repository_index() if m.get("state") == "READY"}
        for name in models:
            if name not in missing and name not in ready:
                missing[name] = ("not loaded now" if (self.repository / name).is_dir()
                                 else f"the repository holds no model {name!r}")
        if missing:
            raise ServerStartError(
                f"the Triton server for {self.repository} could not load "
                + "; ".join(f"{name!r}: {why}" for name, why in sorted(missing.items()))
            )

    def state(self, model: str) -> str | None:
        """The repository index's state of ``model`` (READY if any version is), None if it is not listed."""
        from .client import TritonClient

        with TritonClient(self._process.http_url, timeout=30) as client:
            states = {m["state"] for m in client.repository_index() if m["name"] == model}
        return "READY" if "READY" in states else next(iter(states), None)

    def learn_ensembles(self, client: TritonClient | None = None) -> None:
        """Which ensembles hold which models, so an ensemble whose step is reloading counts as not ready.

        Learnt ahead: while a model loads, Triton answers config queries only once the load is done.
        """
        from .client import TritonClient

        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(TritonClient(self._process.http_url, timeout=30))
            for entry in client.repository_index():
                name = entry["name"]
                if name not in self.ensemble_steps and entry["state"] == "READY":
                    with contextlib.suppress(PipelinesError):
                        scheduling = client.model_config(name).get("ensemble_scheduling") or {}
                        steps = scheduling.get("step", ())
                        self.ensemble_steps[name] = frozenset(step.get("model_name", "") for step in steps)

    def reload(self, model: str) -> None:
        """Load ``model`` afresh: a model whose stub died (its other instances go with it)."""
        from .client import TritonClient

        with TritonClient(self._process.http_url, timeout=max(self._process.startup_timeout, 60.0)) as client:
            self.learn_ensembles(client)  # models loaded since the start
            # Loading a model that is loaded and unchanged is a no-op in 2.51 (its dead stub
            # stays dead), so unload it first. That unload never finishes (it waits for the
            # dead stub), but once it has begun a load starts a fresh instance. Triton unloads
            # the ensembles that use the model, and loads them again with it.
            client.unload_model(model)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if all(m["state"] != "READY" for m in client.repository_index() if m["name"] == model):
                    break
                time.sleep(0.02)
            client.load_model(model)

    def settled(self) -> None:
        """Wait until no load or unload through this package is under way."""
        with self.changing:
            pass

    def serves(self, name: str) -> bool:
        """Whether the server was asked to serve ``name`` now: loaded since the start, or started
        with it (by name, or every model of the repository) and neither unloaded nor failed since."""
        if name in self.loaded_later:
            return self.loaded_later[name]
        if name in self.unavailable:
            return False
        arguments = self._process.arguments
        if arguments.load_models == ("*",) or arguments.model_control_mode != "explicit":
            return name in _model_folders(self.repository)
        return name in arguments.load_models

    def load_again(self) -> None:
        """Replay the loads and unloads made since the start (the arguments load the start's models)."""
        if not self.loaded_later:
            return
        from .client import TritonClient

        with TritonClient(self._process.http_url, timeout=max(self._process.startup_timeout, 60.0)) as client:
            for name, loaded in list(self.loaded_later.items()):
                try:
                    if loaded:
                        client.load_model(name)
                    else:
                        unload(client, name, wait=30.0)
                except PipelinesError as error:
                    self._process.log.note(
                        f"model {name!r}: {'loading' if loaded else 'unloading'} it again failed: {error}"
                    )


def unload(client: TritonClient, name: str, *, wait: float) -> None:
    """Unload model ``name``; Triton answers at once, so wait up to ``wait`` s until it has."""
    client.unload_model(name)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if "UNLOADING" not in {m["state"] for m in client.repository_index() if m["name"] == name}:
            return
        time.sleep(0.05)


def _model_folders(repository: Path) -> list[str]:
    """The repository's model folders as Triton sees them: hidden ones (a write's staging) are not models."""
    try:
        return [e.name for e in os.scandir(repository) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return []
