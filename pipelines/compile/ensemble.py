"""The ensemble form: ``platform: "ensemble"`` with one ``ensemble_scheduling``
step per live node, wired by ``input_map``/``output_map`` over the tensor names
the plan chose. Triton's scheduler then runs each step as soon as its inputs
are ready; each composing model keeps its own instances and batching.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import CompileError
from .configs import add_io
from .plan import CompilePlan
from .repository import CompiledModel

__all__ = ["compile_ensemble"]


def compile_ensemble(plan: CompilePlan, name: str) -> CompiledModel:
    """The ensemble model ``name`` over the composing models of ``plan``."""
    pipeline = plan.pipeline
    for output, earlier in plan.repeated_outputs:
        raise CompileError(
            f"pipeline {pipeline.name!r}: outputs {earlier!r} and {output!r} are the same tensor "
            f"{pipeline.outputs[output].qualname!r}; a Triton ensemble produces each tensor once, so "
            "expose it once, or compile with target='bls'",
            pipeline=pipeline.name, step=pipeline.outputs[output].node, tensor=output,
        )
    used_inputs = {ref.name for node in plan.nodes for ref in node.sources.values() if ref.is_input}
    unused = [i for i in pipeline.inputs if i not in used_inputs]
    if unused:
        raise CompileError(
            f"pipeline {pipeline.name!r}: input {unused[0]!r} feeds no step that reaches an output; "
            "Triton refuses an ensemble with an unused input, so remove it or wire it to a step",
            pipeline=pipeline.name, tensor=unused[0],
        )

    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=pipeline.max_batch_size)
    add_io(config, pipeline.inputs, pipeline.output_specs)
    for node in plan.nodes:
        step = config.ensemble_scheduling.step.add(model_name=node.model, model_version=-1)
        for key, value in node.inputs.items():
            step.input_map[key] = value
        for key, value in node.outputs.items():
            step.output_map[key] = value
    return CompiledModel(name, config, {})
