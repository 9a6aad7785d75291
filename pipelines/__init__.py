"""pipelines: declare Triton pipeline steps once, as a typed DAG; compile them to an
ensemble and to BLS, run them locally, and measure one against the other."""

from __future__ import annotations

from .errors import (
    BatchingMismatchError,
    ClientTimeoutError,
    CompileError,
    CycleError,
    DeclarationError,
    DtypeMismatchError,
    DuplicateNameError,
    InferenceError,
    InputError,
    InvalidNameError,
    PipelinesError,
    RepositoryWriteError,
    ServerDiedError,
    ServerError,
    ServerStartError,
    ShapeMismatchError,
    StepDeclarationError,
    StepError,
    StepTimeoutError,
    StubDiedError,
    TensorProducedTwiceError,
    TensorSpecError,
    UnboundInputError,
    UnknownTensorError,
)
from .graph import Node, Pipeline, TensorRef
from .step import DynamicBatching, ExternalModel, ModelOptions, Step, external_model, step
from .tensor import DATATYPES, TensorSpec

__version__ = "0.1.0"

# Imported on first use: the step models on a Triton server import this package,
# and need neither the compiler (protobuf, tritonclient) nor the runtime.
_LAZY = {
    "compile_pipeline": ("pipelines.compile", "compile_pipeline"),
    "ModelRepository": ("pipelines.compile", "ModelRepository"),
    "LocalRuntime": ("pipelines.runtime", "LocalRuntime"),
    "compare": ("pipelines.runtime", "compare"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")

__all__ = [
    "DATATYPES",
    "BatchingMismatchError",
    "ClientTimeoutError",
    "CompileError",
    "CycleError",
    "DeclarationError",
    "DtypeMismatchError",
    "DuplicateNameError",
    "DynamicBatching",
    "ExternalModel",
    "InferenceError",
    "InputError",
    "InvalidNameError",
    "LocalRuntime",
    "ModelOptions",
    "ModelRepository",
    "Node",
    "Pipeline",
    "PipelinesError",
    "RepositoryWriteError",
    "ServerDiedError",
    "ServerError",
    "ServerStartError",
    "ShapeMismatchError",
    "Step",
    "StepDeclarationError",
    "StepError",
    "StepTimeoutError",
    "StubDiedError",
    "TensorProducedTwiceError",
    "TensorSpecError",
    "TensorRef",
    "TensorSpec",
    "UnboundInputError",
    "UnknownTensorError",
    "__version__",
    "compare",
    "compile_pipeline",
    "external_model",
    "step",
]
