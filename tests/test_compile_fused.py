"""The fused form's compiled model: its config (instances, batching), its plan
(which nodes run in-process, which are called), and its self-contained version folder."""

from __future__ import annotations

import json
import re

import pytest

from pipelines import CompileError, Pipeline, TensorSpec, external_model, step
from pipelines.compile.configs import parse_config

ROW = TensorSpec("FP32", [4])


@step(inputs={"x": ROW}, outputs={"y": ROW})
def inc(x):
    return {"y": x + 1}


def pipeline(*, fixed_batch=None, max_batch_size=8, share_model=None):
    detector = external_model("detector", inputs={"x": ROW}, outputs={"y": ROW}, backend="onnxruntime",
                              fixed_batch=fixed_batch, timeout=2.5)
    used_twice = inc if share_model is None else inc.with_options(share_model=share_model)
    p = Pipeline("fz", inputs={"x": ROW}, max_batch_size=max_batch_size)
    a = p.add(used_twice, name="first", x=p.input("x"))
    p.output("y", p.add(used_twice, name="second", x=p.add(detector, x=a["y"])["y"])["y"])
    return p


def test_the_fused_config_has_its_own_instances_and_batching():
    config = parse_config(pipeline().compile("fused", fused_instance_count=3).config_text("fz"))
    assert config.backend == "python" and config.max_batch_size == 8
    assert [(g.count, g.kind) for g in config.instance_group] == [(3, config.instance_group[0].KIND_CPU)]
    assert config.HasField("dynamic_batching")
    assert "FORCE_CPU_ONLY_INPUT_TENSORS" not in config.parameters  # CPU steps take numpy inputs
    unbatched = parse_config(pipeline(max_batch_size=0).compile("fused").config_text("fz"))
    assert unbatched.max_batch_size == 0 and not unbatched.HasField("dynamic_batching")
    with pytest.raises(CompileError, match="fused_instance_count must be an int >= 1; got 0"):
        pipeline().compile("fused", fused_instance_count=0)


def test_the_plan_says_which_nodes_run_inside_and_which_are_called():
    model = pipeline().compile("all")["fz_fused"]
    data = json.loads(model.files["1/fused.json"])
    assert data["nodes"]["first"] == {"kind": "python", "folder": "steps/fz__inc", "model": "fz__inc",
                                      "device": None, "timeout_us": 0}
    assert data["nodes"]["second"]["folder"] == "steps/fz__second"  # a model, and an instance, per node
    assert data["nodes"]["detector"] == {"kind": "external", "model": "fz__detector", "timeout_us": 2_500_000}
    assert data["join_rows"] == 8 and data["plan"]["pipeline"] == "fz"
    step_plan = json.loads(model.files["1/steps/fz__inc/step.json"])
    assert step_plan["step"] == "inc" and step_plan["impl"]["pickle"] == "step.pkl"  # by value: a test module
    assert step_plan["nodes"] == ["first"]
    # Asked to share: one step, one instance, two nodes.
    shared = json.loads(pipeline(share_model=True).compile("fused")["fz"].files["1/fused.json"])
    assert shared["nodes"]["first"]["folder"] == shared["nodes"]["second"]["folder"] == "steps/fz__inc"
    # A model exported with a fixed batch takes one request's rows at a time: no joined batches.
    assert json.loads(pipeline(fixed_batch=1).compile("fused")["fz"].files["1/fused.json"])["join_rows"] == 0


class _Stuck:
    """A step instance whose call waits for ``release``; it notes when it is finalized."""

    is_async = False

    def __init__(self, release, finalized):
        self.release, self.finalized = release, finalized

    def execute(self, inputs):
        self.release.wait(10)
        return {"y": inputs["x"]}

    def finalize(self):
        self.finalized.append(self)


def test_the_fused_model_abandons_a_call_past_its_timeout_for_a_fresh_instance_or_says_why_it_cannot():
    """What the fused model does on the server (tests/test_server_failures.py), down to the
    instance it abandons, its finalize() once the call returns, and a renewal that fails."""
    import asyncio
    import threading

    from pipelines.compile.models import fused_model as fm

    model = fm.TritonPythonModel.__new__(fm.TritonPythonModel)  # no stub here: only what the call reads
    model.pipeline, node = "p", {"name": "n", "step": "s", "model": "p__s"}
    release, finalized = threading.Event(), []
    stuck, fresh = _Stuck(release, finalized), _Stuck(threading.Event(), finalized)
    fresh.release.set()
    step_ = fm._Step(stuck, None, None, 0.2, renew=lambda: fresh)

    async def main():
        with pytest.raises(fm.NodeFailed, match=r"StepTimeoutError in pipeline 'p', node 'n', step 's': ran past "
                                                r"its timeout of 0.2 s .*a fresh instance"):
            await model._within_timeout(step_, node, {"x": 1})
        # the stuck call still runs (it finalizes its instance once it returns): the timeout ended the wait
        assert step_.instance is fresh and not finalized
        assert await model._within_timeout(step_, node, {"x": 2}) == {"y": 2}  # the fresh one answers
        release.set()  # the stuck call returns at last: its instance is finalized, its answer dropped
        for _ in range(100):
            if finalized:
                break
            await asyncio.sleep(0.01)
        assert finalized == [stuck]

        def cannot():
            try:
                raise ValueError("the model file is gone")
            except ValueError as exc:
                raise RuntimeError("StepError in pipeline 'p' ...") from exc

        broken = fm._Step(_Stuck(threading.Event(), []), None, None, 0.1, renew=cannot)
        with pytest.raises(fm.NodeFailed, match="StepTimeoutError"):
            await model._within_timeout(broken, node, {"x": 1})
        assert re.search(r"a fresh one could not be made: raised ValueError: the model file is gone "
                         r"\(at test_compile_fused\.py:\d+\)$", broken.broken)

    asyncio.run(main())
