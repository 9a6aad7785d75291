"""pipelines: declare Triton pipeline steps once, as a typed DAG; compile them to an
ensemble and to BLS, run them locally, and measure one against the other."""

from __future__ import annotations

from .errors import (
    BatchingMismatchError,
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
    TensorProducedTwiceError,
    UnboundInputError,
    UnknownTensorError,
)
from .graph import Node, Pipeline, TensorRef
from .step import DynamicBatching, ExternalModel, ModelOptions, Step, external_model, step
from .tensor import DATATYPES, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "DATATYPES",
    "BatchingMismatchError",
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
    "ModelOptions",
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
    "TensorProducedTwiceError",
    "TensorRef",
    "TensorSpec",
    "UnboundInputError",
    "UnknownTensorError",
    "__version__",
    "external_model",
    "step",
]
