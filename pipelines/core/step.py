"""``@step``: a function or a class with typed inputs and outputs, plus the
per-model options that become its ``config.pbtxt`` (batching, instances, device).

A step knows nothing of Triton or of the runtime; the compilers and the local
runtime read its declaration. ``external_model`` declares a step that is an
existing Triton model (ONNX Runtime, TensorRT, PyTorch…) with an optional
Python stand-in for the local runtime.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import serving
from ..blocking import run_blocking
from ..errors import PipelinesError, StepDeclarationError, StepError
from .names import check_name
from .step_options import (  # re-exported: a step's options are declared with it
    DynamicBatching,
    ExternalModel,
    ModelOptions,
    ParameterValue,
)
from .tensor import TensorSpec

__all__ = [
    "DynamicBatching",
    "ExternalModel",
    "ModelOptions",
    "Step",
    "StepInstance",
    "external_model",
    "instance_config",
    "step",
]

@dataclass(frozen=True, eq=False)
class Step:
    """A declared step: typed inputs and outputs, an implementation, model options.

    Steps compare by identity; the same step may be added to a pipeline many
    times under different node names.
    """

    name: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    impl: Any = None
    options: ModelOptions = field(default_factory=ModelOptions)
    external: ExternalModel | None = None
    # Streams (docs/running_locally.md, "Streaming steps"): None detects a generator function.
    streaming: bool | None = None
    whole_stream: bool = False

    def __post_init__(self) -> None:
        check_name(self.name, what="step")
        object.__setattr__(self, "inputs", _spec_map(self.inputs, self.name, "inputs"))
        object.__setattr__(self, "outputs", _spec_map(self.outputs, self.name, "outputs"))
        if not self.outputs:
            raise StepDeclarationError(f"step {self.name!r} declares no outputs; a step must produce at least one")
        if self.impl is not None and not callable(self.impl):
            raise StepDeclarationError(f"step {self.name!r}: implementation {self.impl!r} is not callable")
        if self.impl is None and self.external is None:
            raise StepDeclarationError(f"step {self.name!r} has neither an implementation nor an external model")
        object.__setattr__(self, "streaming", _streaming(self))

    @property
    def fn(self) -> Any:
        """The function (or class) the step was declared from, as written: plain Python to
        unit-test (``double.fn(x=arr)`` returns what the function returns). ``double(x=arr)``
        calls it as a runtime does instead (a class initialised and finalised, a tuple or a lone
        array read as the dict of outputs); a pipeline's ``run`` also checks each output's dtype
        and dims. An external model's ``fn`` is its stand-in (``None`` without one); ``impl``
        is the same object.
        """
        return self.impl

    @property
    def is_class(self) -> bool:
        return inspect.isclass(self.impl)

    @property
    def is_external(self) -> bool:
        return self.external is not None

    @property
    def runnable(self) -> bool:
        """Whether the local runtime can run it (external models need a stand-in)."""
        return self.impl is not None

    def with_options(self, **options: Any) -> Step:
        """A copy of this step with some model options changed."""
        return replace(self, options=replace(self.options, **options))

    def instantiate(self, config: Mapping[str, Any] | None = None) -> StepInstance:
        """Create one instance, running ``initialize(config)`` for class steps.

        Without a config, the step gets :func:`instance_config` of itself.
        """
        return StepInstance(self, dict(config) if config is not None else instance_config(self))

    def __call__(self, **inputs: Any) -> Any:
        """Run the step once, as plain Python (a class step is initialised and finalised).

        A streaming step answers the list of its responses."""
        instance = self.instantiate()
        try:
            if self.streaming:
                return [normalise_outputs(self, r) for r in _responses(instance.function(**inputs))]
            return instance.execute(inputs)
        finally:
            instance.finalize()

    def __repr__(self) -> str:
        ins = ", ".join(f"{k}: {v}" for k, v in self.inputs.items())
        outs = ", ".join(f"{k}: {v}" for k, v in self.outputs.items())
        return f"<Step {self.name!r} ({ins}) -> ({outs})>"


def _responses(stream: Any) -> list[Any]:
    """A streaming step's responses, from a generator or an async one, as a list."""
    if not inspect.isasyncgen(stream):
        return list(stream)

    async def collect() -> list[Any]:
        return [r async for r in stream]

    return run_blocking(collect)


def _streaming(step: Step) -> bool:
    """Whether ``step`` answers a call with many responses: declared so, or a generator function.

    A generator step yields dicts of outputs; a step declared ``whole_stream`` reads a stream
    whole (each input a stream feeds arrives as an iterator), and only a sync function can.
    """
    fn = step.impl
    if inspect.isclass(fn):
        fn = getattr(fn, "execute", None) or fn.__call__
    generator = fn is not None and (inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn))
    if step.streaming is False and generator:
        raise StepDeclarationError(
            f"step {step.name!r} is a generator function but is declared streaming=False; a generator "
            "answers with each yield, so drop streaming=False (or return one dict instead of yielding)",
            step=step.name,
        )
    streaming = bool(step.streaming) or generator
    if streaming or step.whole_stream:
        if step.options.dynamic_batching is not None:
            raise StepDeclarationError(
                f"step {step.name!r} streams (or reads a stream whole) and declares dynamic batching; a "
                "stream belongs to one request, so drop dynamic_batching from this step",
                step=step.name,
            )
        if step.is_external:
            raise StepDeclarationError(
                f"external model {step.name!r}: streaming is declared on Python steps only for now",
                step=step.name,
            )
    if step.whole_stream and fn is not None and (
        serving.is_coroutine_callable(fn) or inspect.isasyncgenfunction(fn)
    ):
        raise StepDeclarationError(
            f"step {step.name!r} is declared whole_stream=True and is async; a step that reads a stream "
            "whole iterates it with a plain for loop, so make it a plain function or generator",
            step=step.name,
        )
    return streaming


def _spec_map(specs: Any, step_name: str, what: str) -> Mapping[str, TensorSpec]:
    if not isinstance(specs, Mapping):
        raise StepDeclarationError(
            f"step {step_name!r}: {what} must be a dict of name -> TensorSpec; got {type(specs).__name__}"
        )
    out = {}
    for name, spec in specs.items():
        check_name(name, what=f"step {step_name!r} {what[:-1]}", tensor=True, step=step_name)
        if isinstance(spec, tuple) and len(spec) == 2:
            spec = TensorSpec(*spec)
        if not isinstance(spec, TensorSpec):
            raise StepDeclarationError(
                f"step {step_name!r} {what[:-1]} {name!r}: expected a TensorSpec such as "
                f"TensorSpec('FP32', [4]); got {spec!r}"
            )
        out[name] = spec
    return MappingProxyType(out)


def instance_config(
    step: Step,
    *,
    pipeline: str | None = None,
    node: str | None = None,
    model_name: str | None = None,
    instance_index: int = 0,
    device: str = "cpu",
    max_batch_size: int | None = None,
    parameters: Mapping[str, ParameterValue] | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dict a class step's ``initialize(config)`` receives, in every runtime.

    See :func:`pipelines.serving.instance_config`, which the step adapter on a
    server calls too, so a step reads the same keys everywhere.
    """
    return serving.instance_config(
        step=step.name,
        inputs=step.inputs,
        outputs=step.outputs,
        parameters=step.options.parameters if parameters is None else parameters,
        max_batch_size=step.options.max_batch_size if max_batch_size is None else max_batch_size,
        pipeline=pipeline,
        node=node,
        model_name=model_name,
        instance_index=instance_index,
        device=device,
        model_config=model_config,
    )


def _step_failure(step: Step) -> Callable[[str, str | None], StepError]:
    """Turns what :mod:`pipelines.serving` refuses into a :class:`StepError` naming the step."""

    def fail(message: str, tensor: str | None) -> StepError:
        return StepError(f"step {step.name!r} {message}", step=step.name, tensor=tensor)

    return fail


class StepInstance(serving.StepInstance):
    """One live instance of a step: initialised once, executed many times, finalised once."""

    def __init__(self, step: Step, config: dict[str, Any]) -> None:
        self.step = step
        if step.impl is None:
            raise StepError(
                f"step {step.name!r} is an external model with no Python stand-in; "
                "give external_model(..., stand_in=fn) to run it outside Triton",
                step=step.name,
            )

        def fail(message: str, tensor: str | None) -> PipelinesError:
            if message.startswith("class "):  # a class without execute() is a declaration problem
                return StepDeclarationError(f"step {step.name!r}: {message}", step=step.name)
            return _step_failure(step)(message, tensor)

        super().__init__(step.name, step.impl, list(step.outputs), config, fail, array=step.options.array)

    def execute(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Call the step with its inputs as keyword arguments; return a dict of outputs."""
        chunks = self._fixed_batch_chunks(inputs)
        if chunks is not None:
            return _joined([super(StepInstance, self).execute(c) for c in chunks[0]], chunks[1])
        return super().execute(inputs)

    async def execute_async(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Await an ``async def`` step with its inputs as keyword arguments; return a dict of outputs."""
        chunks = self._fixed_batch_chunks(inputs)
        if chunks is not None:
            return _joined([await super(StepInstance, self).execute_async(c) for c in chunks[0]], chunks[1])
        return await super().execute_async(inputs)

    def _fixed_batch_chunks(self, inputs: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int] | None:
        """A batch cut into the fixed batch of an external model, the last chunk padded; None if none is needed.

        A model exported with a fixed batch runs exactly that many rows, so a larger
        (or smaller) batch is fed to it ``fixed_batch`` rows at a time.
        """
        fixed = self.step.external.fixed_batch if self.step.external is not None else None
        if fixed is None or not inputs:
            return None
        ranks = {n: getattr(v, "ndim", None) for n, v in inputs.items()}
        if any(r != self.step.inputs[n].rank + 1 for n, r in ranks.items() if n in self.step.inputs):
            return None  # not a batch: a single sample, as Step.__call__ may be given
        rows = int(next(iter(inputs.values())).shape[0])
        if rows == fixed:
            return None
        chunks = []
        for start in range(0, rows, fixed):
            chunk = {}
            for n, v in inputs.items():
                part = v[start : start + fixed]
                if part.shape[0] < fixed:  # pad with copies of the last row; their outputs are dropped
                    pad = part[-1:].repeat(fixed - part.shape[0], axis=0)
                    part = _concatenate([part, pad])
                chunk[n] = part
            chunks.append(chunk)
        return chunks, rows


def _concatenate(arrays: list[Any]) -> Any:
    # numpy's concatenate dispatches to CuPy for CuPy arrays (NEP 18), so both work here.
    return np.concatenate(arrays, axis=0)


def _joined(parts: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    return {name: _concatenate([p[name] for p in parts])[:rows] for name in parts[0]}


def normalise_outputs(step: Step, result: Any) -> dict[str, Any]:
    """Accept a dict, a tuple in declaration order, or a lone array for a one-output step."""
    return serving.normalise_outputs(list(step.outputs), result, _step_failure(step))


def check_outputs(step: Step, outputs: Mapping[str, Any], *, batched: bool, batch_size: int | None) -> None:
    """Raise :class:`StepError` if an output breaks the step's declared dtype or dims."""
    serving.check_outputs(step.outputs, outputs, batched=batched, batch_size=batch_size, fail=_step_failure(step))


def step(
    impl: Any = None,
    *,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
    name: str | None = None,
    max_batch_size: int | None = None,
    instance_count: int = 1,
    instance_kind: str = "auto",
    dynamic_batching: DynamicBatching | bool | Mapping[str, Any] | None = None,
    device: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    array: str | None = None,
    share_model: bool | None = None,
    streaming: bool | None = None,
    whole_stream: bool = False,
) -> Any:
    """Declare a step from a function or a class.

    A function gets its inputs as keyword arguments and returns a dict of its
    outputs. A class may define ``initialize(config)``, ``execute(**inputs)``
    (or ``__call__``) and ``finalize()``, the lifecycle of Triton's Python
    backend. Options left as ``None`` follow the pipeline.

    Usable as ``@step(inputs=..., outputs=...)`` or ``step(fn, inputs=..., outputs=...)``.

    A generator function (or ``async`` generator, or a class whose ``execute`` is one) is a
    **streaming step**: each ``yield`` is one response, a dict of outputs checked like a
    return value, and the steps it feeds run once per response. ``streaming=True`` declares
    one whose function returns an iterator of such dicts. ``whole_stream=True``: the step
    runs once per request and each input a stream feeds arrives as an iterator over that
    stream's responses (a detokenizer that keeps state per request); as a generator it
    streams again, as a plain function it answers once after the stream ends.
    """
    options = ModelOptions(
        max_batch_size=max_batch_size,
        instance_count=instance_count,
        instance_kind=instance_kind,
        # ModelOptions takes True or a dict too and keeps a DynamicBatching (its __post_init__).
        dynamic_batching=dynamic_batching,  # type: ignore[arg-type]
        device=device,
        parameters=parameters or {},
        timeout=timeout,
        array=array,
        share_model=share_model,
    )

    def wrap(obj: Any) -> Step:
        if isinstance(obj, Step):
            raise StepDeclarationError(f"{obj!r} is already a step; use step.with_options(...) to change it")
        if not callable(obj):
            raise StepDeclarationError(f"@step needs a function or a class; got {obj!r}")
        step_name = name or getattr(obj, "__name__", None) or ""
        if name is None and not step_name.isidentifier():
            raise StepDeclarationError(
                f"@step cannot take a name from {obj!r}; give it a name: step(fn, name='my_step', ...)"
            )
        return Step(
            name=step_name,
            inputs=inputs,
            outputs=outputs,
            impl=obj,
            options=options,
            streaming=streaming,
            whole_stream=whole_stream,
        )

    return wrap(impl) if impl is not None else wrap


def external_model(
    name: str,
    *,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
    backend: str | None = None,
    platform: str | None = None,
    model_file: str | os.PathLike[str] | None = None,
    model_filename: str | None = None,
    stand_in: Callable[..., Any] | None = None,
    fixed_batch: int | None = None,
    **options: Any,
) -> Step:
    """Declare a step that is an existing Triton model (e.g. ``backend="onnxruntime"``).

    Compiled, it becomes a model with that backend or platform and ``model_file``
    copied into ``1/``. ``stand_in``, a function or class with the step's
    signature, is what the local runtime runs in its place. ``fixed_batch``: the
    model takes exactly this many rows per run (see :class:`ExternalModel`).
    """
    if isinstance(stand_in, Step):
        stand_in = stand_in.impl
    if model_file is not None and not os.path.exists(model_file):
        raise StepDeclarationError(
            f"external model {name!r}: model file {os.fspath(model_file)!r} does not exist", step=name
        )
    return Step(
        name=name,
        inputs=inputs,
        outputs=outputs,
        impl=stand_in,
        options=ModelOptions(**options),
        external=ExternalModel(
            backend=backend,
            platform=platform,
            model_file=None if model_file is None else os.fspath(model_file),
            model_filename=model_filename,
            fixed_batch=fixed_batch,
        ),
    )
