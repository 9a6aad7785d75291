"""The fused form on the real tritonserver: one repository compiled with "all", one server.

The fused model answers what the ensemble and both BLS forms answer (mixed dtypes,
BYTES and BOOL included, every subset of outputs), runs independent branches at
the same time (a file barrier both branches must reach), calls an external model
step through BLS on its own composing model, and fails only the bad request of a
batch, naming the pipeline, the node and the step.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_compile_server import (
    _execution_count,
    assert_same,
    chain_pipeline,
    diamond_pipeline,
    example_inputs,
    flat_pipeline,
    mixed_pipeline,
    reference,
    twice_pipeline,
)

from pipelines import InferenceError, Pipeline, TensorSpec, external_model, step
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

OTHER_FORMS = ("ensemble", "bls", "bls_sync")
ROW = TensorSpec("FP32", [4])

# A Python-backend model standing in for an ONNX or TensorRT one (the bundled server has
# only the Python backend): the fused model must call it through BLS, not run it itself.
_EXTERNAL_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x * 10).astype(np.float32))]))
        return out
"""


@step(inputs={"x": ROW}, outputs={"y": ROW})
def touchy(x):
    if (x > 50).any():  # the request that keeps the model busy while the others queue
        time.sleep(1.0)
    if (x < 0).any():
        raise ValueError("negative input")
    return {"y": x + 1}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def quitter(x):
    if (x < 0).any():
        sys.exit(3)  # a SystemExit once left the fused model's request unanswered: a hang
    if (x > 100).any():
        raise KeyboardInterrupt("from a step")  # it ended the fused model's event loop: every later request hung
    return {"y": x}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def scribble(x):
    x += 1  # into its input, which the fused model shares with the sibling step below
    return {"y": x}


@step(inputs={"x": ROW}, outputs={"y": ROW})
def pre(x):
    return {"y": x + 1}


@step(inputs={"x": ROW}, outputs={"y": ROW, "flag": TensorSpec("BOOL", [4])})
def post(x):
    return {"y": x - 1, "flag": x > 20}


@step(inputs={"x": ROW}, outputs={"y": ROW}, parameters={"init_dir": ""})
class Counted:
    """Leaves one file per initialize() in ``init_dir``, so a test can count the instances."""

    def initialize(self, config):
        directory = config["parameters"]["init_dir"]
        if directory:
            Path(directory, f"init-{config['pipeline']}-{config['node']}-{os.getpid()}-{id(self)}").touch()

    def execute(self, x):
        return {"y": x * 3}


def counted_pipeline(init_dir, *, share_model=None):
    counted = Counted.with_options(parameters={"init_dir": init_dir}, share_model=share_model)
    p = Pipeline("counted_shared" if share_model else "counted", inputs={"x": ROW}, max_batch_size=8)
    a = p.add(counted, name="a", x=p.input("x"))
    p.output("y", p.add(counted, name="b", x=a["y"])["y"])
    return p


def touchy_pipeline():
    p = Pipeline("touchy", inputs={"x": ROW}, max_batch_size=8)
    p.output("y", p.add(touchy, name="guard", x=p.input("x"))["y"])
    return p


def external_pipeline(model_file):
    detector = external_model(
        "detector", inputs={"x": ROW}, outputs={"y": ROW}, backend="python", model_file=model_file,
        model_filename="model.py", stand_in=lambda x: {"y": x * 10},
    )
    p = Pipeline("withext", inputs={"x": ROW}, max_batch_size=8)
    a = p.add(pre, x=p.input("x"))
    d = p.add(detector, x=a["y"])
    b = p.add(post, x=d["y"])
    p.output("y", b["y"])
    p.output("flag", b["flag"])
    p.output("pre", a["y"])  # needs no external call
    return p


def quits_pipeline():
    p = Pipeline("quits", inputs={"x": ROW}, max_batch_size=8)
    p.output("y", p.add(quitter, x=p.input("x"))["y"])
    p.output("mine", p.add(scribble, x=p.input("x"))["y"])
    return p


def raw_external_pipeline(model_file):
    """yolov5's "raw detections beside the post-processed ones": an external model's output is a
    pipeline output (twice) and a step's input, which a plain ensemble would need an output copy
    of the external model for; it cannot declare one, so the ensemble answers through a gate."""
    detector = external_model(
        "detector", inputs={"x": ROW}, outputs={"y": ROW}, backend="python", model_file=model_file,
        model_filename="model.py", stand_in=lambda x: {"y": x * 10},
    )
    p = Pipeline("rawext", inputs={"x": ROW}, max_batch_size=8)
    d = p.add(detector, x=p.input("x"))
    p.output("raw", d["y"])
    p.output("raw_again", d["y"])
    p.output("y", p.add(post, x=d["y"])["y"])
    return p


@pytest.fixture(scope="module")
def barrier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fused_barrier")


@pytest.fixture(scope="module")
def pipelines(barrier_dir, tmp_path_factory):
    model_file = tmp_path_factory.mktemp("external") / "model.py"
    model_file.write_text(_EXTERNAL_MODEL)
    return {
        "chain": chain_pipeline(),
        "mixed": mixed_pipeline(),
        "flat": flat_pipeline(),
        "twice": twice_pipeline(),
        "diamond": diamond_pipeline(str(barrier_dir)),
        "touchy": touchy_pipeline(),
        "withext": external_pipeline(str(model_file)),
        "rawext": raw_external_pipeline(str(model_file)),
        "quits": quits_pipeline(),
    }


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inits")


@pytest.fixture(scope="module")
def server(pipelines, init_dir, tmp_path_factory):
    repos = [p.compile("all") for p in pipelines.values()]
    # Two fused instances, each with one instance of each node's step; and of the step two nodes share.
    repos.append(counted_pipeline(str(init_dir)).compile("fused", fused_instance_count=2))
    repos.append(counted_pipeline(str(init_dir), share_model=True).compile("fused", fused_instance_count=2))
    path = repos[0].merge(*repos[1:]).write(tmp_path_factory.mktemp("fused") / "repo")
    with TritonServer(path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with server.client("grpc", timeout=60) as c:
        yield c


@pytest.mark.parametrize("name", ["chain", "mixed", "flat", "twice"])
def test_fused_answers_what_every_other_form_answers(client, pipelines, name):
    inputs = example_inputs(name, seed=7)
    fused = client.infer(f"{name}_fused", inputs)
    assert_same(fused, reference(pipelines[name], inputs))
    for form in OTHER_FORMS:
        assert_same(fused, client.infer(f"{name}_{form}", inputs))


def test_every_subset_of_outputs_answers_only_those(client, pipelines):
    inputs = example_inputs("mixed")
    expected = reference(pipelines["mixed"], inputs)
    names = list(expected)
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(names, k):
            got = client.infer("mixed_fused", inputs, outputs=list(subset))
            assert_same(got, {n: expected[n] for n in subset})
            assert_same(got, client.infer("mixed_ensemble", inputs, outputs=list(subset)))


def test_an_external_output_that_is_also_read_or_exposed_twice_answers_every_subset_in_every_form(
    client, pipelines
):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    expected = {"raw": x * 10, "raw_again": x * 10, "y": x * 10 - 1}
    assert_same(reference(pipelines["rawext"], {"x": x}), expected)
    for k in range(1, len(expected) + 1):
        for subset in itertools.combinations(expected, k):
            for form in ("fused", *OTHER_FORMS):
                got = client.infer(f"rawext_{form}", {"x": x}, outputs=list(subset))
                assert_same(got, {n: expected[n] for n in subset})


@pytest.mark.parametrize("form", ["fused", *OTHER_FORMS])
def test_a_step_that_raises_keyboard_interrupt_fails_its_request_by_name_and_the_model_answers_on(client, form):
    said = r"raised StepInterrupted: KeyboardInterrupt\('from a step'\) was raised inside the step"
    for _ in range(2):
        with pytest.raises(InferenceError, match=r"node 'quitter', step 'quitter': " + said):
            client.infer(f"quits_{form}", {"x": np.full((1, 4), 200, np.float32)}, outputs=["y"], timeout=30)
    x = np.ones((1, 4), np.float32)
    assert_same(client.infer(f"quits_{form}", {"x": x}, outputs=["y"], timeout=30), {"y": x})


@pytest.mark.parametrize("form", ["fused", *OTHER_FORMS])
def test_a_step_that_calls_sys_exit_fails_its_request_by_name_and_the_model_answers_on(client, form):
    with pytest.raises(InferenceError, match=r"node 'quitter', step 'quitter': raised StepExited: sys\.exit\(3\)"):
        client.infer(f"quits_{form}", {"x": -np.ones((1, 4), np.float32)}, outputs=["y"], timeout=30)
    x = np.ones((1, 4), np.float32)
    assert_same(client.infer(f"quits_{form}", {"x": x}, outputs=["y"]), {"y": x})


@pytest.mark.parametrize("form", ["fused", *OTHER_FORMS])
def test_a_step_that_writes_into_its_input_never_changes_what_a_sibling_reads(client, form):
    """Each step model has its own copy; the fused model shares one array and hands it read-only,
    so the write fails by name where it would otherwise change the sibling's answer unseen."""
    x = np.ones((1, 4), np.float32)
    if form == "fused":
        with pytest.raises(InferenceError, match=r"step 'scribble': raised ValueError: .*read-only"):
            client.infer("quits_fused", {"x": x}, outputs=["y", "mine"], timeout=30)
    else:
        assert_same(client.infer(f"quits_{form}", {"x": x}, outputs=["y", "mine"]), {"y": x, "mine": x + 1})


def test_the_branches_run_at_the_same_time_inside_the_fused_model(client, pipelines):
    x = np.random.default_rng(11).standard_normal((2, 4)).astype(np.float32)
    got = client.infer("diamond_fused", {"x": x})
    # Each branch waited at a barrier the other had to reach: both met, so both ran at once.
    assert got["left_met"].all() and got["right_met"].all()
    assert_same(got, reference(pipelines["diamond"], {"x": x}))


def test_an_external_step_is_called_through_bls_on_its_own_model(server, client):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    before = _inference_count(server, "withext__detector")
    got = client.infer("withext_fused", {"x": x})
    np.testing.assert_array_equal(got["y"], (x + 1) * 10 - 1)
    np.testing.assert_array_equal(got["flag"], (x + 1) * 10 > 20)
    np.testing.assert_array_equal(got["pre"], x + 1)
    assert _inference_count(server, "withext__detector") == before + 2  # two rows, one BLS call
    # An output that needs no external step calls no external model.
    assert_same(client.infer("withext_fused", {"x": x}, outputs=["pre"]), {"pre": x + 1})
    assert _inference_count(server, "withext__detector") == before + 2
    assert_same(got, client.infer("withext_ensemble", {"x": x}))


def test_compiled_alone_the_fused_form_keeps_only_the_external_models(pipelines):
    repo = pipelines["withext"].compile("fused")
    assert repo.top_level == ("withext",)
    assert repo.names == ["withext", "withext__detector"]
    files = sorted(repo["withext"].files)
    assert "1/fused.json" in files and "1/serving/__init__.py" in files
    assert [f for f in files if f.startswith("1/steps/")] == [
        "1/steps/withext__post/step.json", "1/steps/withext__post/step.pkl",
        "1/steps/withext__pre/step.json", "1/steps/withext__pre/step.pkl",
    ]


def test_each_step_is_initialized_once_per_fused_instance(server, init_dir):
    x = np.ones((1, 4), np.float32)
    with server.client("grpc", timeout=60) as c:
        np.testing.assert_array_equal(c.infer("counted", {"x": x})["y"], x * 9)
        np.testing.assert_array_equal(c.infer("counted_shared", {"x": x})["y"], x * 9)
    inits = sorted(f.name.split("-")[1:3] for f in init_dir.iterdir())
    # two fused instances; nodes a and b have a step instance each, unless they share one (which
    # names no node: initialize() gets the step's name)
    assert [i for i in inits if i[0] == "counted"] == [["counted", "a"]] * 2 + [["counted", "b"]] * 2
    assert [i for i in inits if i[0] == "counted_shared"] == [["counted_shared", "Counted"]] * 2


def test_a_failing_request_does_not_fail_the_others_of_its_batch(server):
    before = _execution_count(server, "touchy_fused")

    def call(x):
        with server.client("grpc", timeout=60) as c:
            try:
                return c.infer("touchy_fused", {"x": x})
            except InferenceError as exc:
                return exc

    blocker = threading.Thread(target=call, args=(np.full((1, 4), 99.0, np.float32),))
    blocker.start()
    time.sleep(0.3)  # the model is busy with the blocker: the next four queue and run as one batch
    xs = [np.full((1, 4), v, np.float32) for v in (1.0, 2.0, -3.0, 4.0)]
    with ThreadPoolExecutor(len(xs)) as pool:
        results = list(pool.map(call, xs))
    blocker.join()
    error = results[2]
    assert isinstance(error, InferenceError)
    text = str(error)
    assert "pipeline 'touchy'" in text and "node 'guard'" in text and "step 'touchy'" in text
    assert "negative input" in text
    for x, result in zip(xs, results, strict=True):
        if x[0, 0] > 0:
            np.testing.assert_array_equal(result["y"], x + 1)
    executions = _execution_count(server, "touchy_fused") - before
    assert executions < 5  # some requests shared one execute()


def _inference_count(server, model):
    stats = server.client("grpc").statistics(model)
    return int(stats["model_stats"][0].get("inference_count", 0))
