"""One table of forms: compile targets, local modes, the CLI and model names all come from
pipelines.forms, and no module builds a form's model name by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from pipelines import CompileError, InferenceError, Pipeline, TensorSpec, step
from pipelines.cli import build_parser
from pipelines.compile import COMPILERS, TARGETS
from pipelines.forms import FORMS, form, forms_of_target, model_name
from pipelines.runtime import MODES, LocalRuntime

V = TensorSpec("FP32", [-1])
PACKAGE = Path(__file__).parents[1] / "pipelines"


@step(inputs={"x": V}, outputs={"y": V})
def inc(x):
    return {"y": x + 1}


def tiny() -> Pipeline:
    p = Pipeline("tiny", inputs={"x": V}, max_batch_size=2)
    p.output("y", p.add(inc, x=p.input("x"))["y"])
    return p


def test_each_form_is_named_once_with_its_suffix_and_scheduler():
    assert list(FORMS) == ["ensemble", "bls", "bls-sync", "fused"]
    assert [f.suffix for f in FORMS.values()] == ["_ensemble", "_bls", "_bls_sync", "_fused"]
    assert [f.scheduler for f in FORMS.values()] == ["event", "concurrent", "sequential", "concurrent"]
    assert [f.in_process for f in FORMS.values()] == [False, False, False, True]
    assert len({f.suffix for f in FORMS.values()}) == len(FORMS)
    assert model_name("yolo", "bls-sync") == "yolo_bls_sync"
    assert form("bls").model_name("yolo", side_by_side=False) == "yolo"
    with pytest.raises(ValueError, match=r"unknown form 'bls_sync' \(did you mean 'bls-sync'\?\); choose one of"):
        form("bls_sync")


def test_targets_modes_and_the_cli_read_the_table():
    assert TARGETS == (*FORMS, "both", "all")
    assert MODES == tuple(FORMS)
    assert [f.name for f in forms_of_target("both")] == ["ensemble", "bls", "bls-sync"]  # as in the first release
    assert forms_of_target("all") == tuple(FORMS.values())
    parser = build_parser()
    assert parser.parse_args(["compile", "m:p", "--target", "all", "--out", "d"]).target == "all"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "m:p", "--mode", "bls_sync"])



def test_each_layer_has_its_own_entry_for_every_form():
    # forms.py names no compiler and no profile boundary: each layer's table, keyed by form name, does.
    # (Imported here: a module-level import of an internal module makes tiny()'s step travel by value.)
    from pipelines.calibration.cost import BOUNDARIES, FORM_COSTS

    assert set(COMPILERS) == set(FORMS)
    assert all(callable(compile_form) for compile_form in COMPILERS.values())
    assert set(FORM_COSTS) == set(FORMS)
    for name, pays in FORM_COSTS.items():
        named = [pays.call_cost, pays.own_cost, pays.stub_cost] + [pays.in_process_step_cost] * bool(pays.in_process_step_cost)
        assert set(named) <= set(BOUNDARIES), name
        assert bool(pays.in_process_step_cost) == FORMS[name].in_process, name
    source = (PACKAGE / "forms.py").read_text()
    assert "pipelines.compile" not in source.replace(":data:`pipelines.compile.COMPILERS`", "")
    assert not any(b in source for b in ('"ensemble_step"', '"bls_call"', '"fused_model"'))

def test_compile_names_top_level_models_from_the_table():
    p = tiny()
    for target in TARGETS:
        forms = forms_of_target(target)
        repo = p.compile(target)
        side_by_side = target not in FORMS
        assert repo.top_level == tuple(f.model_name("tiny", side_by_side=side_by_side) for f in forms)
    assert p.compile("all").top_level == (*p.compile("both").top_level, "tiny_fused")
    # The fused form alone holds no step model: its Python steps run inside it.
    assert p.compile("fused").names == ["tiny"]
    with pytest.raises(CompileError, match=r"unknown target 'fuse'; choose one of ensemble, bls, bls-sync, fused, both, all"):
        p.compile("fuse")


def test_every_mode_runs_and_an_unknown_one_lists_the_table():
    p = tiny()
    for mode in FORMS:
        assert p.run({"x": np.ones((1, 1), np.float32)}, mode=mode)["y"].tolist() == [[2.0]]
    with pytest.raises(InferenceError, match=r"unknown mode 'bls_sync' \(did you mean 'bls-sync'\?\)"):
        LocalRuntime(p, "bls_sync")


def test_no_module_builds_a_forms_model_name_by_hand():
    suffixes = {f.suffix for f in FORMS.values()}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "forms.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in suffixes:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not found, "model names built by hand instead of pipelines.forms: " + ", ".join(found)
