"""The embedded Triton server: start on free ports, wait until ready, serve, stop.

:class:`TritonServer` is a facade over its parts: the process (launch.py), its models
(model_state.py), its recovery from dead stubs and crashes (recovery.py) and its log (logs.py).
On stop it leaves no process, shared-memory region or temporary directory behind.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PipelinesError, ServerError, ServerStartError
from ..process_exit import describe_exit
from .arguments import PythonBackendSettings, ServerArguments
from .cleanup import REGISTRY, SHM_TAG, shutdown_connections, sigint_deferred, sweep_orphaned_shm
from .crashes import Crash
from .installation import TritonInstallation, find_installation
from .launch import STUB_LOCK_LOST, PortTaken, ServerProcess, StubLockLost
from .model_state import ModelState, ModelsUnavailableWarning, unload
from .ports import choose_ports
from .python_env import current_environment, probe_environment
from .recovery import Recovery
from .stand_ins import StandIn
from .stubs import model_of_instance

if TYPE_CHECKING:
    from .async_client import AsyncTritonClient
    from .client import TritonClient

__all__ = ["ModelsUnavailableWarning", "TritonServer", "describe_exit"]

_PORT_ATTEMPTS = 4


class _Held:
    """An attribute of the server that one of its parts holds (read and written there)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, server: object, owner: type | None = None) -> Any:
        return self if server is None else getattr(getattr(server, self.part), self.name)

    def __set__(self, server: object, value: Any) -> None:
        setattr(getattr(server, self.part), self.name, value)


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

    ``stand_ins`` (default): this Triton has only the Python backend, so a model whose config
    names the ``onnxruntime`` backend is served by a labelled Python stand-in that runs its ONNX
    file with onnxruntime (``pip install 'pipelines[onnx]'``), and the rest of its pipeline can be
    tested and measured. The repository itself is left as written for a full Triton: the server
    is given a copy of it made of links, with each stand-in in place of its model. The start says
    so in the log and in Python's logging; :attr:`stand_ins` lists them. ``False``: such models
    fail to load, as on any Triton without the backend.
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
        stand_ins: bool = True,
    ) -> None:
        # Unique per server: the python backend names its regions <prefix><uuid>.
        self.shm_prefix = f"{SHM_TAG}-{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        if model_control_mode == "none" and restart_dead_stubs and not load_models:
            # Reloading a model needs explicit model control; loading "*" at start loads
            # exactly what mode "none" would.
            model_control_mode, load_models = "explicit", ("*",)
        arguments = ServerArguments(
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
        self._process = ServerProcess(
            arguments,
            env=dict(env or {}),
            python_env=current_environment() if python_env is None else probe_environment(python_env),
            startup_timeout=float(startup_timeout),
            fixed_ports=(http_port, grpc_port, metrics_port),
            stand_ins=stand_ins,
        )
        self._log = self._process.log
        self._installation = installation
        self._models = ModelState(self._process)
        self._recovery = Recovery(
            self._process, self._models, restart_dead_stubs=restart_dead_stubs, restart_on_crash=restart_on_crash
        )
        # The clients handed out, closed when the server stops (weakly held: a client dropped is gone).
        self._clients: weakref.WeakSet[TritonClient | AsyncTritonClient] = weakref.WeakSet()

    # ---------------------------------------------------------------- arguments

    arguments = _Held("_process")
    env = _Held("_process")
    python_env = _Held("_process")
    startup_timeout = _Held("_process")
    restart_dead_stubs = _Held("_recovery")
    restart_on_crash = _Held("_recovery")
    #: Models that failed to load at the start -> why.
    unavailable = _Held("_models")
    #: Each death of the server nobody asked for (see ``restart_on_crash``).
    crashes = _Held("_recovery")

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
        return self._process.http_url

    @property
    def grpc_url(self) -> str:
        return self._process.grpc_url

    @property
    def metrics_url(self) -> str:
        return self._process.metrics_url

    @property
    def pid(self) -> int:
        if self._process.proc is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        return self._process.proc.pid

    @property
    def restarting(self) -> Crash | None:
        """The death the server is starting again after, while it does (see ``restart_on_crash``)."""
        return self._recovery.restarting

    @property
    def stand_ins(self) -> dict[str, StandIn]:
        """The models served by a stand-in (see ``stand_ins``): name -> what stands in, and why."""
        served = self._process.served
        return dict(served.stand_ins) if served is not None else {}

    @property
    def workdir(self) -> Path | None:
        """The server's temporary folder (its backend directory and log); removed when it stops."""
        return self._process.workdir

    @property
    def log_path(self) -> Path | None:
        return self._log.path

    @property
    def running(self) -> bool:
        proc = self._process.proc
        return proc is not None and not self._process.stopped and proc.poll() is None

    def log_tail(self, n_lines: int = 50) -> str:
        """The last ``n_lines`` lines of the server's log ('' before it starts)."""
        return self._log.tail(n_lines)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> TritonServer:
        """Start the server and return once it answers ready; raise :class:`ServerStartError` otherwise."""
        process = self._process
        with process.lock:
            if process.proc is not None and not process.stopped:
                raise ServerError(f"the Triton server for {self.repository} is already started (pid {process.proc.pid})")
            process.stopped = process.reaped = False
            self._recovery.reset()
            self._models.loaded_later = {}
            if not self.repository.is_dir():
                raise ServerStartError(f"model repository {self.repository} is not a directory; write one first")
            installation = self._installation or find_installation(self.python_env.python_version)
            sweep_orphaned_shm()
            workdir = process.make_workdir()
            REGISTRY.add(self)
            try:
                process.prepare(installation)
                deadline = time.monotonic() + self.startup_timeout
                for attempt in range(1, _PORT_ATTEMPTS + 1):
                    process.launch(choose_ports(process.fixed_ports, self.host), workdir / f"tritonserver.{attempt}.log")
                    self._recovery.classified.clear()
                    try:
                        process.wait_ready(deadline)
                        self._models.find_unavailable()
                        self._recovery.watch_stubs()
                        self._recovery.watch_process()
                        return self
                    except PortTaken:
                        process.kill()
                        if attempt == _PORT_ATTEMPTS:
                            raise ServerStartError(
                                f"the Triton server for {self.repository} could not bind its ports after "
                                f"{attempt} attempts ({process.ports}); pass free ports or leave them None\n"
                                f"--- log tail ---\n{self.log_tail()}"
                            ) from None
                    except StubLockLost:
                        # A starved machine's transient (docs/triton_server_failures.md): a fresh start loads.
                        process.kill()
                        sweep_orphaned_shm()
                        if attempt == _PORT_ATTEMPTS:
                            raise ServerStartError(
                                f"the Triton server for {self.repository} aborted during start-up {attempt} times "
                                f"on a stub's shared-memory lock ({STUB_LOCK_LOST}); the machine may be too busy "
                                f"to load {self.repository}'s models: retry when it is quieter\n"
                                f"--- log tail ---\n{self.log_tail()}"
                            ) from None
                raise AssertionError("unreachable")
            except BaseException:
                self.stop()
                raise

    def stop(self) -> None:
        """Stop the server (gracefully, then by force) and remove everything it left. Safe to call twice."""
        process, recovery = self._process, self._recovery
        recovery.stopping = True  # before the lock: a restart under way gives up at its next step
        with sigint_deferred(), process.lock:
            proc = process.proc
            try:
                stub_died = recovery.stop_watching()
                if proc is not None and proc.poll() is None:
                    self._close_connections()
                    process.terminate()
                    process.wait_exit(proc, stub_died)
            finally:
                process.remove()
                process.stopped = True
                recovery.restarting = None
                if proc is not None and not recovery.gone.is_set():
                    recovery.exit_code = proc.poll()
                recovery.gone.set()
                REGISTRY.discard(self)

    def _close_connections(self) -> None:
        for client in list(self._clients):
            with contextlib.suppress(Exception):  # a client broken already is as good as closed
                client.close_from_any_thread()
        if self._process.ports is not None:
            shutdown_connections({self._process.ports.http, self._process.ports.grpc})

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until the server has exited for good: stopped, or dead and not started again (see
        ``restart_on_crash``). Its exit code, or None past ``timeout``."""
        if self._process.proc is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        if not self._recovery.gone.wait(timeout):
            return None
        return self._recovery.exit_code

    # ---------------------------------------------------------------- dead stubs

    def unhealthy_models(self) -> dict[str, str]:
        """Models whose stub died and that are not reloaded yet (Triton still says READY), with why."""
        return self._recovery.unhealthy_models()

    def reloading_models(self) -> dict[str, str]:
        """Each model failing now, or a moment ago, because a stub died (the step and the ensembles
        that use it): the model whose stub died."""
        return self._recovery.reloading_models()

    @property
    def stub_restarts(self) -> list[tuple[str, float]]:
        """Each model reloaded after its stub died: the model, and seconds from noticing to reloaded."""
        return self._recovery.stub_restarts

    def broken_reason(self, model: str | None = None) -> str | None:
        """Why ``model`` (None: any model) cannot answer although Triton says ready; None if it can.

        An ensemble is broken while one of its steps is (a BLS model, whose callees are not
        in its config, is not: its requests fail with the step's :class:`StubDiedError`).
        """
        return self._recovery.broken_reason(model)

    # ---------------------------------------------------------------- use

    def check_alive(self) -> None:
        """Raise :class:`ServerDiedError` unless the server process is running
        (:class:`ServerRestartingError` while it starts again after dying on its own)."""
        self._recovery.check_alive()

    def client(self, protocol: str = "http", *, timeout: float | None = None) -> TritonClient:
        """A blocking client of this server whose calls fail fast with :class:`ServerDiedError` if it dies."""
        from .client import TritonClient

        url = self.http_url if protocol == "http" else self.grpc_url
        client = TritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self))
        self._clients.add(client)
        return client

    def async_client(
        self, protocol: str = "http", *, timeout: float | None = None, compression: str | None = None
    ) -> AsyncTritonClient:
        """An asyncio client of this server, failing fast like :meth:`client` (``compression``: see
        :class:`AsyncTritonClient`)."""
        from .async_client import AsyncTritonClient

        url = self.http_url if protocol == "http" else self.grpc_url
        client = AsyncTritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self), compression=compression)
        self._clients.add(client)
        return client

    # ---------------------------------------------------------------- models

    def require(self, models: Sequence[str]) -> None:
        """Fail (``ServerStartError``) if any of ``models`` cannot answer: one that did not load at the
        start (named with Triton's reason), or one the server does not serve now."""
        self._models.require(models)

    def load_model(self, name: str) -> None:
        """Load (or reload) model ``name``; needs ``model_control_mode='explicit'``."""
        if self._process.served is not None:  # its folder as it is now: a link, or a stand-in written again
            self._process.served.refresh(name)
        with self._models.changing, self.client() as client:
            client.load_model(name)
        self._models.remember(name, loaded=True)
        self._recovery.rescan()  # watch the new stubs

    def unload_model(self, name: str, *, wait: float = 30.0) -> None:
        """Unload model ``name``; Triton answers at once, so wait up to ``wait`` s until it has."""
        with self._models.changing, self.client() as client:
            unload(client, name, wait=wait)
        self._models.remember(name, loaded=False)

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
        state = f"pid {self.pid}, http {self.http_url}" if self.running else "not running"
        return f"TritonServer({str(self.repository)!r}, {state})"


class _Liveness:
    """What a client of an owned server calls to tell a dead server from a slow one."""

    def __init__(self, server: TritonServer) -> None:
        self._server = server

    def check(self) -> None:
        self._server.check_alive()

    def check_after_failure(self) -> None:
        # A connection error while the process is being killed comes just before its exit.
        self._server._process.wait_dead(0.5)
        self._server.check_alive()

    def stub_died(self, instance: str) -> bool:
        watcher = self._server._recovery.watcher
        if watcher is None:
            return False
        watcher.suspect(instance)
        return self._server.model_control_mode == "explicit"

    def broken(self, model: str | None) -> str | None:
        return self._server.broken_reason(model)

    def model_of(self, instance: str) -> str:
        watcher = self._server._recovery.watcher
        return watcher.model_of(instance) if watcher is not None else model_of_instance(instance)

    def reloading_models(self) -> dict[str, str]:
        return self._server.reloading_models()

    def unavailable(self) -> dict[str, str]:
        return self._server.unavailable

    def generation(self) -> int:
        return self._server._recovery.generation

    def restarted_since(self, generation: int) -> PipelinesError | None:
        return self._server._recovery.restarted_since(generation)

    def check_serving(self, model: str) -> None:
        # Triton answers "unknown model" for every model while it tears itself down after a fatal
        # signal (its handler exits, which unloads them, and waits for the calls in flight up to its
        # exit timeout): a model it serves, answered so, after the log's "Signal (N) received" is
        # that death under way, and the call is told to retry now rather than when it ends.
        if self._server._models.serves(model):
            self._server._recovery.check_dying()
