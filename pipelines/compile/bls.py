"""The BLS form: a Python-backend model running the generic executor
``models/bls_model.py``, which reads ``1/bls.json``: the mode, the pipeline's
input and output specs, each step's timeout, and the execution plan
(:mod:`pipelines.plan`) as JSON.

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

from ..forms import Form
from ..plan import PLAN_FORMAT
from ..repository_files import BLS_PLAN
from .bound_plan import CompilePlan
from .configs import set_parameters, top_level_python_config
from .repository import CompiledModel
from .step_models import model_files, plan_json

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
    files = {**model_files("bls_model.py"), f"1/{BLS_PLAN}": plan_json(data)}
    return CompiledModel(name, config, files)
