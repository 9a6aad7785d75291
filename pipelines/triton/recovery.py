"""Keeping an embedded server answering: a model whose stub died is reloaded (stubs.py), and a
server that died on its own is started again on the same ports with the same models (crashes.py).

:class:`Recovery` also tells the server's clients a dead server from one starting again.
"""

from __future__ import annotations

import subprocess
import threading
import time

from ..errors import ServerDiedError, ServerRestartingError
from ..process_exit import describe_exit
from .crashes import STARTED_AGAIN, Crash, CrashBudget, crash_reason, fatal_signal
from .launch import PortTaken, ServerProcess
from .model_state import ModelState
from .stubs import ServerHooks, StubWatcher

__all__ = ["Recovery"]


class Recovery:
    """The dead stubs and crashes of one server, and what came of them.

    ``watcher`` watches the stubs while the server runs (with ``restart_dead_stubs``). ``crashes``
    lists each death nobody asked for; ``restarting`` is the one the server is starting again
    after, while it does. ``gone`` is set once the process has exited for good (stopped, or dead
    and not started again), with ``exit_code``; ``gave_up`` says why it was not started again.
    ``stopping`` (a stop under way) makes a restart give up at its next step.
    """

    def __init__(
        self, process: ServerProcess, models: ModelState, *, restart_dead_stubs: bool, restart_on_crash: bool
    ) -> None:
        self._process = process
        self._models = models
        self.restart_dead_stubs = restart_dead_stubs
        self.restart_on_crash = restart_on_crash
        self.watcher: StubWatcher | None = None
        self.earlier_stub_restarts: list[tuple[str, float]] = []  # from before a restart
        self.crashes: list[Crash] = []
        self._crash_budget = CrashBudget()
        self._crash_lock = threading.Lock()
        self.restarting: Crash | None = None  # set from noticing a death until ready again
        self.classified = threading.Event()  # the exit of the current process has been looked at
        self.gone = threading.Event()  # exited for good: stopped, or dead and not started again
        self.gave_up = ""  # why the server was not started again, if it was not
        self.exit_code: int | None = None
        self.stopping = False
        self.generation = 0  # restarts after a crash, over the server's life: clients reconnect on a change

    def reset(self) -> None:
        """Forget the last run's deaths: the server starts anew."""
        self.stopping = False
        self.restarting, self.gave_up, self.exit_code = None, "", None
        self.gone.clear()
        self._crash_budget = CrashBudget()
        self.crashes, self.earlier_stub_restarts = [], []

    # ---------------------------------------------------------------- dead stubs

    def watch_stubs(self) -> None:
        proc = self._process.proc
        if not self.restart_dead_stubs or proc is None:
            return
        models = self._models
        reload = models.reload if self._process.arguments.model_control_mode == "explicit" else None
        self.watcher = StubWatcher(server_pid=proc.pid, hooks=ServerHooks(
            state=models.state,
            reload=reload,
            note=self._process.log.note,
            prepare=models.learn_ensembles,
            settled=models.settled,
            dying=lambda: self._fatal_signal() is not None,
        )).start()

    def stop_watching(self) -> bool:
        """Stop watching the stubs, which exit now on purpose; whether one had died."""
        if self.watcher is None:
            return False
        stub_died = bool(self.watcher.restarts or self.watcher.broken())
        self.watcher.stop()
        self.watcher = None
        return stub_died

    def rescan(self) -> None:
        """Watch the stubs of models loaded just now."""
        if self.watcher is not None:
            self.watcher.rescan()

    def unhealthy_models(self) -> dict[str, str]:
        """Models whose stub died and that are not reloaded yet (Triton still says READY), with why."""
        return self.watcher.broken() if self.watcher is not None else {}

    def reloading_models(self) -> dict[str, str]:
        """Each model failing now, or a moment ago, because a stub died (the step and the ensembles
        that use it): the model whose stub died."""
        if self.watcher is None:
            return {}
        dead = self.watcher.reloading()
        found = {name: name for name in dead}
        for ensemble, steps in self._models.ensemble_steps.items():
            for step in sorted(steps & set(dead)):
                found.setdefault(ensemble, step)
        return found

    @property
    def stub_restarts(self) -> list[tuple[str, float]]:
        """Each model reloaded after its stub died: the model, and seconds from noticing to reloaded."""
        now = self.watcher.restarts if self.watcher is not None else []
        return self.earlier_stub_restarts + now

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
        for step in sorted(self._models.ensemble_steps.get(model, frozenset()) & broken.keys()):
            return f"its step model {step!r}: {broken[step]}"
        return None

    # ---------------------------------------------------------------- a server that dies

    def check_alive(self) -> None:
        """Raise :class:`ServerDiedError` unless the server process is running
        (:class:`ServerRestartingError` while it starts again after dying on its own)."""
        process = self._process
        proc = process.proc
        if proc is None or process.stopped:
            raise ServerDiedError(
                f"the Triton server for {process.repository} is "
                f"{'stopped' if process.stopped else 'not started'}; start it again (start() or 'with')"
            )
        crash = self.restarting
        if crash is None:
            if proc.poll() is None:
                return
            self.classified.wait(1.0)  # its exit is being looked at this very moment
            crash = self.restarting
        if crash is not None:
            raise self._restarting_error(crash)
        code = proc.poll()
        if code is None:
            return
        with process.lock:
            process.reap()  # its stubs and shared memory must go too
        why = f"; {self.gave_up}" if self.gave_up else ""
        raise ServerDiedError(
            f"the Triton server for {process.repository} (pid {proc.pid}) died while in use "
            f"({describe_exit(code)}){why}; start a new TritonServer\n--- log tail ---\n{process.log.tail(20)}"
        )

    def watch_process(self) -> None:
        """Notice at once when the server process ends (a thread blocked on its exit)."""
        proc = self._process.proc
        assert proc is not None
        threading.Thread(target=self._after_exit, args=(proc,), name=f"triton-exit-{proc.pid}", daemon=True).start()

    def _after_exit(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        process, log = self._process, self._process.log
        with self._crash_lock:
            if self.stopping or proc is not process.proc:
                self.classified.set()
                return  # stopped on purpose, or replaced already
            crash = Crash(proc.pid, describe_exit(code), crash_reason(log.tail(80)))
            if self.restart_on_crash and self._crash_budget.spend():
                self.restarting = crash
            else:
                self.exit_code = code
                if self.restart_on_crash:
                    self.gave_up = (f"it had been started again {self._crash_budget.restarts} times within "
                                    f"{self._crash_budget.window_s:g} s, so it is not started again")
                self.crashes.append(crash)
                self.gone.set()
            self.classified.set()
        if self.restarting is None:
            with process.lock:
                if not (process.reaped or self.stopping):  # its stubs and shared memory, now rather than at the next call
                    process.kill(proc)
                    process.reaped = True
            if self.restart_on_crash:
                log.note(f"the server ({crash.describe()}) died on its own; {self.gave_up}")
            return
        log.note(f"the server ({crash.describe()}) died on its own; starting it again on the same ports, "
                 "with the same models")
        self._restart(proc, crash, code)

    def _restart(self, dead: subprocess.Popen[bytes], crash: Crash, code: int) -> None:
        """Start the server again where it was: the same ports, arguments, log and loaded models."""
        process = self._process
        started = time.monotonic()
        watcher, self.watcher = self.watcher, None
        if watcher is not None:  # its stubs die with the server: nothing of theirs to reload
            watcher.stop(wait=False)
        try:
            with process.lock:
                if self.stopping:
                    return
                # Its stubs and shared memory go first. The stubs hold the dead server's listening
                # sockets (inherited), so until they die a call to its ports hangs instead of failing:
                # a reload the watcher has under way among them.
                process.kill(dead)
            if watcher is not None:
                watcher.stop()
                self.earlier_stub_restarts += watcher.restarts
            with process.lock:
                if self.stopping:
                    return
                process.relaunch()
                self.classified.clear()
            process.wait_ready(started + process.startup_timeout)
            self._models.find_unavailable()
            self._models.load_again()
            with process.lock:
                if self.stopping:
                    return
                self.watch_stubs()
                self.crashes.append(Crash(crash.pid, crash.exit, crash.why, time.monotonic() - started))
                self.generation += 1  # before a call can pass: its client reconnects first
                self.restarting = None
                self.watch_process()
            process.log.note(f"{STARTED_AGAIN} {time.monotonic() - started:.2f} s after it died; it answers again")
        except Exception as error:  # noqa: BLE001 - whatever failed, the server stays down and says why
            with process.lock:
                if self.stopping:
                    return
                process.kill()
                process.reaped = True
                said = "a port it had was taken meanwhile" if isinstance(error, PortTaken) else str(error)
                self.gave_up = f"starting it again failed: {said.splitlines()[0]}"
                self.crashes.append(crash)
                self.exit_code = code
                self.restarting = None
                self.gone.set()
            process.log.note(self.gave_up)

    def check_dying(self) -> None:
        """Raise the server's death if it is going down: its log says Triton's "Signal (N) received"
        since it last started, or it exits, within a moment (the log is read from a pipe, which a
        starved machine drains late). Otherwise return: a model's own answer, not a dying server."""
        deadline = time.monotonic() + _DYING_WAIT_S
        while True:
            self.check_alive()
            proc = self._process.proc
            signum = self._fatal_signal()
            if proc is None:
                return
            if signum is not None:
                break
            if time.monotonic() >= deadline:
                return
            self._process.wait_dead(0.1)
        crash = Crash(proc.pid, describe_exit(-signum), f"Signal ({signum}) received")
        if not self.restart_on_crash:
            raise ServerDiedError(
                f"the Triton server for {self._process.repository} (pid {proc.pid}) is going down "
                f"({crash.why}); start a new TritonServer")
        raise self._restarting_error(crash)

    def _fatal_signal(self) -> int | None:
        return fatal_signal(self._process.log.tail(_DYING_LINES))

    def restarted_since(self, generation: int) -> ServerRestartingError | None:
        """The error for a call begun at ``generation`` that failed while the server starts again,
        or after it has (its crash, the latest); None if the server has not died since."""
        crash = self.restarting
        if crash is None and self.generation != generation and self.crashes:
            crash = self.crashes[-1]
        return self._restarting_error(crash) if crash is not None else None

    def _restarting_error(self, crash: Crash) -> ServerRestartingError:
        return ServerRestartingError(
            f"the Triton server for {self._process.repository} (pid {crash.pid}) died while in use "
            f"({crash.exit}{': ' + crash.why if crash.why else ''}); it is starting again on the same ports with the same models: retry in a few "
            f"seconds (its log: {self._process.log.path})"
        )



_DYING_LINES = 80
_DYING_WAIT_S = 1.5
