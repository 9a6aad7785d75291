"""What ``p.compile(target)`` produces, read without a server: the configs
(golden files, byte for byte), the ensemble wiring, the BLS and step plans,
composing-model naming, external models, and how each step will be found."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipelines import (
    CompileError,
    DynamicBatching,
    InvalidNameError,
    Pipeline,
    TensorSpec,
    external_model,
    step,
)
from pipelines.compile import compile_pipeline
from pipelines.compile.configs import parse_config
from pipelines.compile.ensemble import ERR_INPUT, ERR_OUTPUT
from pipelines.compile.step_models import model_source, plan_json, step_reference
from pipelines.core.plan import DeadNodeWarning

GOLDEN = Path(__file__).parent / "golden"
F4 = TensorSpec("FP32", [4])


# ------------------------------------------------------------ golden pipelines


@step(inputs={"x": F4}, outputs={"y": F4}, instance_count=2, instance_kind="cpu",
      dynamic_batching=DynamicBatching(preferred_batch_sizes=(4, 8), max_queue_delay_us=100),
      parameters={"scale": "2", "alpha": "x"})
def pre(x):
    return {"y": x * 2}


@step(inputs={"a": F4, "b": F4}, outputs={"sum": F4, "diff": F4})
def combine(a, b):
    return {"sum": a + b, "diff": a - b}


sort = step(np.sort, name="sort", inputs={"a": F4}, outputs={"sorted": F4})


def golden_pipeline(model_dir: Path) -> Pipeline:
    model_file = model_dir / "detector.onnx"
    model_file.write_bytes(b"not really onnx")
    detector = external_model(
        "detector", inputs={"images": F4}, outputs={"scores": F4},
        backend="onnxruntime", model_file=model_file, instance_count=1, instance_kind="cpu",
    )
    p = Pipeline("golden", inputs={"x": F4}, max_batch_size=8)
    a = p.add(pre, x=p.input("x"))
    d = p.add(detector, images=a["y"])
    s = p.add(sort, a=p.input("x"))
    c = p.add(combine, a=d["scores"], b=s["sorted"])
    p.output("sum", c["sum"])
    p.output("diff", c["diff"])
    p.output("sorted", s["sorted"])
    return p


@step(inputs={"x": TensorSpec("INT64", [2, -1])}, outputs={"n": TensorSpec("INT64", [1])})
def count(x):
    return {"n": np.array([x.size], np.int64)}


def flat_pipeline() -> Pipeline:
    p = Pipeline("flat", inputs={"x": TensorSpec("INT64", [2, -1])}, max_batch_size=0)
    p.output("n", p.add(count, x=p.input("x"))["n"])
    return p


def golden_files(tmp: Path) -> dict[str, bytes]:
    """Every deterministic file of the golden repositories, by relative path."""
    files = {}
    for repo in (golden_pipeline(tmp).compile("both"), flat_pipeline().compile("ensemble")):
        for name, model in repo.models.items():
            files[f"{name}/config.pbtxt"] = model.config_text.encode()
            for rel, data in model.files.items():
                if rel.endswith(".json"):
                    files[f"{name}/{rel}"] = _stable(data)
    return files


def _stable(plan: bytes) -> bytes:
    """A plan with the digest and Python of a by-value step file masked: pickled code holds its file's path."""
    data = json.loads(plan)
    if "pickle" in data.get("impl", {}):
        data["impl"].update(sha256="<sha256 of step.pkl>", python="<major.minor>")
    return plan_json(data)


# ----------------------------------------------------------------------- tests


def test_configs_and_plans_match_the_golden_files(tmp_path):
    files = golden_files(tmp_path)
    if os.environ.get("UPDATE_GOLDEN"):
        for rel, data in files.items():
            (GOLDEN / rel).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / rel).write_bytes(data)
    on_disk = {str(p.relative_to(GOLDEN)): p.read_bytes() for p in GOLDEN.rglob("*") if p.is_file()}
    assert sorted(on_disk) == sorted(files)
    for rel, data in files.items():
        assert data == on_disk[rel], f"{rel} differs from tests/golden (UPDATE_GOLDEN=1 rewrites it)"


def test_output_is_byte_identical_across_processes(tmp_path):
    """Hash seeds differ between runs; the files must not."""
    script = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); from pathlib import Path;"
        "import test_compile_configs as t; files = t.golden_files(Path(sys.argv[2]));"
        "print(json.dumps({k: v.decode() for k, v in sorted(files.items())}))"
    )
    outputs = []
    for seed in ("1", "2"):
        d = tmp_path / seed
        d.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent), str(d)],
            env=env, check=True, capture_output=True, text=True,
        )
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1]


def test_every_config_parses_back_to_the_same_message(tmp_path):
    repo = golden_pipeline(tmp_path).compile("both")
    for name, model in repo.models.items():
        parsed = parse_config(repo.config_text(name))
        assert parsed == model.config, name
        assert text_format.Parse(repo.config_text(name), mc.ModelConfig()) == model.config


def test_max_batch_size_zero_is_written_out():
    repo = flat_pipeline().compile("both")
    for name in repo.names:
        assert "max_batch_size: 0\n" in repo.config_text(name), name


def test_both_holds_three_top_level_models_over_shared_step_models(tmp_path):
    repo = golden_pipeline(tmp_path).compile("both")
    assert repo.top_level == ("golden_ensemble", "golden_bls", "golden_bls_sync")
    # The ensemble's branches run at once, so it gets a gate that answers for them (see test_ensemble_gate).
    assert repo.names == sorted(
        ["golden__pre", "golden__detector", "golden__sort", "golden__combine",
         "golden_ensemble", "golden_ensemble__gate", "golden_bls", "golden_bls_sync"]
    )
    for target, count in (("ensemble", 6), ("bls", 5), ("bls-sync", 5)):
        single = golden_pipeline(tmp_path).compile(target)
        assert single.top_level == ("golden",)
        assert "golden" in single and len(single) == count


def test_ensemble_wires_every_edge_through_unique_tensors(tmp_path):
    p = golden_pipeline(tmp_path)
    config = p.compile("ensemble")["golden"].config
    assert config.platform == "ensemble"
    assert [i.name for i in config.input] == ["x"]
    assert [o.name for o in config.output] == ["sum", "diff", "sorted"]
    steps = {s.model_name: s for s in config.ensemble_scheduling.step}
    assert dict(steps["golden__pre"].input_map) == {"x": "x"}
    assert dict(steps["golden__detector"].input_map) == {"images": dict(steps["golden__pre"].output_map)["y"]}
    combine, sort = steps["golden__combine"], steps["golden__sort"]
    assert combine.input_map["a"] == steps["golden__detector"].output_map["scores"]
    assert combine.input_map["b"] == sort.output_map["sorted"]
    # The outputs leave through the gate, which reads the steps' tensors and their failures.
    gate = steps["golden__gate"] if "golden__gate" in steps else steps["golden_ensemble__gate"]
    assert dict(gate.output_map) == {"sum": "sum", "diff": "diff", "sorted": "sorted"}
    assert set(gate.input_map.values()) == {
        combine.output_map["sum"], combine.output_map["diff"], sort.output_map["sorted"],
        combine.output_map["__err__"], sort.output_map["__err__"], steps["golden__pre"].output_map["__err__"],
    }
    # The external detector carries no failure; combine looks through it to `pre`.
    assert "__err__" not in steps["golden__detector"].output_map
    assert {combine.input_map["__err_in_0"], combine.input_map["__err_in_1"]} == {
        steps["golden__pre"].output_map["__err__"], sort.output_map["__err__"],
    }
    assert config.ensemble_scheduling.step[-1].model_name.endswith("__gate")
    _assert_ensemble_is_well_formed(config)


def _assert_ensemble_is_well_formed(config):
    """Each tensor produced once; each read tensor produced or an input; each output produced."""
    produced = [v for s in config.ensemble_scheduling.step for v in s.output_map.values()]
    assert len(produced) == len(set(produced))
    inputs = {i.name for i in config.input}
    assert not inputs & set(produced)
    for s in config.ensemble_scheduling.step:
        for value in s.input_map.values():
            assert value in inputs or value in produced
    assert {o.name for o in config.output} <= set(produced)


def test_internal_tensor_names_cannot_collide_with_pipeline_names():
    # Node "a" output "b.c" and node "a.b" output "c" both read "a.b.c"; so do the input and an output.
    odd = TensorSpec("FP32", [1])
    s1 = step(lambda x: {"b.c": x}, name="s1", inputs={"x": odd}, outputs={"b.c": odd})
    s2 = step(lambda x: {"c": x}, name="s2", inputs={"x": odd}, outputs={"c": odd})
    s3 = step(lambda u, v: {"out": u + v}, name="s3", inputs={"u": odd, "v": odd}, outputs={"out": odd})
    p = Pipeline("odd", inputs={"a.b.c": odd}, max_batch_size=2)
    a = p.add(s1, name="a", x=p.input("a.b.c"))
    ab = p.add(s2, name="a.b", x=p.input("a.b.c"))
    j = p.add(s3, name="j", u=a["b.c"], v=ab["c"])
    p.output("a.b.c_1", j["out"])
    config = p.compile("ensemble")["odd"].config
    _assert_ensemble_is_well_formed(config)
    steps = {s.model_name: s for s in config.ensemble_scheduling.step}
    wires = [steps["odd__s1"].output_map["b.c"], steps["odd__s2"].output_map["c"]]
    assert len(set(wires)) == 2 and not set(wires) & {"a.b.c", "a.b.c_1"}


def _used_twice_and_a_renamed_copy(double):
    other = double.with_options(instance_count=3)  # a different step object under the same name
    p = Pipeline("p", inputs={"x": F4}, max_batch_size=4)
    a = p.add(double, x=p.input("x"))
    b = p.add(double, name="again", x=a["y"])
    c = p.add(other, name="third", x=b["y"])
    p.output("y", c["y"])
    return p


def test_a_step_used_twice_is_a_model_per_node_and_one_shared_model_only_when_asked():
    double = step(lambda x: {"y": x * 2}, name="double", inputs={"x": F4}, outputs={"y": F4})
    repo = _used_twice_and_a_renamed_copy(double).compile("ensemble")
    # Each node's model knows its node and names it in its own error: a chain needs no gate.
    steps = repo["p"].config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["p__double", "p__again", "p__third"]
    assert not any(ERR_OUTPUT in s.output_map or any(k.startswith(ERR_INPUT) for k in s.input_map) for s in steps)
    assert json.loads(repo["p__double"].files["1/step.json"])["nodes"] == ["double"]
    assert json.loads(repo["p__again"].files["1/step.json"])["nodes"] == ["again"]
    assert [repo[m].config.instance_group[0].count for m in ("p__double", "p__again", "p__third")] == [1, 1, 3]

    shared = _used_twice_and_a_renamed_copy(double.with_options(share_model=True)).compile("ensemble")
    # One model for the two nodes, which tells them apart by the name its input arrives under.
    steps = shared["p"].config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["p__double", "p__double", "p__third"]
    assert [list(s.input_map) for s in steps] == [["x__at_double"], ["x__at_again"], ["x"]]
    assert json.loads(shared["p__double"].files["1/step.json"])["nodes"] == ["double", "again"]
    assert shared["p__third"].config.instance_group[0].count == 3


def test_step_model_carries_options_and_the_adapter(tmp_path):
    repo = golden_pipeline(tmp_path).compile("ensemble")
    model = repo["golden__pre"]
    config = model.config
    assert config.backend == "python" and config.max_batch_size == 8
    assert config.instance_group[0].count == 2
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert {k: v.string_value for k, v in config.parameters.items()} == {"scale": "2", "alpha": "x"}
    assert model.files["1/model.py"] == model_source("step_model.py")
    plan = json.loads(model.files["1/step.json"])
    # A test module is not installed: exported by value, with the file's digest and the Python that wrote it.
    assert plan["impl"] == {
        "pickle": "step.pkl",
        "sha256": hashlib.sha256(model.files["1/step.pkl"]).hexdigest(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    assert plan["inputs"] == {"x": {"dtype": "FP32", "dims": [4]}}


def test_bls_models_are_python_models_with_their_plan(tmp_path):
    repo = golden_pipeline(tmp_path).compile("both")
    for name, mode in (("golden_bls", "async"), ("golden_bls_sync", "sync")):
        model = repo[name]
        assert model.config.backend == "python"
        assert model.config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
        assert model.config.max_batch_size == 8
        assert model.files["1/model.py"] == model_source("bls_model.py")
        plan = json.loads(model.files["1/bls.json"])
        assert plan["mode"] == mode
        nodes = plan["plan"]["nodes"]
        assert [n["name"] for n in nodes] == ["pre", "detector", "sort", "combine"]
        assert nodes[3]["inputs"] == [
            {"input": "a", "node": "detector", "tensor": "scores", "dtype": "FP32"},
            {"input": "b", "node": "sort", "tensor": "sorted", "dtype": "FP32"},
        ]
        assert plan["outputs"]["sorted"] == {"dtype": "FP32", "dims": [4]}
        assert {"name": "sorted", "node": "sort", "tensor": "sorted", "dtype": "FP32", "needs": ["sort"]} in plan[
            "plan"
        ]["outputs"]
    wide = compile_pipeline(golden_pipeline(tmp_path), "bls", bls_instance_count=3)
    assert wide["golden"].config.instance_group[0].count == 3


def test_external_model_gets_its_backend_and_its_file(tmp_path):
    repo = golden_pipeline(tmp_path).compile("ensemble")
    model = repo["golden__detector"]
    assert model.config.backend == "onnxruntime" and model.config.default_model_filename == "model.onnx"
    assert [i.name for i in model.config.input] == ["images"]
    assert dict(model.files) == {"1/model.onnx": b"not really onnx"}
    written = repo.write(tmp_path / "repo")
    assert (written / "golden__detector" / "1" / "model.onnx").read_bytes() == b"not really onnx"


def test_steps_are_referenced_when_installed_and_exported_otherwise():
    assert step_reference(sort) == ("numpy", "sort")
    assert step_reference(pre) is None  # defined in a test file, which no server can import
    namespace = {"__name__": "__main__"}
    exec("def f(x):\n    return {'y': x}\n", namespace)
    assert step_reference(step(namespace["f"], inputs={"x": F4}, outputs={"y": F4})) is None


def test_pipelines_that_cannot_compile_say_why():
    p = Pipeline("p", inputs={"x": F4}, max_batch_size=4)
    double = step(lambda x: {"y": x * 2}, name="double", inputs={"x": F4}, outputs={"y": F4})
    n = p.add(double, x=p.input("x"))
    p.output("y", n["y"])
    with pytest.raises(CompileError, match="unknown target 'tensorrt'"):
        p.compile("tensorrt")
    p.output("y_again", n["y"])
    # One tensor exposed twice: the ensemble takes the second from a copy the step returns.
    ensemble = p.compile("ensemble")["p"].config
    assert dict(ensemble.ensemble_scheduling.step[0].output_map) == {"y": "y", "y__copy": "y_again"}
    assert p.compile("bls")["p"].config.output[1].name == "y_again"

    scalar = step(lambda x: {"y": x}, name="scalar", inputs={"x": TensorSpec("FP32", [])},
                  outputs={"y": TensorSpec("FP32", [])})
    q = Pipeline("q", inputs={"x": TensorSpec("FP32", [])}, max_batch_size=4)
    q.output("y", q.add(scalar, x=q.input("x"))["y"])
    with pytest.raises(CompileError, match=r"TensorSpec\('FP32', \[1\]\)"):
        q.compile("ensemble")

    long_name = "s" * 128
    r = Pipeline("r" * 128, inputs={"x": F4}, max_batch_size=4)
    r.output("y", r.add(step(lambda x: {"y": x}, name=long_name, inputs={"x": F4}, outputs={"y": F4}),
                        x=r.input("x"))["y"])
    with pytest.raises(InvalidNameError, match="shorten"):
        r.compile("ensemble")


def test_nodes_that_feed_no_output_are_left_out():
    p = Pipeline("p", inputs={"x": F4}, max_batch_size=4)
    used = step(lambda x: {"y": x}, name="used", inputs={"x": F4}, outputs={"y": F4})
    dead = step(lambda x: {"y": x}, name="dead", inputs={"x": F4}, outputs={"y": F4})
    p.output("y", p.add(used, x=p.input("x"))["y"])
    p.add(dead, x=p.input("x"))
    with pytest.warns(DeadNodeWarning, match="step 'dead' feeds no pipeline output"):
        repo = p.compile("both")
    assert "p__dead" not in repo
    plan = json.loads(repo["p_bls"].files["1/bls.json"])["plan"]
    assert [n["name"] for n in plan["nodes"]] == ["used"] and plan["dropped"] == ["dead"]



def test_the_ensemble_workarounds_apply_only_where_needed():
    inc = step(lambda x: {"y": x + 1}, name="inc", inputs={"x": F4}, outputs={"y": F4})
    dbl = step(lambda x: {"y": x * 2}, name="dbl", inputs={"x": F4}, outputs={"y": F4})
    # A chain whose outputs nothing else reads: the ensemble as one would write it by hand.
    p = Pipeline("plain", inputs={"x": F4}, max_batch_size=4)
    p.output("y", p.add(dbl, x=p.add(inc, x=p.input("x"))["y"])["y"])
    repo = p.compile("ensemble")
    assert sorted(repo.names) == ["plain", "plain__dbl", "plain__inc"]
    assert [o.name for o in repo["plain__inc"].config.output] == ["y"]
    assert "ensemble" not in json.loads(repo["plain__inc"].files["1/step.json"])
    # The first output is also read by the next step: only `inc` returns a copy, which is the output.
    q = Pipeline("read", inputs={"x": F4}, max_batch_size=4)
    a = q.add(inc, x=q.input("x"))
    q.output("a", a["y"])
    q.output("y", q.add(dbl, x=a["y"])["y"])
    repo = q.compile("ensemble")
    steps = {s.model_name: s for s in repo["read"].config.ensemble_scheduling.step}
    assert dict(steps["read__inc"].output_map) == {"y": "inc.y", "y__copy": "a"}
    assert dict(steps["read__dbl"].input_map) == {"x": "inc.y"}
    assert [o.name for o in repo["read__inc"].config.output] == ["y", "y__copy"]
    assert [o.name for o in repo["read__dbl"].config.output] == ["y"]
    assert "read__gate" not in repo.names


def test_a_join_that_produces_every_output_is_the_gate_itself():
    left = step(lambda x: {"y": x + 1}, name="left", inputs={"x": F4}, outputs={"y": F4})
    right = step(lambda x: {"y": x * 2}, name="right", inputs={"x": F4}, outputs={"y": F4})
    join = step(lambda a, b: {"y": a + b}, name="join", inputs={"a": F4, "b": F4}, outputs={"y": F4})
    p = Pipeline("d", inputs={"x": F4}, max_batch_size=4)
    j = p.add(join, a=p.add(left, x=p.input("x"))["y"], b=p.add(right, x=p.input("x"))["y"])
    p.output("y", j["y"])
    p.output("y_again", j["y"])
    repo = p.compile("ensemble")
    assert "d__gate" not in repo.names  # the join runs last and alone: it answers for the branches
    steps = {s.model_name: s for s in repo["d"].config.ensemble_scheduling.step}
    assert dict(steps["d__join"].output_map) == {"y": "y", "y__copy": "y_again"}
    assert {steps["d__join"].input_map["__err_in_0"], steps["d__join"].input_map["__err_in_1"]} == {
        steps["d__left"].output_map["__err__"], steps["d__right"].output_map["__err__"],
    }
    assert "__err__" not in [o.name for o in repo["d__join"].config.output]
    _assert_ensemble_is_well_formed(repo["d"].config)
