"""Random DAGs of arithmetic steps give the same answers in every mode as a plain
sequential evaluation; Pipeline.run also works inside a running event loop."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines import Pipeline, TensorSpec, step
from pipelines.runtime import MODES, LocalRuntime, run_many

V = TensorSpec("FP64", [3])


@step(inputs={"x": V, "y": V}, outputs={"z": V})
def add(x, y):
    return {"z": x + y}


@step(inputs={"x": V, "y": V}, outputs={"z": V})
def mul(x, y):
    return {"z": x * y}


@step(inputs={"x": V}, outputs={"z": V})
def affine(x):
    return {"z": x * 0.5 + 1.0}


@step(inputs={"x": V}, outputs={"lo": V, "hi": V})
def spread(x):
    return x - 1.0, x + 1.0  # a tuple in declaration order


class Accumulate:
    """A class step: its state comes from initialize()."""

    def initialize(self, config):
        self.offset = float(len(config["model_name"]))

    def execute(self, x):
        return {"z": x + self.offset}


accumulate = step(Accumulate, inputs={"x": V}, outputs={"z": V}, name="accumulate")

OPS = {
    "add": (add, lambda x, y: {"z": x + y}),
    "mul": (mul, lambda x, y: {"z": x * y}),
    "affine": (affine, lambda x: {"z": x * 0.5 + 1.0}),
    "spread": (spread, lambda x: {"lo": x - 1.0, "hi": x + 1.0}),
    "accumulate": (accumulate, None),
}


@st.composite
def dags(draw):
    """A recipe: each node an op fed by earlier tensors; some of them exposed as outputs."""
    n = draw(st.integers(1, 7))
    tensors = [("in", "a"), ("in", "b")]
    nodes = []
    for i in range(n):
        op = draw(st.sampled_from(sorted(OPS)))
        arity = len(OPS[op][0].inputs)
        sources = [draw(st.sampled_from(tensors)) for _ in range(arity)]
        nodes.append((f"n{i}_{op}", op, sources))
        tensors += [(f"n{i}_{op}", out) for out in OPS[op][0].outputs]
    produced = [t for t in tensors if t[0] != "in"]
    extra = draw(st.lists(st.sampled_from(produced), max_size=2, unique=True))
    outputs = list(dict.fromkeys([produced[-1], *extra]))
    return nodes, outputs


def build(recipe) -> Pipeline:
    nodes, outputs = recipe
    p = Pipeline("random", inputs={"a": V, "b": V}, max_batch_size=4)
    refs = {("in", "a"): p.input("a"), ("in", "b"): p.input("b")}
    for name, op, sources in nodes:
        s = OPS[op][0]
        node = p.add(s, name=name, **{inp: refs[src] for inp, src in zip(s.inputs, sources, strict=True)})
        refs.update({(name, out): node[out] for out in s.outputs})
    for i, key in enumerate(outputs):
        p.output(f"out{i}", refs[key])
    return p


def reference(recipe, a, b):
    nodes, outputs = recipe
    values = {("in", "a"): a, ("in", "b"): b}
    for name, op, sources in nodes:
        s, fn = OPS[op]
        args = [values[src] for src in sources]
        result = {"z": args[0] + float(len(name))} if fn is None else fn(*args)
        values.update({(name, k): v for k, v in result.items()})
    return {f"out{i}": values[key] for i, key in enumerate(outputs)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=dags(), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_random_dags_match_a_sequential_reference_in_every_mode(recipe, rows, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(rows, 3)), rng.normal(size=(rows, 3))
    p = build(recipe)
    expected = reference(recipe, a, b)
    for mode in MODES:
        got = p.run({"a": a, "b": b}, mode=mode)
        assert sorted(got) == sorted(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{mode} {name}")


DIAMOND = (
    [("n0_spread", "spread", [("in", "a")]), ("n1_mul", "mul", [("n0_spread", "lo"), ("in", "b")]),
     ("n2_add", "add", [("n0_spread", "hi"), ("n1_mul", "z")]), ("n3_accumulate", "accumulate", [("n2_add", "z")])],
    [("n3_accumulate", "z"), ("n1_mul", "z")],
)


@pytest.mark.parametrize("mode", MODES)
def test_many_concurrent_requests_each_get_their_own_answer(mode):
    p = build(DIAMOND)
    rng = np.random.default_rng(1)
    requests = [{"a": rng.normal(size=(1 + i % 4, 3)), "b": rng.normal(size=(1 + i % 4, 3))} for i in range(40)]
    results, report = run_many(p, requests, mode=mode, concurrency=8)
    for req, got in zip(requests, results, strict=True):
        want = reference(DIAMOND, req["a"], req["b"])
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    assert report.requests == 40 and report.errors == 0


def test_run_inside_a_running_event_loop_like_jupyter():
    p = build(DIAMOND)
    a, b = np.ones((2, 3)), np.full((2, 3), 2.0)

    async def notebook_cell():
        return p.run({"a": a, "b": b}, mode="bls")  # a blocking call while this loop runs

    got = anyio.run(notebook_cell)
    np.testing.assert_array_equal(got["out0"], reference(DIAMOND, a, b)["out0"])


def test_async_steps_are_awaited():
    @step(inputs={"x": V}, outputs={"z": V})
    async def later(x):
        await anyio.sleep(0)
        return {"z": x - 3.0}

    p = Pipeline("asyncsteps", inputs={"x": V}, max_batch_size=2)
    p.output("z", p.add(later, x=p.add(later, name="later2", x=p.input("x"))["z"])["z"])
    for mode in MODES:
        np.testing.assert_array_equal(p.run({"x": np.zeros((1, 3))}, mode=mode)["z"], np.full((1, 3), -6.0))


def test_unknown_mode_is_refused():
    from pipelines import InferenceError

    with pytest.raises(InferenceError, match="unknown mode 'fast'.*ensemble, bls, bls-sync"):
        LocalRuntime(build(DIAMOND), mode="fast")


@pytest.mark.parametrize("offload", ["always", "never"])
def test_offload_choices_give_the_same_answers(offload):
    p = build(DIAMOND)
    requests = [{"a": np.full((2, 3), float(i)), "b": np.ones((2, 3))} for i in range(10)]
    results, _ = run_many(p, requests, mode="ensemble", concurrency=4, offload=offload)
    for req, got in zip(requests, results, strict=True):
        np.testing.assert_array_equal(got["out0"], reference(DIAMOND, req["a"], req["b"])["out0"])
