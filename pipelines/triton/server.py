"""The embedded Triton server's lifecycle: start on free ports, wait until ready, stop.

:class:`TritonServer` runs the real ``tritonserver`` binary of the ``nvidia-pytriton`` wheel in its
own process group; on stop it leaves no process, shared-memory region or temporary directory behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PipelinesError, ServerDiedError, ServerError, ServerRestartingError, ServerStartError
from ..process_exit import describe_exit
from ..repository_files import leftover_staging, models_called
from .arguments import Ports, PythonBackendSettings, ServerArguments
from .cleanup import (
    REGISTRY,
    SHM_TAG,
    kill_server,
    shutdown_connections,
    sigint_deferred,
    signal_group,
    sweep_orphaned_shm,
)
from .crashes import Crash, CrashBudget, crash_reason
from .installation import TritonInstallation, backend_directory, find_installation
from .ports import choose_ports, health_ready, listens, taken_port
from .python_env import current_environment, probe_environment
from .stubs import StubWatcher, model_of_instance, server_stubs
from .supervisor import Supervisor

if TYPE_CHECKING:
    from .async_client import AsyncTritonClient
    from .client import TritonClient

__all__ = ["ModelsUnavailableWarning", "TritonServer", "describe_exit"]


class ModelsUnavailableWarning(UserWarning):
    """The server started, but some models of its repository failed to load."""


log = logging.getLogger("pipelines.triton")

_PORT_ATTEMPTS = 4
_ERROR_LINE = re.compile(r"E\d{4} |error:", re.IGNORECASE)
_UNLOAD_GRACE = 2.0  # the server polls its shutdown once a second; give it that long past its exit timeout
_STUBLESS_GRACE = 0.5  # after a stub died: how long no stub may be left before the server counts as done


class TritonServer:
    """A ``tritonserver`` process serving ``repository``; a context manager.

    Ports left as ``None`` are chosen free (and chosen again if another process takes
    one first). ``env`` adds variables to the server's environment. ``exit_timeout`` is
    how long the server may take to stop: to answer the requests in flight and to unload
    (finalize) its models. Past it, and a short grace, its whole process group is killed.
    Stopping first closes the clients it handed out and every connection this process
    holds to it, since Triton would otherwise spend its exit timeout waiting for them. ``python_env`` is the root
    of a virtual (or conda) environment the Python models run in instead of this one's; it
    needs ``numpy<2`` and whatever the models import, not ``pipelines``.

    ``restart_dead_stubs`` (default): a model whose Python stub process dies is reloaded
    (Triton 2.51 would keep it READY and failing); model control mode ``"none"`` is then
    served as ``"explicit"`` with every model loaded at start, which loads the same models.
    ``python_backend`` sets the Python backend's shared-memory sizes (:class:`PythonBackendSettings`).

    ``restart_on_crash`` (default): a server that dies on its own (Triton aborts, the OOM killer)
    is started again at once on the same ports, with the same models (those loaded and unloaded
    since the start too), up to three times in five minutes; :attr:`crashes` lists each death.
    Meanwhile calls fail fast with :class:`ServerRestartingError` (retry), and the clients
    already handed out work again once it is back. Past the budget, or with ``False``, calls
    fail with :class:`ServerDiedError` and :meth:`wait` returns.

    A model that fails to load (a step whose ``initialize()`` raises) does not keep the
    others from being served: the start warns (:class:`ModelsUnavailableWarning`) naming
    each such model with Triton's reason, and :attr:`unavailable` holds them. Requests to
    it fail; :meth:`require` fails at once for models a caller cannot do without.
    ``exit_on_error=True`` is Triton's own default: such a model fails the whole start.
    """

    def __init__(
        self,
        repository: str | os.PathLike[str],
        *,
        model_control_mode: str = "none",
        load_models: Sequence[str] = (),
        startup_timeout: float = 120.0,
        exit_timeout: int = 30,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        allow_grpc: bool = True,
        allow_metrics: bool = True,
        python_env: str | os.PathLike[str] | None = None,
        restart_dead_stubs: bool = True,
        python_backend: PythonBackendSettings | None = None,
        installation: TritonInstallation | None = None,
        exit_on_error: bool = False,
        restart_on_crash: bool = True,
    ) -> None:
        # Unique per server: the python backend names its regions <prefix><uuid>.
        self.shm_prefix = f"{SHM_TAG}-{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        if model_control_mode == "none" and restart_dead_stubs and not load_models:
            # Reloading a model needs explicit model control; loading "*" at start loads
            # exactly what mode "none" would.
            model_control_mode, load_models = "explicit", ("*",)
        self.arguments = ServerArguments(
            repository=Path(repository).resolve(),
            model_control_mode=model_control_mode,
            load_models=tuple(load_models),
            host=host,
            exit_timeout=int(exit_timeout),
            log_verbose=int(log_verbose),
            allow_grpc=allow_grpc,
            allow_metrics=allow_metrics,
            shm_region_prefix=self.shm_prefix,
            python_backend=python_backend or PythonBackendSettings(),
            extra=tuple(str(a) for a in extra_args),
            exit_on_error=exit_on_error,
        )
        self.startup_timeout = float(startup_timeout)
        self.env = dict(env or {})
        self.python_env = current_environment() if python_env is None else probe_environment(python_env)
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self._installation = installation
        self._ports: Ports | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._workdir: Path | None = None
        self._supervisor: Supervisor | None = None
        self.restart_dead_stubs = restart_dead_stubs
        self._watcher: StubWatcher | None = None
        self._ensemble_steps: dict[str, frozenset[str]] = {}
        self._log_path: Path | None = None
        self._stopped = False
        self.unavailable: dict[str, str] = {}  # models that failed to load at the start -> why
        self._reaped = False
        self._lock = threading.RLock()
        # A death nobody asked for, and what came of it (crashes.py).
        self.restart_on_crash = restart_on_crash
        self.crashes: list[Crash] = []
        self._crash_budget = CrashBudget()
        self._crash_lock = threading.Lock()
        self._restarting: Crash | None = None  # set from noticing a death until ready again
        self._classified = threading.Event()  # the exit of the current process has been looked at
        self._gone = threading.Event()  # exited for good: stopped, or dead and not started again
        self._gave_up = ""  # why the server was not started again, if it was not
        self._exit_code: int | None = None
        self._stopping = False
        self._launch_with: tuple[TritonInstallation, Path] | None = None
        self._loaded_later: dict[str, bool] = {}  # loads (True) and unloads since the start, to replay
        self._earlier_stub_restarts: list[tuple[str, float]] = []  # from before a restart
        self._generation = 0  # restarts after a crash, over the server's life: clients reconnect on a change
        # The clients handed out, closed when the server stops (weakly held: a client dropped is gone).
        self._clients: weakref.WeakSet[TritonClient | AsyncTritonClient] = weakref.WeakSet()

    # ---------------------------------------------------------------- arguments

    @property
    def repository(self) -> Path:
        return self.arguments.repository

    @property
    def host(self) -> str:
        return self.arguments.host

    @property
    def exit_timeout(self) -> int:
        return self.arguments.exit_timeout

    @property
    def model_control_mode(self) -> str:
        return self.arguments.model_control_mode

    # ---------------------------------------------------------------- addresses

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self._require_ports().http}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self._require_ports().grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self._require_ports().metrics}/metrics"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        return self._proc.pid

    @property
    def restarting(self) -> Crash | None:
        """The death the server is starting again after, while it does (see ``restart_on_crash``)."""
        return self._restarting

    @property
    def workdir(self) -> Path | None:
        """The server's temporary folder (its backend directory and log); removed when it stops."""
        return self._workdir

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc is not None and not self._stopped and self._proc.poll() is None

    @property
    def _client_host(self) -> str:
        # A server bound to every interface is reached locally through loopback.
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)

    def _require_ports(self) -> Ports:
        if self._ports is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        return self._ports

    def log_tail(self, n_lines: int = 50) -> str:
        """The last ``n_lines`` lines of the server's log ('' before it starts)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * max(n_lines, 1)))  # enough for typical lines, without reading a large log
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def _failure_log(self, n_lines: int = 50) -> str:
        """The part of the log that says why start-up failed: error lines first, then the tail."""
        if self._log_path is None or not self._log_path.exists():
            return "--- log tail ---\n(no log)"
        lines = self._log_path.read_text("utf-8", "replace").splitlines()
        usage = next((i for i, line in enumerate(lines) if line.startswith("Usage: tritonserver")), None)
        if usage is not None:  # a bad argument: the reason precedes a long usage text that says nothing more
            return "--- log ---\n" + "\n".join(lines[:usage])
        tail = lines[-n_lines:]
        errors = [line for line in lines[:-n_lines] if _ERROR_LINE.match(line)][-10:]
        head = "--- errors in the log ---\n" + "\n".join(errors) + "\n" if errors else ""
        return head + "--- log tail ---\n" + "\n".join(tail)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> TritonServer:
        """Start the server and return once it answers ready; raise :class:`ServerStartError` otherwise."""
        with self._lock:
            if self._proc is not None and not self._stopped:
                raise ServerError(f"the Triton server for {self.repository} is already started (pid {self._proc.pid})")
            self._stopped = self._reaped = self._stopping = False
            self._restarting, self._gave_up, self._exit_code = None, "", None
            self._gone.clear()
            self._crash_budget = CrashBudget()
            self.crashes, self._loaded_later, self._earlier_stub_restarts = [], {}, []
            if not self.repository.is_dir():
                raise ServerStartError(f"model repository {self.repository} is not a directory; write one first")
            installation = self._installation or find_installation(self.python_env.python_version)
            sweep_orphaned_shm()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{SHM_TAG}-"))
            REGISTRY.add(self)
            try:
                self._supervisor = Supervisor(workdir=self._workdir, shm_prefix=self.shm_prefix)
                backends = backend_directory(installation, self._workdir / "backends")
                self._launch_with = (installation, backends)
                deadline = time.monotonic() + self.startup_timeout
                for attempt in range(1, _PORT_ATTEMPTS + 1):
                    ports = choose_ports(self._fixed_ports, self.host)
                    self._launch(installation, backends, ports, self._workdir / f"tritonserver.{attempt}.log")
                    try:
                        self._wait_ready(deadline)
                        self._find_unavailable()
                        self._watch_stubs()
                        self._watch_process()
                        return self
                    except _PortTaken:
                        kill_server(self._proc, self._pgid, self.shm_prefix)
                        if attempt == _PORT_ATTEMPTS:
                            raise ServerStartError(
                                f"the Triton server for {self.repository} could not bind its ports after "
                                f"{attempt} attempts ({self._ports}); pass free ports or leave them None\n"
                                f"--- log tail ---\n{self.log_tail()}"
                            ) from None
                raise AssertionError("unreachable")
            except BaseException:
                self.stop()
                raise

    def _launch(self, installation: TritonInstallation, backends: Path, ports: Ports, log_path: Path) -> None:
        assert self._workdir is not None
        self._ports = ports
        args = self.arguments.command(
            binary=installation.binary, backend_directory=backends, ports=self._ports, repository=self._served_path()
        )
        env = {**self.arguments.python_backend.environment(), **os.environ, **self.env}
        # The stub's embedded interpreter finds its site-packages through the python on PATH;
        # the stub (unlike the server binary) has no RPATH to the wheel's libraries.
        env["PATH"] = os.pathsep.join(filter(None, [str(self.python_env.bin), env.get("PATH")]))
        if installation.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(installation.libs), env.get("LD_LIBRARY_PATH")]))
        self._log_path = log_path
        # A file, never a pipe that fills up and stalls the server; appended to, so that our
        # own notes (a stub reloaded) can go in the same log without overwriting its lines.
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._workdir,
                start_new_session=True,
            )
        self._pgid = self._proc.pid  # start_new_session makes it the leader of its own group
        self._reaped = False
        self._classified.clear()
        assert self._supervisor is not None
        self._supervisor.watch(self._pgid)

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        ports = self._require_ports()
        while True:
            code = self._proc.poll()
            if code is not None:
                taken = taken_port(self.log_tail(200))
                if taken is not None and taken not in self._fixed_ports:
                    raise _PortTaken
                why = f"port {taken} is already in use; pass another port or leave it None" if taken else ""
                left = leftover_staging(self.repository)
                if left and not why:  # Triton tries to load them as models, and fails on them
                    why = (f"the repository holds {', '.join(map(repr, left))}, the staging of a write that was "
                           "killed or could not remove it; the next write or removal into the repository deletes "
                           "it, or remove it by hand (as a user who may)")
                raise ServerStartError(
                    f"the Triton server for {self.repository} exited during start-up ({describe_exit(code)}); "
                    f"{why or 'its log says why (fix the model or argument it names)'}\n{self._failure_log()}"
                )
            # Another server may answer on our ports until ours fails to bind them (it logs
            # "Started" before it binds), so ready means: healthy, and the ports are its own.
            if health_ready(self._client_host, ports.http) and all(
                listens(self._proc.pid, port) for port in self.arguments.listening_ports(ports)
            ):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the Triton server for {self.repository} was not ready after {self.startup_timeout:g} s; "
                    f"raise startup_timeout if its models are slow to load\n--- log tail ---\n{self.log_tail()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)

    def stop(self) -> None:
        """Stop the server (gracefully, then by force) and remove everything it left. Safe to call twice."""
        self._stopping = True  # before the lock: a restart under way gives up at its next step
        with sigint_deferred(), self._lock:
            proc = self._proc
            stub_died = False
            try:
                if self._watcher is not None:
                    stub_died = bool(self._watcher.restarts or self._watcher.broken())
                    self._watcher.stop()  # stubs exit now on purpose
                    self._watcher = None
                if proc is not None and proc.poll() is None:
                    self._close_connections()
                    signal_group(self._pgid, signal.SIGTERM)
                    self._wait_exit(proc, stub_died)
            finally:
                kill_server(self._proc, self._pgid, self.shm_prefix)
                if self._workdir is not None:
                    shutil.rmtree(self._workdir, ignore_errors=True)
                if self._supervisor is not None:
                    self._supervisor.release()
                    self._supervisor = None
                self._stopped = True
                self._restarting = None
                if proc is not None and not self._gone.is_set():
                    self._exit_code = proc.poll()
                self._gone.set()
                REGISTRY.discard(self)

    # ---------------------------------------------------------------- dead stubs

    def _watch_stubs(self) -> None:
        if not self.restart_dead_stubs or self._proc is None:
            return
        reload = self._reload_model if self.model_control_mode == "explicit" else None
        self._watcher = StubWatcher(
            server_pid=self._proc.pid,
            state=self._model_state,
            reload=reload,
            note=self._note,
            prepare=self._learn_ensembles,
        ).start()

    # ---------------------------------------------------------------- a server that dies

    def _watch_process(self) -> None:
        """Notice at once when the server process ends (a thread blocked on its exit)."""
        proc = self._proc
        assert proc is not None
        threading.Thread(target=self._after_exit, args=(proc,), name=f"triton-exit-{proc.pid}", daemon=True).start()

    def _after_exit(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self._crash_lock:
            if self._stopping or proc is not self._proc:
                self._classified.set()
                return  # stopped on purpose, or replaced already
            crash = Crash(proc.pid, describe_exit(code), crash_reason(self.log_tail(80)))
            if self.restart_on_crash and self._crash_budget.spend():
                self._restarting = crash
            else:
                self._exit_code = code
                if self.restart_on_crash:
                    self._gave_up = (f"it had been started again {self._crash_budget.restarts} times within "
                                     f"{self._crash_budget.window_s:g} s, so it is not started again")
                self.crashes.append(crash)
                self._gone.set()
            self._classified.set()
        if self._restarting is None:
            with self._lock:
                if not (self._reaped or self._stopping):  # its stubs and shared memory, now rather than at the next call
                    kill_server(proc, self._pgid, self.shm_prefix)
                    self._reaped = True
            if self.restart_on_crash:
                self._note(f"the server ({crash.describe()}) died on its own; {self._gave_up}")
            return
        self._note(f"the server ({crash.describe()}) died on its own; starting it again on the same ports, "
                   "with the same models")
        self._restart(proc, crash, code)

    def _restart(self, dead: subprocess.Popen[bytes], crash: Crash, code: int) -> None:
        """Start the server again where it was: the same ports, arguments, log and loaded models."""
        started = time.monotonic()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # its stubs die with the server: nothing of theirs to reload
            watcher.stop(wait=False)
        try:
            with self._lock:
                if self._stopping:
                    return
                # Its stubs and shared memory go first. The stubs hold the dead server's listening
                # sockets (inherited), so until they die a call to its ports hangs instead of failing:
                # a reload the watcher has under way among them.
                kill_server(dead, self._pgid, self.shm_prefix)
            if watcher is not None:
                watcher.stop()
                self._earlier_stub_restarts += watcher.restarts
            with self._lock:
                if self._stopping:
                    return
                assert self._launch_with is not None and self._ports is not None and self._log_path is not None
                self._launch(*self._launch_with, self._ports, self._log_path)
            self._wait_ready(started + self.startup_timeout)
            self._find_unavailable()
            self._load_again()
            with self._lock:
                if self._stopping:
                    return
                self._watch_stubs()
                self.crashes.append(Crash(crash.pid, crash.exit, crash.why, time.monotonic() - started))
                self._generation += 1  # before a call can pass: its client reconnects first
                self._restarting = None
                self._watch_process()
            self._note(f"started again {time.monotonic() - started:.2f} s after it died; it answers again")
        except Exception as error:  # noqa: BLE001 - whatever failed, the server stays down and says why
            with self._lock:
                if self._stopping:
                    return
                kill_server(self._proc, self._pgid, self.shm_prefix)
                self._reaped = True
                said = "a port it had was taken meanwhile" if isinstance(error, _PortTaken) else str(error)
                self._gave_up = f"starting it again failed: {said.splitlines()[0]}"
                self.crashes.append(crash)
                self._exit_code = code
                self._restarting = None
                self._gone.set()
            self._note(self._gave_up)

    def _load_again(self) -> None:
        """Replay the loads and unloads made since the start (the arguments load the start's models)."""
        if not self._loaded_later:
            return
        from .client import TritonClient

        with TritonClient(self.http_url, timeout=max(self.startup_timeout, 60.0)) as client:
            for name, loaded in list(self._loaded_later.items()):
                try:
                    if loaded:
                        client.load_model(name)
                    else:
                        _unload(client, name, wait=30.0)
                except PipelinesError as error:
                    self._note(f"model {name!r}: {'loading' if loaded else 'unloading'} it again failed: {error}")

    def _restarting_error(self, crash: Crash) -> ServerRestartingError:
        return ServerRestartingError(
            f"the Triton server for {self.repository} (pid {crash.pid}) died while in use "
            f"({crash.exit}{': ' + crash.why if crash.why else ''}); it is starting again on the same ports with the same models: retry in a few "
            f"seconds (its log: {self._log_path})"
        )

    def _served_path(self) -> Path:
        """The repository's path as Triton is given it: its own, or a link to it in the work folder
        where its own would break every Python model. The Python backend of 2.51 passes a model's
        path to its stub in a command line that the stub splits at spaces ("Expected 9 arguments,
        found 4", and the start waits out its timeout), and the stub reads it as ASCII."""
        assert self._workdir is not None
        path = str(self.repository)
        if path.isascii() and not any(c.isspace() for c in path):
            return self.repository
        link = self._workdir / "repository"
        if not link.is_symlink():
            link.symlink_to(self.repository, target_is_directory=True)
        return link

    def _find_unavailable(self) -> None:
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

        with TritonClient(self.http_url, timeout=30) as client:
            index = client.repository_index()
        states = {m["name"]: m for m in index}
        everything = self.arguments.load_models == ("*",) or self.arguments.model_control_mode != "explicit"
        asked = (set(states) | set(_model_folders(self.repository))) if everything else set(self.arguments.load_models)
        said = _load_failures_in_log(self._log_path)
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
        with TritonClient(self.http_url, timeout=30) as client:
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

    def _model_state(self, model: str) -> str | None:
        from .client import TritonClient

        with TritonClient(self.http_url, timeout=30) as client:
            states = {m["state"] for m in client.repository_index() if m["name"] == model}
        return "READY" if "READY" in states else next(iter(states), None)

    def _learn_ensembles(self, client: TritonClient | None = None) -> None:
        """Which ensembles hold which models, so an ensemble whose step is reloading counts as not ready.

        Learnt ahead: while a model loads, Triton answers config queries only once the load is done.
        """
        from .client import TritonClient

        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(TritonClient(self.http_url, timeout=30))
            for entry in client.repository_index():
                name = entry["name"]
                if name not in self._ensemble_steps and entry["state"] == "READY":
                    with contextlib.suppress(PipelinesError):
                        scheduling = client.model_config(name).get("ensemble_scheduling") or {}
                        steps = scheduling.get("step", ())
                        self._ensemble_steps[name] = frozenset(step.get("model_name", "") for step in steps)

    def _reload_model(self, model: str) -> None:
        from .client import TritonClient

        with TritonClient(self.http_url, timeout=max(self.startup_timeout, 60.0)) as client:
            self._learn_ensembles(client)  # models loaded since the start
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

    def _note(self, line: str) -> None:
        """Say something in the server's log (and Python's logging), in Triton's line format."""
        log.warning("Triton server for %s: %s", self.repository, line)
        if self._log_path is None:
            return
        now = time.time()
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
        with contextlib.suppress(OSError), open(self._log_path, "a") as f:
            f.write(f"W{stamp} {os.getpid()} pipelines.triton] {line}\n")

    def unhealthy_models(self) -> dict[str, str]:
        """Models whose stub died and that are not reloaded yet (Triton still says READY), with why."""
        return self._watcher.broken() if self._watcher is not None else {}

    def reloading_models(self) -> dict[str, str]:
        """Each model failing now, or a moment ago, because a stub died (the step and the ensembles
        that use it): the model whose stub died."""
        if self._watcher is None:
            return {}
        dead = self._watcher.reloading()
        found = {name: name for name in dead}
        for ensemble, steps in self._ensemble_steps.items():
            for step in sorted(steps & set(dead)):
                found.setdefault(ensemble, step)
        return found

    @property
    def stub_restarts(self) -> list[tuple[str, float]]:
        """Each model reloaded after its stub died: the model, and seconds from noticing to reloaded."""
        now = self._watcher.restarts if self._watcher is not None else []
        return self._earlier_stub_restarts + now

    def broken_reason(self, model: str | None = None) -> str | None:
        """Why ``model`` (None: any model) cannot answer although Triton says ready; None if it can.

        An ensemble is broken while one of its steps is (a BLS model, whose callees are not
        in its config, is not: its requests fail with the step's :class:`StubDiedError`).
        """
        broken = self.unhealthy_models()
        if not broken:
            return None
        if model is None:
            name, why = next(iter(broken.items()))
            return f"model {name!r}: {why}"
        if model in broken:
            return f"model {model!r}: {broken[model]}"
        for step in sorted(self._ensemble_steps.get(model, frozenset()) & broken.keys()):
            return f"its step model {step!r}: {broken[step]}"
        return None

    def _close_connections(self) -> None:
        for client in list(self._clients):
            with contextlib.suppress(Exception):  # a client broken already is as good as closed
                client.close_from_any_thread()
        if self._ports is not None:
            shutdown_connections({self._ports.http, self._ports.grpc})

    def _wait_exit(self, proc: subprocess.Popen[bytes], stub_died: bool) -> None:
        """Wait for the server to exit, up to its exit timeout and a grace.

        The unload of a model whose stub died never finishes, and holds Triton for its whole
        exit timeout. So once a stub has died, the server is done as soon as no stub is left:
        every model it could finalize is finalized by then.
        """
        deadline = time.monotonic() + self.exit_timeout + _UNLOAD_GRACE
        stubless_since: float | None = None
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
                return
            if stub_died:
                if server_stubs(proc.pid):
                    stubless_since = None
                elif stubless_since is None:
                    stubless_since = time.monotonic()
                elif time.monotonic() - stubless_since > _STUBLESS_GRACE:
                    return

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until the server has exited for good: stopped, or dead and not started again (see
        ``restart_on_crash``). Its exit code, or None past ``timeout``."""
        if self._proc is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        if not self._gone.wait(timeout):
            return None
        return self._exit_code

    # ---------------------------------------------------------------- use

    def check_alive(self) -> None:
        """Raise :class:`ServerDiedError` unless the server process is running
        (:class:`ServerRestartingError` while it starts again after dying on its own)."""
        proc = self._proc
        if proc is None or self._stopped:
            raise ServerDiedError(
                f"the Triton server for {self.repository} is "
                f"{'stopped' if self._stopped else 'not started'}; start it again (start() or 'with')"
            )
        crash = self._restarting
        if crash is None:
            if proc.poll() is None:
                return
            self._classified.wait(1.0)  # its exit is being looked at this very moment
            crash = self._restarting
        if crash is not None:
            raise self._restarting_error(crash)
        code = proc.poll()
        if code is None:
            return
        with self._lock:
            if not self._reaped:
                kill_server(self._proc, self._pgid, self.shm_prefix)  # its stubs and shared memory must go too
                self._reaped = True
        why = f"; {self._gave_up}" if self._gave_up else ""
        raise ServerDiedError(
            f"the Triton server for {self.repository} (pid {proc.pid}) died while in use "
            f"({describe_exit(code)}){why}; start a new TritonServer\n--- log tail ---\n{self.log_tail(20)}"
        )

    def _wait_dead(self, timeout: float) -> bool:
        """Whether the process has exited, waiting up to ``timeout`` for a dying one to finish."""
        if self._proc is None:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout)
        return self._proc.poll() is not None

    def client(self, protocol: str = "http", *, timeout: float | None = None) -> TritonClient:
        """A blocking client of this server whose calls fail fast with :class:`ServerDiedError` if it dies."""
        from .client import TritonClient

        url = self.http_url if protocol == "http" else self.grpc_url
        client = TritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self))
        self._clients.add(client)
        return client

    def async_client(self, protocol: str = "http", *, timeout: float | None = None) -> AsyncTritonClient:
        """An asyncio client of this server, failing fast like :meth:`client`."""
        from .async_client import AsyncTritonClient

        url = self.http_url if protocol == "http" else self.grpc_url
        client = AsyncTritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self))
        self._clients.add(client)
        return client

    def load_model(self, name: str) -> None:
        """Load (or reload) model ``name``; needs ``model_control_mode='explicit'``."""
        with self.client() as client:
            client.load_model(name)
        self._loaded_later.pop(name, None)  # replayed in the order of the last call
        self._loaded_later[name] = True
        if self._watcher is not None:
            self._watcher.rescan()  # watch the new stubs

    def unload_model(self, name: str, *, wait: float = 30.0) -> None:
        """Unload model ``name``; Triton answers at once, so wait up to ``wait`` s until it has."""
        with self.client() as client:
            _unload(client, name, wait=wait)
        self._loaded_later.pop(name, None)
        self._loaded_later[name] = False

    def models(self) -> list[dict]:
        """The repository index: each model's name, version, state and reason.

        A model whose stub died, and an ensemble that uses it, are not READY (Triton itself would
        still say READY) and give the reason until it is reloaded.
        """
        with self.client() as client:
            index = client.repository_index()
        for entry in index:
            why = self.broken_reason(entry["name"])
            if why is not None:  # Triton's state while it reloads (LOADING...), or UNAVAILABLE for its READY
                entry.update(state="UNAVAILABLE" if entry["state"] == "READY" else entry["state"], reason=why)
        return index

    def ready(self, model: str | None = None) -> bool:
        """Whether the server (or ``model``) is ready; a model whose stub died is not, until reloaded."""
        with self.client() as client:
            return client.ready(model)

    def __repr__(self) -> str:
        state = f"pid {self._proc.pid}, http {self.http_url}" if self.running else "not running"
        return f"TritonServer({str(self.repository)!r}, {state})"


class _Liveness:
    """What a client of an owned server calls to tell a dead server from a slow one."""

    def __init__(self, server: TritonServer) -> None:
        self._server = server

    def check(self) -> None:
        self._server.check_alive()

    def check_after_failure(self) -> None:
        # A connection error while the process is being killed comes just before its exit.
        self._server._wait_dead(0.5)
        self._server.check_alive()

    def stub_died(self, instance: str) -> bool:
        watcher = self._server._watcher
        if watcher is None:
            return False
        watcher.suspect(instance)
        return self._server.model_control_mode == "explicit"

    def broken(self, model: str | None) -> str | None:
        return self._server.broken_reason(model)

    def model_of(self, instance: str) -> str:
        watcher = self._server._watcher
        return watcher.model_of(instance) if watcher is not None else model_of_instance(instance)

    def reloading_models(self) -> dict[str, str]:
        return self._server.reloading_models()

    def unavailable(self) -> dict[str, str]:
        return self._server.unavailable

    def generation(self) -> int:
        return self._server._generation


class _PortTaken(Exception):
    """Another process bound one of the chosen ports first; choose again."""


# Triton's log lines for a model it could not load, or refused before loading (2.51 wording).
_LOAD_FAILURE = re.compile(
    r"(?:failed to (?:load|poll) model|Poll failed for model directory|failed to load) '(?P<name>[^']+)'"
    r"(?: version \d+)?: (?P<why>.*?)\"?$"
)


def _load_failures_in_log(log: Path | None) -> dict[str, str]:
    """Each model the server's log says failed to load, with the log's reason (the first line)."""
    try:
        text = log.read_text("utf-8", "replace") if log is not None else ""
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _LOAD_FAILURE.search(line) if _ERROR_LINE.match(line) else None
        if match is not None:
            found.setdefault(match["name"], match["why"].strip())
    return found


def _unload(client: TritonClient, name: str, *, wait: float) -> None:
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


