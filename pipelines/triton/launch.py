"""Launching the ``tritonserver`` process and waiting until it answers ready, then ending it.

:class:`ServerProcess` runs the binary of the ``nvidia-pytriton`` wheel in its own process group,
with a watchdog (supervisor.py) that cleans up if its owner dies, and a work folder for its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ..errors import ServerError, ServerStartError
from ..process_exit import describe_exit
from ..repository_files import leftover_staging
from .arguments import Ports, ServerArguments
from .cleanup import SHM_TAG, kill_server, signal_group
from .installation import TritonInstallation, backend_directory
from .logs import ServerLog
from .ports import health_ready, listens, taken_port
from .python_env import PythonEnvironment
from .stand_ins import ServedRepository
from .stubs import server_stubs
from .supervisor import Supervisor

__all__ = ["PortTaken", "ServerProcess"]

_UNLOAD_GRACE = 2.0  # the server polls its shutdown once a second; give it that long past its exit timeout
_STUBLESS_GRACE = 0.5  # after a stub died: how long no stub may be left before the server counts as done


class PortTaken(Exception):
    """Another process bound one of the chosen ports first; choose again."""


#: What Triton 2.51 prints when it aborts because a stub missed a shared-memory lock while its
#: models loaded: seen on a starved machine (load above 10 on 2 cores), gone on the next start.
STUB_LOCK_LOST = "boost::interprocess::lock_exception"


class StubLockLost(Exception):
    """The server aborted during start-up on a stub's shared-memory lock; start it again."""


class ServerProcess:
    """The process of one server: launched (again, after a crash) on given ports, waited for, ended.

    ``lock`` is held while the process is launched, killed or replaced; ``reaped`` says that what
    the process left (its stubs, its shared memory) is gone; ``stopped``, that its owner stopped it.
    ``stand_ins``: serve the models of a backend this server lacks through stand-ins (stand_ins.py).
    """

    def __init__(
        self,
        arguments: ServerArguments,
        *,
        env: dict[str, str],
        python_env: PythonEnvironment,
        startup_timeout: float,
        fixed_ports: tuple[int | None, int | None, int | None],
        stand_ins: bool = True,
    ) -> None:
        self.arguments = arguments
        self.log = ServerLog(arguments.repository)  # the output of each process launched, in turn
        self.env = env
        self.python_env = python_env
        self.startup_timeout = startup_timeout
        self.fixed_ports = fixed_ports
        self.stand_ins = stand_ins
        #: The repository as the server is given it, where a model needs a stand-in (else None).
        self.served: ServedRepository | None = None
        self.ports: Ports | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.workdir: Path | None = None
        self.supervisor: Supervisor | None = None
        self.reaped = False
        self.stopped = False
        self.lock = threading.RLock()
        self._launch_with: tuple[TritonInstallation, Path] | None = None

    @property
    def repository(self) -> Path:
        return self.arguments.repository

    @property
    def client_host(self) -> str:
        # A server bound to every interface is reached locally through loopback.
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.arguments.host, self.arguments.host)

    def require_ports(self) -> Ports:
        if self.ports is None:
            raise ServerError(f"the Triton server for {self.repository} is not started; call start() or use 'with'")
        return self.ports

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.require_ports().http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.require_ports().grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.require_ports().metrics}/metrics"

    def make_workdir(self) -> Path:
        """A fresh temporary folder for the server's backend directory and log."""
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{SHM_TAG}-"))
        return self.workdir

    def prepare(self, installation: TritonInstallation) -> None:
        """Start the watchdog and lay out the backends, once for every launch to come."""
        assert self.workdir is not None
        self.supervisor = Supervisor(workdir=self.workdir, shm_prefix=self.arguments.shm_region_prefix)
        backends = backend_directory(installation, self.workdir / "backends")
        self._launch_with = (installation, backends)
        self.served = ServedRepository.build(self.repository, self.workdir / "repository") if self.stand_ins else None

    def launch(self, ports: Ports, log_path: Path) -> None:
        assert self.workdir is not None and self._launch_with is not None
        installation, backends = self._launch_with
        self.ports = ports
        args = self.arguments.command(
            binary=installation.binary, backend_directory=backends, ports=self.ports, repository=self._served_path()
        )
        env = {**self.arguments.python_backend.environment(), **os.environ, **self.env}
        # The stub's embedded interpreter finds its site-packages through the python on PATH;
        # the stub (unlike the server binary) has no RPATH to the wheel's libraries.
        env["PATH"] = os.pathsep.join(filter(None, [str(self.python_env.bin), env.get("PATH")]))
        if installation.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(installation.libs), env.get("LD_LIBRARY_PATH")]))
        self.log.path = log_path
        for stand_in in (self.served.stand_ins.values() if self.served is not None else ()):
            # In short: the full label is in the stand-in's config, and commands say it once per model.
            self.log.note(f"model {stand_in.model!r} is served by a STAND-IN: {stand_in.short}")
        # A file, never a pipe that fills up and stalls the server; appended to, so that our
        # own notes (a stub reloaded) can go in the same log without overwriting its lines.
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.pgid = self.proc.pid  # start_new_session makes it the leader of its own group
        self.reaped = False
        assert self.supervisor is not None
        self.supervisor.watch(self.pgid)

    def relaunch(self) -> None:
        """Launch again where the last process was: the same ports, arguments and log."""
        assert self.ports is not None and self.log.path is not None
        self.launch(self.ports, self.log.path)

    def wait_ready(self, deadline: float) -> None:
        """Return once the server answers ready; raise :class:`PortTaken` or :class:`ServerStartError`."""
        assert self.proc is not None
        ports = self.require_ports()
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log.tail(200)
                taken = taken_port(tail)
                if taken is not None and taken not in self.fixed_ports:
                    raise PortTaken
                if STUB_LOCK_LOST in tail:
                    raise StubLockLost
                why = f"port {taken} is already in use; pass another port or leave it None" if taken else ""
                left = leftover_staging(self.repository)
                if left and not why:  # Triton tries to load them as models, and fails on them
                    why = (f"the repository holds {', '.join(map(repr, left))}, the staging of a write that was "
                           "killed or could not remove it; the next write or removal into the repository deletes "
                           "it, or remove it by hand (as a user who may)")
                raise ServerStartError(
                    f"the Triton server for {self.repository} exited during start-up ({describe_exit(code)}); "
                    f"{why or 'its log says why (fix the model or argument it names)'}\n{self.log.failure()}"
                )
            # Another server may answer on our ports until ours fails to bind them (it logs
            # "Started" before it binds), so ready means: healthy, and the ports are its own.
            if health_ready(self.client_host, ports.http) and all(
                listens(self.proc.pid, port) for port in self.arguments.listening_ports(ports)
            ):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the Triton server for {self.repository} was not ready after {self.startup_timeout:g} s; "
                    f"raise startup_timeout if its models are slow to load\n--- log tail ---\n{self.log.tail()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)

    def _served_path(self) -> Path:
        """The repository's path as Triton is given it: its own, or a link to it in the work folder
        where its own would break every Python model. The Python backend of 2.51 passes a model's
        path to its stub in a command line that the stub splits at spaces ("Expected 9 arguments,
        found 4", and the start waits out its timeout), and the stub reads it as ASCII."""
        assert self.workdir is not None
        if self.served is not None:  # in the work folder, whose path has neither
            return self.served.folder
        path = str(self.repository)
        if path.isascii() and not any(c.isspace() for c in path):
            return self.repository
        link = self.workdir / "repository"
        if not link.is_symlink():
            link.symlink_to(self.repository, target_is_directory=True)
        return link

    def kill(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Kill the process group of ``proc`` (default: the current process), its stubs, and its shared memory."""
        kill_server(self.proc if proc is None else proc, self.pgid, self.arguments.shm_region_prefix)

    def reap(self) -> None:
        """Kill what the exited process left, once."""
        if not self.reaped:
            self.kill()
            self.reaped = True

    def terminate(self) -> None:
        """Ask the server to stop: it answers the requests in flight and unloads its models."""
        signal_group(self.pgid, signal.SIGTERM)

    def wait_exit(self, proc: subprocess.Popen[bytes], stub_died: bool) -> None:
        """Wait for the server to exit, up to its exit timeout and a grace.

        The unload of a model whose stub died never finishes, and holds Triton for its whole
        exit timeout. So once a stub has died, the server is done as soon as no stub is left:
        every model it could finalize is finalized by then.
        """
        deadline = time.monotonic() + self.arguments.exit_timeout + _UNLOAD_GRACE
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

    def wait_dead(self, timeout: float) -> bool:
        """Whether the process has exited, waiting up to ``timeout`` for a dying one to finish."""
        if self.proc is None:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        return self.proc.poll() is not None

    def remove(self) -> None:
        """Kill whatever is left of the server and remove its work folder; release the watchdog."""
        self.kill()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.supervisor is not None:
            self.supervisor.release()
            self.supervisor = None
