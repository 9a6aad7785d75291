"""The embedded server dies on its own (Triton aborts, as 2.51 does when a stub is killed holding
a shared mutex; the OOM killer): it is started again on the same ports with the same models,
clients are told to retry meanwhile and work again after, and a server that keeps dying is let
go with the reason."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile import compile_pipeline
from pipelines.errors import PipelinesError, ServerDiedError, ServerRestartingError
from pipelines.triton import TritonClient, TritonServer
from pipelines.triton.crashes import CrashBudget, crash_reason
from pipelines.triton.stubs import server_stubs

F4 = TensorSpec("FP32", [4])
LIMIT_S = 60.0  # generous: the machine is shared; the bound is what matters, not its size


class AddOne:
    def execute(self, x):
        return {"y": x + 1}


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    pipeline = Pipeline("sturdy", inputs={"x": F4}, max_batch_size=4)
    pipeline.output("y", pipeline.add(step(AddOne, name="add", inputs={"x": F4}, outputs={"y": F4}),
                                      x=pipeline.input("x"))["y"])
    return compile_pipeline(pipeline, "both").write(tmp_path_factory.mktemp("crash") / "repo")


def wait_for(condition, what):
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {LIMIT_S:g} s"
        time.sleep(0.02)


def shm_regions(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))


def crash(server):
    pid = server.pid
    os.kill(pid, signal.SIGABRT)  # what Triton does to itself on an exception nothing catches
    return pid


@pytest.mark.server
def test_a_server_that_aborts_under_load_starts_again_on_the_same_ports_with_the_models_it_had(repository):
    x = np.ones((1, 4), np.float32)
    start_models = ["sturdy__add", "sturdy_bls"]
    with TritonServer(repository, model_control_mode="explicit", load_models=start_models) as server:
        server.load_model("sturdy_ensemble")  # loaded and unloaded since the start: replayed after it
        server.unload_model("sturdy_bls")
        # one stub, sturdy__add's, and its region: the stubs that the load replaced (loading the
        # ensemble loads its step model again) and the unload ended take theirs with them once they
        # have exited, which a starved machine may take seconds to see; until then two stubs hold
        # two regions, which is no state to compare the restarted server with
        wait_for(lambda: [s.model for s in server_stubs(server.pid)] == ["sturdy__add"]
                 and len(shm_regions(server.shm_prefix)) == 1, "the replaced and unloaded stubs' regions to go")
        urls, regions = (server.http_url, server.grpc_url), shm_regions(server.shm_prefix)
        done, outcomes = threading.Event(), []  # (protocol, error or None), in the order answered

        def load(protocol):
            with server.client(protocol, timeout=LIMIT_S) as client:
                while not done.is_set():
                    try:
                        np.testing.assert_array_equal(client.infer("sturdy_ensemble", {"x": x})["y"], 2)
                        outcomes.append((protocol, None))
                    except PipelinesError as error:
                        outcomes.append((protocol, error))
                        time.sleep(0.01)

        threads = [threading.Thread(target=load, args=(protocol,)) for protocol in ("http", "grpc")]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: {p for p, e in outcomes if e is None} == {"http", "grpc"}, "a first answer")
            before = len(outcomes)  # answered before the crash: none of these may have failed
            dead = crash(server)
            wait_for(lambda: server.crashes and server.crashes[0].restarted_in is not None, "the restart")
            count = len(outcomes)
            wait_for(lambda: {p for p, e in outcomes[count:] if e is None} == {"http", "grpc"},
                     "answers from the same clients after the restart")
        finally:
            done.set()
            for thread in threads:
                thread.join()
        (restart,) = server.crashes
        assert restart.pid == dead and restart.exit == "killed by SIGABRT" and restart.restarted_in is not None  # started again
        assert server.pid != dead and (server.http_url, server.grpc_url) == urls
        failures = [e for _, e in outcomes if e is not None]
        assert failures, "no request met the dead server"
        for error in failures:  # told to retry, fast, naming how it died
            assert isinstance(error, ServerRestartingError), error
            assert "killed by SIGABRT" in error.message and "retry in a few seconds" in error.message
        assert all(e is None for _, e in outcomes[:before])  # every failure met the crash
        # Nothing of the dead server is left: its stubs, its shared memory (the new one has its own).
        assert server_stubs(dead) == []
        assert not set(regions) & set(shm_regions(server.shm_prefix))
        wait_for(lambda: len(shm_regions(server.shm_prefix)) == len(regions), "the replayed unload's region to go")
        states = {m["name"]: m["state"] for m in server.models()}
        assert states["sturdy__add"] == states["sturdy_ensemble"] == "READY" and states.get("sturdy_bls") != "READY"
        assert server.wait(timeout=0) is None  # still serving
        log = server.log_tail(400)
        assert f"the server (pid {dead}, killed by SIGABRT" in log and "started again" in log
    assert server.wait(timeout=0) is not None


@pytest.mark.server
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_grpc_client_answers_at_once_after_the_restart_though_its_channel_failed_meanwhile(repository, kind):
    """gRPC shares a subchannel between channels to one address, and one that failed to connect
    keeps failing until its backoff (1 s, growing) runs out: a client reconnects on a fresh one."""
    x = {"x": np.ones((1, 4), np.float32)}
    with TritonServer(repository) as server:
        owned = server.client("grpc", timeout=LIMIT_S) if kind == "sync" else server.async_client("grpc")
        infer = (lambda: owned.infer("sturdy_bls", x)) if kind == "sync" else (
            lambda: anyio.run(owned.infer, "sturdy_bls", x))
        np.testing.assert_array_equal(infer()["y"], 2)
        plain = TritonClient(server.grpc_url, "grpc", timeout=5)  # not the server's: it tries to connect
        os.kill(server.pid, signal.SIGKILL)
        wait_for(lambda: server.restarting, "noticing the death")
        assert not plain.ready() and not plain.ready()  # the shared subchannel fails, and backs off
        wait_for(lambda: server.restarting is None, "the restart")
        np.testing.assert_array_equal(infer()["y"], 2)  # the first call after it is answered
        if kind == "async":
            anyio.run(owned.close)


@pytest.mark.server
def test_a_server_that_keeps_dying_is_let_go_with_the_reason_and_leaves_nothing(repository):
    with TritonServer(repository) as server:
        client = server.client("grpc", timeout=LIMIT_S)
        budget = CrashBudget()
        for n in range(budget.restarts):
            crash(server)
            wait_for(lambda n=n: len(server.crashes) > n and server.crashes[n].restarted_in is not None,
                     f"restart {n + 1}")
            assert client.ready("sturdy_bls")
        last = crash(server)
        assert server.wait(timeout=LIMIT_S) == -signal.SIGABRT
        with pytest.raises(ServerDiedError) as caught:
            client.infer("sturdy_bls", {"x": np.ones((1, 4), np.float32)})
        assert not isinstance(caught.value, ServerRestartingError)
        assert f"(pid {last}) died while in use (killed by SIGABRT)" in caught.value.message
        assert f"started again {budget.restarts} times within" in caught.value.message
        assert [c.restarted_in is None for c in server.crashes] == [False] * budget.restarts + [True]
        assert server_stubs(last) == [] and shm_regions(server.shm_prefix) == []


@pytest.mark.server
def test_without_restarts_a_dead_server_stays_dead_and_says_so(repository):
    with TritonServer(repository, restart_on_crash=False) as server:
        client = server.client("http", timeout=LIMIT_S)
        dead = crash(server)
        assert server.wait(timeout=LIMIT_S) == -signal.SIGABRT
        with pytest.raises(ServerDiedError, match=r"died while in use \(killed by SIGABRT\); start a new"):
            client.infer("sturdy_bls", {"x": np.ones((1, 4), np.float32)})
        assert server.crashes[0].pid == dead and server.crashes[0].restarted_in is None


def test_the_server_s_last_words_name_the_exception_that_ended_it():
    tail = (
        'I1125 05:59:49.041248 18363 model_lifecycle.cc:472] "loading: brittle__fragile:1"\n'
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
        "  what():  boost::interprocess::lock_exception\n"
        "Signal (6) received.\n"
        " 0# 0x000055D4 in tritonserver\n"
    )
    assert crash_reason(tail) == (
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'; "
        "what():  boost::interprocess::lock_exception"
    )
    assert crash_reason("Signal (11) received.\n 0# ...") == "Signal (11) received"
    assert crash_reason('I1125 model_lifecycle.cc:472] "loading: m:1"\n') == ""


def test_the_restart_budget_refills_as_its_window_passes(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    budget = CrashBudget(restarts=2, window_s=60)
    assert budget.spend()
    now[0] += 20
    assert budget.spend() and not budget.spend() and budget.left() == 0
    now[0] += 41  # the first restart is more than a window ago, the second is not
    assert budget.left() == 1 and budget.spend() and not budget.spend()


def test_a_swapped_in_stub_takes_the_place_of_the_one_it_replaces_whatever_its_name():
    from pipelines.triton.stubs import Stub, _slot

    # Triton names the first instance "m" at times and "m_0_0" after a reload: one place
    assert _slot(Stub(1, "m", "m")) == _slot(Stub(2, "m", "m_0_0")) == _slot(Stub(3, "m", "m_0"))
    assert _slot(Stub(1, "m", "m_0_1")) != _slot(Stub(2, "m", "m_0_0"))
    assert _slot(Stub(1, "m", "mine_0")) != _slot(Stub(2, "m", "m_0_0"))  # a group of the user's own name


def test_a_fatal_signal_in_the_log_since_the_last_start_says_the_server_is_going_down():
    from pipelines.triton.crashes import fatal_signal

    line = 'I1127 04:45:05.074449 10467 model_lifecycle.cc:472] "loading: m:1"'
    assert fatal_signal(line) is None
    assert fatal_signal(f"{line}\nSignal (6) received.\n{line}") == 6
    again = "W1127 04:45:13.0 10464 pipelines.triton] started again 3.26 s after it died; it answers again"
    assert fatal_signal(f"Signal (6) received.\n{again}\n{line}") is None  # the dead one's, not this one's
