"""Bad requests, failing steps and stuck steps end in an error that names the culprit,
and the runtime goes on serving; 200 concurrent requests, a third of them malformed,
each get their own answer or their own error."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from pipelines import InputError, Pipeline, StepError, StepTimeoutError, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime
from pipelines.runtime.local import run_many

IMG = TensorSpec("FP32", [3, -1])
IDS = TensorSpec("INT64", [1])


@step(inputs={"image": IMG, "ids": IDS}, outputs={"score": TensorSpec("FP32", [1])})
def score(image, ids):
    if (ids == 666).any():
        raise ValueError(f"id 666 is cursed (rows {np.nonzero(ids[:, 0] == 666)[0].tolist()})")
    return {"score": image.sum(axis=(1, 2))[:, None] + ids.astype(np.float32)}


@step(inputs={"score": TensorSpec("FP32", [1])}, outputs={"score": TensorSpec("FP32", [1])})
def negate(score):
    return {"score": -score}


def scoring() -> Pipeline:
    p = Pipeline("scoring", inputs={"image": IMG, "ids": IDS}, max_batch_size=4)
    s = p.add(score, image=p.input("image"), ids=p.input("ids"))
    p.output("score", p.add(negate, score=s["score"])["score"])
    return p


def good(i: int = 1, rows: int = 1) -> dict[str, np.ndarray]:
    return {"image": np.full((rows, 3, 2), i, np.float32), "ids": np.full((rows, 1), i, np.int64)}


def expected(i: int, rows: int = 1) -> np.ndarray:
    return np.full((rows, 1), -(6 * i + i), np.float32)


BAD = {
    "missing": (lambda: {"image": good()["image"]}, "ids", "missing"),
    "extra": (lambda: {**good(), "mask": np.zeros((1, 1))}, "mask", "not declared"),
    "misnamed": (lambda: {"img": good()["image"], "ids": good()["ids"]}, "img", "did you mean 'image'"),
    "dtype": (lambda: {**good(), "ids": np.ones((1, 1), np.int32)}, "ids", "int32"),
    "bytes": (lambda: {**good(), "image": np.full((1, 3, 2), b"x", dtype=object)}, "image", "BYTES payload"),
    "rank": (lambda: {**good(), "image": np.ones((3, 2), np.float32)}, "image", "rank 3"),
    "dimension": (lambda: {**good(), "image": np.ones((1, 4, 2), np.float32)}, "image", "dimension 1 is 4"),
    "batch_too_big": (lambda: good(rows=5), "image", "max_batch_size is 4"),
    "empty_batch": (lambda: good(rows=0), "image", "empty batch"),
    "batch_mismatch": (lambda: {"image": good(rows=2)["image"], "ids": good(rows=3)["ids"]}, "ids", "2 and 3"),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_bad_request_is_refused_before_any_step_then_a_good_one_succeeds(mode):
    calls = []

    @step(inputs={"image": IMG, "ids": IDS}, outputs={"score": TensorSpec("FP32", [1])}, name="score")
    def counted(image, ids):
        calls.append(1)
        return score.impl(image, ids)

    p = Pipeline("guarded", inputs={"image": IMG, "ids": IDS}, max_batch_size=4)
    p.output("score", p.add(counted, image=p.input("image"), ids=p.input("ids"))["score"])

    async def main():
        async with LocalRuntime(p, mode) as rt:
            for case, (make, tensor, words) in BAD.items():
                with pytest.raises(InputError) as info:
                    await rt.infer(make())
                assert info.value.tensor == tensor, case
                assert words in str(info.value) and "pipeline 'guarded'" in str(info.value), case
                assert not calls, f"{case}: a step ran"
                out = await rt.infer(good(2))
                np.testing.assert_array_equal(out["score"], np.full((1, 1), 14, np.float32))
                calls.clear()
            return rt.report()

    report = anyio.run(main)
    assert report.errors == len(BAD) and report.requests == len(BAD)


def _pipeline_with(fn, name):
    s = step(fn, inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])}, name="inner")
    p = Pipeline(name, inputs={"x": TensorSpec("FP32", [2])}, max_batch_size=4)
    p.output("y", p.add(s, name="culprit", x=p.input("x"))["y"])
    return p


STEP_FAILURES = {
    "raises": (lambda x: 1 / 0, "raised ZeroDivisionError", None),
    "wrong_dtype": (lambda x: {"y": x.astype(np.float64)}, "dtype float64", "y"),
    "wrong_shape": (lambda x: {"y": x[:, :1]}, "shape [1, 1]", "y"),
    "wrong_batch": (lambda x: {"y": np.concatenate([x, x])}, "batch dimension 1", "y"),
    "missing_output": (lambda x: {"z": x}, "did not return output(s) ['y']", "y"),
    "not_a_dict": (lambda x: [x, x], "returned list", None),
}


@pytest.mark.parametrize("case", sorted(STEP_FAILURES))
def test_a_step_that_breaks_its_contract_is_named(case):
    fn, words, tensor = STEP_FAILURES[case]
    broken = [True]

    def impl(x):
        return fn(x) if broken[0] else {"y": x + 1}

    p = _pipeline_with(impl, f"contract_{case}")

    async def main():
        async with LocalRuntime(p, "ensemble") as rt:
            with pytest.raises(StepError) as info:
                await rt.infer({"x": np.zeros((1, 2), np.float32)})
            broken[0] = False
            return info.value, await rt.infer({"x": np.zeros((1, 2), np.float32)})

    err, out = anyio.run(main)
    assert err.pipeline == p.name and err.step == "culprit"
    assert f"StepError in pipeline {p.name!r}, node 'culprit', step " in str(err) and words in str(err)
    assert err.tensor == tensor
    np.testing.assert_array_equal(out["y"], np.ones((1, 2), np.float32))


def test_a_stuck_async_step_times_out():
    @step(inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])}, timeout=0.1)
    async def never(x):
        await anyio.sleep_forever()

    p = Pipeline("stuck_async", inputs={"x": TensorSpec("FP32", [2])}, max_batch_size=4)
    p.output("y", p.add(never, x=p.input("x"))["y"])
    with pytest.raises(StepTimeoutError, match=r"StepTimeoutError in pipeline 'stuck_async', node 'never', step '[^']+': ran past its timeout"):
        p.run({"x": np.zeros((1, 2), np.float32)}, mode="fused")  # an ensemble times no step out


def _malformed(kind: int, i: int):
    """The ways a request of the 200 goes wrong, and what its error must name."""
    req = good(i)
    if kind == 0:
        return {"image": req["image"]}, InputError, "ids"
    if kind == 1:
        return {**req, "ids": req["ids"].astype(np.float32)}, InputError, "ids"
    if kind == 2:
        return {**req, "image": np.ones((1, 3 + i % 5 + 1, 2), np.float32)}, InputError, "image"
    if kind == 3:
        return good(i, rows=5), InputError, "image"
    if kind == 4:
        return {**req, f"extra{i}": req["ids"]}, InputError, f"extra{i}"
    return {**req, "ids": np.full((1, 1), 666, np.int64)}, StepError, None  # a step fails for this one only


@pytest.mark.parametrize("mode", MODES)
def test_200_concurrent_requests_a_third_malformed_none_lost_or_mixed(mode):
    requests = []
    for i in range(200):
        if i % 3 == 0:
            req, err_type, tensor = _malformed((i // 3) % 6, i)
            requests.append((req, err_type, tensor))
        else:
            rows = 1 + i % 4
            requests.append((good(i, rows), None, expected(i, rows)))

    async def main():
        results = {}
        async with LocalRuntime(scoring(), mode) as rt:
            async def one(i):
                try:
                    results[i] = await rt.infer(requests[i][0])
                except Exception as exc:
                    results[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
            return results, rt.report()

    results, report = anyio.run(main)
    assert sorted(results) == list(range(200))
    for i, (_, err_type, want) in enumerate(requests):
        got = results[i]
        if err_type is None:
            assert isinstance(got, dict), f"request {i}: {got!r}"
            np.testing.assert_array_equal(got["score"], want)
        else:
            assert isinstance(got, err_type), f"request {i}: {got!r}"
            if err_type is InputError:
                assert got.tensor == want, f"request {i}: {got}"
            else:
                assert got.step == "score" and "666" in str(got)
    bad = sum(1 for r in requests if r[1] is not None)
    assert report.errors == bad and report.requests == 200 - bad


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_calls_sys_exit_is_a_step_error_naming_it_not_a_system_exit(mode):
    import sys

    @step(inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])})
    def leaves(x):
        sys.exit(3)

    p = Pipeline("leaving", inputs={"x": TensorSpec("FP32", [2])}, max_batch_size=2)
    p.output("y", p.add(leaves, x=p.input("x"))["y"])
    with pytest.raises(StepError, match=r"node 'leaves', step '[^']+': raised StepExited: sys\.exit\(3\) was called") as caught:
        p.run({"x": np.ones((1, 2), np.float32)}, mode=mode)
    assert caught.value.step == "leaves"


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_raises_keyboard_interrupt_in_a_worker_thread_is_a_step_error_and_the_rest_go_on(mode):
    # Only the main thread gets the user's Ctrl-C: in a worker thread it is the step's own doing.
    @step(inputs={"x": TensorSpec("FP32", [2])}, outputs={"y": TensorSpec("FP32", [2])})
    def stops(x):
        if (x > 100).any():
            raise KeyboardInterrupt("from a step")
        return {"y": x}

    p = Pipeline("stopping", inputs={"x": TensorSpec("FP32", [2])}, max_batch_size=2)
    p.output("y", p.add(stops, x=p.input("x"))["y"])
    requests = [{"x": np.full((1, 2), 200.0 if i % 3 == 0 else i, np.float32)} for i in range(12)]
    results, _ = run_many(p, requests, mode=mode, concurrency=4, return_exceptions=True, offload="always")
    for i, got in enumerate(results):
        if i % 3 == 0:
            assert isinstance(got, StepError) and got.step == "stops", got
            assert "raised StepInterrupted: KeyboardInterrupt('from a step') was raised inside the step" in str(got)
        else:
            assert not isinstance(got, BaseException), got
            np.testing.assert_array_equal(got["y"], requests[i]["x"])


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_writes_into_its_input_fails_by_name_and_nothing_shared_changes(mode):
    """Arrays go from step to step without a copy: a write would reach a sibling and the caller."""
    row = TensorSpec("FP32", [2])
    text = TensorSpec("BYTES", [2])

    @step(inputs={"x": row, "t": text}, outputs={"y": row})
    def scribble(x, t):
        t[0, 0] = b"XXX" if (x[:, 0] < 0).any() else t[0, 0]
        x += 1
        return {"y": x}

    @step(inputs={"x": row, "t": text}, outputs={"z": row})
    def reads(x, t):
        return {"z": x + len(t[0, 0])}

    p = Pipeline("scribbling", inputs={"x": row, "t": text}, max_batch_size=2)
    p.output("y", p.add(scribble, x=p.input("x"), t=p.input("t"))["y"])
    p.output("z", p.add(reads, x=p.input("x"), t=p.input("t"))["z"])
    for x in (np.zeros((1, 2), np.float32), -np.ones((1, 2), np.float32)):
        t = np.array([[b"hello", b"world"]], dtype=object)
        with pytest.raises(StepError, match=r"node 'scribble', step '[^']+': raised ValueError: .*read-only") as caught:
            p.run({"x": x, "t": t}, mode=mode)
        assert caught.value.step == "scribble"
        assert t[0, 0] == b"hello" and (x == x.flat[0]).all()  # the caller's arrays are as they were
