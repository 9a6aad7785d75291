"""The compiler: a pipeline's execution plan -> a Triton model repository, one top-level model per form.
Configs (protobuf), step and BLS models, the ensemble's wiring, and the atomic write to disk live here.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

from tritonclient.grpc import model_config_pb2 as mc

from ..core.graph import Graph
from ..core.plan import ensemble_refusal
from ..core.planning import refuse_streaming_form
from ..errors import CompileError, NotCompilableError
from ..forms import FORMS, FormLeftOutWarning, TimeoutNotEnforcedWarning, forms_of_target
from ..forms import TARGETS as FORM_TARGETS
from . import bls, ensemble, fused
from .bound_plan import CompilePlan, bind_plan
from .checks import check_compilable
from .ensemble import layout_ensemble
from .repository import CompiledModel, FileCopy, ModelRepository, remove_pipelines, repository_pipelines
from .requirements import NUMPY_REQUIREMENT, ServerNeeds, distributions_of
from .step_models import compile_step_model

__all__ = [
    "COMPILERS",
    "TARGETS",
    "CompilePlan",
    "CompiledModel",
    "FileCopy",
    "ModelRepository",
    "compile_pipeline",
    "remove_pipelines",
    "repository_pipelines",
]

#: What ``compile_pipeline`` accepts: each form of :data:`pipelines.forms.FORMS`, ``"both"``
#: (the ensemble and both BLS forms side by side) and ``"all"`` (every form side by side).
TARGETS = tuple(FORM_TARGETS)

#: Each form's compiler, by form name: ``(plan, name, form, options) -> [CompiledModel]``, the
#: form's top-level model and what it adds (a test checks every form of FORMS has one).
COMPILERS: dict[str, Callable[..., list[CompiledModel]]] = {
    "ensemble": ensemble.compile_form,
    "bls": bls.compile_form,
    "bls-sync": bls.compile_form,
    "fused": fused.compile_form,
}


def compile_pipeline(
    pipeline: Graph, target: str = "both", *, bls_instance_count: int = 1, fused_instance_count: int = 1
) -> ModelRepository:
    """Compile ``pipeline`` into an in-memory :class:`ModelRepository`.

    A form's name (``"ensemble"``, ``"bls"``, ``"bls-sync"``) gives one top-level
    model named after the pipeline; ``"both"`` gives ``<name>_ensemble``,
    ``<name>_bls`` and ``<name>_bls_sync`` over the same composing models
    ``<name>__<step>``, and ``"all"`` every form of :data:`pipelines.forms.FORMS`
    with its suffix.
    ``bls_instance_count`` sets the BLS models' instance count, ``fused_instance_count``
    the fused model's (each fused instance holds an instance of every Python step).
    """
    if not isinstance(pipeline, Graph):
        raise CompileError(f"compile_pipeline needs a Pipeline; got {pipeline!r}")
    try:
        forms = forms_of_target(target)
    except ValueError as exc:
        raise CompileError(f"pipeline {pipeline.name!r}: {exc}", pipeline=pipeline.name) from None
    for option, count in (("bls_instance_count", bls_instance_count), ("fused_instance_count", fused_instance_count)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise CompileError(
                f"pipeline {pipeline.name!r}: {option} must be an int >= 1; got {count!r}", pipeline=pipeline.name
            )
    plan = bind_plan(pipeline)
    check_compilable(pipeline, plan.plan)
    side_by_side = target not in FORMS
    refusals = {form.name: why for form in forms if (why := _refusal(pipeline, plan, form.name)) is not None}
    if refusals:
        if not side_by_side:
            raise next(iter(refusals.values()))
        if len(refusals) == len(forms):
            said = "; ".join(f"{name}: {why.message}" for name, why in refusals.items())
            raise NotCompilableError(f"pipeline {pipeline.name!r}: no form of compile({target!r}) can run it ({said})",
                                     pipeline=pipeline.name)
        forms = tuple(f for f in forms if f.name not in refusals)
        for name, why in refusals.items():
            said = ensemble_refusal(plan.plan) if name == "ensemble" and plan.plan.conditional else why.message
            warnings.warn(
                f"{said}; compile({target!r}) left the {name} form out and wrote {', '.join(f.name for f in forms)}",
                FormLeftOutWarning,
                stacklevel=3,
            )

    # A streaming step's own model bounds its stream by its timeout, in the ensemble too.
    timed = [n.name for n in plan.nodes if n.step.options.timeout and not n.step.streaming]
    if timed and FORMS["ensemble"] in forms:
        warnings.warn(
            f"pipeline {pipeline.name!r}: {', '.join(map(repr, timed))} declare timeout=, which the ensemble form "
            "cannot enforce (Triton's ensemble has no per-step timeout; bls and fused enforce it)",
            TimeoutNotEnforcedWarning,
            stacklevel=3,
        )
    # The ensemble's layout adds tensors to the step models it shares with the other forms.
    layout = layout_ensemble(plan) if FORMS["ensemble"] in forms else None
    options = {"bls_instance_count": bls_instance_count, "fused_instance_count": fused_instance_count,
               "ensemble_layout": layout}
    models: dict[str, CompiledModel] = {}
    # A form that runs Python steps in-process calls only the external steps' models.
    in_process_only = all(form.in_process for form in forms)
    for model in plan.models:
        if in_process_only and not plan.step_of(model).is_external:
            continue
        extras = layout.extras.get(model.name) if layout is not None else None
        models[model.name] = compile_step_model(plan, model, extras)
    top = []
    for form in forms:
        name = form.model_name(pipeline.name, side_by_side=side_by_side)
        for compiled in COMPILERS[form.name](plan, name, form, options):
            models[compiled.name] = compiled
        top.append(name)
    return ModelRepository({name: _owned(model, pipeline.name) for name, model in models.items()},
                           top_level=tuple(top))


def _refusal(pipeline: Graph, plan: CompilePlan, form: str) -> NotCompilableError | None:
    """Why the form named ``form`` cannot run ``pipeline``, or ``None`` where it can."""
    if form == "ensemble" and plan.plan.conditional:
        # Triton's ensemble scheduler runs every step for every request: it cannot skip a branch.
        return NotCompilableError(f"{ensemble_refusal(plan.plan)}: compile('bls') or compile('fused')",
                                  pipeline=pipeline.name)
    try:
        refuse_streaming_form(pipeline, form)
    except NotCompilableError as exc:
        return exc
    return None


def _owned(model: CompiledModel, pipeline: str) -> CompiledModel:
    """``model`` owned by ``pipeline``, with numpy required wherever it runs Python on the server."""
    needs = model.needs
    if needs == ServerNeeds() and model.config.backend == "python":
        needs = ServerNeeds((NUMPY_REQUIREMENT,))
    if model.config.backend == "python" and _has_bf16(model):
        needs = functools.partial(_with_bf16, needs)
    return dataclasses.replace(model, pipeline=pipeline, needs=needs)


def _with_bf16(needs: ServerNeeds | Callable[[], ServerNeeds]) -> ServerNeeds:
    """``needs`` and ml_dtypes: numpy has no BF16, and the in-server code hands it to steps as ml_dtypes.bfloat16."""
    needs = needs() if callable(needs) else needs
    return dataclasses.replace(needs, requirements=tuple(dict.fromkeys((*needs.requirements, *distributions_of(["ml_dtypes"])))))


def _has_bf16(model: CompiledModel) -> bool:
    tensors = [*model.config.input, *model.config.output]
    return any(t.data_type == mc.TYPE_BF16 for t in tensors)
