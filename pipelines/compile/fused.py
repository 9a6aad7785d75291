"""The fused form: one Python-backend model running ``models/fused_model.py``, which
runs the pipeline's Python steps in its own process and calls its external model
steps (ONNX Runtime, TensorRT…) through BLS ``async_exec()``.

The model's version folder holds everything it runs, so it serves on its own:

- ``1/fused.json``: the pipeline's input and output specs, the execution plan
  (:mod:`pipelines.core.plan`) as JSON, and for each live node whether it runs here
  (``"python"``, with the folder of its step) or is called (``"external"``, with
  its composing model and timeout);
- ``1/steps/<model>/``: each Python step's ``step.json`` (and ``step.pkl`` for a
  step exported by value, or ``steps_src/`` for one that travels as its source
  file), the same files its step model would hold, with the same checks when
  they are loaded.

One instance runs one ``execute()`` at a time (Triton's Python backend), and its
dynamic batcher hands it the requests that arrived meanwhile: they run as one
batch through the steps. ``fused_instance_count`` (a compile option, like
``bls_instance_count``) sets how many instances, each with its own instance of
every step (``initialize``/``finalize`` once per fused instance).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import serving
from ..core.plan import PLAN_FORMAT
from ..repository_files import FUSED_PLAN
from .bound_plan import CompilePlan
from .configs import set_parameters, top_level_python_config
from .repository import CompiledModel
from .requirements import NUMPY_REQUIREMENT, ServerNeeds
from .step_models import compile_step_model, model_files, model_source, plan_json, step_files

__all__ = [
    "FUSED_PLAN", "STEPS_DIR", "STREAM_FILES", "compile_form", "compile_fused", "in_process_steps", "merged_needs",
    "stream_nodes", "streaming_model",
]

#: The modules that run one request of a streaming pipeline, copied beside the fused and BLS models.
STREAM_FILES = ("stream_run.py", "stream_calls.py")

STEPS_DIR = "steps"


def compile_form(plan: CompilePlan, name: str, form: Any, options: Mapping[str, Any]) -> list[CompiledModel]:
    """The forms table's entry (:mod:`pipelines.forms`): the fused model ``name``."""
    return [compile_fused(plan, name, instance_count=options.get("fused_instance_count", 1))]


def compile_fused(plan: CompilePlan, name: str, *, instance_count: int = 1) -> CompiledModel:
    """The fused model ``name``: ``plan``'s Python steps inside it, its external steps called by BLS."""
    pipeline = plan.pipeline
    config = top_level_python_config(pipeline, name, instance_count)

    files: dict[str, Any] = dict(model_files("fused_model.py"))
    files.update({f"1/{module}": model_source(module) for module in STREAM_FILES})
    step_files_, steps, needs = in_process_steps(plan, [m for m in plan.models if not plan.step_of(m).is_external])
    files.update(step_files_)
    gpu = any(n.step.options.device == "gpu" for n in plan.nodes if not n.step.is_external and n.model)
    if gpu:  # a GPU step takes its inputs where they are, through DLPack
        set_parameters(config, {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})

    nodes = {}
    for node in plan.nodes:
        step = node.step
        timeout = step.options.timeout
        timeout_us = round(timeout * 1e6) if timeout else 0
        if plan.plan.node(node.name).kind == "select":  # merged by the fused model itself
            nodes[node.name] = {"kind": "select"}
        elif step.is_external:
            nodes[node.name] = {"kind": "external", "model": node.model, "timeout_us": timeout_us}
        else:
            nodes[node.name] = {"kind": "python", "folder": steps[node.model], "model": node.model,
                                "device": step.options.device, "timeout_us": timeout_us}
    data = {
        "format": PLAN_FORMAT,
        "pipeline": pipeline.name,
        "model": name,
        "max_batch_size": pipeline.max_batch_size,
        # Requests of one execute() run as one batch only when every step takes that many rows.
        "join_rows": _join_rows(plan),
        "gpu": gpu,
        "inputs": {n: s.to_dict() for n, s in pipeline.inputs.items()},
        "outputs": {n: ref.spec.to_dict() for n, ref in pipeline.outputs.items()},
        "plan": plan.plan.to_json(),
        "nodes": nodes,
    }
    if pipeline.streaming:
        streaming_model(config)
        data["streams"] = stream_nodes(plan)
    files[f"1/{FUSED_PLAN}"] = plan_json(data)
    return CompiledModel(name, config, files, needs=lambda: merged_needs(needs))


def in_process_steps(plan: CompilePlan, models: list[Any]) -> tuple[dict[str, Any], dict[str, str], list[Any]]:
    """What a top-level model needs to run ``models``' Python steps in its own process: their
    files under ``1/steps/<model>/``, the folder of each model, and what each needs on the server."""
    files: dict[str, Any] = {}
    folders: dict[str, str] = {}
    needs: list[Any] = []
    for model in models:
        # The step model's own files (not the model): the same export, digest and checks.
        compiled = compile_step_model(plan, model)
        folder = f"{STEPS_DIR}/{model.name}"
        for rel in step_files(compiled):
            # Read now: a step that cannot be exported fails this compile, not the write (the
            # local endpoint tells a pipeline it cannot compile by this).
            compiled.files[f"1/{rel}"]  # noqa: B018
            files[f"1/{folder}/{rel}"] = compiled.files.source(f"1/{rel}")
        folders[model.name] = folder
        needs.append(compiled.needs)
    return files, folders, needs


def streaming_model(config: Any) -> None:
    """A streaming pipeline's top-level model is decoupled: one response per response of its stream."""
    config.model_transaction_policy.decoupled = True


def stream_nodes(plan: CompilePlan) -> dict[str, dict[str, Any]]:
    """Where each live node of a streaming pipeline runs (``serving.stream_record``), written into the
    model's JSON for ``models/stream_run.py``'s ``serving.StreamLayout``."""
    return serving.stream_record(plan.pipeline, [node.name for node in plan.nodes])


def _join_rows(plan: CompilePlan) -> int:
    """The most rows one batched run may hold (0: run each request alone)."""
    if plan.pipeline.max_batch_size == 0:
        return 0
    limits = [m.max_batch_size for m in plan.models]
    steps = [plan.step_of(m) for m in plan.models]
    if any(s.is_external and s.external.fixed_batch is not None for s in steps) or 0 in limits:
        return 0
    return min([plan.pipeline.max_batch_size, *limits])


def merged_needs(needs: list[Any]) -> ServerNeeds:
    requirements: list[str] = [NUMPY_REQUIREMENT]
    python = None
    for need in needs:
        need = need() if callable(need) else need
        requirements += need.requirements
        python = python or need.python
    return ServerNeeds(tuple(dict.fromkeys(requirements)), python=python)
