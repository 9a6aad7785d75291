"""Noticing a Python-backend stub that died, and reloading its model.

Triton 2.51 never restarts a stub that died (``kill -9``, a segfault in a step): the model
stays READY and every request fails with "Stub process '<instance>' is not healthy"
(docs/triton_server_failures.md). :class:`StubWatcher` holds a pidfd of every stub of one server, so a
stub's exit wakes it at once; a stub that exits while its model is still READY and no other
stub took its instance's place has died, and the watcher reloads the model through explicit
model control. Until the reload is done, the model counts as not ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cleanup import live_processes

__all__ = ["ServerHooks", "Stub", "StubWatcher", "dead_stub_instance", "model_of_instance", "server_stubs"]

log = logging.getLogger("pipelines.triton")

_STUB_BINARY = "triton_python_backend_stub"
# How the Python backend answers a request for an instance whose stub is gone.
_NOT_HEALTHY = re.compile(r"Stub process '([^']+)' is not healthy")
# Triton names an instance <model>_<index>, or <group>_<index> with a group named <model>_<index>.
_INSTANCE = re.compile(r"^(.+?)(?:_\d+){1,2}$")
# New stubs appear only when models load, and a load through this package rescans at once;
# look this often besides (a scan of /proc costs milliseconds, or tens of them on a busy machine).
_RESCAN_S = 15.0
# Errors of requests sent while a model reloaded may arrive a little after; they are still the reload's.
_RECENT_S = 10.0
# A reload swaps stubs: the new instance is up before the old one exits; a moment settles the swap.
_SWAP_GRACE_S = 0.05


@dataclass(frozen=True)
class Stub:
    """One stub process: which model instance it runs."""

    pid: int
    model: str
    instance: str


def server_stubs(pgid: int) -> list[Stub]:
    """The live stubs in a server's process group (the stub's command line names its model and instance)."""
    stubs = []
    for pid in live_processes(pgid=pgid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            # <stub> <repo>/<model>/<version>/model.py <shm region> <sizes...> <parent pid> <backend dir> <n> <instance> ...
            if len(argv) > 9 and argv[0].endswith(_STUB_BINARY):
                model = Path(argv[1]).parts[-3]
                instance = next((a for a in argv[2:] if a.startswith(model + "_") and _INSTANCE.match(a)), model)
                stubs.append(Stub(pid, model, instance))
    return stubs


_SLOT = re.compile(r"(?:_(\d+))?(?:_(\d+))?$")


def _slot(stub: Stub) -> tuple[str, str]:
    """A stub's place: its model and instance (group and index). A swapped-in stub takes the place
    of the one it replaces under another name at times ("m" at the start, "m_0_0" after a reload)."""
    found = _SLOT.fullmatch(stub.instance[len(stub.model):]) if stub.instance.startswith(stub.model) else None
    if found is None:  # an instance group of the user's own name
        return stub.model, stub.instance
    first, second = found.group(1), found.group(2)
    group, index = ("0", first or "0") if second is None else (first, second)
    return stub.model, f"{int(group)}_{int(index)}"


def dead_stub_instance(text: str) -> str | None:
    """The instance an error from the server says has an unhealthy stub, if it says so."""
    found = _NOT_HEALTHY.search(text)
    return found.group(1) if found else None


def model_of_instance(instance: str) -> str:
    """The model an instance name belongs to, read from the name (a model named like ``m_0`` is misread)."""
    found = _INSTANCE.match(instance)
    return found.group(1) if found else instance


@dataclass(frozen=True)
class ServerHooks:
    """What a :class:`StubWatcher` asks of the server it watches.

    ``state(model)``: the model's state in the repository index ("READY", ...). ``reload(model)``:
    load it again (explicit model control); None where the server cannot (poll mode): the model is
    then reported broken until the server stops. ``note(line)``: write to the server's log.
    ``prepare()``: run once the watcher starts. ``settled()``: return once no load or unload through
    the server's owner is under way (Triton swaps stubs until it returns). ``dying()``: whether the
    server is going down (its stubs end with it: none to reload).
    """

    state: Callable[[str], str | None]
    reload: Callable[[str], None] | None
    note: Callable[[str], None]
    prepare: Callable[[], None] | None = None
    settled: Callable[[], None] | None = None
    dying: Callable[[], bool] | None = None


class StubWatcher:
    """Watches one server's stubs; reloads the model of one that died, and says so (through
    :class:`ServerHooks`)."""

    def __init__(self, *, server_pid: int, hooks: ServerHooks) -> None:
        self._server_pid = server_pid
        self._hooks = hooks
        self._lock = threading.Lock()
        self._broken: dict[str, str] = {}  # model -> why
        self._restarts: list[tuple[str, float]] = []  # (model, seconds from death to reloaded)
        self._reloaded_at: dict[str, float] = {}
        self._models: dict[str, str] = {}  # instance -> model, from the stubs' command lines
        self._suspects: set[str] = set()  # instances a client reported unhealthy
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"stub-watcher-{server_pid}", daemon=True)

    def start(self) -> StubWatcher:
        self._thread.start()
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop watching; ``wait=False`` only tells the thread to end, and ``stop()`` must follow."""
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        if not wait:
            return
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def broken(self) -> dict[str, str]:
        """The models whose stub died and that are not yet reloaded, with why."""
        with self._lock:
            return dict(self._broken)

    def reloading(self) -> list[str]:
        """The models broken now, or reloaded in the last few seconds: a failed request names one of
        these when it was sent while the model reloaded."""
        now = time.monotonic()
        with self._lock:
            recent = {model for model, at in self._reloaded_at.items() if now - at < _RECENT_S}
            return sorted(self._broken.keys() | recent)

    @property
    def restarts(self) -> list[tuple[str, float]]:
        """Each reload so far: the model, and seconds from noticing its dead stub to its reload."""
        with self._lock:
            return list(self._restarts)

    def model_of(self, instance: str) -> str:
        """The model of a stub instance, as its command line said (its name alone can mislead)."""
        with self._lock:
            return self._models.get(instance) or model_of_instance(instance)

    def suspect(self, instance: str) -> None:
        """A client saw ``instance`` reported unhealthy: look now (its stub may not have been watched yet)."""
        with self._lock:
            self._suspects.add(instance)
        self.rescan()

    def rescan(self) -> None:
        """Look for new stubs now (a model was loaded)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"s")

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        if self._hooks.prepare is not None:
            with contextlib.suppress(Exception):  # only an early start on what a reload learns anyway
                self._hooks.prepare()
        try:
            server_fd = os.pidfd_open(self._server_pid)
        except OSError:
            return  # the server is gone already, or no pidfds here: nothing to watch
        watched: dict[int, tuple[int, Stub]] = {}  # fd -> (fd, stub)
        try:
            while not self._stopping:
                current = {stub.pid: stub for stub in server_stubs(self._server_pid)}
                with self._lock:
                    self._models.update({stub.instance: stub.model for stub in current.values()})
                known = {stub.pid for _, stub in watched.values()}
                for pid in current.keys() - known:
                    with contextlib.suppress(OSError):
                        fd = os.pidfd_open(pid)
                        watched[fd] = (fd, current[pid])
                poller = select.poll()
                poller.register(server_fd, select.POLLIN)
                poller.register(self._wake_read, select.POLLIN)
                for fd in watched:
                    poller.register(fd, select.POLLIN)
                events = poller.poll(_RESCAN_S * 1000)
                if self._stopping or any(fd == server_fd for fd, _ in events):
                    return
                if any(fd == self._wake_read for fd, _ in events):
                    with contextlib.suppress(OSError):
                        os.read(self._wake_read, 4096)
                exited = [watched.pop(fd)[1] for fd, _ in events if fd in watched]
                with self._lock:
                    suspects, self._suspects = self._suspects, set()
                alive = {stub.instance for _, stub in watched.values()}
                exited += [Stub(0, self.model_of(i), i) for i in suspects - alive - {s.instance for s in exited}]
                for fd in [fd for fd, _ in events if fd not in (server_fd, self._wake_read)]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if exited:
                    try:
                        self._examine(exited)
                    except Exception as exc:  # the watcher must outlive one failed look at the server
                        self._hooks.note(f"could not check stubs that exited ({exc!r}); watching on")
        finally:
            for fd in [server_fd, *watched]:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _examine(self, exited: list[Stub]) -> None:
        time.sleep(_SWAP_GRACE_S)
        if self._hooks.settled is not None:
            self._hooks.settled()  # a load or unload through this package swaps stubs until it returns
        if self._stopping or (self._hooks.dying is not None and self._hooks.dying()):
            return  # a server going down ends its stubs: not theirs to reload
        alive = {_slot(stub) for stub in server_stubs(self._server_pid)}
        for model in sorted({stub.model for stub in exited if _slot(stub) not in alive}):
            if self._hooks.state(model) != "READY":
                continue  # unloaded (or being unloaded) on purpose
            dead = ", ".join(
                f"{s.instance} (pid {s.pid})" if s.pid else f"{s.instance}, reported unhealthy"
                for s in exited
                if s.model == model
            )
            self._died(model, dead)

    def _died(self, model: str, dead: str) -> None:
        noticed = time.monotonic()
        if self._hooks.reload is None:
            why = f"its stub process died ({dead}); this server cannot reload it (model control mode poll)"
            with self._lock:
                self._broken[model] = why
            self._hooks.note(f"model '{model}': {why}; restart the server")
            return
        with self._lock:
            self._broken[model] = f"its stub process died ({dead}); the server is reloading it"
        self._hooks.note(f"model '{model}': its stub process died ({dead}); reloading the model")
        try:
            self._hooks.reload(model)
        except Exception as exc:  # the reload failed: say so, and leave the model marked broken
            with self._lock:
                self._broken[model] = f"its stub process died ({dead}) and reloading it failed: {exc}"
            self._hooks.note(f"model '{model}': reloading it after its stub died failed: {exc}")
            return
        took = time.monotonic() - noticed
        with self._lock:
            self._broken.pop(model, None)
            self._restarts.append((model, took))
            self._reloaded_at[model] = time.monotonic()
        self._hooks.note(f"model '{model}': reloaded in {took:.2f} s after its stub died; it answers again")
