"""Compiling a streaming pipeline, without a server: the streaming step's decoupled model, the
decoupled and gated ensemble, the tensors the stream carries, and each form's refusal.
What the server does with them: tests/test_stream_server_ensemble.py."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile.ensemble import ensemble_layout_of
from pipelines.errors import CompileError, NotCompilableError
from pipelines.forms import FormLeftOutWarning, TimeoutNotEnforcedWarning

pytestmark = pytest.mark.filterwarnings("ignore::pipelines.compile.step_sources.StepByValueWarning")

ONE = TensorSpec("INT32", [1])


@step(inputs={"n": ONE}, outputs={"tok": ONE}, timeout=2.0)
def count(n):
    for i in range(int(n[0])):
        yield {"tok": np.array([i], np.int32)}


@step(inputs={"tok": ONE, "base": ONE}, outputs={"sq": ONE})
def plus(tok, base):
    return {"sq": tok + base}


@step(inputs={"n": ONE}, outputs={"base": ONE})
def prep(n):
    return {"base": n * 10}


@step(inputs={"tok": ONE}, outputs={"out": ONE}, whole_stream=True)
def total(tok):
    return {"out": sum(tok)}


def alone() -> Pipeline:
    p = Pipeline("alone", inputs={"n": ONE})
    p.output("tok", p.add(count, n=p.input("n"))["tok"])
    return p


def beside() -> Pipeline:
    p = Pipeline("beside", inputs={"n": ONE})
    base = p.add(prep, n=p.input("n"))["base"]
    p.output("sq", p.add(plus, tok=p.add(count, n=p.input("n"))["tok"], base=base)["sq"])
    return p


def whole() -> Pipeline:
    p = Pipeline("whole", inputs={"n": ONE})
    p.output("out", p.add(total, tok=p.add(count, n=p.input("n"))["tok"])["out"])
    return p


def plan_of_model(repo, name: str) -> dict:
    data = repo.models[name].files["1/step.json"]
    return json.loads(data() if callable(data) else data)


def test_the_streaming_steps_model_is_decoupled_and_declares_its_failure_output():
    repo = alone().compile("ensemble")
    config = repo.models["alone__count"].config
    assert config.model_transaction_policy.decoupled
    assert [(o.name, list(o.dims)) for o in config.output] == [("tok", [1]), ("__err__", [-1])]
    assert plan_of_model(repo, "alone__count")["stream"] == {"err_output": "__err__", "timeout_s": 2.0}


def test_the_ensemble_is_decoupled_and_gated():
    repo = alone().compile("ensemble")
    assert repo.models["alone"].config.model_transaction_policy.decoupled
    steps = [s.model_name for s in repo.models["alone"].config.ensemble_scheduling.step]
    assert steps == ["alone__count", "alone__gate"]  # the streaming step never answers for the ensemble
    assert not repo.models["alone__gate"].config.model_transaction_policy.decoupled


def test_a_step_after_the_stream_reads_the_requests_tensors_from_the_streams_carry():
    repo = beside().compile("ensemble")
    config = repo.models["beside__count"].config
    assert [(i.name, i.optional) for i in config.input] == [("n", False), ("__err_in_0", True), ("__carry_in_0", True)]
    assert [o.name for o in config.output] == ["tok", "__err__", "__carry_0"]
    assert plan_of_model(repo, "beside__count")["ensemble"]["carries"] == {
        "__carry_0": {"input": "__carry_in_0", "spec": {"dtype": "INT32", "dims": [1]}}}
    steps = {s.model_name: s for s in repo.models["beside"].config.ensemble_scheduling.step}
    carried = steps["beside__count"].output_map["__carry_0"]
    assert steps["beside__count"].input_map["__carry_in_0"] == steps["beside__prep"].output_map["base"]
    assert steps["beside__count"].input_map["__err_in_0"] == steps["beside__prep"].output_map["__err__"]
    # the step after the stream reads only what the stream's responses carry
    plus_inputs = dict(steps["beside__plus"].input_map)
    assert plus_inputs == {"tok": steps["beside__count"].output_map["tok"], "base": carried,
                           "__err_in_0": steps["beside__count"].output_map["__err__"]}


def test_the_ensemble_refuses_a_step_that_reads_a_stream_whole_and_names_the_forms_that_can():
    said = (r"pipeline 'whole': the ensemble form cannot run step 'total', which reads the stream of 'count' whole "
            r"\(whole_stream=True\).*the 'bls', 'bls-sync' and 'fused' forms can run it")
    with pytest.raises(NotCompilableError, match=said) as err:
        whole().compile("ensemble")
    assert err.value.step == "total"
    assert ensemble_layout_of(whole()) is None


def test_each_form_that_does_not_stream_yet_refuses_by_name():
    for form in ("bls", "bls-sync", "fused"):
        with pytest.raises(NotCompilableError, match=f"pipeline 'alone' streams \\(step 'count'\\), and the '{form}' "
                                                     "form does not stream yet"):
            alone().compile(form)
    with pytest.raises(NotCompilableError, match=r"no form of compile\('both'\) can run it \(ensemble: .*whole"):
        whole().compile("both")


def test_side_by_side_the_forms_that_cannot_stream_are_left_out_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo = alone().compile("all")
    left_out = [str(w.message) for w in caught if issubclass(w.category, FormLeftOutWarning)]
    assert len(left_out) == 3 and all("left the" in m and "wrote ensemble" in m for m in left_out), left_out
    assert repo.top_level == ("alone_ensemble",)
    # the streaming step's own model enforces its timeout: no warning that the ensemble cannot
    assert not [w for w in caught if issubclass(w.category, TimeoutNotEnforcedWarning)]


def test_a_streaming_step_cannot_name_a_tensor_as_the_models_it_adds():
    @step(inputs={"n": ONE}, outputs={"__err__": ONE})
    def clash(n):
        yield {"__err__": n}

    p = Pipeline("clash", inputs={"n": ONE})
    p.output("x", p.add(clash, n=p.input("n"))["__err__"])
    with pytest.raises(CompileError, match="'__err__'"):
        p.compile("ensemble")

    @step(inputs={"n": ONE, "__carry_in_0": ONE}, outputs={"tok": ONE})
    def carrying(n, __carry_in_0):
        yield {"tok": n}

    q = Pipeline("carrying", inputs={"n": ONE})
    c = q.add(carrying, n=q.input("n"), __carry_in_0=q.input("n"))
    q.output("sq", q.add(plus, tok=c["tok"], base=q.input("n"))["sq"])
    with pytest.raises(CompileError, match="'__carry_in_0'.*rename it"):
        q.compile("ensemble")
