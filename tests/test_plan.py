"""One execution plan: the compiler, the local runtime and the in-server BLS executor
read the same plan, dead nodes are dropped everywhere (with a warning), and the
executor's subset schedule is the plan's own pruning."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import warnings
from pathlib import Path

import pytest
from toy_steps import V, add, explode, inc, split

from pipelines import Pipeline
from pipelines.core.plan import DeadNodeWarning, ExecutionPlan
from pipelines.core.planning import plan_of
from pipelines.examples.basic import make_diamond
from pipelines.runtime import MODES, LocalRuntime


def edges(*, share_model: bool | None = None) -> Pipeline:
    """The shapes that trip planners: an output read by later steps, an output read by two
    steps, two outputs of one step, a step used by three nodes, an independent branch, dead nodes."""
    used_thrice = inc if share_model is None else inc.with_options(share_model=share_model)
    p = Pipeline("edges", inputs={"x": V}, max_batch_size=4)
    a = p.add(used_thrice, name="a", x=p.input("x"))
    b = p.add(used_thrice, name="b", x=a["y"])  # inc used by a, b, e
    c = p.add(add, name="c", a=b["y"], b=a["y"])
    d = p.add(split, name="d", x=b["y"])
    e = p.add(used_thrice, name="e", x=p.input("x"))
    dead = p.add(explode, name="dead", x=d["lo"])
    p.add(add, name="dead_too", a=dead["y"], b=e["y"])
    p.output("a", a["y"])  # also feeds b and c
    p.output("b", b["y"])  # also feeds c and d
    p.output("c", c["y"])
    p.output("lo", d["lo"])  # two outputs of one step
    p.output("hi", d["hi"])
    p.output("e", e["y"])
    return p


def shared_diamond() -> Pipeline:
    """A diamond of four parallel branches, all one step object, plus a dead branch."""
    p = make_diamond(ms=0, branches=4, name="sd")
    p.add(explode, name="unused", x=p.input("x"))
    return p


PIPELINES = {"edges": edges, "shared_diamond": shared_diamond, "diamond": lambda: make_diamond(ms=0, branches=3)}


def _quiet_plan(p: Pipeline) -> ExecutionPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        return plan_of(p)


def _load_executor():
    """The in-server BLS executor, as a stub would load it (no Triton here: pb_utils is None)."""
    path = Path(__file__).parents[1] / "pipelines" / "compile" / "models" / "bls_model.py"
    spec = importlib.util.spec_from_file_location("bls_executor_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_the_compiled_bls_plan_and_the_local_runtimes_plan_are_equal(name, tmp_path):
    p = PIPELINES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        written = p.compile("both").write(tmp_path / "repo")
        runtimes = [LocalRuntime(p, mode) for mode in MODES]
    for model in (f"{p.name}_bls", f"{p.name}_bls_sync"):
        data = json.loads((written / model / "1" / "bls.json").read_text())
        compiled = ExecutionPlan.from_json(data["plan"])
        for rt in runtimes:
            assert compiled == rt.plan
    # The ensemble runs the same nodes, on the same models.
    ensemble = (written / f"{p.name}_ensemble" / "config.pbtxt").read_text()
    for model in compiled.models:
        assert ensemble.count(f'model_name: "{model.name}"') == len(model.nodes)
    top = {f"{p.name}_ensemble", f"{p.name}_bls", f"{p.name}_bls_sync"}
    others = {d.name for d in written.iterdir() if d.is_dir()} - top - {m.name for m in compiled.models}
    assert others <= {f"{p.name}_ensemble__gate"}  # the ensemble's failure gate, no step model of a dead node


def test_the_plan_holds_live_nodes_groups_readers_last_uses_returns_and_models():
    p = edges()
    with pytest.warns(DeadNodeWarning, match=r"steps 'dead', 'dead_too' feed no pipeline output") as caught:
        plan = plan_of(p)
    assert caught[0].filename == __file__  # the warning points at the caller, not into the package
    assert plan.order == ("a", "b", "c", "d", "e")
    assert plan.dropped == ("dead", "dead_too")
    assert plan.groups == (("a", "e"), ("b",), ("c", "d"))
    assert plan.node("b").after == ("a",) and plan.node("b").before == ("c", "d")
    a_y = plan.tensor(("a", "y"))
    assert a_y.consumers == ("b", "c") and a_y.outputs == ("a",) and a_y.last_use is None and a_y.reads == 3
    x = plan.tensor((None, "x"))
    assert x.consumers == ("a", "e") and x.last_use == "e"
    assert plan.node("d").returns == ("lo", "hi")
    # one model per node of inc, in the order of the nodes: the first keeps the step's name, the
    # later ones are named after their node; the dead nodes' steps get no model
    assert [(m.name, m.nodes) for m in plan.models] == [
        ("edges__inc", ("a",)), ("edges__b", ("b",)), ("edges__add", ("c",)), ("edges__split", ("d",)),
        ("edges__e", ("e",)),
    ]
    assert {m.step for m in plan.models if m.name in ("edges__inc", "edges__b", "edges__e")} == {"inc"}
    assert plan.tensor(("a", "y")).ensemble == "a" and plan.ensemble_name((None, "x")) == "x"
    assert ExecutionPlan.from_json(json.dumps(plan.to_json())) == plan
    # Asked to share: one model for the three nodes of inc.
    shared = _quiet_plan(edges(share_model=True))
    assert [(m.name, m.nodes) for m in shared.models] == [
        ("edges__inc", ("a", "b", "e")), ("edges__add", ("c",)), ("edges__split", ("d",))
    ]
    assert ExecutionPlan.from_json(json.dumps(shared.to_json())) == shared


def test_a_subset_of_outputs_prunes_the_plan():
    plan = _quiet_plan(edges())
    sub = plan.for_outputs(["lo"])
    assert sub.order == ("a", "b", "d") and sub.output_names == ("lo",)
    assert sub.node("d").returns == ("lo",)  # "hi" is read by nothing now
    assert sub.node("b").returns == ("y",) and sub.tensor(("b", "y")).last_use == "d"
    assert [m.nodes for m in sub.models] == [("a",), ("b",), ("d",)]
    assert [m.nodes for m in _quiet_plan(edges(share_model=True)).for_outputs(["lo"]).models] == [("a", "b"), ("d",)]
    assert plan.for_outputs(["lo"]) is sub  # cached per subset
    assert plan.for_outputs(plan.output_names) is plan
    with pytest.raises(ValueError, match=r"no output 'nope'; its outputs are \['a', 'b', 'c', 'lo', 'hi', 'e'\]"):
        plan.for_outputs(["lo", "nope"])
    assert plan.for_outputs([]) is plan  # as in Triton: naming no output asks for every output


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_the_bls_executor_prunes_as_the_plan_does_for_every_subset(name):
    executor = _load_executor()
    assert "networkx" not in vars(executor)  # reads JSON, not the package
    plan = _quiet_plan(PIPELINES[name]())
    data = json.loads(json.dumps(plan.to_json()))
    names = plan.output_names
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(names, k):
            schedule = executor.serving.Schedule(data, frozenset(subset))
            sub = plan.for_outputs(subset)
            assert schedule.wanted == list(sub.output_names)
            assert schedule.order == list(sub.order)
            assert schedule.after == {n.name: list(n.after) for n in sub.nodes}
            assert schedule.returns == {n.name: list(n.returns) for n in sub.nodes}
            assert schedule.uses == sub.reads
