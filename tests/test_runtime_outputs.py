"""Requested outputs in the local runtime: every non-empty subset, in every mode, answers
exactly those outputs and runs the steps the server's form runs for it (only those they
need, except in a gated ensemble, which runs them all); an unknown output is a clear error."""

from __future__ import annotations

import itertools
import warnings

import anyio
import numpy as np
import pytest
from toy_steps import V, add, explode, inc, split

from pipelines import InputError, Pipeline, StepError
from pipelines.core.plan import DeadNodeWarning
from pipelines.runtime import MODES, LocalRuntime, run_many


def edges() -> Pipeline:
    p = Pipeline("edges", inputs={"x": V}, max_batch_size=4)
    a = p.add(inc, name="a", x=p.input("x"))
    b = p.add(inc, name="b", x=a["y"])
    c = p.add(add, name="c", a=b["y"], b=a["y"])
    d = p.add(split, name="d", x=b["y"])
    e = p.add(inc, name="e", x=p.input("x"))
    p.add(explode, name="dead", x=d["lo"])
    p.output("a", a["y"])  # an output that also feeds later steps
    p.output("b", b["y"])  # an output that feeds two steps
    p.output("c", c["y"])
    p.output("lo", d["lo"])  # two outputs of one step
    p.output("hi", d["hi"])
    p.output("e", e["y"])
    return p


X = np.array([[1.0, 2.0]], np.float32)
EXPECTED = {"a": X + 1, "b": X + 2, "c": 2 * X + 3, "lo": X + 1, "hi": (X + 2) * 10, "e": X + 1}
# 'a' and 'e' can run side by side, so the ensemble compiles gated and Triton runs every live
# step for every request, whatever it asks for (docs/triton_requested_outputs.md); the local
# ensemble mode does the same. The other forms run only what the outputs need.
LIVE = {"a", "b", "c", "d", "e"}
NEEDS = {"a": {"a"}, "b": {"a", "b"}, "c": {"a", "b", "c"}, "lo": {"a", "b", "d"}, "hi": {"a", "b", "d"}, "e": {"e"}}


@pytest.mark.parametrize("mode", MODES)
def test_every_subset_of_outputs_runs_the_steps_its_form_runs_on_the_server(mode):
    p = edges()

    async def main():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeadNodeWarning)
            rt = LocalRuntime(p, mode)
        async with rt:
            for k in range(1, len(EXPECTED) + 1):
                for subset in itertools.combinations(EXPECTED, k):
                    out, report = await rt.infer_with_report({"x": X}, outputs=list(subset))
                    assert sorted(out) == sorted(subset), subset
                    for name in subset:
                        np.testing.assert_array_equal(out[name], EXPECTED[name])
                    ran = {s.step for s in report.steps if s.calls}
                    assert ran == (LIVE if mode == "ensemble" else set().union(*(NEEDS[n] for n in subset))), subset
            full = await rt.infer({"x": X})  # no selection: every output
            assert sorted(full) == sorted(EXPECTED)

    anyio.run(main)


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_output_names_itself_and_the_valid_ones(mode):
    p = edges()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        with pytest.raises(InputError, match=r"no output 'nope'; its outputs are \['a', 'b', 'c', 'lo', 'hi', 'e'\]") as err:
            p.run({"x": X}, mode=mode, outputs=["a", "nope"])
    assert err.value.tensor == "nope" and err.value.pipeline == "edges"


def test_run_and_run_many_take_outputs():
    p = edges()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        out = p.run({"x": X}, mode="bls", outputs=["hi"])
        results, report = run_many(p, [{"x": X}] * 3, mode="bls-sync", outputs=["e", "a"], concurrency=2)
    assert list(out) == ["hi"]
    np.testing.assert_array_equal(out["hi"], EXPECTED["hi"])
    assert [sorted(r) for r in results] == [["a", "e"]] * 3
    assert {s.step: s.calls for s in report.steps} == {"a": 3, "b": 0, "c": 0, "d": 0, "e": 3}


def test_naming_no_output_asks_for_every_output_as_in_triton():
    p = edges()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        out = p.run({"x": X}, outputs=[])
    assert sorted(out) == sorted(EXPECTED)


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_node_that_would_raise_is_not_run_and_is_named(mode):
    """The compiler leaves such a node out, so the server answers; the local runtime must too."""
    p = edges()
    with pytest.warns(DeadNodeWarning, match=r"step 'dead' feeds no pipeline output, so no form runs it"):
        out = p.run({"x": X}, mode=mode)
    np.testing.assert_array_equal(out["hi"], EXPECTED["hi"])


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_step_no_asked_output_needs_fails_only_the_gated_ensemble(mode):
    """Side by side, 'ok' and 'boom' make a gated ensemble: on the server it runs 'boom' for a
    request that asks only for 'fine', and the gate fails the request; the BLS and fused forms
    never call it. A chain compiles to a plain ensemble, which Triton prunes as asked."""
    p = Pipeline("sides", inputs={"x": V}, max_batch_size=4)
    p.output("fine", p.add(inc, name="ok", x=p.input("x"))["y"])
    p.output("bad", p.add(explode, name="boom", x=p.input("x"))["y"])
    if mode == "ensemble":
        with pytest.raises(StepError, match="node 'boom'"):
            p.run({"x": X}, mode=mode, outputs=["fine"])
    else:
        np.testing.assert_array_equal(p.run({"x": X}, mode=mode, outputs=["fine"])["fine"], X + 1)

    chain = Pipeline("line", inputs={"x": V}, max_batch_size=4)
    first = chain.add(inc, name="ok", x=chain.input("x"))["y"]
    chain.output("fine", first)
    chain.output("bad", chain.add(explode, name="boom", x=first)["y"])
    np.testing.assert_array_equal(chain.run({"x": X}, mode=mode, outputs=["fine"])["fine"], X + 1)
