"""Compiled repositories on the real tritonserver: every pipeline compiled to
"both", all loaded into one server, and each of ``_ensemble``, ``_bls`` and
``_bls_sync`` answering exactly what the plain-Python steps compute."""

from __future__ import annotations

import hashlib
import itertools
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pipelines import DynamicBatching, InferenceError, Pipeline, TensorSpec, step
from pipelines.compile import compile_pipeline
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

FORMS = ("ensemble", "bls", "bls_sync")
PROTOCOLS = ("http", "grpc")
BARRIER_TIMEOUT_S = 2.0


# ----------------------------------------------------------------- the steps


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def scale(x):
    return {"y": x * 3}


# An installed function: the repository refers to it by import instead of exporting it.
sort = step(np.sort, name="sort", inputs={"a": TensorSpec("FP32", [4])}, outputs={"sorted": TensorSpec("FP32", [4])})


@step(
    inputs={"x": TensorSpec("FP32", [4])},
    outputs={"y": TensorSpec("FP32", [4])},
    parameters={"offset": "0.25"},
)
class Offset:
    """A class step: its parameter reaches initialize() on the server."""

    def initialize(self, config):
        self.offset = np.float32(config.get("parameters", {}).get("offset", "100"))

    def execute(self, x):
        return {"y": x + self.offset}


def make_branch(side: str, other: str):
    """A diamond branch that waits (with a timeout) until the other branch has started on the same input."""

    class Branch:
        def initialize(self, config):
            self.directory = config.get("parameters", {}).get("barrier_dir")

        def execute(self, x):
            met = True
            if self.directory:  # plain-Python calls run without the barrier
                token = hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest()
                Path(self.directory, f"{side}-{token}").touch()
                deadline = time.monotonic() + BARRIER_TIMEOUT_S
                while not Path(self.directory, f"{other}-{token}").exists():
                    if time.monotonic() > deadline:
                        met = False
                        break
                    time.sleep(0.005)
            factor = np.float32(2 if side == "left" else 5)
            return {"y": x * factor, "met": np.full((x.shape[0], 1), met)}

    Branch.__name__ = Branch.__qualname__ = f"Branch_{side}"
    return Branch


def branch_step(side: str, other: str, barrier_dir: str):
    return step(
        make_branch(side, other),
        name=side,
        inputs={"x": TensorSpec("FP32", [4])},
        outputs={"y": TensorSpec("FP32", [4]), "met": TensorSpec("BOOL", [1])},
        parameters={"barrier_dir": barrier_dir},
    )


@step(inputs={"a": TensorSpec("FP32", [4]), "b": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def join(a, b):
    return {"y": a + b}


@step(inputs={"text": TensorSpec("BYTES", [-1])}, outputs={"loud": TensorSpec("BYTES", [-1])})
def shout(text):
    return {"loud": np.vectorize(lambda t: t.upper() + b"!", otypes=[object])(text)}


@step(
    inputs={"text": TensorSpec("BYTES", [-1]), "count": TensorSpec("INT64", [1])},
    outputs={"lengths": TensorSpec("INT64", [-1]), "long": TensorSpec("BOOL", [-1])},
)
def measure(text, count):
    lengths = np.vectorize(len, otypes=[np.int64])(text) * count
    return {"lengths": lengths, "long": lengths > 6}


@step(inputs={"x": TensorSpec("FP32", [2, 3])}, outputs={"y": TensorSpec("FP32", [2, 3])})
def flip(x):
    return {"y": x[::-1].copy()}


@step(inputs={"x": TensorSpec("FP32", [2, 3])}, outputs={"total": TensorSpec("FP64", [3])})
def colsum(x):
    return {"total": x.sum(axis=0, dtype=np.float64)}


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def double(x):
    return {"y": x * 2}


@step(
    inputs={"x": TensorSpec("FP32", [4])},
    outputs={"y": TensorSpec("FP32", [4])},
    dynamic_batching=DynamicBatching(max_queue_delay_us=300_000),
)
def explode(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return {"y": x + 1}


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def inc(x):
    return {"y": x + 1}


@step(inputs={"a": TensorSpec("FP32", [4]), "b": TensorSpec("FP32", [4])},
      outputs={"sum": TensorSpec("FP32", [4]), "diff": TensorSpec("FP32", [4])})
def mix(a, b):
    return {"sum": a + b, "diff": a - b}


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def explode_on_negative(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return {"y": x + 1}


@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def negate(x):
    return {"y": -x}


# ------------------------------------------------------------- the pipelines


def chain_pipeline():
    p = Pipeline("chain", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    a = p.add(scale, x=p.input("x"))
    b = p.add(sort, a=a["y"])
    c = p.add(Offset, x=b["sorted"])
    p.output("y", c["y"])
    return p


def diamond_pipeline(barrier_dir: str):
    p = Pipeline("diamond", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    left = p.add(branch_step("left", "right", barrier_dir), x=p.input("x"))
    right = p.add(branch_step("right", "left", barrier_dir), x=p.input("x"))
    j = p.add(join, a=left["y"], b=right["y"])
    p.output("y", j["y"])
    p.output("left_met", left["met"])
    p.output("right_met", right["met"])
    return p


def mixed_pipeline():
    p = Pipeline(
        "mixed",
        inputs={"text": TensorSpec("BYTES", [-1]), "count": TensorSpec("INT64", [1])},
        max_batch_size=4,
    )
    s = p.add(shout, text=p.input("text"))
    m = p.add(measure, text=p.input("text"), count=p.input("count"))
    p.output("loud", s["loud"])
    p.output("lengths", m["lengths"])
    p.output("long", m["long"])
    return p


def flat_pipeline():
    p = Pipeline("flat", inputs={"x": TensorSpec("FP32", [2, 3])}, max_batch_size=0)
    f = p.add(flip, x=p.input("x"))
    c = p.add(colsum, x=f["y"])
    p.output("y", f["y"])
    p.output("total", c["total"])
    return p


def twice_pipeline(*, share_model=None):
    used_twice = double if share_model is None else double.with_options(share_model=share_model)
    p = Pipeline("twice", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    a = p.add(used_twice, x=p.input("x"))
    b = p.add(used_twice, name="double2", x=a["y"])
    p.output("y", b["y"])
    return p


def faulty_pipeline():
    p = Pipeline("faulty", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    e = p.add(explode, x=p.input("x"))
    p.output("y", e["y"])
    return p


def fan_pipeline():
    """A chain whose first output is read by both later steps and exposed twice; the last step
    gives two outputs. The ensemble stays plain, with output copies."""
    p = Pipeline("fan", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    a = p.add(inc, x=p.input("x"))
    b = p.add(scale, x=a["y"])
    c = p.add(mix, a=a["y"], b=b["y"])
    p.output("a", a["y"])
    p.output("a_again", a["y"])
    p.output("b", b["y"])
    p.output("sum", c["sum"])
    p.output("diff", c["diff"])
    return p


def forked_pipeline():
    """One output read by two parallel branches, which join; the join's output exposed twice.
    The ensemble is gated."""
    p = Pipeline("forked", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    a = p.add(inc, x=p.input("x"))
    left = p.add(scale, x=a["y"])
    right = p.add(double, x=a["y"])
    j = p.add(join, a=left["y"], b=right["y"])
    p.output("a", a["y"])
    p.output("left", left["y"])
    p.output("y", j["y"])
    p.output("y_again", j["y"])
    return p


def joined_pipeline():
    """Two branches into one step with two outputs, one exposed twice: that step answers for the
    branches (no gate model), and returns a copy for the second exposure."""
    p = Pipeline("joined", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    m = p.add(mix, a=p.add(inc, x=p.input("x"))["y"], b=p.add(scale, x=p.input("x"))["y"])
    p.output("sum", m["sum"])
    p.output("sum_again", m["sum"])
    p.output("diff", m["diff"])
    return p


def named_chain_pipeline():
    p = Pipeline("named_chain", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    f = p.add(explode_on_negative, name="fragile_step", x=p.input("x"))
    p.output("y", p.add(scale, x=f["y"])["y"])
    return p


def named_diamond_pipeline():
    p = Pipeline("named_diamond", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    f = p.add(explode_on_negative, name="fragile_step", x=p.input("x"))
    d = p.add(double, x=p.input("x"))
    p.output("y", p.add(join, a=f["y"], b=d["y"])["y"])
    return p


def named_twice_pipeline():
    """One step used at two nodes of a chain: each node's model names its node, with no gate."""
    p = Pipeline("named_twice", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=8)
    first = p.add(explode_on_negative, name="sturdy_step", x=p.input("x"))
    n = p.add(negate, x=first["y"])
    p.output("y", p.add(explode_on_negative, name="fragile_step", x=n["y"])["y"])
    return p


# A pipeline whose steps live only in a script's __main__; the script is deleted before serving.
SCRIPT = '''
import sys
import numpy as np
from pipelines import Pipeline, TensorSpec, step

BIAS = np.float32(7)

def helper(x):
    return x * 10 + BIAS

@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
def main_step(x):
    return {"y": helper(x)}

@step(inputs={"x": TensorSpec("FP32", [4])}, outputs={"y": TensorSpec("FP32", [4])})
class MainClass:
    def initialize(self, config):
        self.scale = np.float32(-1)
    def execute(self, x):
        return {"y": x * self.scale}

p = Pipeline("scripted", inputs={"x": TensorSpec("FP32", [4])}, max_batch_size=4)
a = p.add(main_step, x=p.input("x"))
b = p.add(MainClass, x=a["y"])
p.output("y", b["y"])
p.compile("both").write(sys.argv[1])
'''


def scripted_reference(x):
    return {"y": -(x * 10 + np.float32(7))}


# ------------------------------------------------------------------ fixtures


def reference(p: Pipeline, inputs: dict) -> dict:
    """The plain-Python answer: each step instantiated with its parameters and called in order.

    The barrier is left out: alone in this process, a branch would wait for a partner that never comes.
    """
    values = {(None, k): v for k, v in inputs.items()}
    for node in p:
        kwargs = {i: values[(ref.node, ref.name)] for i, ref in node.bindings.items()}
        params = {k: v for k, v in node.step.options.parameters.items() if k != "barrier_dir"}
        instance = node.step.instantiate({"parameters": params})
        try:
            outputs = instance.execute(kwargs)
        finally:
            instance.finalize()
        for name, value in outputs.items():
            values[(node.name, name)] = value
    return {name: values[(ref.node, ref.name)] for name, ref in p.outputs.items()}


@pytest.fixture(scope="module")
def barrier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("barrier")


@pytest.fixture(scope="module")
def pipelines(barrier_dir):
    return {
        "chain": chain_pipeline(),
        "diamond": diamond_pipeline(str(barrier_dir)),
        "mixed": mixed_pipeline(),
        "flat": flat_pipeline(),
        "twice": twice_pipeline(),
        "faulty": faulty_pipeline(),
        "fan": fan_pipeline(),
        "forked": forked_pipeline(),
        "joined": joined_pipeline(),
        "named_chain": named_chain_pipeline(),
        "named_diamond": named_diamond_pipeline(),
        "named_twice": named_twice_pipeline(),
    }


@pytest.fixture(scope="module")
def repository(tmp_path_factory, pipelines):
    root = tmp_path_factory.mktemp("compiled")
    repos = [compile_pipeline(p, "both") for p in pipelines.values()]
    repo_dir = repos[0].merge(*repos[1:]).write(root / "repo")

    script = root / "define_in_main.py"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), str(root / "scripted")], check=True, cwd=root)
    script.unlink()  # the source is gone: the repository must carry the steps itself
    for model in (root / "scripted").iterdir():
        shutil.move(str(model), repo_dir / model.name)
    return repo_dir


@pytest.fixture(scope="module")
def server(repository):
    with TritonServer(repository) as running:
        yield running


@pytest.fixture(scope="module", params=PROTOCOLS)
def client(request, server):
    with server.client(request.param, timeout=60) as c:
        yield c


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], np.asarray(value), err_msg=name)
        assert got[name].dtype == np.asarray(value).dtype or value.dtype == object, name


def example_inputs(name: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    if name in ("chain", "twice", "diamond", "scripted", "fan", "forked", "joined"):
        return {"x": rng.standard_normal((3, 4)).astype(np.float32)}
    if name == "mixed":
        text = np.array([[b"a", b"hello", b"triton"], [b"bb", b"", b"xyz"]], dtype=object)
        return {"text": text, "count": np.array([[2], [3]], dtype=np.int64)}
    if name == "flat":
        return {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    raise KeyError(name)


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["chain", "mixed", "flat", "twice"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_answers_as_plain_python(client, pipelines, name, form):
    inputs = example_inputs(name, seed=hash((name, form)) % 1000)
    expected = reference(pipelines[name], inputs)
    assert_same(client.infer(f"{name}_{form}", inputs), expected)


@pytest.mark.parametrize("form", FORMS)
def test_steps_defined_in_main_serve_after_the_script_is_gone(client, form):
    x = example_inputs("scripted")["x"]
    assert_same(client.infer(f"scripted_{form}", {"x": x}), scripted_reference(x))


def test_a_step_used_twice_is_a_model_per_node(server, pipelines):
    repo = compile_pipeline(pipelines["twice"], "both")
    composing = [n for n in repo.names if n.startswith("twice__")]
    assert composing == ["twice__double", "twice__double2"]  # the first node keeps the step's name
    for model in composing:
        stats = server.client().statistics(model)
        assert stats  # loaded and served under its node's name
    # Asked to share, the nodes get one model (tests/test_reused_step_server.py serves one).
    shared = compile_pipeline(twice_pipeline(share_model=True), "both")
    assert [n for n in shared.names if n.startswith("twice__")] == ["twice__double"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("wanted", [["lengths"], ["loud", "long"]])
def test_asking_for_some_outputs_answers_only_those(client, pipelines, form, wanted):
    inputs = example_inputs("mixed")
    expected = reference(pipelines["mixed"], inputs)
    got = client.infer(f"mixed_{form}", inputs, outputs=wanted, timeout=30)
    assert_same(got, {k: expected[k] for k in wanted})


@pytest.mark.parametrize("form", ["ensemble", "bls"])
def test_diamond_branches_run_at_the_same_time(client, pipelines, form):
    x = np.random.default_rng(abs(hash((form, client.protocol))) % 10_000).standard_normal((2, 4)).astype(np.float32)
    got = client.infer(f"diamond_{form}", {"x": x})
    # Each branch waited at a barrier the other had to reach: both met, so both ran at once.
    assert got["left_met"].all() and got["right_met"].all()
    assert_same(got, reference(pipelines["diamond"], {"x": x}))


def test_bls_sync_runs_the_branches_one_after_the_other(server, pipelines):
    x = np.full((1, 4), 42.0, np.float32)
    got = server.client("grpc", timeout=60).infer("diamond_bls_sync", {"x": x})
    # "left" is first in topological order: it waited in vain, and "right" then found it had run.
    assert not got["left_met"].any()
    assert got["right_met"].all()
    np.testing.assert_array_equal(got["y"], reference(pipelines["diamond"], {"x": x})["y"])


@pytest.mark.parametrize("form", FORMS)
def test_a_failing_step_is_named_in_the_error(client, form):
    with pytest.raises(InferenceError) as info:
        client.infer(f"faulty_{form}", {"x": np.full((1, 4), -1.0, np.float32)})
    text = str(info.value)
    assert "explode" in text and "negative input" in text and "faulty" in text
    ok = client.infer(f"faulty_{form}", {"x": np.zeros((1, 4), np.float32)})
    np.testing.assert_array_equal(ok["y"], np.ones((1, 4), np.float32))


def test_a_failing_request_does_not_fail_its_batch(server):
    """Four requests batched into one call of the step; only the bad one gets an error."""
    before = _execution_count(server, "faulty__explode")
    xs = [np.full((1, 4), v, np.float32) for v in (1.0, 2.0, -3.0, 4.0)]

    def call(x):
        with server.client("grpc", timeout=60) as c:
            try:
                return c.infer("faulty__explode", {"x": x})
            except InferenceError as exc:
                return exc

    with ThreadPoolExecutor(len(xs)) as pool:
        results = list(pool.map(call, xs))
    assert isinstance(results[2], InferenceError) and "explode" in str(results[2])
    for x, result in zip(xs, results, strict=True):
        if x[0, 0] > 0:
            np.testing.assert_array_equal(result["y"], x + 1)
    assert _execution_count(server, "faulty__explode") - before < len(xs)  # some shared one execution


def _execution_count(server, model):
    stats = server.client("grpc").statistics(model)
    entry = stats["model_stats"][0]
    return int(entry.get("execution_count", 0))


# ------------------------------------------------- every subset of outputs (issue 12.1)


@pytest.mark.parametrize("name", ["fan", "forked", "joined", "mixed"])
def test_every_non_empty_subset_of_outputs_answers_in_every_form(client, pipelines, name):
    """An output also read by later steps, one read by two, one exposed twice, two from one step:
    a plain ensemble deadlocks on most of these subsets ("unexpected deadlock")."""
    inputs = example_inputs(name, seed=7)
    expected = reference(pipelines[name], inputs)
    names = list(expected)
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            for form in FORMS:
                got = client.infer(f"{name}_{form}", inputs, outputs=list(subset), timeout=30)
                assert sorted(got) == sorted(subset), (form, subset)
                for output in subset:
                    np.testing.assert_array_equal(got[output], expected[output], err_msg=f"{form} {subset}")


# ------------------------------------------------- the node as the user named it (issue 12.2)


@pytest.mark.parametrize("name", ["named_chain", "named_diamond", "named_twice"])
@pytest.mark.parametrize("form", FORMS)
def test_a_failing_node_is_named_as_the_user_named_it(client, name, form):
    bad = np.full((1, 4), 2.0, np.float32) if name == "named_twice" else np.full((1, 4), -1.0, np.float32)
    with pytest.raises(InferenceError) as info:
        client.infer(f"{name}_{form}", {"x": bad})
    text = str(info.value)
    said = f"StepError in pipeline '{name}', node 'fragile_step', step 'explode_on_negative': raised ValueError: negative input"
    assert said in text, text  # the step's own name appears too
    assert "sturdy_step" not in text, text
    assert info.value.step == "fragile_step" and info.value.pipeline == name
    if name == "named_twice":  # the other node of the same model, when it is the one that fails
        with pytest.raises(InferenceError) as info:
            client.infer(f"{name}_{form}", {"x": np.full((1, 4), -2.0, np.float32)})
        assert info.value.step == "sturdy_step", str(info.value)
