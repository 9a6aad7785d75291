"""A step instance in a process of its own, as Triton runs each Python model instance in a stub.

In one process, every step's function shares one GIL: a numpy-heavy step lets go
of it at each numpy call and waits to take it back, so whatever Python runs
beside it (other steps, the event loop, the hand-overs) lengthens it. On a
server, each instance has a stub process and a GIL of its own. Measured on
yolov5's stand-in detector: 12.7 ms alone, 210 ms beside a thread looping on
pure Python, 12.2 ms beside the same loop in another process. ``LocalRuntime(isolation="process")`` runs each
instance of a step where the server runs it: in a process of its own, so that
steps side by side do not wait for each other's GIL.

:class:`ProcessInstance` stands in for a :class:`~pipelines.core.step.StepInstance`:
the runtime's worker thread calls ``execute(inputs)``, which hands the inputs to
the instance's process and waits for its outputs, without holding the GIL.

- **Fork, not spawn.** The process is forked, so it holds the step as the user
  declared it, a function from a notebook cell included; nothing is pickled but
  tensors' metadata and errors. ``initialize(config)`` runs in the process, as it
  runs in the stub. Forking needs Linux; CUDA cannot be used in a forked process,
  so steps placed on a GPU stay in threads (``LocalRuntime._isolation_of``).
- **Tensors through shared memory**, as between Triton and its stubs: one region
  for the inputs (written by this process) and one for the outputs (written by the
  step's), each an anonymous ``memfd`` handed over with ``SCM_RIGHTS`` and grown
  when a tensor outgrows it. Nothing is named, so nothing can leak in ``/dev/shm``:
  the memory goes when both processes let go of it. Object arrays (``BYTES``) and
  values that are not arrays are pickled with the message.
- **Faults.** A process that dies (a segfault, the OOM killer) fails the call with
  :class:`~pipelines.errors.StubDiedError` naming how it died, and the next call
  forks a fresh one (``initialize()`` again), as Triton restarts a dead stub. A call
  abandoned at its step's timeout kills its process, which a thread could not be.
  The step's process exits when this one does, even when this one is killed.

Each call's :attr:`last_compute` is the step's function alone; the rest of the call's time
is the hand-over through shared memory, which the cost report counts as overhead.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import warnings
import weakref
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import recvfds, sendfds
from time import perf_counter
from typing import Any

import numpy as np

from ..errors import StepError, StubDiedError
from ..process_exit import describe_exit
from ..serving import WireError, as_arrays, code_home, is_coroutine_callable, raised_at
from .device import device_of

__all__ = ["ISOLATIONS", "ProcessInstance", "fork_with_pipe", "is_async_impl", "isolation_supported"]

#: Where the local runtime can run a step's instances: its own threads, or a process of
#: their own each.
ISOLATIONS = ("thread", "process")

_ALIGN = 64
_MIN_REGION = 1 << 20
# How often a step's process checks that the runtime's process is still there.
_ORPHAN_POLL_S = 0.5
_FINALIZE_WAIT_S = 10.0


def isolation_supported() -> bool:
    """Whether this platform can fork a step's process and share memory with it (Linux)."""
    return hasattr(os, "fork") and hasattr(os, "memfd_create") and sys.platform.startswith("linux")


def is_async_impl(impl: Any) -> bool:
    """Whether a step's function, or its class's ``execute``/``__call__``, is ``async def``."""
    if inspect.isclass(impl):
        return is_coroutine_callable(getattr(impl, "execute", None) or impl.__call__)
    return is_coroutine_callable(impl)


# ------------------------------------------------------------------ shared memory


class _Region:
    """One side's shared memory: an anonymous memfd, mapped, grown by replacing it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.map: mmap.mmap | None = None
        self.size = 0

    def ensure(self, nbytes: int) -> int | None:
        """Make room for ``nbytes``: the fd of a new region to hand over, or None if it fits."""
        if nbytes <= self.size:
            return None
        size = max(nbytes, self.size + self.size // 2, _MIN_REGION)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)  # the old map goes when the last view of it does
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        return fd

    def adopt(self, fd: int, size: int) -> None:
        """Map the other side's new region."""
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size


def _layout(tensors: dict[str, Any]) -> tuple[list[tuple], int]:
    """Where each tensor goes in a region: ``(name, dtype, shape, offset)`` for arrays,
    ``(name, value)`` for what travels pickled; and the bytes the arrays need."""
    specs: list[tuple] = []
    end = 0
    for name, value in tensors.items():
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            offset = -(-end // _ALIGN) * _ALIGN
            specs.append((name, value.dtype, value.shape, offset))
            end = offset + value.nbytes
        else:
            specs.append((name, value))
    return specs, end


def _write(region: _Region, tensors: dict[str, Any], specs: list[tuple]) -> None:
    for spec in specs:
        if len(spec) == 4:
            name, dtype, shape, offset = spec
            view = np.ndarray(shape, dtype=dtype, buffer=region.map, offset=offset)
            np.copyto(view, tensors[name], casting="no")


def _views(region: _Region, specs: list[tuple]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in specs:
        if len(spec) == 4:
            name, dtype, shape, offset = spec
            out[name] = np.ndarray(shape, dtype=dtype, buffer=region.map, offset=offset)
        else:
            out[spec[0]] = spec[1]
    return out


def _send_fd(conn: Connection, fd: int) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        sendfds(s, [fd])


def _recv_fd(conn: Connection) -> int:
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        return recvfds(s, 1)[0]


# ------------------------------------------------------------------ the step's process


def _portable(exc: BaseException, home: str | None = None) -> tuple:
    """An error as it can cross to the runtime: the exception itself when it pickles back,
    with where the step raised it (a traceback does not cross)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = raised_at(exc, home)
    if where is not None:
        with contextlib.suppress(Exception):  # an exception that takes no attributes goes without
            exc._step_location = where
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        return ("failed", None, f"{type(exc).__name__}: {exc}", text)
    return ("failed", data, None, text)


def _serve(conn: Connection, step: Any, config: dict[str, Any], parent: int) -> None:
    """The step's process: initialize, then run calls until told to finalize or orphaned."""
    try:
        instance = step.instantiate(config)
    except BaseException as exc:
        conn.send(_portable(exc, code_home(step.impl)))
        return
    conn.send(("ready",))
    inputs, outputs = _Region("pipelines-step-in"), _Region("pipelines-step-out")
    while True:
        while not conn.poll(_ORPHAN_POLL_S):
            if os.getppid() != parent:  # the runtime's process is gone: nobody will ask again
                return
        message = conn.recv()
        if message[0] == "finalize":
            try:
                instance.finalize()
            except BaseException as exc:
                conn.send(_portable(exc))
            else:
                conn.send(("finalized",))
            return
        _, specs, grown = message
        if grown:
            inputs.adopt(_recv_fd(conn), grown)
        try:
            t = perf_counter()
            result = instance.execute(_views(inputs, specs))
            compute = perf_counter() - t
            values = as_arrays(dict(result))  # a PyTorch or other DLPack output is read here, in its own process
            out_specs, nbytes = _layout(values)
            fd = outputs.ensure(nbytes)
            _write(outputs, values, out_specs)
        except BaseException as exc:
            conn.send(_portable(exc, instance.home))
            continue
        finally:
            result = values = None  # views of the input region must not outlive the call
        conn.send(("done", compute, out_specs, outputs.size if fd is not None else 0))
        if fd is not None:
            _send_fd(conn, fd)
            os.close(fd)


_FORK_LOCK = threading.Lock()


def _fresh_fork_lock() -> None:
    """In a forked child: the lock is held by the thread that forked, which is not here."""
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()


def fork_with_pipe(child: Any) -> tuple[Connection, int]:
    """Fork a process that runs ``child(its_end, our_end, parent_pid)`` and exits: ``(our end, pid)``.

    The pipe is made and its far end closed here under one lock, so that no other fork of
    this module's takes a copy of that end: a copy in another process would keep this one
    from seeing the child's death as the end of its pipe.
    """
    with _FORK_LOCK:
        ours, theirs = Pipe(duplex=True)
        parent = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork() in a threaded process: the child runs only code of
            # this module's, which takes no lock another thread could have held.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _fresh_fork_lock()
            try:
                child(theirs, ours, parent)
            finally:
                os._exit(1)
        theirs.close()
    return ours, pid


def _child(conn: Connection, other: Connection, step: Any, config: dict[str, Any], parent: int) -> None:
    code = 0
    try:
        other.close()
        # Ctrl-C in a terminal reaches the whole process group: the runtime handles it and
        # finalizes its steps, so the step's process must not die of it first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _serve(conn, step, config, parent)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


# ------------------------------------------------------------------ the runtime's side

_live: weakref.WeakSet[ProcessInstance] = weakref.WeakSet()


@atexit.register
def _kill_live() -> None:
    for instance in list(_live):
        instance.kill()


def _sigkill(pid: int) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ProcessInstance:
    """One instance of a step, run in a forked process; used like a StepInstance."""

    is_async = False

    def __init__(self, step: Any, config: dict[str, Any], *, pipeline: str | None, node: str) -> None:
        self.step = step
        self.config = config
        self.pipeline = pipeline
        self.node = node
        self.last_compute = 0.0  # the step's function alone, in the last call
        self.pid = 0
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # kill() may come from another thread than the call's
        self._finalized = False
        self._start()

    # -------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        ours, pid = fork_with_pipe(lambda mine, other, parent: _child(mine, other, self.step, self.config, parent))
        self._conn, self.pid = ours, pid
        # this side's regions: a fresh process has none of an earlier one's
        self._inputs, self._outputs = _Region("pipelines-step-in"), _Region("pipelines-step-out")
        _live.add(self)
        reply = self._receive("initialize()")
        if reply[0] != "ready":
            error = self._failure(reply)
            self._reap(kill=True)
            raise error

    def finalize(self) -> None:
        """Run the step's ``finalize()`` in its process, and let the process exit."""
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
            conn = self._conn
        if conn is None:
            return
        try:
            conn.send(("finalize",))
            if not conn.poll(_FINALIZE_WAIT_S):
                return  # finalize() hangs: the process is killed below
            reply = conn.recv()
        except (EOFError, OSError):
            return  # died already: nothing left to finalize
        finally:
            self._reap(kill=True)
        if reply[0] != "finalized":
            raise self._failure(reply)

    def kill(self) -> None:
        """Kill the process now (a call abandoned at its timeout, or this process exiting)."""
        with self._lock:
            _sigkill(self.pid)

    abandon = kill

    def _reap(self, *, kill: bool) -> str:
        """Wait for the process (killing it first if asked): how it ended."""
        with self._lock:
            pid, self.pid = self.pid, 0
            conn, self._conn = self._conn, None
        _live.discard(self)
        if conn is not None:
            conn.close()
        if not pid:
            return "gone"
        if kill:
            _sigkill(pid)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return "gone"
        return describe_exit(os.waitstatus_to_exitcode(status))

    # -------------------------------------------------------------- calls

    def execute(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run the step in its process on ``inputs``; its outputs, copied out of shared memory."""
        if self._conn is None:
            if self._finalized:
                raise StepError(
                    f"pipeline {self.pipeline!r} step {self.node!r}: this instance was finalized",
                    pipeline=self.pipeline, step=self.node, node=self.node,
                )
            self._start()  # the last process died: a fresh one, as Triton restarts a stub
        conn = self._conn
        assert conn is not None
        for name, value in inputs.items():
            if device_of(value) == "gpu":
                raise StepError(
                    f"pipeline {self.pipeline!r} step {self.node!r}: input {name!r} is on the GPU, and this step "
                    "runs in a process of its own (isolation='process'), where CUDA cannot be used after a fork; "
                    "give the step device='gpu' (it then runs in this process), or use isolation='thread'",
                    pipeline=self.pipeline, step=self.node, node=self.node, tensor=name,
                )
        specs, nbytes = _layout(dict(inputs))
        fd = self._inputs.ensure(nbytes)
        _write(self._inputs, inputs, specs)
        try:
            conn.send(("run", specs, self._inputs.size if fd is not None else 0))
            if fd is not None:
                _send_fd(conn, fd)
        except OSError:
            pass  # it died: the receive below says how
        finally:
            if fd is not None:
                os.close(fd)
        reply = self._receive("execute()")
        if reply[0] != "done":
            raise self._failure(reply)
        _, compute, out_specs, grown = reply
        if grown:
            self._outputs.adopt(_recv_fd(conn), grown)
        self.last_compute = compute
        # The region is written again by the next call, while these outputs travel on: copy.
        return {n: (v.copy() if isinstance(v, np.ndarray) else v) for n, v in _views(self._outputs, out_specs).items()}

    def _receive(self, what: str) -> tuple:
        conn = self._conn
        try:
            if conn is None:
                raise EOFError
            return conn.recv()
        except (EOFError, OSError):
            pid = self.pid
            how = self._reap(kill=False)
            raise StubDiedError(
                f"pipeline {self.pipeline!r} step {self.node!r}: its process (pid {pid}) died in {what} "
                f"({how}); the call failed, and the next one starts a fresh process, which runs "
                "initialize() again, as Triton restarts a stub that died",
                pipeline=self.pipeline, step=self.node, node=self.node,
            ) from None

    def _failure(self, reply: tuple) -> BaseException:
        _, data, text, trace = reply
        if data is not None:
            exc = pickle.loads(data)
        else:  # an exception that does not pickle back: its type's name and message
            exc = StepError(
                WireError("StepError", self.pipeline or "", f"raised {text}", self.node, self.step.name).text(),
                pipeline=self.pipeline, step=self.node, node=self.node,
            )
        if hasattr(exc, "add_note"):  # Python 3.11+: the step's own traceback, from its process
            exc.add_note(f"in the step's process (pid {self.pid}):\n{trace.rstrip()}")
        return exc
