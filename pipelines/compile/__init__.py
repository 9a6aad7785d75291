"""Compile a :class:`~pipelines.Pipeline` into a Triton model repository:
an ensemble, a BLS model (async or sync), or all three over shared composing models.
"""

from __future__ import annotations

import dataclasses

from ..errors import CompileError
from ..graph import Pipeline
from .bls import compile_bls
from .bound_plan import CompilePlan, bind_plan
from .checks import check_compilable
from .ensemble import compile_ensemble, layout_ensemble
from .repository import CompiledModel, FileCopy, ModelRepository, remove_pipelines, repository_pipelines
from .requirements import NUMPY_REQUIREMENT, ServerNeeds
from .step_models import compile_step_model

__all__ = [
    "TARGETS",
    "TOP_LEVEL_SUFFIXES",
    "CompilePlan",
    "CompiledModel",
    "FileCopy",
    "ModelRepository",
    "compile_pipeline",
    "remove_pipelines",
    "repository_pipelines",
]

#: The suffix of each top-level model in a ``"both"`` repository.
TOP_LEVEL_SUFFIXES = {"ensemble": "_ensemble", "bls": "_bls", "bls-sync": "_bls_sync"}

#: What ``compile_pipeline`` accepts; ``"both"`` means the ensemble and both BLS forms.
TARGETS = ("ensemble", "bls", "bls-sync", "both")


def compile_pipeline(pipeline: Pipeline, target: str = "both", *, bls_instance_count: int = 1) -> ModelRepository:
    """Compile ``pipeline`` into an in-memory :class:`ModelRepository`.

    ``"ensemble"``, ``"bls"`` or ``"bls-sync"`` give one top-level model named
    after the pipeline; ``"both"`` gives ``<name>_ensemble``, ``<name>_bls`` and
    ``<name>_bls_sync`` over the same composing models ``<name>__<step>``.
    ``bls_instance_count`` sets the BLS models' instance count.
    """
    if not isinstance(pipeline, Pipeline):
        raise CompileError(f"compile_pipeline needs a Pipeline; got {pipeline!r}")
    if target not in TARGETS:
        raise CompileError(
            f"pipeline {pipeline.name!r}: unknown target {target!r}; choose one of {', '.join(TARGETS)}",
            pipeline=pipeline.name,
        )
    if isinstance(bls_instance_count, bool) or not isinstance(bls_instance_count, int) or bls_instance_count < 1:
        raise CompileError(
            f"pipeline {pipeline.name!r}: bls_instance_count must be an int >= 1; got {bls_instance_count!r}",
            pipeline=pipeline.name,
        )
    plan = bind_plan(pipeline)
    check_compilable(pipeline, plan.plan)
    both = target == "both"
    forms = ("ensemble", "bls", "bls-sync") if both else (target,)

    layout = layout_ensemble(plan) if "ensemble" in forms else None
    models: dict[str, CompiledModel] = {}
    for model in plan.models:
        extras = layout.extras.get(model.name) if layout is not None else None
        models[model.name] = compile_step_model(plan, model, extras)
    top = []
    for form in forms:
        name = pipeline.name + TOP_LEVEL_SUFFIXES[form] if both else pipeline.name
        if form == "ensemble":
            for compiled in compile_ensemble(plan, name, layout):
                models[compiled.name] = compiled
        else:
            models[name] = compile_bls(plan, name, target=form, instance_count=bls_instance_count)
        top.append(name)
    return ModelRepository({name: _owned(model, pipeline.name) for name, model in models.items()},
                           top_level=tuple(top))


def _owned(model: CompiledModel, pipeline: str) -> CompiledModel:
    """``model`` owned by ``pipeline``, with numpy required wherever it runs Python on the server."""
    needs = model.needs
    if needs == ServerNeeds() and model.config.backend == "python":
        needs = ServerNeeds((NUMPY_REQUIREMENT,))
    return dataclasses.replace(model, pipeline=pipeline, needs=needs)
