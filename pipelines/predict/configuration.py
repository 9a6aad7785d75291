"""One configuration of a pipeline on a server: its form, and the model options of each of its
step models and of its top-level model. :mod:`pipelines.predict.advise` searches over them;
:func:`configured` turns one back into a pipeline that compiles to exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

import networkx as nx

from ..core.graph import Graph
from ..core.planning import plan_of
from ..core.step import DynamicBatching
from ..errors import ArgumentError
from ..forms import form as form_named

__all__ = ["Configuration", "ModelChoice", "configured", "default_configuration"]

_G = TypeVar("_G", bound=Graph)  # configured() gives back a copy of the class it is given


@dataclass(frozen=True)
class ModelChoice:
    """The options of one step model: what ``@step(...)`` sets in its ``config.pbtxt``."""

    instance_count: int = 1
    max_batch_size: int = 0
    dynamic_batching: bool = False
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()

    def arguments(self) -> str:
        """The ``@step(...)`` / ``.with_options(...)`` arguments that set these options."""
        parts = [f"instance_count={self.instance_count}", f"max_batch_size={self.max_batch_size}"]
        if self.dynamic_batching:
            inner = [f"max_queue_delay_us={self.max_queue_delay_us}"]
            if self.preferred_batch_sizes:
                inner.insert(0, f"preferred_batch_sizes={self.preferred_batch_sizes!r}")
            parts.append(f"dynamic_batching=DynamicBatching({', '.join(inner)})")
        else:
            parts.append("dynamic_batching=None")
        return ", ".join(parts)


@dataclass(frozen=True)
class Configuration:
    """A form and the options of every step model (by the model's name in the execution plan,
    ``<pipeline>__<step>``), plus the instance count of the BLS or fused model."""

    form: str
    models: Mapping[str, ModelChoice] = field(default_factory=dict)
    top_instances: int = 1

    def __post_init__(self) -> None:
        form_named(self.form)
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def compile_arguments(self) -> str:
        """The ``p.compile(...)`` call that builds this configuration's form."""
        if self.form == "fused":
            return f'p.compile("fused", fused_instance_count={self.top_instances})'
        if self.form in ("bls", "bls-sync"):
            return f'p.compile("{self.form}", bls_instance_count={self.top_instances})'
        return 'p.compile("ensemble")'

    def compile_options(self) -> dict[str, int]:
        if self.form == "fused":
            return {"fused_instance_count": self.top_instances}
        if self.form in ("bls", "bls-sync"):
            return {"bls_instance_count": self.top_instances}
        return {}

    def changes(self, default: Configuration) -> list[str]:
        """What to set, as code, where this configuration differs from ``default``."""
        lines = []
        for name, choice in self.models.items():
            if default.models.get(name) != choice:
                lines.append(f"{name.split('__', 1)[-1]}: .with_options({choice.arguments()})")
        lines.append(self.compile_arguments())
        return lines

    def label(self, default: Configuration | None = None) -> str:
        """One short line: the form, the top instances, and each changed model's options."""
        bits = [self.form]
        if self.form != "ensemble" and self.top_instances != 1:
            bits.append(f"x{self.top_instances}")
        for name, choice in self.models.items():
            if default is not None and default.models.get(name) == choice:
                continue
            short = name.split("__", 1)[-1]
            text = f"{short}:i{choice.instance_count}"
            if choice.dynamic_batching:
                text += f",b{choice.max_batch_size}@{choice.max_queue_delay_us}us"
            bits.append(text)
        return " ".join(bits)


def _options_of(step: Any, node_max_batch: int) -> ModelChoice:
    options = step.options
    db = options.dynamic_batching
    return ModelChoice(
        instance_count=int(options.instance_count),
        max_batch_size=int(node_max_batch),
        dynamic_batching=db is not None,
        max_queue_delay_us=int(db.max_queue_delay_us) if db is not None else 0,
        preferred_batch_sizes=tuple(db.preferred_batch_sizes) if db is not None else (),
    )


def default_configuration(pipeline: Graph, form: str, *, top_instances: int = 1) -> Configuration:
    """The configuration ``pipeline`` compiles to as declared, in ``form``."""
    plan = plan_of(pipeline, warn=False)
    models = {}
    for model in plan.models:
        node = pipeline.nodes[model.nodes[0]]
        models[model.name] = _options_of(node.step, node.max_batch_size)
    return Configuration(form, models, top_instances)


def configured(pipeline: _G, configuration: Configuration, *, name: str | None = None) -> _G:
    """A copy of ``pipeline`` (named ``name``, default its own) whose steps carry
    ``configuration``'s model options.

    Nodes that share one model keep sharing one (changed) step, so they still compile to one
    model; a node with a model of its own gets a changed step of its own. A step's
    ``max_batch_size`` above the pipeline's is refused: Triton's ensemble cannot hand a step
    more rows than the request has.
    """
    plan = plan_of(pipeline, warn=False)
    model_of = {node: model.name for model in plan.models for node in model.nodes}
    copy = type(pipeline)(name or pipeline.name, inputs=dict(pipeline.inputs), max_batch_size=pipeline.max_batch_size)
    changed: dict[str, Any] = {}  # model -> its changed step
    position = {name: i for i, name in enumerate(pipeline.nodes)}
    for name in nx.lexicographical_topological_sort(pipeline.graph, key=position.__getitem__):
        node = pipeline.nodes[name]
        step = node.step
        choice = configuration.models.get(model_of.get(name, ""))
        if choice is not None and choice != _options_of(step, node.max_batch_size):
            if choice.max_batch_size > pipeline.max_batch_size:
                raise ArgumentError(
                    f"pipeline {pipeline.name!r} step {name!r}: max_batch_size {choice.max_batch_size} is above the "
                    f"pipeline's {pipeline.max_batch_size}; a step batches at most the pipeline's rows"
                )
            if model_of[name] not in changed:
                db = (DynamicBatching(choice.preferred_batch_sizes, choice.max_queue_delay_us)
                      if choice.dynamic_batching else None)
                changed[model_of[name]] = step.with_options(
                    instance_count=choice.instance_count, max_batch_size=choice.max_batch_size, dynamic_batching=db
                )
            step = changed[model_of[name]]
        bindings = {}
        for input_name, ref in node.bindings.items():
            bindings[input_name] = copy.input(ref.name) if ref.is_input else copy.nodes[ref.node][ref.name]
        copy.add(step, name=name, **bindings)
    for out_name, ref in pipeline.outputs.items():
        copy.output(out_name, copy.nodes[ref.node][ref.name])
    return copy
