"""isolation="process": each step instance runs in a forked process of its own, as a Triton
stub does; tensors cross through shared memory, faults stay in the step's process, and
nothing is left behind."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, StepError, StepTimeoutError, StubDiedError, TensorSpec, step
from pipelines.runtime import LocalRuntime
from pipelines.runtime.step_process import isolation_supported

pytestmark = pytest.mark.skipif(not isolation_supported(), reason="process isolation needs Linux (fork and memfd)")

V = TensorSpec("FP32", [-1])
PID = TensorSpec("INT64", [1])
ISOLATED_MODES = ["ensemble", "bls", "bls-sync"]


def run(pipeline: Pipeline, requests: list[dict], **options) -> list[dict]:
    async def main() -> list[dict]:
        async with LocalRuntime(pipeline, **options) as rt:
            return [await rt.infer(r) for r in requests]

    return anyio.run(main)


def children() -> set[int]:
    """This process's live children (zombies included)."""
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                found.add(int(entry.name))
    return found


def where_pipeline() -> Pipeline:
    @step(inputs={"x": V}, outputs={"y": V, "pid": PID})
    def first(x):
        return {"y": x + 1, "pid": np.array([os.getpid()])}

    @step(inputs={"y": V}, outputs={"z": V, "pid": PID})
    def second(y):
        return {"z": y * 2, "pid": np.array([os.getpid()])}

    p = Pipeline("where", inputs={"x": V})
    a = p.add(first, x=p.input("x"))
    b = p.add(second, y=a["y"])
    p.output("z", b["z"])
    p.output("first_pid", a["pid"])
    p.output("second_pid", b["pid"])
    return p


@pytest.mark.parametrize("mode", ISOLATED_MODES)
def test_each_step_runs_in_a_process_of_its_own_and_answers_the_same(mode):
    x = np.arange(10, dtype=np.float32)
    before = children()
    (out,) = run(where_pipeline(), [{"x": x}], mode=mode, isolation="process")
    pids = {int(out["first_pid"][0]), int(out["second_pid"][0])}
    assert os.getpid() not in pids and len(pids) == 2
    np.testing.assert_array_equal(out["z"], (x + 1) * 2)
    assert children() == before  # every step's process was finalized and reaped


def test_a_fused_models_python_steps_share_its_process_and_threads_stay_in_this_one():
    x = np.ones(3, np.float32)
    (fused,) = run(where_pipeline(), [{"x": x}], mode="fused", isolation="process")
    (threaded,) = run(where_pipeline(), [{"x": x}], mode="ensemble", isolation="thread")
    for out in (fused, threaded):
        assert int(out["first_pid"][0]) == int(out["second_pid"][0]) == os.getpid()


def test_steps_run_in_threads_unless_processes_are_asked_for():
    x = np.ones(3, np.float32)
    assert LocalRuntime(where_pipeline()).isolation == "thread"
    (out,) = run(where_pipeline(), [{"x": x}])
    assert int(out["first_pid"][0]) == int(out["second_pid"][0]) == os.getpid()

    async def main() -> tuple[tuple[str, ...], str]:
        async with LocalRuntime(where_pipeline(), isolation="process") as rt:
            await rt.infer({"x": x})
            report = rt.report()
            return report.in_processes, str(report)

    isolated, text = anyio.run(main)
    assert isolated == ("first", "second") and "steps in processes of their own: first, second" in text


def test_an_unknown_isolation_is_refused_by_name():
    with pytest.raises(InferenceError, match=r"isolation must be one of thread, process; got 'stub'"):
        LocalRuntime(where_pipeline(), isolation="stub")
    with pytest.raises(InferenceError, match=r"isolation='auto' is gone.*choose isolation='thread' or 'process'"):
        LocalRuntime(where_pipeline(), isolation="auto")


def test_branches_in_processes_overlap(tmp_path):
    # Each branch says it arrived and waits for the other: both must run at once to return.
    def branch(name: str, other: str):
        def fn(x):
            (tmp_path / name).touch()
            deadline = time.monotonic() + 10
            while not (tmp_path / other).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} waited 10 s for {other}: the branches did not overlap")
                time.sleep(0.005)
            return {"y": x}

        return step(fn, inputs={"x": V}, outputs={"y": V}, name=name)

    @step(inputs={"a": V, "b": V}, outputs={"y": V})
    def join(a, b):
        return {"y": a + b}

    p = Pipeline("overlap", inputs={"x": V})
    p.output("y", p.add(join, a=p.add(branch("a", "b"), x=p.input("x"))["y"],
                         b=p.add(branch("b", "a"), x=p.input("x"))["y"])["y"])
    (out,) = run(p, [{"x": np.ones(2, np.float32)}], mode="ensemble", isolation="process")
    np.testing.assert_array_equal(out["y"], [2, 2])


def test_every_datatype_and_layout_crosses_intact_and_the_regions_grow():
    specs = {"f16": ("FP16", np.float16), "f64": ("FP64", np.float64), "i8": ("INT8", np.int8),
             "u64": ("UINT64", np.uint64), "b": ("BOOL", np.bool_)}

    @step(inputs={**{k: TensorSpec(t, [-1, -1]) for k, (t, _) in specs.items()}, "s": TensorSpec("BYTES", [-1])},
          outputs={**{f"{k}_out": TensorSpec(t, [-1, -1]) for k, (t, _) in specs.items()},
                   "s_out": TensorSpec("BYTES", [-1])})
    def echo(**tensors):
        # inputs are views of shared memory: return some as they are, others changed
        return {f"{k}_out": v if k != "f64" else v * 2 for k, v in tensors.items()}

    p = Pipeline("dtypes", inputs={**{k: TensorSpec(t, [-1, -1]) for k, (t, _) in specs.items()},
                                   "s": TensorSpec("BYTES", [-1])})
    node = p.add(echo, **{k: p.input(k) for k in [*specs, "s"]})
    for k in [*specs, "s"]:
        p.output(f"{k}_out", node[f"{k}_out"])
    rng = np.random.default_rng(0)
    requests = []
    for rows in (4, 700, 0, 3):  # 700 x 1500 FP64 is 8 MB: past the first 1 MiB region
        request = {k: (rng.standard_normal((rows, 1500)) * 100).astype(dt)[:, ::3] for k, (_, dt) in specs.items()}
        request["s"] = np.array([b"caf\xc3\xa9", b"", b"\x00x"], dtype=object)
        requests.append(request)
    answers = run(p, requests, mode="ensemble", isolation="process")
    for request, out in zip(requests, answers, strict=True):
        for k in specs:
            want = request[k] * 2 if k == "f64" else request[k]
            assert out[f"{k}_out"].dtype == want.dtype and out[f"{k}_out"].shape == want.shape
            np.testing.assert_array_equal(out[f"{k}_out"], want)
        assert list(out["s_out"]) == list(request["s"])


class Counted:
    """A class step that writes what happened to it, and where, to a folder."""

    folder: Path

    def initialize(self, config):
        self.index = config["instance_index"]
        with open(self.folder / "events", "a") as f:
            f.write(f"initialize {os.getpid()} {self.index}\n")

    def execute(self, x):
        if x[0] == -1:
            os.kill(os.getpid(), signal.SIGKILL)
        if x[0] == -2:
            time.sleep(60)
        if x[0] == -3:
            raise ValueError(f"first element {x[0]} is negative")
        return {"y": x, "pid": np.array([os.getpid()])}

    def finalize(self):
        with open(self.folder / "events", "a") as f:
            f.write(f"finalize {os.getpid()} {self.index}\n")


def counted_pipeline(folder: Path, **options) -> Pipeline:
    cls = type("Counted", (Counted,), {"folder": folder})
    s = step(cls, inputs={"x": V}, outputs={"y": V, "pid": PID}, name="counted", **options)
    p = Pipeline("counted", inputs={"x": V})
    node = p.add(s, x=p.input("x"))
    p.output("y", node["y"])
    p.output("pid", node["pid"])
    return p


def events(folder: Path) -> list[tuple[str, int]]:
    return [(w, int(pid)) for w, pid, _ in (line.split() for line in (folder / "events").read_text().splitlines())]


def outcomes(pipeline: Pipeline, xs: list[float], **options) -> list:
    async def main() -> list:
        got = []
        async with LocalRuntime(pipeline, isolation="process", **options) as rt:
            for x in xs:
                try:
                    got.append(await rt.infer({"x": np.array([x], np.float32)}))
                except Exception as exc:  # each outcome is checked by the test
                    got.append(exc)
        return got

    return anyio.run(main)


@pytest.mark.parametrize("mode", ISOLATED_MODES)
def test_a_step_process_that_dies_fails_its_call_and_a_fresh_one_serves_the_next(tmp_path, mode):
    before = children()
    first, died, after = outcomes(counted_pipeline(tmp_path), [1, -1, 2], mode=mode)
    assert isinstance(died, StubDiedError) and died.step == "counted"
    assert "killed by SIGKILL" in str(died) and "initialize() again" in str(died)
    assert int(after["pid"][0]) != int(first["pid"][0])
    np.testing.assert_array_equal(after["y"], [2])
    # initialize ran in each process; the dead one never finalized, the fresh one did at close
    assert events(tmp_path) == [("initialize", int(first["pid"][0])), ("initialize", int(after["pid"][0])),
                                ("finalize", int(after["pid"][0]))]
    assert children() == before


def test_a_step_error_names_the_step_and_carries_the_traceback_from_its_process(tmp_path):
    first, failed, after = outcomes(counted_pipeline(tmp_path), [1, -3, 2])
    assert isinstance(failed, StepError) and failed.step == "counted"
    assert "node 'counted', step 'counted': raised ValueError: first element -3.0 is negative" in str(failed)
    assert isinstance(failed.__cause__, ValueError)
    if sys.version_info >= (3, 11):
        assert "in the step's process" in failed.__cause__.__notes__[0]
        assert "time.sleep(60)" not in failed.__cause__.__notes__[0] and "raise ValueError" in failed.__cause__.__notes__[0]
    assert int(after["pid"][0]) == int(first["pid"][0])  # an exception is not a crash: same process


def test_a_call_past_its_timeout_kills_the_steps_process(tmp_path):
    before = children()
    first, stuck, after = outcomes(counted_pipeline(tmp_path, timeout=1.0), [1, -2, 2], mode="ensemble",
                                    enforce_timeouts=True)  # Triton's ensemble would wait
    assert isinstance(stuck, StepTimeoutError)
    # the 60 s sleep was not waited out: its process is gone (below), and a new one answered
    assert int(after["pid"][0]) != int(first["pid"][0])
    assert children() == before
    stuck_pid = int(first["pid"][0])
    with pytest.raises(ProcessLookupError):
        os.kill(stuck_pid, 0)


def test_an_initialize_that_fails_is_reported_at_open_and_leaves_no_process():
    class Broken:
        def initialize(self, config):
            raise OSError("weights.bin: no such file")

        def execute(self, x):
            return {"y": x}

    p = Pipeline("broken", inputs={"x": V})
    p.output("y", p.add(step(Broken, inputs={"x": V}, outputs={"y": V}, name="broken"), x=p.input("x"))["y"])
    before = children()
    with pytest.raises(StepError, match=r"step 'broken'.*initialize\(\).*OSError: weights.bin: no such file"):
        run(p, [{"x": np.ones(1, np.float32)}], isolation="process")
    assert children() == before


def test_an_error_that_does_not_pickle_is_told_by_its_type_and_message(tmp_path):
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} and {b}")

    @step(inputs={"x": V}, outputs={"y": V})
    def odd(x):
        raise Odd("this", "that")

    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):  # a local class: no pickle
        pickle.loads(pickle.dumps(Odd("this", "that")))
    p = Pipeline("odd", inputs={"x": V})
    p.output("y", p.add(odd, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"node 'odd', step 'odd': raised Odd: this and that"):
        run(p, [{"x": np.ones(1, np.float32)}], isolation="process")


def test_a_steps_process_exits_when_the_runtimes_process_is_killed(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time, anyio, numpy as np
        from pipelines import Pipeline, TensorSpec, step
        from pipelines.runtime import LocalRuntime
        V = TensorSpec("FP32", [-1])

        @step(inputs={"x": V}, outputs={"pid": TensorSpec("INT64", [1])})
        def where(x):
            return {"pid": np.array([os.getpid()])}

        p = Pipeline("orphan", inputs={"x": V})
        p.output("pid", p.add(where, x=p.input("x"))["pid"])

        async def main():
            async with LocalRuntime(p, isolation="process") as rt:
                out = await rt.infer({"x": np.ones(1, np.float32)})
                print(int(out["pid"][0]), flush=True)
                time.sleep(60)

        anyio.run(main)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    def alive() -> bool:  # a zombie waiting for whoever adopted it has exited
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), "the step's process outlived the runtime's"


def test_an_input_on_the_gpu_is_refused_by_a_steps_process_by_name():
    class OnGpu:  # what the step's process cannot take: an array with CUDA's interface
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}

    from pipelines.runtime.step_process import ProcessInstance

    node = where_pipeline().nodes["first"]
    instance = ProcessInstance(node.step, {}, pipeline="where", node="first")
    try:
        with pytest.raises(StepError, match=r"step 'first': input 'x' is on the GPU.*isolation='thread'") as caught:
            instance.execute({"x": OnGpu()})
        assert caught.value.tensor == "x"
        np.testing.assert_array_equal(instance.execute({"x": np.ones(2, np.float32)})["y"], [2, 2])
    finally:
        instance.finalize()


@pytest.mark.parametrize("share_model", [None, True])
@pytest.mark.parametrize("mode", ISOLATED_MODES)
def test_dynamic_batches_and_a_step_used_twice_run_in_the_steps_processes(mode, share_model):
    from pipelines.runtime.local import run_many

    row = TensorSpec("FP64", [2])

    def model(x):
        return {"y": x * 10, "rows": np.full((len(x), 1), len(x), np.int64),
                "pid": np.full((len(x), 1), os.getpid(), np.int64)}

    s = step(model, inputs={"x": row}, outputs={"y": row, "rows": TensorSpec("INT64", [1]),
                                                 "pid": TensorSpec("INT64", [1])},
             name="model", max_batch_size=8, dynamic_batching={"max_queue_delay_us": 20_000}, instance_count=2,
             share_model=share_model)
    p = Pipeline("batched", inputs={"x": row}, max_batch_size=4)
    first = p.add(s, x=p.input("x"), name="first")
    second = p.add(s, x=first["y"], name="second")  # the same step: a model per node, or one when shared
    p.output("y", second["y"])
    p.output("rows", second["rows"])
    p.output("pid", second["pid"])
    p.output("first_pid", first["pid"])
    requests = [{"x": np.full((1 + i % 3, 2), float(i))} for i in range(24)]
    answers, _ = run_many(p, requests, mode=mode, concurrency=8, isolation="process")
    pids, first_pids = set(), set()
    for request, out in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(out["y"], request["x"] * 100)  # nobody got another caller's rows
        pids |= {int(v) for v in out["pid"].ravel()}
        first_pids |= {int(v) for v in out["first_pid"].ravel()}
    if share_model:
        pids |= first_pids
        assert os.getpid() not in pids and 1 <= len(pids) <= 2  # the step's two instances, shared by both nodes
    else:  # each node's model has two instances of its own
        assert os.getpid() not in pids | first_pids and not pids & first_pids
        assert 1 <= len(pids) <= 2 and 1 <= len(first_pids) <= 2
    if mode != "bls-sync":  # requests one after another reach it one at a time there
        assert max(int(out["rows"].max()) for out in answers) > 3  # rows of several requests ran as one batch
