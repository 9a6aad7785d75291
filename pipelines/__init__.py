"""pipelines: declare Triton pipeline steps once, as a typed DAG; compile them to an
ensemble and to BLS, run them locally, and measure one against the other."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from . import errors
from .core.graph import Condition, Node, TensorRef
from .core.step import DynamicBatching, ExternalModel, ModelOptions, Step, external_model, step
from .core.tensor import DATATYPES, TensorSpec
from .errors import *  # noqa: F403 - every error class, named once: in errors.__all__
from .forms import FormLeftOutWarning, TimeoutNotEnforcedWarning

__version__ = "0.1.0"

if TYPE_CHECKING:  # what a type checker reads for the names imported on first use (_LAZY)
    from .compile import ModelRepository, compile_pipeline
    from .measured_prediction import advise, predict
    from .pipeline import Pipeline
    from .predict.advise import Advice
    from .predict.prediction_rows import Prediction
    from .runtime import LocalRuntime, compare

# Imported on first use: the step models on a Triton server import this package,
# and need neither the compiler (protobuf, tritonclient) nor the runtime. Pipeline
# is among them: it sits above the compiler, the runtime and the prediction it calls.
_LAZY = {
    "Pipeline": ("pipelines.pipeline", "Pipeline"),
    "compile_pipeline": ("pipelines.compile", "compile_pipeline"),
    "ModelRepository": ("pipelines.compile", "ModelRepository"),
    "LocalRuntime": ("pipelines.runtime", "LocalRuntime"),
    "compare": ("pipelines.runtime", "compare"),
    "predict": ("pipelines.measured_prediction", "predict"),
    "advise": ("pipelines.measured_prediction", "advise"),
    "Prediction": ("pipelines.predict", "Prediction"),
    "Advice": ("pipelines.predict", "Advice"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        # Importing a package binds its name here, so pipelines.predict, the package (which
        # Pipeline imports), would hide predict, the function exported by that name (which
        # lives elsewhere: pipelines.measured_prediction, imported here where it is not yet).
        for other, (loaded, exported) in _LAZY.items():
            if isinstance(globals().get(other), types.ModuleType):
                globals()[other] = getattr(importlib.import_module(loaded), exported)
        return value
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")

__all__ = [
    "Advice",
    "Condition",
    "DATATYPES",
    "DynamicBatching",
    "ExternalModel",
    "FormLeftOutWarning",
    "LocalRuntime",
    "ModelOptions",
    "ModelRepository",
    "Node",
    "Pipeline",
    "Prediction",
    "Step",
    "TensorRef",
    "TensorSpec",
    "TimeoutNotEnforcedWarning",
    "__version__",
    "advise",
    "compare",
    "compile_pipeline",
    "external_model",
    "predict",
    "step",
]
# The errors: the same names, read from the module that defines them (pyright follows this form).
__all__ += errors.__all__
