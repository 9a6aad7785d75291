"""Bad input, failing steps and stuck steps on the real tritonserver: through the compiled
``_ensemble``, ``_bls`` and ``_bls_sync`` a user gets an error that names the tensor or the
step, expected against given, and the server goes on answering everyone else."""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines import DynamicBatching, Pipeline, TensorSpec, step
from pipelines.compile import compile_pipeline
from pipelines.errors import ClientTimeoutError, InferenceError, InputError, StepTimeoutError
from pipelines.examples import failing_branch as fb
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

FORMS = ("ensemble", "bls", "bls_sync")
PROTOCOLS = ("http", "grpc")
F4 = TensorSpec("FP32", [4])
K = TensorSpec("INT32", [1])
MAX_BATCH = 4
# A stuck step waits at most this long for the test to release it, so the server never hangs.
STUCK_S = 10.0
STUCK_MARKER = 999.0
TOKENS = itertools.count(1)  # one release file per stuck request


# ----------------------------------------------------------------- the steps


@step(inputs={"x": F4}, outputs={"y": F4}, dynamic_batching=DynamicBatching(max_queue_delay_us=20_000))
def guard(x):
    if (x < 0).any():
        raise ValueError(f"negative value {x.min():g} in x")
    return {"y": x + 1}


@step(inputs={"y": F4, "k": K}, outputs={"z": F4}, dynamic_batching=DynamicBatching(max_queue_delay_us=20_000))
def weigh(y, k):
    return {"z": y * k.astype(np.float32)}


@step(inputs={"x": F4}, outputs={"total": TensorSpec("FP64", [1])})
def total(x):
    return {"total": x.sum(axis=1, keepdims=True, dtype=np.float64)}


# What a row whose first value is the marker makes `misbehave` do, and what the user must read.
MISDEEDS = {
    "raises": (101.0, r"raised ValueError: refusing row marked 101"),
    "wrong_dtype": (102.0, r"output 'y' has dtype float64; it declares FP32 \(float32\); cast it"),
    "wrong_shape": (103.0, r"output 'y' has shape \[1, 3\]; it declares \[1, 4\]"),
    "omits_output": (104.0, r"did not return output\(s\) \['y'\]; it returned \['n'\]"),
    "drops_a_row": (105.0, r"output 'y' has shape \[0, 4\]; expected the batch dimension 1 first"),
    "exits": (106.0, r"raised StepExited: sys\.exit\(3\) was called; a step returns its outputs or raises"),
}


def culprit(form: str) -> str:
    """How each form names the failing step: the wire format (pipelines.serving.WireError), after
    the ensemble's own words; the BLS executor says the adapter's words again."""
    where = re.escape("StepError in pipeline 'wayward', node 'misbehave', step 'misbehave'") + r"(, tensor '\w+')?: "
    if form == "ensemble":
        return re.escape("in ensemble 'wayward_ensemble', ") + where
    return where


class Misbehave:
    """Breaks its contract as the markers say; logs the first value of each row of each call."""

    def initialize(self, config):
        self.log = Path(config["parameters"]["log_dir"]) / "calls.log"

    def execute(self, x):
        with open(self.log, "a") as f:
            f.write(" ".join(f"{v:g}" for v in x[:, 0]) + "\n")
        return _misbehave(x)


def _misbehave(x):
    marks = set(x[:, 0].tolist())
    y, n = x * 2, np.full((x.shape[0], 1), x.shape[0], np.int32)
    if 101.0 in marks:
        raise ValueError("refusing row marked 101")
    if 102.0 in marks:
        return {"y": y.astype(np.float64), "n": n}
    if 103.0 in marks:
        return {"y": y[:, :3].copy(), "n": n}
    if 104.0 in marks:
        return {"n": n}
    if 105.0 in marks:
        return {"y": y[:-1].copy(), "n": n}
    if 106.0 in marks:
        sys.exit(3)
    return {"y": y, "n": n}


@step(inputs={"y": F4}, outputs={"z": F4})
def plus_one(y):
    return {"z": y + 1}


class Hang:
    """Sleeps while the first value is the marker, until the test drops its release file."""

    def initialize(self, config):
        self.directory = Path(config["parameters"]["release_dir"])

    def held(self, x):
        """Yields while a request with the marker waits for its release file (at most STUCK_S)."""
        if x[0, 0] != STUCK_MARKER:
            return
        token = f"release-{int(x[0, 1])}"
        deadline = time.monotonic() + STUCK_S
        while time.monotonic() < deadline:
            if (self.directory / token).exists() or (self.directory / "release-all").exists():
                return
            yield

    def execute(self, x):
        for _ in self.held(x):
            time.sleep(0.01)
        return {"y": x * 3}


@step(inputs={"x": TensorSpec("FP32", [2, 3])}, outputs={"y": TensorSpec("FP32", [2, 3])})
def flip(x):
    return {"y": x[::-1].copy()}


# ------------------------------------------------------------- the pipelines


def strict_pipeline():
    """Two inputs, a chain and a branch; `guard` raises on negative values."""
    p = Pipeline("strict", inputs={"x": F4, "k": K}, max_batch_size=MAX_BATCH)
    g = p.add(guard, x=p.input("x"))
    w = p.add(weigh, y=g["y"], k=p.input("k"))
    t = p.add(total, x=p.input("x"))
    p.output("z", w["z"])
    p.output("total", t["total"])
    return p


def strict_reference(x, k):
    return {"z": (x + 1) * k.astype(np.float32), "total": x.sum(axis=1, keepdims=True, dtype=np.float64)}


def wayward_pipeline(log_dir: Path):
    misbehave = step(
        Misbehave, name="misbehave", inputs={"x": F4}, outputs={"y": F4, "n": K},
        dynamic_batching=DynamicBatching(max_queue_delay_us=100_000), parameters={"log_dir": str(log_dir)},
    )
    p = Pipeline("wayward", inputs={"x": F4}, max_batch_size=8)
    m = p.add(misbehave, x=p.input("x"))
    o = p.add(plus_one, y=m["y"])
    p.output("z", o["z"])
    p.output("n", m["n"])
    return p


def stuck_pipeline(release_dir: Path):
    hang = step(
        Hang, name="hang", inputs={"x": F4}, outputs={"y": F4},
        instance_count=2, parameters={"release_dir": str(release_dir)},
    )
    p = Pipeline("stuck", inputs={"x": F4}, max_batch_size=MAX_BATCH)
    h = p.add(hang, x=p.input("x"))
    p.output("y", h["y"])
    return p


def flat_pipeline():
    p = Pipeline("flat", inputs={"x": TensorSpec("FP32", [2, 3])}, max_batch_size=0)
    f = p.add(flip, x=p.input("x"))
    p.output("y", f["y"])
    return p


class Follow:
    """Runs after `brittle`; logs the tags (second values) of the rows it was called on."""

    def initialize(self, config):
        self.log = Path(config["parameters"]["log_dir"]) / "follow.log"

    def execute(self, x):
        with open(self.log, "a") as f:
            f.write(" ".join(f"{v / 2:g}" for v in x[:, 1]) + "\n")  # brittle doubled the tag
        return {"y": x - 1}


@step(inputs={"a": F4, "b": F4}, outputs={"y": F4})
def last(a, b):
    if (a[:, 2] == 13).any():
        raise ValueError("unlucky 13 in the last step")
    return {"y": a * b}


class Nap(Hang):
    """Hangs like `Hang` on the marker; declared with a `timeout`, which the BLS forms enforce."""


class Doze(Hang):
    """`Nap` as an ``async def``: the fused model cancels it at its timeout instead of abandoning it."""

    async def execute(self, x):
        for _ in self.held(x):
            await asyncio.sleep(0.01)
        return {"y": x * 3}


NAP_TIMEOUT_S = 2.0


def maze_pipeline(log_dir: Path):
    """A failing branch with a chain after it, two joins (one step model for both), and a last step
    that fails too: x -> brittle -> follow -> join -> join2 -> last, x -> plus_one -> every join and last."""
    follow = step(Follow, name="follow", inputs={"x": F4}, outputs={"y": F4}, parameters={"log_dir": str(log_dir)})
    p = Pipeline("maze", inputs={"x": F4}, max_batch_size=8)
    b = p.add(fb.brittle, x=p.input("x"))
    f = p.add(follow, x=b["y"])
    r = p.add(fb.plus_one, x=p.input("x"))
    j1 = p.add(fb.join, a=f["y"], b=r["y"])
    j2 = p.add(fb.join, name="join2", a=j1["y"], b=r["y"])
    z = p.add(last, a=j2["y"], b=r["y"])
    p.output("z", z["y"])
    p.output("followed", f["y"])
    return p


def maze_reference(x):
    return {"z": (4 * x + 1) * (x + 1), "followed": 2 * x - 1}


def nap_pipeline(release_dir: Path, kind: type = Nap, name: str = "napping"):
    nap = step(
        kind, name="nap", inputs={"x": F4}, outputs={"y": F4}, timeout=NAP_TIMEOUT_S,
        instance_count=2, parameters={"release_dir": str(release_dir)},
    )
    p = Pipeline(name, inputs={"x": F4}, max_batch_size=MAX_BATCH)
    p.output("y", p.add(nap, x=p.input("x"))["y"])
    return p


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("release")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("calls")


@pytest.fixture(scope="module")
def server(tmp_path_factory, release_dir, log_dir):
    repos = [
        compile_pipeline(strict_pipeline(), "both"),
        compile_pipeline(wayward_pipeline(log_dir), "both"),
        # A Python model runs one execute at a time, async or not, so a stuck request holds
        # its BLS instance: a second instance keeps the BLS forms answering meanwhile.
        compile_pipeline(stuck_pipeline(release_dir), "both", bls_instance_count=2),
        # Triton refuses bad requests before any model runs, the same for every form: one form will do.
        compile_pipeline(flat_pipeline(), "ensemble"),
        compile_pipeline(fb.make_failing_diamond(), "both"),
        # The same diamond answering through a gate model (a branch's output is exposed too).
        compile_pipeline(fb.make_failing_diamond("failing_gated", expose_branch=True), "ensemble"),
        compile_pipeline(maze_pipeline(log_dir), "both"),
        compile_pipeline(nap_pipeline(release_dir), "all"),
        compile_pipeline(nap_pipeline(release_dir, Doze, "dozing"), "fused"),
    ]
    root = repos[0].merge(*repos[1:]).write(tmp_path_factory.mktemp("failures") / "repo")
    # Nothing is in flight at the end; a short exit timeout spares the wait for Triton's unloading.
    with TritonServer(root, exit_timeout=1) as running:
        try:
            yield running
        finally:
            (release_dir / "release-all").touch()  # nothing stuck may hold the server's exit


@pytest.fixture(scope="module", params=PROTOCOLS)
def client(request, server):
    with server.client(request.param, timeout=60) as c:
        yield c


def good_strict(seed: int, batch: int = 2) -> dict:
    x = (seed * 8 + np.arange(batch * 4, dtype=np.float32).reshape(batch, 4) * 0.125).astype(np.float32)
    return {"x": x, "k": np.full((batch, 1), seed % 7 + 1, np.int32)}


def assert_answer(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# ------------------------------------------------- bad requests, named precisely

GOOD = good_strict(3)
# name -> (request, what the error must say: the tensor, and expected against given)
BAD_REQUESTS = {
    "wrong_dtype": (
        {"x": GOOD["x"].astype(np.float64), "k": GOOD["k"]},
        r"input 'x' expects dtype FP32 \(float32\) but was given float64",
    ),
    "wrong_rank": (
        {"x": GOOD["x"][..., None], "k": GOOD["k"]},
        r"input 'x' expects rank 2 FP32 \[batch, 4\] but was given shape \[2, 4, 1\] \(rank 3\)",
    ),
    "batch_dimension_left_out": (
        {"x": GOOD["x"][0], "k": GOOD["k"][:1]},
        r"input 'x' expects rank 2 FP32 \[batch, 4\] but was given shape \[4\] \(rank 1\); "
        r"the batch dimension is missing",
    ),
    "wrong_fixed_dimension": (
        {"x": np.ones((2, 5), np.float32), "k": GOOD["k"]},
        r"input 'x' expects shape FP32 \[batch, 4\] but was given \[2, 5\]: dimension 1 is 5, expected 4",
    ),
    "batch_above_max": (
        good_strict(4, batch=MAX_BATCH + 1),
        rf"input 'x' has batch size {MAX_BATCH + 1} \(shape \[{MAX_BATCH + 1}, 4\]\) but max_batch_size is {MAX_BATCH}",
    ),
    "batch_sizes_disagree": (
        {"x": GOOD["x"], "k": np.ones((3, 1), np.int32)},
        r"inputs 'x' and 'k' have batch sizes 2 and 3",
    ),
    "missing_input": (
        {"x": GOOD["x"]},
        r"input 'k' \(INT32 \[1\]\) is missing; expected inputs \['x', 'k'\], given \['x'\]",
    ),
    "extra_input": (
        {**GOOD, "w": np.ones((2, 1), np.float32)},
        r"got input 'w', which is not declared; expected inputs \['x', 'k'\], given \['x', 'k', 'w'\]",
    ),
    "empty_batch": (
        {"x": np.ones((0, 4), np.float32), "k": np.ones((0, 1), np.int32)},
        r"input 'x' is an empty batch \(shape \[0, 4\]\); send at least one row of FP32 \[batch, 4\]",
    ),
    "bytes_for_numbers": (
        {"x": np.array([[b"1", b"2", b"3", b"4"]] * 2, dtype=object), "k": GOOD["k"]},
        r"input 'x' expects FP32 numbers \(float32\) but was given a BYTES payload",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
@pytest.mark.parametrize("form", FORMS)
def test_a_bad_request_names_the_tensor_expected_against_given(client, form, case):
    model = f"strict_{form}"
    request, said = BAD_REQUESTS[case]
    with pytest.raises(InputError) as caught:
        client.infer(model, request)
    text = str(caught.value)
    assert re.search(said, text), text
    assert text.startswith(f"model {model!r} refused the request: ")
    assert "[Triton: " in text  # the server's own words are kept too
    # The server is unharmed: the next good request gets its answer.
    assert_answer(client.infer(model, GOOD), strict_reference(**GOOD))


@pytest.mark.parametrize(
    ("x", "said"),
    [
        (np.ones((1, 2, 3), np.float32), r"input 'x' expects rank 2 FP32 \[2, 3\] but was given shape \[1, 2, 3\]"),
        (np.ones((2, 4), np.float32), r"expects shape FP32 \[2, 3\] but was given \[2, 4\]: dimension 1 is 4, expected 3"),
    ],
    ids=["wrong_rank", "wrong_fixed_dimension"],
)
def test_a_pipeline_without_batching_checks_every_dimension(client, x, said):
    with pytest.raises(InputError, match=said):
        client.infer("flat", {"x": x})
    good = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(client.infer("flat", {"x": good})["y"], good[::-1])


# ------------------------------------------------------------- failing steps


def marked(marker: float, seed: float = 1.0) -> np.ndarray:
    x = np.full((1, 4), seed, np.float32)
    x[0, 0] = marker
    return x


@pytest.mark.parametrize("misdeed", list(MISDEEDS))
@pytest.mark.parametrize("form", FORMS)
def test_a_failing_step_is_named_with_what_it_did_wrong(client, form, misdeed):
    marker, said = MISDEEDS[misdeed]
    with pytest.raises(InferenceError) as caught:
        client.infer(f"wayward_{form}", {"x": marked(marker)})
    text = str(caught.value)
    assert not isinstance(caught.value, InputError), text
    assert re.match(culprit(form) + said, text), text
    assert (caught.value.pipeline, caught.value.step) == ("wayward", "misbehave")  # the step, not the model
    ok = client.infer(f"wayward_{form}", {"x": marked(7.0)})
    np.testing.assert_array_equal(ok["z"], marked(7.0) * 2 + 1)


@pytest.mark.parametrize("form", FORMS)
def test_one_bad_request_does_not_fail_the_others_in_its_batch(server, log_dir, form):
    """Eight requests at once, one per misdeed among them: the step gets them as batches and
    falls back to one call per request, so only the culprits fail, each with its own error.

    On a loaded machine the good requests can reach the step's queue after its delay has
    sent the bad ones on: the burst is sent again (at most five times) until one batch held
    both; every burst's answers are checked."""
    log = log_dir / "calls.log"
    goods = [marked(float(10 + i), seed=float(i)) for i in range(3)]
    requests = goods + [marked(marker) for marker, _ in MISDEEDS.values()]
    goods_marks, bad_marks = {"10", "11", "12"}, {f"{m:g}" for m, _ in MISDEEDS.values()}

    def burst() -> list[set[str]]:
        seen = log.stat().st_size if log.exists() else 0
        # Connecting takes longer than the step's queue delay on a loaded machine: every client
        # connects first, and all send together, so that the requests meet in the step's queue.
        connected = threading.Barrier(len(requests))

        def call(x):
            with server.client("grpc", timeout=60) as c:
                assert c.ready(f"wayward_{form}")  # connects
                connected.wait(timeout=60)
                try:
                    return c.infer(f"wayward_{form}", {"x": x})
                except InferenceError as exc:
                    return exc

        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(call, requests))
        for x, result in zip(goods, results, strict=False):
            assert isinstance(result, dict), result
            np.testing.assert_array_equal(result["z"], x * 2 + 1)
        for (_, said), result in zip(MISDEEDS.values(), results[len(goods):], strict=True):
            assert isinstance(result, InferenceError) and re.match(culprit(form) + said, str(result)), result
        with open(log) as f:
            f.seek(seen)
            return [set(line.split()) for line in f]

    calls = burst()
    if form != "bls_sync":  # the sync executor calls the step for one request at a time
        # The step was called with a batch holding good and bad requests together.
        for _ in range(4):
            if any(c & goods_marks and c & bad_marks for c in calls):
                break
            calls = burst()
        assert any(c & goods_marks and c & bad_marks for c in calls), calls


# ------------------------------------------------------------------ timeouts


@pytest.mark.parametrize("form", FORMS)
def test_a_client_timeout_ends_a_stuck_step_and_the_server_answers_others(client, release_dir, form):
    model = f"stuck_{form}"
    token = next(TOKENS)
    stuck = np.array([[STUCK_MARKER, token, 0, 0]], np.float32)
    try:
        # the step is stuck until its release file is written: only the timeout can end the call
        with pytest.raises(ClientTimeoutError) as caught:
            client.infer(model, {"x": stuck}, timeout=0.5)
        text = str(caught.value)
        assert f"infer on model {model!r} got no answer within 0.5 s" in text, text
        assert caught.value.step == model
        # The step is still stuck on the server, yet the server answers other requests,
        # to the same model too (the step and the BLS model have a second instance).
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(client.infer(model, {"x": x}, timeout=5)["y"], x * 3)
        assert_answer(client.infer("strict_bls_sync", GOOD, timeout=5), strict_reference(**GOOD))
    finally:
        (release_dir / f"release-{token}").touch()


# ------------------------------------------------------- 200 concurrent requests

CONCURRENCY = 32


def mixed_requests(n: int = 200) -> list[tuple[dict, object]]:
    """``n`` requests with unique data, every third one malformed in a varied way.

    Each comes with its expectation: the reference answer, or a pattern its own error must match.
    """
    bad_kinds = ("dtype", "dims", "missing", "raises", "extra", "empty", "batch")
    out = []
    for i in range(n):
        batch = 1 + i % MAX_BATCH
        request = good_strict(i, batch)
        if i % 3 != 2:
            out.append((request, strict_reference(**request)))
            continue
        kind = bad_kinds[(i // 3) % len(bad_kinds)]
        x, k = request["x"], request["k"]
        if kind == "dtype":
            dtype = (np.float64, np.int32, np.float16)[i % 3]
            request = {"x": x.astype(dtype), "k": k}
            expected = rf"input 'x' expects dtype FP32 \(float32\) but was given {np.dtype(dtype)}"
        elif kind == "dims":
            wrong = x[:, :3] if i % 2 else x[..., None]
            request = {"x": wrong, "k": k}
            expected = re.escape(f"but was given {'' if i % 2 else 'shape '}{list(wrong.shape)}")
        elif kind == "missing":
            dropped = "k" if i % 2 else "x"
            request = {name: value for name, value in request.items() if name != dropped}
            expected = rf"input '{dropped}' \((INT32|FP32) \[.*\]\) is missing"
        elif kind == "raises":
            value = -(i + 0.5)
            x = x.copy()
            x[-1, i % 4] = value
            request = {"x": x, "k": k}
            expected = rf"step 'guard': raised ValueError: negative value {value:g} in x \(at test_server_failures\.py:\d+\) \(infer on"
        elif kind == "extra":
            request = {**request, f"extra_{i}": k}
            expected = rf"got input 'extra_{i}', which is not declared"
        elif kind == "empty":
            request = {"x": x[:0], "k": k[:0]}
            expected = r"input 'x' is an empty batch"
        else:
            request = good_strict(i, MAX_BATCH + 1 + i % 3)
            expected = rf"input 'x' has batch size {MAX_BATCH + 1 + i % 3} "
        out.append((request, expected))
    return out


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("form", ["ensemble", "bls"])
def test_200_concurrent_requests_a_third_malformed_each_get_their_own_answer(server, form, protocol):
    model = f"strict_{form}"
    cases = mixed_requests()
    answers: dict[int, list] = {i: [] for i in range(len(cases))}
    before = _successes(server, model)

    async def main():
        limiter = anyio.CapacityLimiter(CONCURRENCY)
        with anyio.fail_after(120):
            async with server.async_client(protocol, timeout=60) as client:

                async def one(i, request):
                    async with limiter:
                        try:
                            answers[i].append(await client.infer(model, request))
                        except InferenceError as exc:
                            answers[i].append(exc)

                async with anyio.create_task_group() as tg:
                    for i, (request, _) in enumerate(cases):
                        tg.start_soon(one, i, request)

    anyio.run(main)

    good = raised = 0
    for i, (_, expected) in enumerate(cases):
        assert len(answers[i]) == 1, f"request {i} answered {len(answers[i])} times"
        (got,) = answers[i]
        if isinstance(expected, dict):
            good += 1
            assert isinstance(got, dict), f"request {i}: {got}"
            assert_answer(got, expected)
        else:
            assert isinstance(got, InferenceError), f"request {i} should have failed: {got}"
            assert re.search(expected, str(got)), f"request {i}: {got}"
            raised += "raised ValueError: negative value" in str(got)
    assert good == 134 and raised == 9
    # The server counted each request that reached the model once, no more, no less. The
    # Python backend counts a request it answered with an error (a failed step) as a success.
    reached = good + (raised if form == "bls" else 0)
    assert _wait_for(lambda: _successes(server, model) - before == reached), _successes(server, model) - before


def _successes(server, model: str) -> int:
    stats = server.client("grpc").statistics(model)["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"])


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------- failures in parallel shapes (issue 11)

# How long the four client groups of the failing-branch test run together. The issue asks for
# 60 s; the suite runs a shorter window to stay affordable (the hand-written ensemble of
# docs/ensemble_branch_error dies within seconds over HTTP), and benchmarks/failing_branch_soak.py
# runs the same load for 60 s (its figures are in docs/benchmarks.md).
FAILING_BRANCH_WINDOW_S = 10.0
FAILING_BRANCH_GROUPS = [("http", 16), ("http", 64), ("grpc", 16), ("grpc", 64)]


def test_a_failing_branch_under_concurrency_leaves_the_server_alive_and_every_request_answered(server):
    """Half the requests fail in one branch of the diamond while the other branch runs, at 16 and
    64 clients over HTTP and gRPC at once, against every form, and against the ensemble that answers
    through a gate model. A plain ensemble crashes Triton 2.51 within seconds here
    (docs/ensemble_branch_error); the compiled ones carry the failure to the join, or to the gate."""
    models = [f"failing_diamond_{form}" for form in FORMS] + ["failing_gated"]
    tallies = anyio.run(fb.hammer_groups, server, models, FAILING_BRANCH_GROUPS, FAILING_BRANCH_WINDOW_S)
    server.check_alive()
    for group, tally in tallies.items():
        assert tally.hung == 0, (group, tally.hung)
        assert tally.wrong == [], (group, tally.wrong[:5])
        assert tally.answered > 0 and tally.own_errors > 0, (group, tally)
    for model in models:  # and it goes on answering
        x = fb.request_for(0, failing=False)
        got = server.client("grpc", timeout=30).infer(model, {"x": x}, outputs=["y"])
        np.testing.assert_array_equal(got["y"], fb.expected_answer(x))


def _follow_tags(log_dir: Path) -> set[str]:
    log = log_dir / "follow.log"
    return set(log.read_text().split()) if log.exists() else set()


@pytest.mark.parametrize("form", FORMS)
def test_a_chain_after_a_failing_step_does_not_run_and_the_error_names_the_step(client, log_dir, form):
    tag = 5000 + 2 * next(TOKENS)  # and tag + 1, both unused by any other test
    x = fb.request_for(tag, failing=True)
    with pytest.raises(InferenceError) as caught:
        client.infer(f"maze_{form}", {"x": x})
    assert caught.value.step == "brittle" and f"refusing request {tag}: negative first value" in str(caught.value)
    assert str(tag) not in _follow_tags(log_dir)  # `follow` was skipped, not run on stand-in values
    good = fb.request_for(tag + 1, failing=False)
    assert_answer(client.infer(f"maze_{form}", {"x": good}), maze_reference(good))
    assert str(tag + 1) in _follow_tags(log_dir)


@pytest.mark.parametrize("form", FORMS)
def test_a_failing_last_step_after_two_joins_is_named(client, form):
    x = np.array([[0.5, next(TOKENS), 3.0, 1.0]], np.float32)  # join2 gives 4 * 3 + 1 = 13 in column 2
    with pytest.raises(InferenceError) as caught:
        client.infer(f"maze_{form}", {"x": x})
    assert caught.value.step == "last" and "unlucky 13 in the last step" in str(caught.value)
    if form == "ensemble":
        # The gate runs after every step, whatever the outputs asked for, so `last` runs and fails.
        with pytest.raises(InferenceError, match="unlucky 13"):
            client.infer(f"maze_{form}", {"x": x}, outputs=["followed"])
    else:  # a BLS form calls only the steps the asked-for outputs need
        got = client.infer(f"maze_{form}", {"x": x}, outputs=["followed"])
        assert_answer(got, {"followed": maze_reference(x)["followed"]})


# ------------------------------------------------------------- step timeouts on the server


@pytest.mark.parametrize("model", ["napping_bls", "napping_bls_sync", "napping_fused", "dozing"])
def test_a_bls_or_fused_form_gives_up_on_a_step_past_its_timeout_and_names_it(client, release_dir, model):
    """The fused model runs the step in its own process: it abandons a stuck sync call's instance
    and answers the next request with a fresh one, so its single instance is not held; an
    ``async def`` step (`dozing`, compiled as its fused form alone) is cancelled instead."""
    token = next(TOKENS)
    stuck = np.array([[STUCK_MARKER, token, 0, 0]], np.float32)
    try:
        with pytest.raises(StepTimeoutError) as caught:
            client.infer(model, {"x": stuck}, timeout=60)
        # The step is still held (its release file does not exist yet): the BLS model answered without it.
        assert not (release_dir / f"release-{token}").exists()
    finally:
        (release_dir / f"release-{token}").touch()
    text = str(caught.value)
    pipeline = model.split("_")[0]
    said = f"StepTimeoutError in pipeline '{pipeline}', node 'nap', step 'nap': ran past its timeout of {NAP_TIMEOUT_S:g} s"
    assert said in text, text
    assert caught.value.step == "nap"
    if model == "dozing":
        assert "the call was cancelled" in text, text
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(client.infer(model, {"x": x}, timeout=60)["y"], x * 3)


def test_an_ensemble_has_no_step_timeout_so_the_client_sets_one(client, release_dir):
    """An ensemble cannot stop a running step (docs/triton_ensemble.md): the client's timeout bounds the wait."""
    token = next(TOKENS)
    try:
        with pytest.raises(ClientTimeoutError):
            client.infer("napping_ensemble", {"x": np.array([[STUCK_MARKER, token, 0, 0]], np.float32)}, timeout=0.5)
    finally:
        (release_dir / f"release-{token}").touch()
