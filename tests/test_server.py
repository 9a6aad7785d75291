"""The embedded Triton server: a user starts the real tritonserver on a repository, talks to it
over HTTP and gRPC, and finds nothing left behind however the server or its owner ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines.errors import (
    ClientTimeoutError,
    InferenceError,
    InputError,
    ServerDiedError,
    ServerError,
    ServerStartError,
    StepError,
    StepTimeoutError,
)
from pipelines.triton import (
    AsyncTritonClient,
    Ports,
    PythonBackendSettings,
    TritonClient,
    TritonServer,
    find_tritonserver,
)
from pipelines.triton.cleanup import SHM_TAG
from pipelines.triton.server import ModelsUnavailableWarning
from pipelines.triton.stubs import server_stubs

try:  # tests/ may or may not be a package
    from .server_fixtures import (
        leftovers,
        make_python_env,
        wait_for_no_leftovers,
        write_broken_repository,
        write_test_repository,
    )
except ImportError:
    from server_fixtures import (
        leftovers,
        make_python_env,
        wait_for_no_leftovers,
        write_broken_repository,
        write_test_repository,
    )

pytestmark = pytest.mark.server

PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return write_test_repository(tmp_path_factory.mktemp("repo"), ("double", "echo", "slow", "fail"))


SHM_DEFAULT, SHM_GROWTH = 2 * 2**20, 4 * 2**20


@pytest.fixture(scope="module")
def server(repository):
    settings = PythonBackendSettings(shm_default_byte_size=SHM_DEFAULT, shm_growth_byte_size=SHM_GROWTH)
    with TritonServer(repository, python_backend=settings) as running:
        workdir = running.workdir
        yield running
    assert leftovers(running.shm_prefix, str(repository)) == []
    assert workdir.name.startswith(SHM_TAG) and not workdir.exists(), "the temporary folder outlived the server"


@pytest.fixture(scope="module")
def small_repository(tmp_path_factory):
    return write_test_repository(tmp_path_factory.mktemp("small"), ("double",))


def test_the_bundled_binary_is_found():
    path = find_tritonserver()
    assert path.name == "tritonserver" and os.access(path, os.X_OK)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_doubles_over_each_protocol(server, protocol):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with server.client(protocol) as client:
        assert client.ready() and client.ready("double") and not client.ready("no_such_model")
        assert client.metadata()["name"] == "triton" and client.metadata()["version"]
        out = client.infer("double", {"x": x})
        assert set(out) == {"y", "z"}
        np.testing.assert_array_equal(out["y"], x * 2)
        assert out["y"].dtype == np.float32 and out["y"].shape == (2, 4)
        only_z = client.infer("double", {"x": x}, outputs=["z"])
        assert list(only_z) == ["z"]
        np.testing.assert_array_equal(only_z["z"], x + 1)
        # One name alone, and a name given twice, as p.run takes them.
        assert list(client.infer("double", {"x": x}, outputs="z")) == ["z"]
        assert list(client.infer("double", {"x": x}, outputs=["y", "y"])) == ["y"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bytes_bool_and_int64_travel_both_ways(server, protocol):
    text = np.array([b"a", b"bc", b""], dtype=object)
    with server.client(protocol) as client:
        out = client.infer(
            "echo", {"text": text, "flag": np.array([True, False]), "count": np.array([1, -2, 2**40], np.int64)}
        )
    assert list(out["text_out"]) == [b"a!", b"bc!", b"!"]
    np.testing.assert_array_equal(out["flag_out"], [False, True])
    assert out["flag_out"].dtype == np.bool_
    np.testing.assert_array_equal(out["count_out"], [3, -6, 3 * 2**40])
    assert out["count_out"].dtype == np.int64


def test_a_stubs_shared_memory_grows_by_the_step_it_is_given_and_stays(server):
    (stub,) = [s for s in server_stubs(server.pid) if s.model == "echo"]
    with open(f"/proc/{stub.pid}/cmdline", "rb") as f:
        region = Path("/dev/shm") / f.read().split(b"\0")[2].decode()  # the stub's own region
    assert region.name.startswith(server.shm_prefix)
    small = {"text": np.array([b"a"], dtype=object), "flag": np.array([True]), "count": np.array([1], np.int64)}
    big = {**small, "count": np.zeros(4 * 2**20, np.int64)}  # 32 MiB in, 32 MiB out
    with server.client("grpc") as client:
        client.infer("echo", small)
        before = region.stat().st_size
        client.infer("echo", big)
        grown = region.stat().st_size
        client.infer("echo", small)
    assert before >= SHM_DEFAULT and (grown - SHM_DEFAULT) % SHM_GROWTH == 0 and grown >= before + 2 * 32 * 2**20
    assert region.stat().st_size == grown, "the region shrank; docs/triton_server_failures.md says it never does"


def _stub_environment(server) -> dict[str, str]:
    stub = server_stubs(server.pid)[0]
    with open(f"/proc/{stub.pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)


def test_stubs_keep_the_memory_their_arrays_free_unless_told_not_to(server, small_repository):
    # glibc's malloc reads these at start: arrays under 32 MiB come from a heap that keeps what is freed
    env = _stub_environment(server)
    assert env.get("MALLOC_MMAP_THRESHOLD_") == str(32 << 20) and env.get("MALLOC_TRIM_THRESHOLD_") == str(64 << 20)
    with TritonServer(small_repository, python_backend=PythonBackendSettings(keep_freed_memory=False)) as plain:
        assert "MALLOC_MMAP_THRESHOLD_" not in _stub_environment(plain) or "MALLOC_MMAP_THRESHOLD_" in os.environ
    # a variable the user set wins over the setting
    with TritonServer(small_repository, env={"MALLOC_TRIM_THRESHOLD_": "4096"}) as mine:
        assert _stub_environment(mine)["MALLOC_TRIM_THRESHOLD_"] == "4096"


def test_python_backend_settings_are_data_and_not_passed_twice(tmp_path):
    with pytest.raises(ServerStartError, match=r"positive int"):
        PythonBackendSettings(shm_growth_byte_size=0)
    with pytest.raises(ServerStartError, match=r"python_backend=PythonBackendSettings\(shm_default_byte_size=\.\.\.\)"):
        TritonServer(tmp_path, extra_args=["--backend-config=python,shm-default-byte-size=4096"])
    with pytest.raises(ServerStartError, match=r"pass TritonServer's http_port= instead"):
        TritonServer(tmp_path, extra_args=["--http-port=1234"])
    # Each owned flag names what exists to set it.
    with pytest.raises(ServerStartError, match=r"pass TritonServer's exit_on_error= \(True also makes"):
        TritonServer(tmp_path, extra_args=["--strict-readiness=true"])
    with pytest.raises(ServerStartError, match=r"installation=TritonInstallation"):
        TritonServer(tmp_path, extra_args=["--backend-directory=/opt/backends"])


def test_one_blocking_client_serves_many_threads(server):
    with server.client("http") as client, ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda i: client.infer("double", {"x": np.full((1, 4), i, np.float32)})["y"], range(16))
        )
    for i, y in enumerate(answers):
        np.testing.assert_array_equal(y, np.full((1, 4), 2 * i))


def test_a_remote_style_client_reaches_the_server_by_url(server):
    with TritonClient(f"http://{server.http_url}") as client:
        np.testing.assert_array_equal(client.infer("double", {"x": np.ones((1, 4), np.float32)})["y"], 2)
    with TritonClient(server.grpc_url, "grpc") as client:
        assert client.ready("double")


def test_statistics_and_config_have_one_shape_for_both_protocols(server):
    with server.client("http") as http, server.client("grpc") as grpc:
        http.infer("double", {"x": np.ones((3, 4), np.float32)})
        stats = {"http": http.statistics("double"), "grpc": grpc.statistics("double")}
        for answer in stats.values():
            (model,) = answer["model_stats"]
            assert model["name"] == "double"
            assert model["inference_count"] >= 3 and isinstance(model["inference_count"], int)
            assert model["inference_stats"]["success"]["count"] >= 1
        assert _shape(stats["http"]) == _shape(stats["grpc"])
        assert {m["name"] for m in http.statistics()["model_stats"]} >= {"double", "echo", "slow", "fail"}
        config = {"http": http.model_config("double"), "grpc": grpc.model_config("double")}
        assert config["http"] == config["grpc"]
        assert config["grpc"]["max_batch_size"] == 8
        assert config["grpc"]["input"][0]["dims"] == [4] and config["grpc"]["input"][0]["data_type"] == "TYPE_FP32"
        assert http.repository_index() == grpc.repository_index()
        assert {m["state"] for m in grpc.repository_index()} == {"READY"}


def _shape(value):
    """The keys of nested dicts (list items merged), without the values."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_step_error_keeps_the_servers_words(server, protocol):
    with server.client(protocol) as client:
        with pytest.raises(InferenceError, match=r"step 'fail' refused: input x is negative") as caught:
            client.infer("fail", {"x": np.ones(1, np.float32)})
        assert caught.value.step == "fail"
        with pytest.raises(InferenceError, match=r"unexpected shape for input 'x'"):
            client.infer("double", {"x": np.ones((2, 3), np.float32)})
        with pytest.raises(InferenceError, match=r"unknown model"):
            client.infer("no_such_model", {"x": np.ones((1, 4), np.float32)})


def test_an_array_without_a_triton_datatype_is_an_input_error(server):
    with server.client() as client, pytest.raises(InputError, match=r"input 'x'.*complex"):
        client.infer("double", {"x": np.ones((1, 4), np.complex64)})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_request_past_its_timeout_fails_fast_and_the_client_still_works(server, protocol):
    with server.client(protocol) as client:
        # the 3 s step would have answered, not raised: the error is the timeout's
        with pytest.raises(ClientTimeoutError, match=r"model 'slow' got no answer within 0.3 s") as caught:
            client.infer("slow", {"seconds": np.array([3.0], np.float32)}, timeout=0.3)
        assert caught.value.step == "slow" and not isinstance(caught.value, StepTimeoutError)
        out = client.infer("slow", {"seconds": np.array([0.0], np.float32)}, timeout=30)
        np.testing.assert_array_equal(out["done"], [0.0])
        np.testing.assert_array_equal(client.infer("double", {"x": np.ones((1, 4), np.float32)})["y"], 2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_async_client_runs_requests_concurrently(server, protocol):
    async def main():
        async with server.async_client(protocol) as client:
            assert await client.ready("double")
            results = [None] * 8

            async def one(i):
                results[i] = await client.infer("double", {"x": np.full((1, 4), i, np.float32)})

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
            for i, out in enumerate(results):
                np.testing.assert_array_equal(out["y"], np.full((1, 4), 2 * i))
            assert list(await client.infer("double", {"x": np.ones((1, 4), np.float32)}, outputs=["z"])) == ["z"]
            assert list(await client.infer("double", {"x": np.ones((1, 4), np.float32)}, outputs="z")) == ["z"]
            with pytest.raises(ClientTimeoutError, match="slow"):
                await client.infer("slow", {"seconds": np.array([3.0], np.float32)}, timeout=0.3)
            with pytest.raises(InferenceError, match="step 'fail' refused"):
                await client.infer("fail", {"x": np.ones(1, np.float32)})
            assert (await client.statistics("double"))["model_stats"][0]["name"] == "double"
            assert (await client.model_config("double"))["max_batch_size"] == 8
            assert (await client.metadata())["name"] == "triton"

    anyio.run(main)
    # A plain client by URL is the same class the load generator uses against a remote server.
    assert AsyncTritonClient(server.http_url).url == server.http_url


def test_two_servers_at_once_get_their_own_ports_and_exit_clean(server, small_repository, monkeypatch):
    # Replay the race where another process binds the chosen ports first: the first choice
    # is the running server's ports, so the second server must choose again and still start.
    from pipelines.triton import server as server_module

    real_choose, calls = server_module.choose_ports, []

    def taken_first(fixed, host):
        calls.append(fixed)
        if len(calls) == 1:
            return Ports(
                *(
                    int(url.rsplit(":", 1)[-1].split("/")[0])
                    for url in (server.http_url, server.grpc_url, server.metrics_url)
                )
            )
        return real_choose(fixed, host)

    monkeypatch.setattr(server_module, "choose_ports", taken_first)
    with TritonServer(small_repository) as second:
        assert len(calls) == 2, "the first, taken, ports should have been replaced"
        urls = {server.http_url, server.grpc_url, server.metrics_url}
        assert not urls & {second.http_url, second.grpc_url, second.metrics_url}
        assert len({u.rsplit(":", 1)[-1] for u in (second.http_url, second.grpc_url)}) == 2
        with second.client() as client, server.client() as first:
            np.testing.assert_array_equal(client.infer("double", {"x": np.ones((1, 4), np.float32)})["y"], 2)
            np.testing.assert_array_equal(first.infer("double", {"x": np.ones((1, 4), np.float32)})["y"], 2)
        assert leftovers(second.shm_prefix), "the stub and its shared memory should be visible while running"
        prefix = second.shm_prefix
    assert leftovers(prefix, str(small_repository)) == []
    assert not second.running
    with pytest.raises(ServerDiedError, match="stopped"):
        second.check_alive()


def test_a_fixed_port_in_use_fails_start_and_says_so(server, small_repository):
    taken = int(server.http_url.rsplit(":", 1)[-1])
    with pytest.raises(
        ServerStartError, match=rf"exited during start-up \(exit code 1\); port {taken} is already in use"
    ):
        TritonServer(small_repository, http_port=taken, grpc_port=None).start()


class Finalizes:
    """A step whose finalize() leaves a file behind: the proof that Triton unloaded it properly."""

    def initialize(self, config):
        self.marker = Path(config["parameters"]["marker"])

    def execute(self, x):
        return {"y": x + 1}

    def finalize(self):
        self.marker.write_text("finalized")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_leaving_the_context_closes_its_clients_and_finalizes_the_steps(tmp_path, protocol):
    from pipelines import Pipeline, TensorSpec, step
    from pipelines.compile import compile_pipeline

    spec, marker = TensorSpec("FP32", [4]), tmp_path / "finalized"
    finalizes = step(Finalizes, inputs={"x": spec}, outputs={"y": spec}, parameters={"marker": str(marker)})
    pipeline = Pipeline("fin", inputs={"x": spec}, max_batch_size=4)
    pipeline.output("y", pipeline.add(finalizes, x=pipeline.input("x"))["y"])
    repository = compile_pipeline(pipeline, "ensemble").write(tmp_path / "repo")
    x = np.ones((1, 4), np.float32)
    with TritonServer(repository) as server:
        # Left open on purpose: an open HTTP connection used to hold Triton for its whole
        # exit timeout, after which it exited without finalizing any model.
        client, remote = server.client(protocol), TritonClient(server.http_url)
        async_client = server.async_client(protocol)
        np.testing.assert_array_equal(client.infer("fin", {"x": x})["y"], 2)
        np.testing.assert_array_equal(remote.infer("fin", {"x": x})["y"], 2)
        anyio.run(async_client.infer, "fin", {"x": x})
        assert not marker.exists()
    assert marker.read_text() == "finalized"
    with pytest.raises(ServerError, match="is stopped; start it again"):
        client.infer("fin", {"x": x})


def test_a_killed_server_makes_the_next_call_fail_fast(small_repository):
    # Not started again (tests/test_server_crash.py has the restarts): a call fails fast, and says so.
    with TritonServer(small_repository, restart_on_crash=False) as doomed:
        client = doomed.client("grpc")
        http = doomed.client("http")
        assert client.ready("double")
        os.kill(doomed.pid, signal.SIGKILL)
        for each in (client, http):  # the death itself, named: not a connection error or a timeout
            with pytest.raises(ServerDiedError, match=r"died while in use \(killed by SIGKILL\)"):
                each.infer("double", {"x": np.ones((1, 4), np.float32)})
        assert not each.ready()
        # Detecting the death already removed what the server left: its stub and shared memory.
        assert leftovers(doomed.shm_prefix, str(small_repository)) == []
    assert leftovers(doomed.shm_prefix, str(small_repository)) == []


def test_explicit_mode_loads_and_unloads_and_an_exception_stops_the_server(small_repository):
    with pytest.raises(RuntimeError, match="user code failed"):
        with TritonServer(small_repository, model_control_mode="explicit", load_models=["double"]) as doomed:
            client = doomed.client()
            assert client.ready("double")
            doomed.unload_model("double")
            assert not client.ready("double")
            assert {m["name"]: m["state"] for m in doomed.models()} == {"double": "UNAVAILABLE"}
            doomed.load_model("double")
            assert client.ready("double")
            with pytest.raises(InferenceError, match="no_such_model"):
                doomed.load_model("no_such_model")
            prefix = doomed.shm_prefix
            raise RuntimeError("user code failed")
    assert leftovers(prefix, str(small_repository)) == []


def test_a_model_that_fails_to_load_is_named_and_the_others_are_served(tmp_path):
    # One pipeline's broken step must not take a shared repository's other models down.
    repository = write_broken_repository(write_test_repository(tmp_path / "repo", ("double",)))
    with pytest.warns(ModelsUnavailableWarning, match=r"serves its other models, but 1 cannot answer: 'broken': .*"
                      r"broken model cannot be imported"), TritonServer(repository) as server:
        assert list(server.unavailable) == ["broken"]
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        with server.client("http") as client:
            np.testing.assert_array_equal(client.infer("double", {"x": x})["y"], x * 2)
            with pytest.raises(InferenceError, match=r"model 'broken' failed to load when the server started: "
                               r".*broken model cannot be imported"):
                client.infer("broken", {"x": x})
        server.require(["double"])
        with pytest.raises(ServerStartError, match=r"could not load 'broken': .*broken model cannot be imported"):
            server.require(["double", "broken"])


class WontLoad:
    """A step whose initialize() fails, as one whose weights are missing."""

    def initialize(self, config):
        raise RuntimeError("weights file missing")

    def execute(self, x):
        return {"y": x}


def test_a_request_to_a_pipeline_whose_step_failed_to_load_says_which_step_and_why(tmp_path):
    from pipelines import Pipeline, TensorSpec, step

    v = TensorSpec("FP32", [2])
    p = Pipeline("wont", inputs={"x": v}, max_batch_size=4)
    p.output("y", p.add(step(WontLoad, name="loader", inputs={"x": v}, outputs={"y": v}), x=p.input("x"))["y"])
    p.compile("all").write(tmp_path / "repo")
    x = np.zeros((1, 2), np.float32)
    with pytest.warns(ModelsUnavailableWarning), TritonServer(tmp_path / "repo") as server:
        assert set(server.unavailable) == {"wont__loader", "wont_ensemble", "wont_fused", "wont_bls", "wont_bls_sync"}
        # Triton lists the BLS models READY: their step is called from their code.
        assert server.unavailable["wont_bls"] == ("loaded, but it calls 'wont__loader', which failed to load: "
                                                  "every request to it fails")
        with server.client("grpc") as client:
            # Triton says only "unknown model" for the ensemble it left unloaded, and "not ready" for the step.
            with pytest.raises(InferenceError, match=r"model 'wont_ensemble' failed to load when the server "
                               r"started: not loaded: an ensemble calling 'wont__loader', which failed to load"):
                client.infer("wont_ensemble", {"x": x})
            with pytest.raises(StepError, match=r"model 'wont__loader' failed to load when the server started: "
                               r".*RuntimeError: weights file missing"):
                client.infer("wont_bls", {"x": x})
            with pytest.raises(InferenceError, match=r"'wont_fused' failed to load when the server started: "
                               r".*weights file missing"):
                client.infer("wont_fused", {"x": x})


def test_a_repository_whose_path_has_a_space_and_non_ascii_letters_is_served(tmp_path):
    # Triton 2.51's Python backend splits its stub's arguments at spaces and reads them as ASCII.
    repository = write_test_repository(tmp_path / "my models ü", ("double",))
    with TritonServer(repository, startup_timeout=60) as server, server.client("grpc") as client:
        assert server.unavailable == {}
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("double", {"x": x})["y"], x * 2)


@pytest.mark.parametrize("mode", ["poll", "explicit"])
def test_every_model_asked_for_that_cannot_answer_is_named_with_its_reason(tmp_path, mode):
    # Poll mode retries a failed model (LOADING when the server is up); Triton leaves a folder it
    # refuses before loading (no version folder) out of its index; explicit names may be wrong.
    repository = write_broken_repository(write_test_repository(tmp_path / "repo", ("double",)))
    (repository / "noversion").mkdir()
    (repository / "noversion" / "config.pbtxt").write_text('name: "noversion"\nbackend: "python"\n')
    (repository / "notes").mkdir()
    (repository / "notes" / "README.md").write_text("not a model\n")
    load = ("double", "typo") if mode == "explicit" else ()
    with pytest.warns(ModelsUnavailableWarning), TritonServer(repository, model_control_mode=mode,
                                                             load_models=load) as server:
        why = server.unavailable
        if mode == "explicit":
            assert list(why) == ["typo"] and "not found" in why["typo"]
        else:
            assert sorted(why) == ["broken", "notes", "noversion"]
            assert "broken model cannot be imported" in why["broken"]
            assert "at least one version must be available" in why["noversion"]
            assert "backend" in why["notes"]
        server.require(["double"])
        with pytest.raises(ServerStartError, match=r"'nope': the repository holds no model 'nope'"):
            server.require(["double", "nope"])
        with server.client("http") as client:
            x = np.ones((1, 4), np.float32)
            np.testing.assert_array_equal(client.infer("double", {"x": x})["y"], x * 2)


def test_a_broken_repository_fails_start_with_the_log_tail_where_asked_to(tmp_path):
    repository = write_broken_repository(tmp_path / "broken_repo")
    with pytest.raises(ServerStartError, match=r"broken model cannot be imported") as caught:
        TritonServer(repository, exit_on_error=True).start()
    # the server exited on the error, not waited out its start-up timeout
    assert "--- log tail ---" in str(caught.value) and "exited during start-up" in str(caught.value)
    assert leftovers(str(repository)) == []


def test_a_staging_directory_left_inside_a_repository_is_named_where_it_fails_the_start(tmp_path):
    # Inside a mount-point repository a write stages its models in the repository itself; one
    # it could not remove makes Triton fail on it as on a model.
    repository = write_test_repository(tmp_path / "repo", ("double",))
    (repository / ".pipelines-write-k1x2" / "models").mkdir(parents=True)
    with pytest.raises(ServerStartError, match=r"holds '\.pipelines-write-k1x2', the staging of a write"):
        TritonServer(repository, exit_on_error=True).start()
    with TritonServer(repository) as server, server.client("http") as client:  # served, the leftover aside
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("double", {"x": x})["y"], x * 2)


def test_a_bad_argument_fails_start_with_the_log_tail(small_repository):
    with pytest.raises(ServerStartError, match=r"(?s)exited during start-up.*no-such-flag"):
        TritonServer(small_repository, extra_args=["--no-such-flag=1"]).start()


def test_start_needs_a_repository_directory(tmp_path):
    with pytest.raises(ServerStartError, match="not a directory"):
        TritonServer(tmp_path / "missing").start()
    with pytest.raises(ServerStartError, match="model_control_mode"):
        TritonServer(tmp_path, model_control_mode="sometimes")


@pytest.fixture(scope="module")
def other_env(tmp_path_factory):
    """A fresh venv with numpy<2 only: a stub run there finds its packages there, not in ours."""
    return make_python_env(tmp_path_factory.mktemp("other") / "env", "numpy<2")


def test_models_run_in_another_python_environment(tmp_path, other_env):
    repository = write_test_repository(tmp_path / "repo", ("where", "double"))
    with TritonServer(repository, python_env=other_env) as server, server.client() as client:
        prefix, numpy_version, has_pipelines = client.infer("where", {"x": np.zeros(1, np.float32)})["where"]
        np.testing.assert_array_equal(client.infer("double", {"x": np.ones((1, 4), np.float32)})["y"], 2)
    assert (Path(prefix.decode()), numpy_version.startswith(b"1."), has_pipelines) == (other_env, True, b"False")


# `pipelines serve` with Ctrl-C as a terminal gives it, whatever the test run's own SIGINT (a
# run started in the background ignores it, and its children inherit that).
_CTRL_C = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from pipelines.cli import main"


def test_pipelines_serve_dir_takes_the_stubs_environment_and_shared_memory(tmp_path, other_env):
    repository = write_test_repository(tmp_path / "repo", ("where",))
    served = subprocess.Popen(
        [sys.executable, "-c", f"{_CTRL_C}; sys.exit(main())", "serve", str(repository), "--python-env", str(other_env),
         "--shm-default-byte-size", str(3 * 2**20)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        printed = []
        for line in served.stdout:
            printed.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        text = "".join(printed)
        assert text.endswith("Press Ctrl-C to stop.\n"), text + served.stderr.read()
        pid = int(re.search(r"\(pid (\d+)\)", text).group(1))
        http = re.search(r"HTTP +(\S+)", text).group(1)
        with TritonClient(f"http://{http}") as client:
            prefix = client.infer("where", {"x": np.zeros(1, np.float32)})["where"][0]
        (stub,) = server_stubs(pid)
        with open(f"/proc/{stub.pid}/cmdline", "rb") as f:
            region = Path("/dev/shm") / f.read().split(b"\0")[2].decode()
        assert (Path(prefix.decode()), region.stat().st_size) == (other_env, 3 * 2**20)
        served.send_signal(signal.SIGINT)
        assert "stopped" in served.communicate(timeout=60)[0] and served.returncode == 0
    finally:
        if served.poll() is None:
            served.kill()
        served.wait()


def test_pipelines_serve_refuses_a_bad_size_and_local_refuses_the_servers_own_flags(capsys):
    from pipelines.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "x", "--shm-growth-byte-size", "-1"])
    assert "--shm-growth-byte-size: expected a positive number of bytes" in capsys.readouterr().err
    assert main(["serve", "--local", "pipelines.examples.basic:diamond", "--python-env", "/venv"]) == 2
    assert "--python-env: for a model repository on the bundled Triton server" in capsys.readouterr().err


def test_a_python_environment_that_cannot_serve_is_refused_before_start(tmp_path):
    with pytest.raises(ServerStartError, match=r"has no bin/python; pass the root of a virtual environment"):
        TritonServer(tmp_path, python_env=tmp_path / "nowhere")
    bare = make_python_env(tmp_path / "bare")
    with pytest.raises(ServerStartError, match=r"has no numpy.*pip install 'numpy<2'"):
        TritonServer(tmp_path, python_env=bare)


# Ctrl-C as a terminal gives it, set in the owner's own Python: a test run started in the
# background (nohup, `cmd &` in a script) ignores SIGINT, and its children inherit that.
_OWNER = """
import signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from pipelines.triton import TritonServer, serve_main

repository, style = sys.argv[1], sys.argv[2]
if style == "serve":  # what `pipelines serve DIR` runs: a 'with' block waiting for Ctrl-C
    raise SystemExit(serve_main(repository))
servers = []
# No 'with': atexit, or the watchdog once the owner is gone, cleans up.
starter = threading.Thread(target=lambda: servers.append(TritonServer(repository).start()))
if style == "thread":  # the server's starting thread ends long before its owner does
    starter.start()
    starter.join()
else:
    starter.run()
print("workdir", servers[0].workdir, flush=True)
print("Press Ctrl-C", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize(
    ("style", "signum"),
    [
        ("serve", signal.SIGINT),
        ("bare", signal.SIGINT),
        ("bare", signal.SIGTERM),
        ("bare", signal.SIGKILL),
        ("thread", signal.SIGKILL),
    ],
    ids=[
        "serve-main-ctrl-c",
        "sigint-without-with",
        "sigterm-to-owner",
        "sigkill-to-owner",
        "sigkill-started-in-thread",
    ],
)
def test_a_signal_to_the_owning_process_leaves_nothing_behind(tmp_path, style, signum):
    repository = write_test_repository(tmp_path / "owned", ("double",))
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(_OWNER))
    owner = subprocess.Popen(
        [sys.executable, str(script), str(repository), style], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    ours = (f"{SHM_TAG}-{owner.pid}-", str(repository))
    try:
        printed = []
        for line in owner.stdout:
            printed.append(line.decode())
            if line.startswith(b"Press Ctrl-C"):
                break
        assert printed and printed[-1].startswith("Press Ctrl-C"), "".join(printed) + owner.stderr.read().decode()
        assert any("triton_python_backend_stub" in item for item in leftovers(*ours))
        workdirs = [Path(line.split(" ", 1)[1].strip()) for line in printed if line.startswith("workdir ")]
        assert all(w.is_dir() and w.name.startswith(SHM_TAG) for w in workdirs)
        owner.send_signal(signum)
        rest = owner.communicate(timeout=60)[0].decode()
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()
    if style == "serve":
        text = "".join(printed)
        assert re.search(r"HTTP +127\.0\.0\.1:\d+", text) and re.search(r"gRPC +127\.0\.0\.1:\d+", text)
        assert re.search(r"double +1 +READY", text)
        assert owner.returncode == 0 and "stopped" in rest
    # A SIGTERM or SIGKILL ends the owner outright; its watchdog then stops the server.
    assert wait_for_no_leftovers(*ours, timeout=10, paths=tuple(workdirs)) == []
