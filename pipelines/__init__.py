"""pipelines: declare Triton pipeline steps once, as a typed DAG; compile them to an
ensemble and to BLS, run them locally, and measure one against the other."""

from __future__ import annotations

from . import errors
from .errors import *  # noqa: F403 - every error class, named once: in errors.__all__
from .forms import FormLeftOutWarning, TimeoutNotEnforcedWarning
from .graph import Condition, Node, Pipeline, TensorRef
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
    "predict": ("pipelines.predict", "predict"),
    "advise": ("pipelines.predict", "advise"),
    "Prediction": ("pipelines.predict", "Prediction"),
    "Advice": ("pipelines.predict", "Advice"),
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
    "Advice",  # noqa: F405 - imported on first use (_LAZY)
    "Condition",
    "DATATYPES",
    "DynamicBatching",
    "ExternalModel",
    "FormLeftOutWarning",
    "LocalRuntime",  # noqa: F405 - imported on first use (_LAZY)
    "ModelOptions",
    "ModelRepository",  # noqa: F405 - imported on first use (_LAZY)
    "Node",
    "Pipeline",
    "Prediction",  # noqa: F405 - imported on first use (_LAZY)
    "Step",
    "TensorRef",
    "TensorSpec",
    "TimeoutNotEnforcedWarning",
    "__version__",
    "advise",  # noqa: F405 - imported on first use (_LAZY)
    "compare",  # noqa: F405 - imported on first use (_LAZY)
    "compile_pipeline",  # noqa: F405 - imported on first use (_LAZY)
    "external_model",
    "predict",  # noqa: F405 - imported on first use (_LAZY)
    "step",
]
# The errors: the same names, read from the module that defines them (pyright follows this form).
__all__ += errors.__all__
