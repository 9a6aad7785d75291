"""Every error a user of the package can meet is a PipelinesError (issue 13).

Two halves: a scan of the source for raises of bare builtin errors (each one left is
listed with the reason it never reaches a user), and bad input given to a few public
entry points of each module whose errors were builtin ones, checked for the root class,
for the builtin class callers caught before, and for words naming what was expected.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import anyio
import numpy as np
import pytest

import pipelines
from pipelines import CompileError, InferenceError, InputError, Pipeline, PipelinesError, TensorSpec, step
from pipelines.bench.results import BenchmarkResult
from pipelines.compile import compile_pipeline
from pipelines.core.plan import ExecutionPlan
from pipelines.core.planning import plan_of
from pipelines.errors import ArgumentError, NotFoundError
from pipelines.forms import form, forms_of_target
from pipelines.percentiles import percentiles
from pipelines.runtime import LocalRuntime
from pipelines.runtime.device import resolve_device
from pipelines.runtime.report import compare

PACKAGE = Path(pipelines.__file__).parent
BUILTIN = {"ValueError", "KeyError", "RuntimeError", "TypeError", "LookupError", "IndexError", "Exception"}

# The raises of builtin errors that stay, each with why no user of the package meets it.
ALLOWED = {
    # In a Triton stub (no pipelines package there): a model whose files are broken. The
    # client sees the server's error response, translated into an InferenceError.
    "serving/lifecycle.py": "in-server only",
    "serving/sources.py": "in-server only",
    # In the fused or BLS model's stub, loading a step: the model fails to load with the
    # serving.WireError text in the server's log.
    "compile/models/stream_calls.py": "in-server only",
    # Steps of the examples: user code that raises on purpose, to show a failing step.
    "examples/text.py": "user step",
    "examples/failing_branch.py": "user step",
    # Raised inside a try whose except turns it into a Refusal (a 400 answer).
    "endpoint/wire.py": "caught internally",
    # The executor contract of concurrent.futures (submit after shutdown); the threads are
    # private to a LocalRuntime, which never submits after closing them.
    "runtime/workers.py": "internal executor",
}


def _builtin_raises() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN:
                found.append(f"{rel}:{node.lineno} raise {exc.id}")
    return found


def test_no_module_raises_a_bare_builtin_error():
    found = _builtin_raises()
    assert not found, "raise a PipelinesError subclass instead (see pipelines/errors.py): " + ", ".join(found)


def test_the_allow_list_names_files_that_still_raise_builtin_errors():
    # An entry whose file no longer raises one would hide a future raise there: drop it.
    for rel in ALLOWED:
        tree = ast.parse((PACKAGE / rel).read_text())
        names = {
            (n.exc.func if isinstance(n.exc, ast.Call) else n.exc).id
            for n in ast.walk(tree)
            if isinstance(n, ast.Raise) and n.exc is not None
            and isinstance(n.exc.func if isinstance(n.exc, ast.Call) else n.exc, ast.Name)
        }
        assert names & BUILTIN, f"{rel} raises no builtin error any more: remove it from ALLOWED"


def test_every_error_class_is_under_the_root_and_exported():
    from pipelines import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, PipelinesError), name
        assert getattr(pipelines, name) is cls and name in pipelines.__all__, name
    # Both new classes also document themselves in the tree of the module docstring.
    assert "ArgumentError" in errors.__doc__ and "NotFoundError" in errors.__doc__


V = TensorSpec("FP32", [-1])


@step(inputs={"x": V}, outputs={"y": V})
def double(x):
    return {"y": x * 2}


def _tiny() -> Pipeline:
    p = Pipeline("tiny", inputs={"x": V}, max_batch_size=2)
    p.output("y", p.add(double, x=p.input("x"))["y"])
    return p


def _raises(cls, builtin, match, call, *args, **kwargs):
    """``call`` raises ``cls``, a PipelinesError that is still a ``builtin``, with ``match`` in its words."""
    with pytest.raises(cls, match=match) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, PipelinesError)
    if builtin is not None:
        assert isinstance(info.value, builtin)
    return info.value


def test_forms_and_targets():
    _raises(ArgumentError, ValueError, r"unknown form 'nope'; choose one of ensemble, ", form, "nope")
    _raises(ArgumentError, ValueError, r"unknown target 'nope'; choose one of .*both", forms_of_target, "nope")
    # Through the entry points users call, the same words under the area's class.
    _raises(CompileError, None, r"pipeline 'tiny': unknown target 'ensembel'", compile_pipeline, _tiny(), "ensembel")
    _raises(InferenceError, None, r"unknown mode 'nope'", LocalRuntime, _tiny(), "nope")


def test_devices():
    _raises(ArgumentError, ValueError, r"device must be 'cpu', 'gpu', 'auto' or None; got 'tpu'", resolve_device, "tpu")
    _raises(InferenceError, None, r"pipeline 'tiny': device must be .* got 'tpu'", LocalRuntime, _tiny(), device="tpu")


def test_plans():
    plan = plan_of(_tiny())
    err = _raises(ArgumentError, ValueError, r"pipeline 'tiny' has no output 'z'; its outputs are \['y'\]",
                  plan.for_outputs, ["z"])
    assert "z" in str(err)
    data = plan.to_json()
    assert ExecutionPlan.from_json(data) == plan
    _raises(ArgumentError, ValueError, r"execution plan format 0 is not .*recompile",
            ExecutionPlan.from_json, {**data, "format": 0})
    # A run that asks for an unknown output: an InputError naming the tensor.
    err = _raises(InputError, None, r"no output 'z'", _tiny().run, {"x": np.ones(2, np.float32)}, outputs=["z"])
    assert err.tensor == "z"


def test_percentiles():
    _raises(ArgumentError, ValueError, r"percentiles of no values: give at least one value", percentiles, [], (50,))


def test_lookups_by_name_list_what_there_is():
    p = _tiny()

    async def one_request():
        async with LocalRuntime(p, "ensemble") as runtime:
            await runtime.infer({"x": np.ones((1, 2), np.float32)})
            return runtime.report()

    report = anyio.run(one_request)
    assert report.step("double").step == "double"
    err = _raises(NotFoundError, KeyError, r"report of pipeline 'tiny' has no step 'nope'; it has \['double'\]",
                  report.step, "nope")
    assert str(err).startswith("report of")  # the message, not KeyError's quoted repr of it
    _raises(NotFoundError, KeyError, r"no figure 'nope'; figures are \[", compare(report, report).ratio, "nope")

    repository = compile_pipeline(p, "ensemble")
    _raises(NotFoundError, KeyError, r"no model 'nope' in this repository; it holds \[.*'tiny'",
            repository.config_text, "nope")

    result = BenchmarkResult(pipeline="tiny", settings={}, measurements=(), comparisons=(), verdict="",
                             machine={}, versions={})
    _raises(NotFoundError, KeyError, r"no measurement of 'server bls' at concurrency 4; measured: \[\]",
            result.find, "server bls", 4)


def test_the_new_errors_keep_their_words_and_context_across_pickle():
    for cls in (ArgumentError, NotFoundError):
        err = pickle.loads(pickle.dumps(cls("what was wrong; what was expected", pipeline="p")))
        assert type(err) is cls and str(err) == "what was wrong; what was expected" and err.pipeline == "p"
