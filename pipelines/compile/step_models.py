"""Composing models: a Python step becomes a Python-backend model running the
generic adapter ``models/step_model.py``; an external step becomes a config for
its backend or platform with its model file in ``1/``.

The adapter finds the step from the repository itself, which travels one of three
ways, recorded as ``"source"`` in ``1/step.json``:

- ``"module"``: code in an installed distribution (or the standard library) is
  referenced by ``module:qualname``, and that distribution goes into the
  repository's ``requirements.txt``;
- ``"file"``: code in a ``.py`` file a server can import (a script, a file loaded
  by path) travels as that file, and the modules beside it that it imports, copied
  into ``1/steps_src/`` (:mod:`.step_sources`); no pickle, no Python-version pin;
- ``"pickle"``: anything else (a notebook, ``__main__`` typed interactively, a
  function in a local scope, ``pipelines``' own steps, a file a server could not
  import) is exported by value with cloudpickle into ``1/step.pkl``
  (:mod:`.step_pickle`), pinned to this Python, and a :class:`StepByValueWarning`
  says why (but not for ``pipelines``' own steps). ``step.json`` records the
  file's sha256 and the Python that wrote it, and the adapter refuses a file that
  does not match either.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
import warnings
from importlib import resources
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from .. import serving
from ..core.names import check_name
from ..core.plan import ModelPlan
from ..core.step import Step
from ..errors import CompileError
from .bound_plan import CompilePlan
from .configs import add_io, set_parameters
from .ensemble_wiring import ERR_OUTPUT
from .repository import CompiledModel, FileCopy
from .requirements import NUMPY_REQUIREMENT, ServerNeeds, distributions_of, is_installed_module, python_version
from .source_top_level import is_ours
from .step_pickle import STEP_PICKLE, PickledStep, _names_imported_by  # noqa: F401 - the last one for tests
from .step_sources import StepByValueWarning, source_files

__all__ = [
    "PLAN_FORMAT",
    "STEP_PICKLE",
    "STEP_PLAN",
    "StepByValueWarning",
    "compile_step_model",
    "model_files",
    "model_source",
    "step_files",
    "step_reference",
]

#: Version of the JSON plans the model files read; bumped on any incompatible change.
PLAN_FORMAT = 1
STEP_PLAN = "step.json"


def model_source(filename: str) -> bytes:
    """The bytes of one of the package's real ``model.py`` files."""
    return resources.files("pipelines.compile.models").joinpath(filename).read_bytes()


def model_files(filename: str) -> dict[str, bytes]:
    """A Python model's code: ``1/model.py`` and, beside it, the one package of ours it imports.

    With ``pipelines/serving/`` copied in as one folder (``1/serving/<module>.py``), the
    model needs only the standard library and numpy on the server, not the ``pipelines``
    package.
    """
    files = {"1/model.py": model_source(filename)}
    for module in sorted(resources.files("pipelines.serving").iterdir(), key=lambda entry: entry.name):
        if module.name.endswith(".py"):
            files[f"1/serving/{module.name}"] = module.read_bytes()
    return files


def plan_json(data: dict[str, Any]) -> bytes:
    """JSON that is byte-identical for the same plan on every run."""
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode()


def compile_step_model(plan: CompilePlan, model: ModelPlan, extras: Any = None) -> CompiledModel:
    """The composing model that serves ``model``'s step for the nodes in ``model.nodes``.

    ``extras`` (an ``ensemble.ModelExtras``) adds what the ensemble form needs: output
    copies and the tensors that carry failures.
    """
    step = plan.step_of(model)
    if step.is_external:
        return _external_model(plan, model, step)
    compiled = _python_model(plan, model, step, extras)
    if extras is not None:
        extras.add_to(compiled.config, step.outputs)
    if step.streaming:
        _stream(plan, model, step, compiled.config, extras)
    return compiled


def _stream(plan: CompilePlan, model: ModelPlan, step: Step, config: mc.ModelConfig, extras: Any) -> None:
    """A streaming step's model is decoupled and always carries its failures in ``__err__``
    (docs/compiled_repository.md, "Streaming steps")."""
    if ERR_OUTPUT in step.inputs or ERR_OUTPUT in step.outputs:
        raise CompileError(
            f"pipeline {plan.name!r}: streaming step {model.nodes[0]!r} has a tensor named {ERR_OUTPUT!r}; its "
            "model carries its failures in an output of that name, so rename it",
            pipeline=plan.name, step=model.nodes[0], tensor=ERR_OUTPUT,
        )
    config.model_transaction_policy.decoupled = True
    if extras is None or not extras.err_output:
        config.output.add(name=ERR_OUTPUT, data_type=mc.TYPE_UINT8, dims=[-1])


def _base_config(model: ModelPlan, step: Step) -> mc.ModelConfig:
    options = step.options
    config = mc.ModelConfig(name=model.name, max_batch_size=model.max_batch_size)
    add_io(config, step.inputs, step.outputs)
    config.instance_group.add(count=options.instance_count, kind=mc.ModelInstanceGroup.Kind.Value(options.config_instance_kind))
    db = options.dynamic_batching
    if db is not None and model.max_batch_size > 0:
        config.dynamic_batching.SetInParent()
        config.dynamic_batching.preferred_batch_size.extend(db.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = db.max_queue_delay_us
    return config


def _python_model(plan: CompilePlan, model: ModelPlan, step: Step, extras: Any = None) -> CompiledModel:
    config = _base_config(model, step)
    config.backend = "python"
    parameters = dict(step.options.parameters)
    if step.options.device == "gpu":
        # A GPU step takes its inputs where they are, through DLPack, instead of a copy to CPU.
        parameters["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
    set_parameters(config, parameters)

    files: dict[str, Any] = model_files("step_model.py")
    base = {
        "format": PLAN_FORMAT,
        "pipeline": plan.name,
        "model": model.name,
        "step": step.name,
        "nodes": list(model.nodes),
        "class": step.is_class,
        "inputs": {n: s.to_dict() for n, s in step.inputs.items()},
        "outputs": {n: s.to_dict() for n, s in step.outputs.items()},
        "max_batch_size": model.max_batch_size,
        "device": step.options.device,
        "parameters": dict(step.options.parameters),
        **({"array": step.options.array} if step.options.array else {}),  # written only when asked: the default adds nothing
        **({"file": _source_name(step)} if _source_name(step) else {}),  # errors name it: by-value code forgets it
    }
    if extras is not None:
        base["ensemble"] = extras.to_dict()
    if step.streaming:  # served decoupled; the timeout bounds the whole stream (0: none)
        base["stream"] = {"err_output": ERR_OUTPUT, "timeout_s": float(step.options.timeout or 0)}
    reference = step_reference(step)
    source, why = (None, None) if reference is not None else source_files(step)
    needs: Any
    if reference is not None:
        files[f"1/{STEP_PLAN}"] = plan_json({**base, "source": "module",
                                             "impl": {"module": reference[0], "qualname": reference[1]}})
        needs = ServerNeeds((NUMPY_REQUIREMENT, *distributions_of([reference[0]])))
    elif source is not None:
        files.update({f"1/{rel}": data for rel, data in source.files.items()})
        files[f"1/{STEP_PLAN}"] = plan_json({**base, "source": "file", "impl": source.impl()})
        needs = ServerNeeds(tuple(dict.fromkeys((NUMPY_REQUIREMENT, *distributions_of(source.imports, exact=False)))))
    else:
        if why is not None:
            warnings.warn(
                f"pipeline {plan.name!r} step {model.nodes[0]!r} ({step.name!r}) travels by value in {STEP_PICKLE}, "
                f"which loads only on Python {python_version()} (and needs cloudpickle), because {why}",
                StepByValueWarning,
                stacklevel=_caller_level(),
            )
        export = PickledStep(plan.name, model.nodes[0], step)
        files[f"1/{STEP_PICKLE}"] = export.data
        # The plan holds the file's digest, so it too is produced when the repository is written.
        files[f"1/{STEP_PLAN}"] = lambda: plan_json({**base, "source": "pickle", "impl": export.impl()})
        needs = export.needs
    return CompiledModel(model.name, config, files, pipeline=plan.name, needs=needs)


def step_files(compiled: CompiledModel) -> list[str]:
    """The files of a step model that hold the step itself (its plan, and its pickle or source
    files), relative to ``1/``: what the fused model carries of it."""
    return [rel[2:] for rel in compiled.files if rel.startswith("1/") and rel != "1/model.py"
            and not rel.startswith("1/serving/")]


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _source_name(step: Step) -> str | None:
    """The name of the file a step's code lives in, as errors show it (``serving.raised_at``)."""
    home = serving.code_home(step.impl) if step.impl is not None else None
    return None if home is None or home.startswith("<") else home.replace("\\", "/").rsplit("/", 1)[-1]


def _external_model(plan: CompilePlan, model: ModelPlan, step: Step) -> CompiledModel:
    ext = step.external
    config = _base_config(model, step)
    if ext.fixed_batch is not None:
        _fix_batch(config, plan, model, ext.fixed_batch)
    if ext.backend:
        config.backend = ext.backend
    if ext.platform:
        config.platform = ext.platform
    set_parameters(config, step.options.parameters)
    files: dict[str, Any] = {}
    if ext.model_filename is not None:
        filename = ext.model_filename
        # One plain path component, so the copy cannot land outside the model's version directory.
        check_name(filename, what=f"step {step.name!r} model_filename", pipeline=plan.name, step=model.nodes[0])
        config.default_model_filename = filename
        if ext.model_file is not None:
            files[f"1/{filename}"] = FileCopy(
                ext.model_file, what=f"pipeline {plan.name!r} step {model.nodes[0]!r} model file"
            )
    return CompiledModel(model.name, config, files)


def _fix_batch(config: mc.ModelConfig, plan: CompilePlan, model: ModelPlan, fixed: int) -> None:
    """A model exported with a fixed batch: ``max_batch_size: 0`` and the batch as its first dim.

    Triton lets a batching ensemble hold such a model when the shapes agree once
    the ensemble's batch dimension is added, which holds for requests of that batch.
    """
    if model.max_batch_size == 0:
        raise CompileError(
            f"pipeline {plan.name!r} step {model.nodes[0]!r}: the model takes a fixed batch of {fixed} as its "
            "first axis, so it belongs in a batching pipeline (max_batch_size > 0), where each tensor has "
            "that axis; or export it with a dynamic batch axis",
            pipeline=plan.name, step=model.nodes[0],
        )
    config.max_batch_size = 0
    config.ClearField("dynamic_batching")
    for tensor in (*config.input, *config.output):
        tensor.dims.insert(0, fixed)


# ------------------------------------------------------------------ finding the step


def _installed(module_name: str) -> bool:
    """Whether ``module_name`` (imported here) comes from the standard library or an installed distribution."""
    module = sys.modules.get(module_name)
    return module is not None and is_installed_module(module)


def step_reference(step: Step) -> tuple[str, str] | None:
    """``(module, qualname)`` when the server can import the step's code; ``None`` for by-value export."""
    impl = step.impl
    module_name = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    if not module_name or not qualname or module_name == "__main__" or "<locals>" in qualname:
        return None
    if not _installed(module_name) or _imports_pipelines(sys.modules[module_name]):
        return None
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        return None
    if obj is impl or (isinstance(obj, Step) and obj.impl is impl):
        return module_name, qualname
    return None


def _imports_pipelines(module: types.ModuleType) -> bool:
    """Whether importing ``module`` imports ``pipelines`` (a ``@step`` at module level does), which a server lacks."""
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if is_ours(name):
            return True
    return False
