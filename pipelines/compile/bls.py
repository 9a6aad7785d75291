"""The BLS form: a Python-backend model running the generic executor
``models/bls_model.py``, which reads ``1/bls.json``: the mode, the pipeline's
input and output specs, each step's timeout, and the execution plan
(:mod:`pipelines.core.plan`) as JSON.

``"bls"`` (mode ``"async"``) runs every node as soon as its inputs are ready
with ``async_exec()``; ``"bls-sync"`` calls them one after another with
``exec()``. One instance serves concurrent requests: a batching pipeline's BLS
model has dynamic batching, so requests that arrive while it is busy reach it
together and the async executor runs them side by side (the sync one, in
turn). Raise ``instance_count`` for more executors, e.g. for a non-batching
pipeline, where Triton hands one request at a time to each instance. Triton's
Python backend finishes one ``execute`` (async or not) before it starts the
next, so a slow or stuck step holds its BLS instance until it answers; the
ensemble holds only the step's own instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.plan import PLAN_FORMAT
from ..forms import Form
from ..repository_files import BLS_PLAN
from .bound_plan import CompilePlan
from .configs import set_parameters, top_level_python_config
from .ensemble_wiring import ERR_OUTPUT
from .fused import STREAM_FILES, in_process_steps, merged_needs, stream_nodes, streaming_model
from .repository import CompiledModel
from .step_models import model_files, model_source, plan_json

__all__ = ["BLS_PLAN", "compile_bls", "compile_form"]

# The executor's mode for each scheduler of the forms table (pipelines.forms).
_MODES = {"concurrent": "async", "sequential": "sync"}


def compile_form(plan: CompilePlan, name: str, form: Form, options: Mapping[str, Any]) -> list[CompiledModel]:
    """The forms table's entry (:mod:`pipelines.forms`): the BLS model ``name``."""
    return [compile_bls(plan, name, form=form, instance_count=options.get("bls_instance_count", 1))]


def compile_bls(plan: CompilePlan, name: str, *, form: Form, instance_count: int = 1) -> CompiledModel:
    """The BLS model ``name`` (a form whose scheduler is concurrent or sequential) over ``plan``'s models."""
    pipeline = plan.pipeline
    config = top_level_python_config(pipeline, name, instance_count)
    # Inputs stay where they are (GPU included) and go on to the steps through DLPack.
    set_parameters(config, {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})

    data = {
        "format": PLAN_FORMAT,
        "pipeline": pipeline.name,
        "model": name,
        "mode": _MODES[form.scheduler],
        "max_batch_size": pipeline.max_batch_size,
        "inputs": {n: s.to_dict() for n, s in pipeline.inputs.items()},
        "outputs": {n: ref.spec.to_dict() for n, ref in pipeline.outputs.items()},
        "plan": plan.plan.to_json(),
        # Each step's `timeout` option, for its BLS call (0: none).
        "timeouts_us": {
            node.name: round(node.step.options.timeout * 1e6) if node.step.options.timeout else 0
            for node in plan.nodes
        },
    }
    # The streaming modules travel with every BLS model: model.py imports them whether it streams or not.
    files: dict[str, Any] = {**model_files("bls_model.py"), **{f"1/{m}": model_source(m) for m in STREAM_FILES}}
    needs: list[Any] = []
    if pipeline.streaming:
        streaming_model(config)
        data["streams"] = stream_nodes(plan)
        data["err_output"] = ERR_OUTPUT  # what a streaming step's model carries its failures in
        # Triton hands a model one request at a time, never a stream: a step that reads a stream
        # whole runs in this model's process, as in the fused form (docs/triton_decoupled.md).
        whole = [node for node in plan.nodes if node.step.whole_stream]
        models = [m for m in plan.models if any(node.name in m.nodes for node in whole)]
        step_files, folders, needs = in_process_steps(plan, models)
        files.update(step_files)
        data["in_process"] = {
            node.name: {"folder": folders[node.model], "model": node.model, "step": node.step.name,
                        "timeout_us": data["timeouts_us"][node.name]}
            for node in whole
        }
    files[f"1/{BLS_PLAN}"] = plan_json(data)
    if needs:
        return CompiledModel(name, config, files, needs=lambda: merged_needs(needs))
    return CompiledModel(name, config, files)
