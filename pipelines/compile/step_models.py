"""Composing models: a Python step becomes a Python-backend model running the
generic adapter ``models/step_model.py``; an external step becomes a config for
its backend or platform with its model file in ``1/``.

The adapter finds the step from the repository itself. A step whose code lives
in an installed distribution (or the standard library) is referenced by
``module:qualname`` in ``1/step.json``, and that distribution goes into the
repository's ``requirements.txt``. Anything else (a script's ``__main__``, a
notebook, a test file, a module beside the script even if it is named like a
standard-library one, a function in a local scope, and ``pipelines``' own
steps, since a server need not have ``pipelines``) is exported by value with
cloudpickle into ``1/step.pkl``, so the repository serves after that source is
gone. ``step.json`` then records the file's sha256 and the Python that wrote it,
and the adapter refuses a file that does not match either.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import pickletools
import sys
import types
from dataclasses import dataclass
from importlib import resources
from typing import Any

import cloudpickle
from tritonclient.grpc import model_config_pb2 as mc

from .. import serving
from ..errors import CompileError
from ..names import check_name
from ..step import Step
from .bound_plan import BoundModel, CompilePlan
from .configs import add_io, set_parameters
from .repository import CompiledModel, FileCopy
from .requirements import (
    NUMPY_REQUIREMENT,
    ServerNeeds,
    cloudpickle_requirement,
    distributions_of,
    is_installed_module,
    python_version,
)

__all__ = ["PLAN_FORMAT", "STEP_PICKLE", "STEP_PLAN", "compile_step_model", "model_files", "model_source", "step_reference"]

#: Version of the JSON plans the model files read; bumped on any incompatible change.
PLAN_FORMAT = 1
STEP_PLAN = "step.json"
STEP_PICKLE = "step.pkl"


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


def compile_step_model(plan: CompilePlan, model: BoundModel, extras: Any = None) -> CompiledModel:
    """The composing model that serves ``model.step`` for the nodes in ``model.nodes``.

    ``extras`` (an ``ensemble.ModelExtras``) adds what the ensemble form needs: output
    copies and the tensors that carry failures.
    """
    if model.step.is_external:
        return _external_model(plan, model)
    compiled = _python_model(plan, model, extras)
    if extras is not None:
        extras.add_to(compiled.config, model.step.outputs)
    return compiled


def _base_config(model: BoundModel) -> mc.ModelConfig:
    step, options = model.step, model.step.options
    config = mc.ModelConfig(name=model.name, max_batch_size=model.max_batch_size)
    add_io(config, step.inputs, step.outputs)
    config.instance_group.add(count=options.instance_count, kind=mc.ModelInstanceGroup.Kind.Value(options.config_instance_kind))
    db = options.dynamic_batching
    if db is not None and model.max_batch_size > 0:
        config.dynamic_batching.SetInParent()
        config.dynamic_batching.preferred_batch_size.extend(db.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = db.max_queue_delay_us
    return config


def _python_model(plan: CompilePlan, model: BoundModel, extras: Any = None) -> CompiledModel:
    step = model.step
    config = _base_config(model)
    config.backend = "python"
    parameters = dict(step.options.parameters)
    if step.options.device == "gpu":
        # A GPU step takes its inputs where they are, through DLPack, instead of a copy to CPU.
        parameters["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
    set_parameters(config, parameters)

    files: dict[str, Any] = model_files("step_model.py")
    reference = step_reference(step)
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
    if reference is None:
        export = _Export(plan.name, model.nodes[0], step)
        files[f"1/{STEP_PICKLE}"] = export.data
        # The plan holds the file's digest, so it too is produced when the repository is written.
        files[f"1/{STEP_PLAN}"] = lambda: plan_json({**base, "impl": export.impl()})
        needs: Any = export.needs
    else:
        files[f"1/{STEP_PLAN}"] = plan_json({**base, "impl": {"module": reference[0], "qualname": reference[1]}})
        needs = ServerNeeds((NUMPY_REQUIREMENT, *distributions_of([reference[0]])))
    return CompiledModel(model.name, config, files, pipeline=plan.name, needs=needs)


def _source_name(step: Step) -> str | None:
    """The name of the file a step's code lives in, as errors show it (``serving.raised_at``)."""
    home = serving.code_home(step.impl) if step.impl is not None else None
    return None if home is None or home.startswith("<") else home.replace("\\", "/").rsplit("/", 1)[-1]


def _external_model(plan: CompilePlan, model: BoundModel) -> CompiledModel:
    ext = model.step.external
    config = _base_config(model)
    if ext.fixed_batch is not None:
        _fix_batch(config, plan, model)
    if ext.backend:
        config.backend = ext.backend
    if ext.platform:
        config.platform = ext.platform
    set_parameters(config, model.step.options.parameters)
    files: dict[str, Any] = {}
    if ext.model_filename is not None:
        filename = ext.model_filename
        # One plain path component, so the copy cannot land outside the model's version directory.
        check_name(filename, what=f"step {model.step.name!r} model_filename", pipeline=plan.name, step=model.nodes[0])
        config.default_model_filename = filename
        if ext.model_file is not None:
            files[f"1/{filename}"] = FileCopy(
                ext.model_file, what=f"pipeline {plan.name!r} step {model.nodes[0]!r} model file"
            )
    return CompiledModel(model.name, config, files)


def _fix_batch(config: mc.ModelConfig, plan: CompilePlan, model: BoundModel) -> None:
    """A model exported with a fixed batch: ``max_batch_size: 0`` and the batch as its first dim.

    Triton lets a batching ensemble hold such a model when the shapes agree once
    the ensemble's batch dimension is added, which holds for requests of that batch.
    """
    fixed = model.step.external.fixed_batch
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


def _is_ours(name: object) -> bool:
    return isinstance(name, str) and (name == "pipelines" or name.startswith("pipelines."))


def _imports_pipelines(module: types.ModuleType) -> bool:
    """Whether importing ``module`` imports ``pipelines`` (a ``@step`` at module level does), which a server lacks."""
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if _is_ours(name):
            return True
    return False


@dataclass
class _Export:
    """A step exported by value, once: the bytes, their digest, and the modules it refers to by name."""

    pipeline: str
    node: str
    step: Step

    @functools.cached_property
    def _result(self) -> tuple[bytes, frozenset[str]]:
        return _export_by_value(self.pipeline, self.node, self.step)

    def data(self) -> bytes:
        return self._result[0]

    def impl(self) -> dict[str, str]:
        return {"pickle": STEP_PICKLE, "sha256": hashlib.sha256(self.data()).hexdigest(), "python": python_version()}

    def needs(self) -> ServerNeeds:
        requirements = (NUMPY_REQUIREMENT, cloudpickle_requirement(), *distributions_of(self._result[1], exact=False))
        return ServerNeeds(tuple(dict.fromkeys(requirements)), python=python_version())


class _RecordingPickler(cloudpickle.Pickler):
    """A cloudpickle pickler that notes the module of everything it pickles, to list what the server must import.

    It also sends ``functools.lru_cache`` functions of by-value modules by value: cloudpickle
    would refer to them by name (they are not plain functions), which a server cannot import.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        else:
            module = getattr(obj, "__module__", None) if isinstance(obj, (type, types.FunctionType,
                                                                          types.BuiltinFunctionType)) else None
            self.modules.add(module if isinstance(module, str) else type(obj).__module__)
        if isinstance(obj, functools._lru_cache_wrapper) and _travels_by_value(getattr(obj, "__module__", None)):
            params = obj.cache_parameters()
            # Rebuilt on the server as lru_cache(maxsize, typed)(the function, by value).
            return functools.lru_cache(maxsize=params["maxsize"], typed=params["typed"]), (obj.__wrapped__,)
        return super().reducer_override(obj)


def _travels_by_value(module_name: object) -> bool:
    if not isinstance(module_name, str):
        return False
    if module_name == "__main__":
        return True
    registered = cloudpickle.list_registry_pickle_by_value()
    return any(module_name == r or module_name.startswith(r + ".") for r in registered)


def _names_imported_by(data: bytes) -> set[str]:
    """The modules a pickle imports by name when loaded (its GLOBAL and STACK_GLOBAL opcodes)."""
    memo: dict[int, Any] = {}
    pushed: list[Any] = []
    modules = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(int(arg)))
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif op.name == "STACK_GLOBAL":
            module = pushed[-2] if len(pushed) >= 2 else None
            if isinstance(module, str):
                modules.add(module)
            pushed.append(None)
        elif op.name in ("GLOBAL", "INST"):
            modules.add(str(arg).partition(" ")[0])
            pushed.append(None)
        else:
            pushed.append(None)
    return modules


def _unimportable(module_name: str) -> bool:
    """Whether a server could not import ``module_name``: ours, a script, or a module that is not installed."""
    if _is_ours(module_name) or module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    return module is not None and not is_installed_module(module)


def _export_by_value(pipeline: str, node: str, step: Step) -> tuple[bytes, frozenset[str]]:
    impl = step.impl
    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    # By value: our own package (a server need not have it), and the step's module. A module
    # that is not installed goes with its whole top-level package, so the helpers the step
    # calls in sibling modules travel with it; an installed one that imports ``pipelines``
    # goes alone, its package being in the requirements.
    chosen = [sys.modules["pipelines"]]
    if module is not None and module.__name__ != "__main__":
        top = sys.modules.get(module.__name__.partition(".")[0], module)
        chosen.append(module if is_installed_module(module) else top)
    registered = [m for m in dict.fromkeys(chosen) if m.__name__ not in cloudpickle.list_registry_pickle_by_value()]
    for m in registered:
        cloudpickle.register_pickle_by_value(m)
    try:
        buffer = io.BytesIO()
        pickler = _RecordingPickler(buffer)
        pickler.dump(impl)
        data = buffer.getvalue()
        by_name = sorted(m for m in _names_imported_by(data) if _unimportable(m))
    except Exception as exc:
        raise CompileError(
            f"pipeline {pipeline!r}: step {node!r} ({step.name!r}) cannot be exported by value with "
            f"cloudpickle: {type(exc).__name__}: {exc}; move it into an installed module, or drop the "
            "unpicklable objects it refers to (create them in initialize() instead)",
            pipeline=pipeline, step=node,
        ) from exc
    finally:
        for m in registered:
            cloudpickle.unregister_pickle_by_value(m)
    if by_name:
        raise CompileError(
            f"pipeline {pipeline!r}: step {node!r} ({step.name!r}) refers by name to something in "
            f"{', '.join(map(repr, by_name))}, which a server cannot import, and cloudpickle cannot send it "
            "by value; refer to it from a plain function or class, or move it into an installed package",
            pipeline=pipeline, step=node,
        )
    return data, frozenset(pickler.modules)
