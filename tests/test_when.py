"""Conditional steps (``with p.when(cond):``), without a server: the wiring refusals, each with
its message; the local runtime's bls, bls-sync and fused modes with 0, some and all rows true
(and every subset of outputs); no step of a branch called when no row holds; the ensemble
form and mode refused; the plan's conditions carried through its JSON."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from when_pipelines import ROW, check, expected, gated_pipeline, minus_one, plus_one, rows

from pipelines import Pipeline, TensorSpec, step
from pipelines.core.plan import ExecutionPlan
from pipelines.core.planning import plan_of
from pipelines.errors import (
    ConditionError,
    DtypeMismatchError,
    NotCompilableError,
    ShapeMismatchError,
)
from pipelines.forms import FormLeftOutWarning

MODES = ("bls", "bls-sync", "fused")
CASES = {"none": (0, 3), "some": (2, 3), "all": (3, 0)}


# ------------------------------------------------------------------ wiring refusals


@step(inputs={"x": ROW}, outputs={"score": TensorSpec("FP32", [1]), "flags": TensorSpec("BOOL", [2])})
def scorer(x):
    return {"score": x[:, :1], "flags": x[:, :2] > 0}


@step(inputs={"x": ROW}, outputs={"y": TensorSpec("FP32", [-1])})
def ragged(x):
    return {"y": x}


@step(inputs={"x": ROW}, outputs={"y": TensorSpec("FP64", [4])})
def wide(x):
    return {"y": x.astype(np.float64)}


def _pipeline(batch: int = 8) -> tuple[Pipeline, object]:
    p = Pipeline("w", inputs={"x": ROW}, max_batch_size=batch)
    return p, p.add(check, x=p.input("x"))


def test_a_condition_that_is_not_bool_is_refused_naming_the_tensor_and_its_spec():
    p, _ = _pipeline()
    s = p.add(scorer, x=p.input("x"))
    with pytest.raises(DtypeMismatchError, match=r"when\(scorer.score\) needs a condition of BOOL dims \[1\].*"
                       r"'scorer.score' \(FP32 \[1\]\) is FP32"):
        with p.when(s["score"]):
            pass


def test_a_condition_of_the_wrong_shape_is_refused_naming_the_tensor_and_its_dims():
    p, _ = _pipeline()
    s = p.add(scorer, x=p.input("x"))
    with pytest.raises(ShapeMismatchError, match=r"when\(scorer.flags\).*'scorer.flags' \(BOOL \[2\]\) has dims \[2\]"):
        with p.when(s["flags"]):
            pass
    q, _ = _pipeline(batch=0)
    with pytest.raises(ShapeMismatchError, match=r"shape \[1\] \(max_batch_size is 0\)"):
        with q.when(q.add(scorer, x=q.input("x"))["flags"]):
            pass


def test_an_output_of_a_branch_without_otherwise_is_refused_naming_the_node_and_the_when():
    p, c = _pipeline()
    with p.when(c["ok"]):
        a = p.add(plus_one, x=p.input("x"))
    with pytest.raises(ConditionError, match=r"output 'y' is 'plus_one.y' .*step 'plus_one' makes only in "
                       r"when\(check.ok\); say what the other rows get: .*otherwise=0"):
        p.output("y", a["y"])
    p.output("y", a["y"], otherwise=0)  # the fix the message gives


def test_a_select_whose_two_sides_differ_in_spec_is_refused_naming_both():
    p, c = _pipeline()
    with p.when(c["ok"]):
        a = p.add(plus_one, x=p.input("x"))
    with p.when(~c["ok"]):
        b = p.add(wide, x=p.input("x"))
    with pytest.raises(DtypeMismatchError, match=r"select\(check.ok\) merges then='plus_one.y' \(FP32 \[4\]\) and "
                       r"otherwise='wide.y' \(FP64 \[4\]\), whose dtypes differ"):
        p.select(c["ok"], then=a["y"], otherwise=b["y"])
    with p.when(~c["ok"]):
        r = p.add(ragged, x=p.input("x"))
    with pytest.raises(ShapeMismatchError, match="whose dims differ"):
        p.select(c["ok"], then=a["y"], otherwise=r["y"])


def test_a_branch_tensor_read_outside_its_block_is_refused():
    p, c = _pipeline()
    with p.when(c["ok"]):
        a = p.add(plus_one, x=p.input("x"))
    with pytest.raises(ConditionError, match=r"step 'minus_one' input 'x' reads 'plus_one.y' .* only in "
                       r"when\(check.ok\), but it is read for every row"):
        p.add(minus_one, x=a["y"])
    with p.when(~c["ok"]), pytest.raises(ConditionError, match=r"read for when\(~check.ok\)"):
        p.add(minus_one, x=a["y"])
    with pytest.raises(ConditionError, match="select"):  # the wrong side of a select
        p.select(~c["ok"], then=a["y"], otherwise=a["y"])


def test_an_otherwise_that_does_not_fit_the_output_is_refused():
    p, c = _pipeline()
    with p.when(c["ok"]):
        a = p.add(plus_one, x=p.input("x"))
        r = p.add(ragged, x=p.input("x"))
    with pytest.raises(ConditionError, match=r"of shape \[3\]; give a scalar, or an array of the output's dims \[4\]"):
        p.output("y", a["y"], otherwise=[1, 2, 3])
    with pytest.raises(ConditionError, match="cannot hold exactly"):
        p.output("y", a["y"], otherwise="zero")
    with pytest.raises(ConditionError, match="variable size"):
        p.output("r", r["y"], otherwise=np.zeros(4, np.float32))
    p.output("r", r["y"], otherwise=0)  # a scalar takes the branch's size
    with pytest.raises(ConditionError, match="drop otherwise="):
        p.output("ok", c["ok"], otherwise=False)


# ------------------------------------------------------------------ the local runtime


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_answers_row_by_row(mode, case):
    x = rows(*CASES[case])
    out = gated_pipeline().run({"x": x}, mode=mode)
    want = expected(x)
    assert sorted(out) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(out[name], value, err_msg=name)
        assert out[name].dtype == value.dtype, name


@pytest.mark.parametrize("mode", MODES)
def test_every_subset_of_outputs_answers(mode):
    p = gated_pipeline()
    x = rows(2, 2)
    want = expected(x)
    names = list(want)
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            out = p.run({"x": x}, mode=mode, outputs=list(subset))
            assert sorted(out) == sorted(subset)
            for name in subset:
                np.testing.assert_array_equal(out[name], want[name], err_msg=f"{subset}: {name}")


@step(inputs={"x": ROW}, outputs={"ok": TensorSpec("BOOL", [1])})
def first_positive(x):
    return {"ok": x[..., :1] > 0}


def _counting_pipeline(calls: list[int], batch: int = 8) -> Pipeline:
    @step(inputs={"x": ROW}, outputs={"y": ROW})
    def counted(x):
        calls.append(len(x) if batch else 1)
        return {"y": x * 3}

    p = Pipeline("counted", inputs={"x": ROW}, max_batch_size=batch)
    c = p.add(first_positive, x=p.input("x"))
    with p.when(c["ok"]):
        a = p.add(counted, x=p.input("x"))
    p.output("y", a["y"], otherwise=np.float32(7))
    return p


@pytest.mark.parametrize("mode", MODES)
def test_the_branch_runs_once_on_the_true_rows_and_not_at_all_without_one(mode):
    calls: list[int] = []
    p = _counting_pipeline(calls)
    for true, false in ((2, 3), (0, 4), (5, 0)):
        x = rows(true, false)
        out = p.run({"x": x}, mode=mode)
        np.testing.assert_array_equal(out["y"], np.where(x[:, :1] > 0, x * 3, 7).astype(np.float32))
    assert calls == [2, 5]  # one call of 2 rows, none, one of 5


@pytest.mark.parametrize("mode", MODES)
def test_a_pipeline_without_batching_runs_or_skips_the_whole_request(mode):
    calls: list[int] = []
    p = _counting_pipeline(calls, batch=0)
    for first, want in ((1.0, 3.0), (-1.0, 7.0)):
        out = p.run({"x": np.full(4, first, np.float32)}, mode=mode)["y"]
        np.testing.assert_array_equal(out, np.full(4, want, np.float32))
    assert calls == [1]


def test_a_select_reads_the_negated_condition_as_the_user_wrote_it():
    p, c = _pipeline()
    with p.when(~c["ok"]):
        b = p.add(minus_one, x=p.input("x"))
    a = p.add(plus_one, x=p.input("x"))
    p.output("z", p.select(~c["ok"], then=b["y"], otherwise=a["y"]))
    x = rows(2, 2)
    out = p.run({"x": x}, mode="bls")
    np.testing.assert_array_equal(out["z"], np.where(x[:, :1] > 0, x + 1, x - 1))


# ------------------------------------------------------------------ the ensemble form


def test_the_ensemble_form_is_refused_naming_the_when_and_the_forms_that_can():
    p = gated_pipeline()
    with pytest.raises(NotCompilableError, match=r"an ensemble cannot skip a step, and when\(check.ok\).*"
                       r"use the 'bls' or 'fused' form.*compile\('bls'\) or compile\('fused'\)"):
        p.compile("ensemble")
    with pytest.raises(NotCompilableError, match=r"the local 'ensemble' mode cannot skip a step.*'bls' or 'fused'"):
        p.run({"x": rows(1, 1)}, mode="ensemble")


@pytest.mark.parametrize("target", ["all", "both"])
def test_all_and_both_write_the_other_forms_and_warn_in_one_line(target):
    p = gated_pipeline()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo = p.compile(target)
    left_out = [w for w in caught if issubclass(w.category, FormLeftOutWarning)]
    assert len(left_out) == 1 and "\n" not in str(left_out[0].message)
    assert f"compile({target!r}) left the ensemble form out" in str(left_out[0].message)
    assert left_out[0].filename == __file__
    names = set(repo.models)
    assert "gated_ensemble" not in names and "gated_bls" in names and "gated_bls_sync" in names
    assert ("gated_fused" in names) == (target == "all")
    assert not any(name.endswith("__select") for name in names)  # merged by the executors, no model


def test_the_plan_carries_conditions_selects_and_fills_through_json():
    plan = plan_of(gated_pipeline())
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    nodes = {n.name: n for n in plan.nodes}
    assert [t.describe() for t in nodes["doubled"].when] == ["when(check.ok)", "when(check.big)"]
    assert [t.describe() for t in nodes["minus_one"].when] == ["when(~check.ok)"]
    assert nodes["select"].kind == "select" and nodes["select"].model == ""
    assert "check" in nodes["detector"].after  # a node waits for its conditions
    fills = {o.name: o.otherwise for o in plan.outputs}
    assert fills["flag"] is None and fills["label"].data == ("neg",)


def test_rows_settle_merges_a_select_skips_a_block_no_row_holds_and_leaves_the_rest_to_call():
    from pipelines.serving import SKIPPED, Branches, Rows

    plan = plan_of(gated_pipeline()).to_json()
    nodes = {n["name"]: n for n in plan["nodes"]}
    branches = Branches(plan)
    values = {
        ("check", "ok"): np.array([[True], [False], [True]]),
        ("check", "big"): np.zeros((3, 1), dtype=bool),
        ("plus_one", "y"): np.ones((2, 4), np.float32),  # the rows of when(check.ok)
        ("minus_one", "y"): np.zeros((1, 4), np.float32),
    }
    rows = Rows(branches, 3, values.__getitem__)
    assert rows.settle(nodes["detector"], ["y"], None) is None and rows.count(branches.when["detector"]) == 2
    assert rows.settle(nodes["doubled"], ["y"], None) == {"y": SKIPPED}  # check.big holds on no row
    assert branches.reads(nodes["doubled"]) == [("plus_one", "y"), ("check", "ok"), ("check", "big")]
    merged = rows.settle(nodes["select"], ["output"], lambda key, _dtype: values[key])
    assert merged.keys() == {"output"} and merged["output"][:, 0].tolist() == [1, 0, 1]


def test_a_static_pipeline_plan_json_is_unchanged():
    p = Pipeline("s", inputs={"x": ROW}, max_batch_size=8)
    p.output("y", p.add(plus_one, x=p.input("x"))["y"])
    data = plan_of(p).to_json()
    assert all("when" not in n and "kind" not in n for n in data["nodes"])
    assert all("otherwise" not in o for o in data["outputs"])


# ------------------------------------------------------------------ the diagram


def test_a_when_block_is_drawn_as_a_labelled_frame_in_every_rendering():
    p = gated_pipeline()
    mermaid, dot, svg = p.to_mermaid(), p.to_dot(), p.diagram().to_svg()
    assert 'subgraph w0["when(check.ok)"]' in mermaid and 'subgraph w1["when(check.big)"]' in mermaid
    assert 'n0 -. "~ok" .-> w2' in mermaid  # the condition's edge into its frame
    assert 'subgraph cluster_when_2 { label="when(~check.ok)"; style=dashed;' in dot
    assert '"check" -> "minus_one" [label="~ok", style=dashed, lhead=cluster_when_2];' in dot
    assert svg.count('stroke-dasharray="6 4"') == 3 and ">when(~check.ok)</text>" in svg
