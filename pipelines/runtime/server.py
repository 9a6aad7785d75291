"""The embedded Triton server: the real ``tritonserver`` binary from the ``nvidia-pytriton`` wheel.

:class:`TritonServer` starts it on free ports in its own process group, waits until it is
ready, and on stop leaves no process, shared-memory region or temporary directory behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import http.client
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ServerDiedError, ServerError, ServerStartError

if TYPE_CHECKING:
    from .client import AsyncTritonClient, TritonClient

__all__ = ["TritonInstallation", "TritonServer", "find_installation", "find_tritonserver", "serve_main"]

#: Every shared-memory region and process of ours carries this tag in its name, so
#: cleanup can find exactly ours, and leftovers of an owner that was killed can be told apart.
SHM_TAG = "pipelines-triton"

_MODEL_CONTROL_MODES = ("none", "explicit", "poll")
# Ports from below Linux's default ephemeral range (32768-60999), where outgoing
# connections never take a port between our choosing it and the server binding it.
_PORT_RANGE = (20000, 32000)
# How tritonserver 2.51 reports a port it could not bind (HTTP and metrics; gRPC).
_PORT_TAKEN = re.compile(r"Socket '[^']*:(\d+)' already in use|No address added .*? for '[^']*:(\d+)'")
_PORT_ATTEMPTS = 4
_ERROR_LINE = re.compile(r"E\d{4} |error:", re.IGNORECASE)
_UNLOAD_GRACE = 2.0  # the server polls its shutdown once a second; give it that long past its exit timeout


@dataclass(frozen=True)
class TritonInstallation:
    """Where the parts of a Triton install live: the binary, the Python backend, its stub, and libraries."""

    binary: Path
    python_backend: Path
    stub: Path
    libs: Path | None


def find_installation() -> TritonInstallation:
    """Locate the ``tritonserver`` shipped in the ``nvidia-pytriton`` wheel of the running Python."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerStartError(
            "no tritonserver found: the 'nvidia-pytriton' package is not installed in "
            f"{sys.prefix}; install it with: pip install 'pipelines[server]' (or nvidia-pytriton)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    installation = TritonInstallation(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=(package.parent / "nvidia_pytriton.libs") if (package.parent / "nvidia_pytriton.libs").is_dir() else None,
    )
    for what, path in (
        ("tritonserver binary", installation.binary),
        ("Python backend", installation.python_backend),
        (f"Python backend stub for Python {version}", installation.stub),
    ):
        if not path.exists():
            raise ServerStartError(
                f"the {what} is missing from the nvidia-pytriton install: expected {path}; "
                "reinstall nvidia-pytriton (0.5 or newer) for this Python"
            )
    return installation


def find_tritonserver() -> Path:
    """Path of the ``tritonserver`` binary of the ``nvidia-pytriton`` wheel."""
    return find_installation().binary


class TritonServer:
    """A ``tritonserver`` process serving ``repository``; a context manager.

    Ports left as ``None`` are chosen free (and chosen again if another process takes
    one first). ``env`` adds variables to the server's environment. ``exit_timeout`` is
    how long the server may wait for in-flight requests when stopped; past it, and a short
    grace to unload models, its whole process group is killed.
    """

    def __init__(
        self,
        repository: str | os.PathLike[str],
        *,
        model_control_mode: str = "none",
        load_models: Sequence[str] = (),
        startup_timeout: float = 120.0,
        exit_timeout: int = 5,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        installation: TritonInstallation | None = None,
    ) -> None:
        if model_control_mode not in _MODEL_CONTROL_MODES:
            raise ServerStartError(
                f"model_control_mode={model_control_mode!r} is not one Triton knows; "
                f"use one of {', '.join(map(repr, _MODEL_CONTROL_MODES))}"
            )
        if load_models and model_control_mode != "explicit":
            raise ServerStartError(
                f"load_models={list(load_models)!r} needs model_control_mode='explicit'; "
                f"in mode {model_control_mode!r} Triton loads every model of the repository itself"
            )
        self.repository = Path(repository).resolve()
        self.model_control_mode = model_control_mode
        self.load_models = tuple(load_models)
        self.startup_timeout = float(startup_timeout)
        self.exit_timeout = int(exit_timeout)
        self.log_verbose = int(log_verbose)
        self.extra_args = tuple(str(a) for a in extra_args)
        self.env = dict(env or {})
        self.host = host
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self._installation = installation
        self._ports: tuple[int, int, int] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._workdir: Path | None = None
        self._log_path: Path | None = None
        self._stopped = False
        self._reaped = False
        self._lock = threading.RLock()
        # Unique per server: the python backend names its regions <prefix><uuid>.
        self.shm_prefix = f"{SHM_TAG}-{os.getpid()}-{uuid.uuid4().hex[:12]}-"

    # ---------------------------------------------------------------- addresses

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self._require_ports()[0]}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self._require_ports()[1]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self._require_ports()[2]}/metrics"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        return self._proc.pid

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

    def _require_ports(self) -> tuple[int, int, int]:
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
            self._stopped = self._reaped = False
            if not self.repository.is_dir():
                raise ServerStartError(f"model repository {self.repository} is not a directory; write one first")
            installation = self._installation or find_installation()
            _sweep_orphaned_shm()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{SHM_TAG}-"))
            _REGISTRY.add(self)
            try:
                backends = _backend_directory(installation, self._workdir / "backends")
                deadline = time.monotonic() + self.startup_timeout
                for attempt in range(1, _PORT_ATTEMPTS + 1):
                    self._launch(installation, backends, attempt)
                    try:
                        self._wait_ready(deadline)
                        return self
                    except _PortTaken:
                        self._kill_group()
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

    def _launch(self, installation: TritonInstallation, backends: Path, attempt: int) -> None:
        assert self._workdir is not None
        self._ports = _choose_ports(self._fixed_ports, self.host)
        http_port, grpc_port, metrics_port = self._ports
        args = [
            str(installation.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--model-control-mode={self.model_control_mode}",
            f"--http-address={self.host}",
            f"--http-port={http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *(f"--load-model={name}" for name in self.load_models),
            *self.extra_args,
        ]
        env = {**os.environ, **self.env}
        # The stub's embedded interpreter finds its site-packages through the python on PATH;
        # the stub (unlike the server binary) has no RPATH to the wheel's libraries.
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.prefix) / "bin"), env.get("PATH")]))
        if installation.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(installation.libs), env.get("LD_LIBRARY_PATH")]))
        self._log_path = self._workdir / f"tritonserver.{attempt}.log"
        with open(self._log_path, "wb") as log:  # a file, never a pipe that fills up and stalls the server
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._workdir,
                start_new_session=True,
                preexec_fn=_parent_death_signal() if threading.current_thread() is threading.main_thread() else None,
            )
        self._pgid = self._proc.pid  # start_new_session makes it the leader of its own group

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                taken = _taken_port(self.log_tail(200))
                if taken is not None and taken not in self._fixed_ports:
                    raise _PortTaken
                why = f"port {taken} is already in use; pass another port or leave it None" if taken else ""
                raise ServerStartError(
                    f"the Triton server for {self.repository} exited during start-up ({_describe_exit(code)}); "
                    f"{why or 'its log says why (fix the model or argument it names)'}\n{self._failure_log()}"
                )
            # Another server may answer on our ports until ours fails to bind them (it logs
            # "Started" before it binds), so ready means: healthy, and the ports are its own.
            if _health_ready(self._client_host, self._require_ports()[0]) and all(
                _listens(self._proc.pid, port) for port in self._expected_ports()
            ):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the Triton server for {self.repository} was not ready after {self.startup_timeout:g} s; "
                    f"raise startup_timeout if its models are slow to load\n--- log tail ---\n{self.log_tail()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)

    def _expected_ports(self) -> list[int]:
        http_port, grpc_port, metrics_port = self._require_ports()
        flags = "=".join(self.extra_args)
        ports = [http_port]
        if "--allow-grpc=false" not in flags:
            ports.append(grpc_port)
        if "--allow-metrics=false" not in flags:
            ports.append(metrics_port)
        return ports

    def stop(self) -> None:
        """Stop the server (gracefully, then by force) and remove everything it left. Safe to call twice."""
        with _sigint_deferred(), self._lock:
            proc = self._proc
            try:
                if proc is not None and proc.poll() is None:
                    _signal_group(self._pgid, signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=self.exit_timeout + _UNLOAD_GRACE)
            finally:
                self._kill_group()
                if self._workdir is not None:
                    shutil.rmtree(self._workdir, ignore_errors=True)
                self._stopped = True
                _REGISTRY.discard(self)

    def _kill_group(self) -> None:
        """SIGKILL whatever of ours still runs, wait for it, and remove our shared memory."""
        if self._proc is not None:
            if self._proc.poll() is None:
                _signal_group(self._pgid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=10)
        pgid, marker = self._pgid, self.shm_prefix.encode()
        deadline = time.monotonic() + 10
        while True:
            # Stubs stay in the server's group; a stub that left it still names our prefix.
            left = [pid for pid in _live_processes(pgid=pgid, marker=marker) if pid != os.getpid()]
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        _remove_shm(self.shm_prefix)

    # ---------------------------------------------------------------- use

    def check_alive(self) -> None:
        """Raise :class:`ServerDiedError` unless the server process is running."""
        proc = self._proc
        if proc is None or self._stopped:
            raise ServerDiedError(
                f"the Triton server for {self.repository} is "
                f"{'stopped' if self._stopped else 'not started'}; start it again (start() or 'with')"
            )
        code = proc.poll()
        if code is not None:
            with self._lock:
                if not self._reaped:
                    self._kill_group()  # its stubs and shared memory must not outlive it
                    self._reaped = True
            raise ServerDiedError(
                f"the Triton server for {self.repository} (pid {proc.pid}) died while in use "
                f"({_describe_exit(code)}); start a new TritonServer\n--- log tail ---\n{self.log_tail(20)}"
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
        return TritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self))

    def async_client(self, protocol: str = "http", *, timeout: float | None = None) -> AsyncTritonClient:
        """An asyncio client of this server, failing fast like :meth:`client`."""
        from .client import AsyncTritonClient

        url = self.http_url if protocol == "http" else self.grpc_url
        return AsyncTritonClient(url, protocol, timeout=timeout, liveness=_Liveness(self))

    def load_model(self, name: str) -> None:
        """Load (or reload) model ``name``; needs ``model_control_mode='explicit'``."""
        with self.client() as client:
            client.load_model(name)

    def unload_model(self, name: str, *, wait: float = 30.0) -> None:
        """Unload model ``name``; Triton answers at once, so wait up to ``wait`` s until it has."""
        with self.client() as client:
            client.unload_model(name)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                states = {m["state"] for m in client.repository_index() if m["name"] == name}
                if "UNLOADING" not in states:
                    return
                time.sleep(0.05)

    def models(self) -> list[dict]:
        """The repository index: each model's name, version, state and reason."""
        with self.client() as client:
            return client.repository_index()

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


class _PortTaken(Exception):
    """Another process bound one of the chosen ports first; choose again."""


# ---------------------------------------------------------------- process helpers


def _backend_directory(installation: TritonInstallation, target: Path) -> Path:
    python = target / "python"
    shutil.copytree(installation.python_backend, python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(installation.stub, python / "triton_python_backend_stub")
    return target


_PORT_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()


def _choose_ports(fixed: tuple[int | None, ...], host: str) -> tuple[int, int, int]:
    rng = random.SystemRandom()
    with _PORT_LOCK:
        chosen: list[int] = []
        for port in fixed:
            while port is None:
                candidate = rng.randrange(*_PORT_RANGE)
                # Remembering what was handed out keeps two servers of this process apart
                # even before either has bound its ports.
                if candidate not in _HANDED_OUT and candidate not in chosen and _bindable(host, candidate):
                    port = candidate
            chosen.append(port)
        _HANDED_OUT.update(chosen)
    return chosen[0], chosen[1], chosen[2]


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


def _taken_port(log: str) -> int | None:
    match = _PORT_TAKEN.search(log)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (True where /proc cannot tell)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the socket's inode.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not os.path.exists("/proc/net/tcp"):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def _health_ready(host: str, port: int) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _parent_death_signal():
    """A pre-exec hook that SIGTERMs the server if its owner dies without cleaning up (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


def _signal_group(pgid: int | None, sig: int) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _live_processes(*, pgid: int | None, marker: bytes) -> list[int]:
    """Running (not zombie) processes in group ``pgid`` or whose command line holds ``marker``."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # The command name may hold spaces or parentheses; the fields after the last ')' do not.
            fields = stat[stat.rindex(b")") + 2 :].split()
            state, group = fields[0], int(fields[2])
            if state in (b"Z", b"X"):
                continue
            if group == pgid:
                found.append(int(entry))
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # the process went away while we looked
    return found


def _remove_shm(prefix: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def _sweep_orphaned_shm() -> None:
    """Remove regions left by a server whose owning process was killed outright (SIGKILL)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if not name.startswith(SHM_TAG + "-"):
                continue
            owner = name[len(SHM_TAG) + 1 :].split("-", 1)[0]
            if owner.isdigit() and int(owner) != os.getpid() and not _pid_exists(int(owner)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives during cleanup until cleanup is done, then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)


class _Registry:
    """Servers still running, stopped at interpreter exit if their owner did not stop them."""

    def __init__(self) -> None:
        self._servers: dict[int, TritonServer] = {}
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def add(self, server: TritonServer) -> None:
        with self._lock:
            self._servers[id(server)] = server

    def discard(self, server: TritonServer) -> None:
        with self._lock:
            self._servers.pop(id(server), None)

    def stop_all(self) -> None:
        with self._lock:
            servers = list(self._servers.values())
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()


_REGISTRY = _Registry()


# ---------------------------------------------------------------- pipelines serve


def serve_main(
    repository: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    model_control_mode: str = "none",
    log_verbose: int = 0,
    startup_timeout: float = 120.0,
    extra_args: Sequence[str] = (),
    out=None,
) -> int:
    """Serve ``repository`` in the foreground until Ctrl-C (or SIGTERM); return the exit status.

    Prints the URLs and the loaded models once the server is ready. A server that dies
    on its own returns 1 after printing its log's tail.
    """
    out = out or sys.stdout
    server = TritonServer(
        repository,
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        model_control_mode=model_control_mode,
        log_verbose=log_verbose,
        startup_timeout=startup_timeout,
        extra_args=extra_args,
    )
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with server:
            print(f"Triton server ready (pid {server.pid}) serving {server.repository}", file=out)
            print(f"  HTTP     {server.http_url}", file=out)
            print(f"  gRPC     {server.grpc_url}", file=out)
            print(f"  metrics  {server.metrics_url}", file=out)
            models = server.models()
            print(f"models ({len(models)}):", file=out)
            for model in models:
                reason = f"  {model['reason']}" if model.get("reason") else ""
                print(
                    f"  {model['name']:<32} {model.get('version', '') or '-':<4} {model.get('state', '')}{reason}",
                    file=out,
                )
            print("Press Ctrl-C to stop.", file=out, flush=True)
            assert server._proc is not None
            code = server._proc.wait()
            print(
                f"the Triton server exited on its own ({_describe_exit(code)})\n--- log tail ---\n{server.log_tail()}",
                file=sys.stderr,
            )
            return 1
    except KeyboardInterrupt:
        print("stopped", file=out, flush=True)
        return 0
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
