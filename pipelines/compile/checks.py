"""What Triton refuses that the local runtime would run: checked before anything is compiled."""

from __future__ import annotations

from ..core.graph import Graph
from ..core.names import MAX_NAME_LENGTH
from ..core.plan import ExecutionPlan
from ..errors import CompileError, DeclarationError, InvalidNameError

__all__ = ["check_compilable"]

# One path component holds at most 255 bytes on common file systems.
_MAX_MODEL_NAME = 2 * MAX_NAME_LENGTH - 1


def check_compilable(pipeline: Graph, plan: ExecutionPlan) -> None:
    """Raise :class:`CompileError` for a tensor with no dims, a model name too long for a path, or
    a model file that cannot serve its model as compiled (an ONNX file with no batch axis, say)."""
    _check_ranks(pipeline)
    _check_model_files(pipeline, plan)
    for model in plan.models:
        if len(model.name) > _MAX_MODEL_NAME:
            node = model.nodes[0]
            raise InvalidNameError(
                f"pipeline {pipeline.name!r}: step {node!r} would compile to a model named "
                f"{model.name!r} ({len(model.name)} characters, over {_MAX_MODEL_NAME}); shorten the pipeline "
                "or the step name",
                pipeline=pipeline.name, step=node,
            )


def _check_ranks(pipeline: Graph) -> None:
    # Triton rejects a tensor with no dims; a scalar per batch item is dims [1].
    specs = [(None, "pipeline input", n, s) for n, s in pipeline.inputs.items()]
    for node in pipeline.nodes.values():
        specs += [(node.name, "input", n, s) for n, s in node.step.inputs.items()]
        specs += [(node.name, "output", n, s) for n, s in node.step.outputs.items()]
    for node_name, what, tensor, spec in specs:
        if spec.rank == 0:
            where = f"step {node_name!r} {what}" if node_name else what
            raise CompileError(
                f"pipeline {pipeline.name!r}: {where} {tensor!r} is declared with no dims ({spec}); "
                f"Triton needs at least one dim, so declare it as TensorSpec({spec.dtype!r}, [1])",
                pipeline=pipeline.name, step=node_name, tensor=tensor,
            )


def _check_model_files(pipeline: Graph, plan: ExecutionPlan) -> None:
    # Whether a step batches is known only now: its file was checked when declared, for either.
    for model in plan.models:
        node = model.nodes[0]
        step = pipeline.nodes[node].step
        check = getattr(step.impl, "check_file", None) if step.is_external else None
        if not callable(check):
            continue
        try:
            check(step.inputs, step.outputs, max_batch_size=model.max_batch_size)
        except DeclarationError as exc:
            batching = (f"batches (max_batch_size {model.max_batch_size})" if model.max_batch_size
                        else "does not batch (max_batch_size 0)")
            raise CompileError(
                f"pipeline {pipeline.name!r}: step {node!r}, in a model that {batching}: {exc}",
                pipeline=pipeline.name, step=node, tensor=exc.tensor,
            ) from None
