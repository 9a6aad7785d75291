"""Conditional pipelines go where the others go: ``~flag`` is a pipeline output in every form
(the local modes, and each compiled form on the real tritonserver), and ``serve --local``
serves a pipeline with ``when`` blocks, leaving the ensemble out in one line, or the modes
``--modes`` names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from when_pipelines import FLAG, ROW, check, plus_one, rows

from pipelines import DeclarationError, DtypeMismatchError, NotCompilableError, Pipeline
from pipelines.endpoint import LocalServer
from pipelines.forms import FormLeftOutWarning
from pipelines.triton import TritonServer

MODES = ("ensemble", "bls", "bls-sync", "fused")
TESTS = Path(__file__).parent


def negated_pipeline() -> Pipeline:
    """No ``when`` block: a flag, its negation, and the negation of a second flag."""
    p = Pipeline("negated", inputs={"x": ROW}, max_batch_size=8)
    c = p.add(check, x=p.input("x"))
    p.output("ok", c["ok"])
    p.output("not_ok", ~c["ok"])
    p.output("not_big", ~c["big"])
    return p


def negated_branch_pipeline() -> Pipeline:
    """A flag made in a ``when`` block, negated on the rows that ran it and filled on the others."""
    p = Pipeline("negbranch", inputs={"x": ROW}, max_batch_size=8)
    c = p.add(check, x=p.input("x"))
    with p.when(c["ok"]):
        inner = p.add(check, name="inner", x=p.input("x"))
        post = p.add(plus_one, x=p.input("x"))
    p.output("not_ok", ~c["ok"])
    p.output("small", ~inner["big"], otherwise=False)
    p.output("y", post["y"], otherwise=0)
    return p


def expected_negated(x: np.ndarray) -> dict[str, np.ndarray]:
    ok, big = x[:, :1] > 0, x[:, 1:2] > 0
    return {"ok": ok, "not_ok": ~ok, "not_big": ~big}


def expected_branch(x: np.ndarray) -> dict[str, np.ndarray]:
    ok, big = x[:, :1] > 0, x[:, 1:2] > 0
    return {"not_ok": ~ok, "small": ok & ~big, "y": np.where(ok, x + 1, 0).astype(np.float32)}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.asarray(got[name]).dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# ------------------------------------------------------------------ ~flag as an output, locally


@pytest.mark.parametrize("mode", MODES)
def test_a_negated_flag_is_an_output_in_every_local_mode(mode):
    p, x = negated_pipeline(), rows(2, 3)
    _same(p.run({"x": x}, mode=mode), expected_negated(x))
    # the flag and its negation share one tensor: asking for one alone answers it as declared
    _same(p.run({"x": x}, mode=mode, outputs=["not_ok"]), {"not_ok": expected_negated(x)["not_ok"]})
    _same(p.run({"x": x}, mode=mode, outputs=["ok"]), {"ok": expected_negated(x)["ok"]})


@pytest.mark.parametrize("mode", ("bls", "bls-sync", "fused"))
@pytest.mark.parametrize("true,false", [(0, 3), (2, 3), (3, 0)])
def test_a_negated_flag_of_a_branch_is_negated_on_its_rows_and_filled_on_the_others(mode, true, false):
    x = rows(true, false)
    _same(negated_branch_pipeline().run({"x": x}, mode=mode), expected_branch(x))


def test_the_ensemble_negates_in_its_gate_model():
    repo = negated_pipeline().compile("ensemble")
    assert "negated__gate" in repo.models  # the one place an ensemble can compute anything of its own
    ungated = Pipeline("plain", inputs={"x": ROW}, max_batch_size=8)
    ungated.output("ok", ungated.add(check, x=ungated.input("x"))["ok"])
    assert not any(name.endswith("__gate") for name in ungated.compile("ensemble").models)


def test_negating_a_tensor_that_is_not_bool_is_refused_at_the_output_line():
    p = Pipeline("notbool", inputs={"x": ROW}, max_batch_size=8)
    post = p.add(plus_one, x=p.input("x"))
    with pytest.raises(DtypeMismatchError, match=r"output 'bad' was given ~plus_one.y.*FP32.*BOOL"):
        p.output("bad", ~post["y"])
    assert "bad" not in p.outputs
    flags = Pipeline("flags", inputs={"f": FLAG}, max_batch_size=8)
    with pytest.raises(DeclarationError, match="pipeline input 'f' itself"):
        flags.output("not_f", ~flags.input("f"))


def test_a_double_negation_is_the_flag_itself():
    p = Pipeline("twice", inputs={"x": ROW}, max_batch_size=8)
    c = p.add(check, x=p.input("x"))
    p.output("ok", ~~c["ok"])
    assert not p.negated_outputs
    x = rows(2, 2)
    _same(p.run({"x": x}, mode="bls"), {"ok": x[:, :1] > 0})


# ------------------------------------------------------------------ serve --local


def test_local_server_leaves_the_ensemble_out_of_a_conditional_pipeline_and_says_why():
    server = LocalServer(negated_branch_pipeline())
    assert server.modes == ("bls", "bls-sync", "fused")
    assert "negbranch_ensemble" not in server.models
    assert "cannot skip a step" in server.left_out and "when(negbranch.check.ok)" not in server.left_out
    assert LocalServer(negated_pipeline()).left_out is None  # a static pipeline: every mode


def test_local_server_refuses_the_ensemble_when_it_is_named_for_a_conditional_pipeline():
    with pytest.raises(NotCompilableError, match=r"cannot skip a step.*--modes bls"):
        LocalServer(negated_branch_pipeline(), modes=("ensemble", "bls"))
    assert LocalServer(negated_branch_pipeline(), modes=["fused"]).models == ["negbranch_fused"]


def _serve_local(tmp_path, *flags: str) -> subprocess.Popen:
    script = tmp_path / "mypipe.py"
    script.write_text("from test_conditional_everywhere import negated_branch_pipeline\n\n"
                      "pipeline = negated_branch_pipeline()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "pipelines", "serve", "--local", f"{script}:pipeline", *flags],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_local_says_in_one_line_that_the_ensemble_is_left_out_and_serves_the_rest(tmp_path):
    import tritonclient.http as httpclient

    proc = _serve_local(tmp_path)
    try:
        lines = []
        while not lines or lines[-1].strip() != "ready; Ctrl-C stops it":
            line = proc.stdout.readline()
            assert line, f"serve --local ended: {lines} {proc.stderr.read()}"
            lines.append(line)
        assert lines[0].startswith("ensemble left out: pipeline 'negbranch': the local 'ensemble' mode cannot skip")
        assert len([line for line in lines if "left out" in line]) == 1
        assert "models: negbranch_bls, negbranch_bls_sync, negbranch_fused" in lines[1]
        client = httpclient.InferenceServerClient(lines[2].split()[1])
        x = rows(2, 2)
        given = httpclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        answer = client.infer("negbranch_fused", [given])
        np.testing.assert_array_equal(answer.as_numpy("small"), expected_branch(x)["small"])
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_serve_local_refuses_an_ensemble_that_modes_names_and_says_what_to_serve(tmp_path):
    proc = _serve_local(tmp_path, "--modes", "ensemble,fused")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "the local 'ensemble' mode cannot skip a step" in err and "--modes fused" in err


def test_modes_is_for_local_only():
    from pipelines.cli import main

    assert main(["serve", "somewhere", "--modes", "bls"]) == 2


# ------------------------------------------------------------------ the real tritonserver


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("negated") / "repo"
    negated_pipeline().compile("all").write(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormLeftOutWarning)
        negated_branch_pipeline().compile("all").write(root)
    with TritonServer(root) as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize("protocol", ("http", "grpc"))
def test_the_server_answers_a_negated_flag_in_every_form(server, protocol):
    x = rows(2, 3, seed=1)
    with server.client(protocol, timeout=60) as client:
        for form in ("ensemble", "bls", "bls_sync", "fused"):
            _same(client.infer(f"negated_{form}", {"x": x}), expected_negated(x))
            _same(client.infer(f"negated_{form}", {"x": x}, outputs=["not_big"]),
                  {"not_big": expected_negated(x)["not_big"]})
        for form in ("bls", "bls_sync", "fused"):
            for true, false in ((0, 3), (2, 3), (3, 0)):
                x = rows(true, false, seed=true)
                _same(client.infer(f"negbranch_{form}", {"x": x}), expected_branch(x))
