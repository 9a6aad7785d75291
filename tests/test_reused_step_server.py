"""A step reused at several nodes, as hand-written ensembles reuse one model: each node gets a
step model of its own, which names its node when it fails, so a chain needs no gate and pays
nothing for it; asked to share (``share_model=True``), the nodes get one model, which learns
its node from the name its input arrives under, so its chain needs no gate either; where two
nodes can run at once the ensemble keeps its gate. On the real tritonserver, over HTTP and
gRPC, every form says what the local runtime says."""

from __future__ import annotations

import json

import anyio
import numpy as np
import pytest

from pipelines import InferenceError, Pipeline, StepDeclarationError, StepError, TensorSpec, external_model, step
from pipelines.compile.bound_plan import bind_plan
from pipelines.compile.ensemble import ERR_INPUT, ERR_OUTPUT, layout_ensemble
from pipelines.core.plan import gated_ensemble
from pipelines.core.planning import plan_of
from pipelines.forms import FORMS
from pipelines.serving import parse_error
from pipelines.triton import TritonServer

F2 = TensorSpec("FP32", [2])
NODES = ("n0", "n1", "n2", "n3")
FAILS_AT = 100.0  # bump refuses a row whose first value is this


@step(inputs={"x": F2}, outputs={"y": F2})
def bump(x):
    if (x[:, 0] == FAILS_AT).any():
        raise ValueError(f"refusing {FAILS_AT:g}")
    return {"y": x + 1}


@step(inputs={"x": F2}, outputs={"y": F2})
def negate(x):
    return {"y": -x}


@step(inputs={"a": F2, "b": F2}, outputs={"y": F2})
def join(a, b):
    return {"y": a + b}


def chain(name: str = "reused", *, share_model: bool | None = None, expose: bool = False,
          batched: bool = False) -> Pipeline:
    """``bump`` at four nodes, one after another; ``expose`` also exposes the first node's output;
    ``batched`` gives the step dynamic batching."""
    reused = bump if share_model is None else bump.with_options(share_model=share_model)
    if batched:
        reused = reused.with_options(dynamic_batching={"max_queue_delay_us": 2000})
    p = Pipeline(name, inputs={"x": F2}, max_batch_size=4)
    ref = p.input("x")
    for node in NODES:
        ref = p.add(reused, name=node, x=ref)["y"]
        if expose and node == NODES[0]:
            p.output("first", ref)
    p.output("y", ref)
    return p


def diamond(name: str = "reused_diamond", *, share_model: bool | None = None, expose_left: bool = True) -> Pipeline:
    """``bump`` on both branches, which run at once: ``left`` on x, ``right`` on -x."""
    reused = bump if share_model is None else bump.with_options(share_model=share_model)
    p = Pipeline(name, inputs={"x": F2}, max_batch_size=4)
    left = p.add(reused, name="left", x=p.input("x"))
    right = p.add(reused, name="right", x=p.add(negate, x=p.input("x"))["y"])
    p.output("y", p.add(join, a=left["y"], b=right["y"])["y"])
    if expose_left:
        p.output("left", left["y"])  # no one step gives every output: a gate model answers
    return p


DIAMOND_FAILS = {"left": np.array([[FAILS_AT, 1.0]], np.float32), "right": np.array([[-FAILS_AT, 1.0]], np.float32)}


def failing_at(node: str) -> np.ndarray:
    """A request that ``bump`` refuses at ``node`` of the chain (each node adds one)."""
    return np.array([[FAILS_AT - NODES.index(node), 7.0]], np.float32)


def _composing(repo, pipeline: str) -> list[str]:
    return [n for n in repo.names if n.startswith(f"{pipeline}__")]


def _per_node(pipeline: str) -> list[str]:
    """The models of the chain's nodes: the first keeps the step's name, the later are named after their node."""
    return [f"{pipeline}__bump"] + [f"{pipeline}__{n}" for n in NODES[1:]]


# ------------------------------------------------------------------ what is compiled


def test_a_chain_reusing_a_step_is_a_model_per_node_with_no_gate_and_no_failure_tensors():
    repo = chain().compile("all")
    assert sorted(_composing(repo, "reused")) == sorted(_per_node("reused"))
    assert "reused_ensemble__gate" not in repo.names
    steps = repo["reused_ensemble"].config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == _per_node("reused")
    for s in steps:
        assert ERR_OUTPUT not in s.output_map and not any(k.startswith(ERR_INPUT) for k in s.input_map)
    for node, model in zip(NODES, _per_node("reused"), strict=True):
        assert json.loads(repo[model].files["1/step.json"])["nodes"] == [node]
        config = repo[model].config
        assert [o.name for o in config.output] == ["y"] and [i.name for i in config.input] == ["x"]
        assert config.instance_group[0].count == 1  # instance_count is per node's model
    assert not gated_ensemble(plan_of(chain()))


def test_a_diamond_reusing_a_step_keeps_its_gate():
    p = diamond()
    assert gated_ensemble(plan_of(p))  # two nodes can run at once
    layout = layout_ensemble(bind_plan(p))
    assert layout.gated and layout.gate_inputs
    repo = p.compile("ensemble")
    assert "reused_diamond__gate" in repo.names
    wired = {s.model_name: s for s in repo["reused_diamond"].config.ensemble_scheduling.step}
    assert ERR_OUTPUT in wired["reused_diamond__bump"].output_map  # node left
    assert ERR_OUTPUT in wired["reused_diamond__right"].output_map


def test_a_step_shared_on_request_is_one_model_that_learns_its_node_from_an_alias_and_needs_no_gate():
    repo = chain("reused_shared", share_model=True).compile("all")
    assert _composing(repo, "reused_shared") == ["reused_shared__bump"]
    assert "reused_shared_ensemble__gate" not in repo.names
    steps = repo["reused_shared_ensemble"].config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["reused_shared__bump"] * 4
    # Each node gives the model its input under an alias of its own; the outputs keep their names.
    assert [list(s.input_map) for s in steps] == [[f"x__at_{n}"] for n in NODES]
    assert not any(ERR_OUTPUT in s.output_map for s in steps)
    config = repo["reused_shared__bump"].config
    assert [(i.name, i.optional) for i in config.input] == [("x", True)] + [(f"x__at_{n}", True) for n in NODES]
    assert not gated_ensemble(plan_of(chain("reused_shared", share_model=True)))
    # In a diamond, the shared model names its node all the same; the gate is there for Triton 2.51:
    # a gate model where no one node gives every output, else the join answers for the branches.
    shared_diamond = diamond("reused_diamond_shared", share_model=True)
    assert gated_ensemble(plan_of(shared_diamond))
    assert "reused_diamond_shared__gate" in shared_diamond.compile("ensemble").names
    joined = diamond("joined", share_model=True, expose_left=False).compile("ensemble")
    assert "joined__gate" not in joined.names
    wired = [(s.model_name, sorted(s.input_map)) for s in joined["joined"].config.ensemble_scheduling.step]
    assert ("joined__bump", ["x__at_left"]) in wired and ("joined__bump", [f"{ERR_INPUT}0", "x__at_right"]) in wired


def test_names_of_steps_used_once_do_not_move():
    """A step used once keeps ``<pipeline>__<step>``, even where a reused step's node has its name."""
    p = Pipeline("names", inputs={"x": F2}, max_batch_size=4)
    first = p.add(bump, name="first", x=p.input("x"))
    second = p.add(bump, name="negate", x=first["y"])  # a later node, named like the other step
    p.output("y", p.add(negate, name="flip", x=second["y"])["y"])
    assert [(m.name, m.nodes) for m in plan_of(p).models] == [
        ("names__bump", ("first",)), ("names__negate_2", ("negate",)), ("names__negate", ("flip",)),
    ]


def test_an_external_model_is_shared_unless_it_says_otherwise_and_share_model_is_a_bool():
    def used_twice(ext):
        p = Pipeline("ext", inputs={"x": F2}, max_batch_size=4)
        first = p.add(ext, name="first", x=p.input("x"))
        p.output("y", p.add(ext, name="second", x=first["y"])["y"])
        return [(m.name, m.nodes) for m in plan_of(p).models]

    det = external_model("det", inputs={"x": F2}, outputs={"y": F2}, backend="onnxruntime")
    assert used_twice(det) == [("ext__det", ("first", "second"))]  # its file is copied and loaded once
    assert used_twice(det.with_options(share_model=False)) == [("ext__det", ("first",)), ("ext__second", ("second",))]
    with pytest.raises(StepDeclarationError, match="share_model must be True, False or None; got 'yes'"):
        bump.with_options(share_model="yes")


def test_pipelines_remove_takes_every_model_of_each_node(tmp_path, capsys):
    from pipelines.cli import main

    root = tmp_path / "models"
    (root / "hand_made" / "1").mkdir(parents=True)
    (root / "hand_made" / "config.pbtxt").write_text('name: "hand_made"\nbackend: "python"\n')
    chain().compile("all").write(root)
    assert set(_per_node("reused")) <= {d.name for d in root.iterdir()}
    assert main(["remove", str(root), "reused"]) == 0
    assert sorted(d.name for d in root.iterdir() if not d.name.startswith(".")) == ["hand_made"]


# ------------------------------------------------------------------ on the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("reused") / "models"
    repo = chain().compile("all").merge(
        chain("reused_shared", share_model=True).compile("all"),
        diamond().compile("all"),
        diamond("reused_diamond_shared", share_model=True).compile("all"),
        chain("reused_exposed", expose=True).compile("ensemble"),
        chain("reused_batched", share_model=True, batched=True).compile("ensemble"),
    )
    repo.write(root)
    with TritonServer(root) as running:
        yield running


def _local_error(p: Pipeline, x: np.ndarray, mode: str) -> StepError:
    with pytest.raises(StepError) as caught:
        p.run({"x": x}, mode=mode)
    return caught.value


def _remote_error(client, model: str, x: np.ndarray) -> InferenceError:
    with pytest.raises(InferenceError) as caught:
        client.infer(model, {"x": x})
    return caught.value


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("pipeline", ["reused", "reused_shared"])
def test_the_failing_node_of_a_reused_step_is_named_as_the_local_runtime_names_it(server, protocol, pipeline):
    p = chain(pipeline, share_model=True if pipeline == "reused_shared" else None)
    with server.client(protocol, timeout=60) as client:
        for node in NODES:
            x = failing_at(node)
            for form in FORMS.values():
                local = _local_error(p, x, form.name)
                assert (local.node, local.step) == (node, node)
                remote = _remote_error(client, form.model_name(pipeline, side_by_side=True), x)
                where = f"{pipeline} {form.name} {protocol} at {node}: {remote}"
                assert type(remote) is StepError and (remote.pipeline, remote.node, remote.step) == (
                    pipeline, node, node), where
                assert str(local) in str(remote), where  # the local runtime's words, word for word
                said = parse_error(str(remote))
                assert (said.node, said.step) == (node, "bump"), where
        ok = client.infer(f"{pipeline}_ensemble", {"x": np.zeros((1, 2), np.float32)})
        np.testing.assert_array_equal(ok["y"], np.full((1, 2), 4.0, np.float32))


@pytest.mark.server
def test_each_node_of_a_reused_step_is_a_model_the_server_serves(server):
    with server.client("grpc", timeout=60) as client:
        client.infer("reused_ensemble", {"x": np.zeros((1, 2), np.float32)})
        for model in _per_node("reused"):  # each node's model ran the request once
            stats = client.statistics(model)["model_stats"][0]
            assert int(stats["execution_count"]) >= 1, model
        assert client.statistics("reused_shared__bump")  # asked to share: one model, served under the step's name


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("pipeline", ["reused_diamond", "reused_diamond_shared"])
def test_a_failing_branch_of_a_reused_step_is_named_through_the_gate(server, protocol, pipeline):
    p = diamond(pipeline, share_model=True if pipeline.endswith("_shared") else None)
    with server.client(protocol, timeout=60) as client:
        for node, x in DIAMOND_FAILS.items():
            for form in FORMS.values():
                local = _local_error(p, x, form.name)
                remote = _remote_error(client, form.model_name(pipeline, side_by_side=True), x)
                assert (remote.node, local.node) == (node, node), str(remote)
                assert str(local) in str(remote), (form.name, str(remote))


@pytest.mark.server
def test_asking_for_some_outputs_runs_what_the_server_runs_locally_too(server):
    """A chain is not gated: the ensemble runs only the nodes the asked-for output needs, so a
    failure further on does not fail the request. A gated ensemble (the diamond) runs every node
    for every request and the gate answers. The local runtime's ensemble mode does as the server."""
    exposed = chain("reused_exposed", expose=True)
    x = failing_at("n2")
    with server.client("grpc", timeout=60) as client:
        got = client.infer("reused_exposed", {"x": x}, outputs=["first"])
        np.testing.assert_array_equal(got["first"], x + 1)
        np.testing.assert_array_equal(exposed.run({"x": x}, outputs=["first"], mode="ensemble")["first"], x + 1)

        x = DIAMOND_FAILS["right"]  # fails the branch that "left" does not need
        remote = _remote_error_for(client, "reused_diamond_ensemble", x, ["left"])
        with pytest.raises(StepError) as local:
            diamond().run({"x": x}, outputs=["left"], mode="ensemble")
        assert remote.node == local.value.node == "right" and str(local.value) in str(remote)


@pytest.mark.server
def test_concurrent_requests_batched_in_one_shared_model_each_name_their_own_node(server):
    requests = [(i, NODES[i % len(NODES)] if i % 3 else None) for i in range(96)]

    async def main():
        async with server.async_client("grpc", timeout=60) as client:
            async def one(i, node):
                x = failing_at(node) if node else np.array([[float(i % 50), float(i)]], np.float32)
                try:
                    got = await client.infer("reused_batched", {"x": x})
                except StepError as exc:
                    answers[i] = exc.node
                else:
                    answers[i] = got["y"]

            async with anyio.create_task_group() as tg:
                for i, node in requests:
                    tg.start_soon(one, i, node)

    answers: dict[int, object] = {}
    anyio.run(main)
    for i, node in requests:
        if node is None:
            np.testing.assert_array_equal(answers[i], np.array([[i % 50 + 4.0, i + 4.0]], np.float32))
        else:
            assert answers[i] == node, (i, answers[i])
    stats = server.client("grpc").statistics("reused_batched__bump")["model_stats"][0]
    assert int(stats["execution_count"]) < int(stats["inference_count"])  # some requests ran as one batch


def _remote_error_for(client, model: str, x: np.ndarray, outputs: list[str]) -> InferenceError:
    with pytest.raises(InferenceError) as caught:
        client.infer(model, {"x": x}, outputs=outputs)
    return caught.value
