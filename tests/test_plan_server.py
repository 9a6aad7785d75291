"""The plan on the real server: a request for some outputs runs only the steps they need in
every form but a gated ensemble, which runs them all, as the local ensemble mode does (the
composing models' statistics show which ran), answers as the local runtime does, and a node
that feeds no output is compiled into no model."""

from __future__ import annotations

import time
import warnings

import anyio
import numpy as np
import pytest
from toy_steps import V, add, explode, inc, split, twice

from pipelines import Pipeline
from pipelines.core.plan import DeadNodeWarning
from pipelines.forms import FORMS

pytestmark = pytest.mark.server

X = np.array([[1.0, 2.0]], np.float32)


def pruned() -> Pipeline:
    p = Pipeline("pruned", inputs={"x": V}, max_batch_size=4)
    a = p.add(inc, name="a", x=p.input("x"))
    c = p.add(add, name="c", a=a["y"], b=a["y"])
    d = p.add(split, name="d", x=a["y"])
    e = p.add(twice, name="e", x=p.input("x"))
    p.add(explode, name="dead", x=d["lo"])
    p.output("a", a["y"])  # also read by c and d
    p.output("c", c["y"])
    p.output("lo", d["lo"])
    p.output("hi", d["hi"])
    p.output("e", e["y"])
    return p


# subset -> the composing models that must run for it (the others must not)
SUBSETS = {
    ("e",): {"pruned__twice"},
    ("hi",): {"pruned__inc", "pruned__split"},
    ("a", "lo"): {"pruned__inc", "pruned__split"},
    ("c", "e"): {"pruned__inc", "pruned__add", "pruned__twice"},
}
STEP_MODELS = {"pruned__inc", "pruned__add", "pruned__split", "pruned__twice"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from pipelines.triton import TritonServer

    p = pruned()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        repo = p.compile("all")
        expected = p.run({"x": X})
    written = repo.write(tmp_path_factory.mktemp("plan") / "repo")
    with TritonServer(written) as server:
        yield server, repo, expected


_STEP_OF_NODE = {"a": "inc", "c": "add", "d": "split", "e": "twice"}  # node -> its step model's step


async def _local_ensemble(subset):
    from pipelines.runtime import LocalRuntime

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        rt = LocalRuntime(pruned(), "ensemble")
    async with rt:
        return await rt.infer_with_report({"x": X}, outputs=list(subset))


def _counts(client) -> dict[str, int]:
    stats = client.statistics()["model_stats"]
    return {m["name"]: int(m.get("inference_count", 0)) for m in stats}


def _counts_once_counted(client, before: dict[str, int], want: set[str]) -> dict[str, int]:
    """The counts once every model of ``want`` has counted a request (10 s at most). Triton
    counts a request as it releases it, which can come after the answer that needed it: read
    at once under load, a step that ran could still show its old count."""
    deadline = time.monotonic() + 10.0
    while True:
        now = _counts(client)
        if all(now.get(m, 0) > before.get(m, 0) for m in want) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def test_the_dead_node_has_no_model(served):
    _, repo, _ = served
    assert not any("explode" in name or "dead" in name for name in repo.models)
    assert STEP_MODELS <= set(repo.models)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_subset_of_outputs_runs_only_the_steps_it_needs(served, form):
    server, _, expected = served
    client = server.client("grpc", timeout=60)
    model = FORMS[form].model_name("pruned", side_by_side=True)
    try:
        for subset, needed in SUBSETS.items():
            before = _counts(client)
            out = client.infer(model, {"x": X}, outputs=list(subset))
            expected_models = (set() if FORMS[form].in_process else
                               STEP_MODELS if FORMS[form].scheduler == "event" else needed)
            after = _counts_once_counted(client, before, expected_models)
            assert sorted(out) == sorted(subset), (form, subset)
            for name in subset:
                np.testing.assert_array_equal(out[name], expected[name])
            ran = {m for m in STEP_MODELS if after.get(m, 0) > before.get(m, 0)}
            if FORMS[form].in_process:  # fused runs Python steps in its own process: no step model is called
                assert ran == set(), (form, subset)
            elif FORMS[form].scheduler == "event":
                # The ensemble's failure gate (parallel shapes) reads every step's error tensor, so
                # Triton's pruning keeps every step, and the local ensemble mode runs them all too.
                assert ran == STEP_MODELS, (form, subset)
                _, report = anyio.run(_local_ensemble, subset)
                assert {f"pruned__{_STEP_OF_NODE[s.step]}" for s in report.steps if s.calls} == ran, subset
            else:
                assert ran == needed, (form, subset)
        everything = client.infer(model, {"x": X})  # naming no output: every output
        assert sorted(everything) == sorted(expected)
    finally:
        client.close()
