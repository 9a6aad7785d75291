"""The forms a pipeline takes on Triton, each named once.

A **form** is one way to run a pipeline's steps on a server: an ensemble, a
BLS model with concurrent calls, a BLS model with sequential calls, one fused
Python model that runs the Python steps in its own process. The
compiler (targets), the local runtime (modes), the benchmark, the CLI, the
demo and the notebook all read this table, so a form has one name, one
model-name suffix and one scheduling rule everywhere.

Each layer keeps its own table of what it does per form, keyed by the form's name: the
compiler's :data:`pipelines.compile.COMPILERS`, the profile's boundaries each form pays
(:data:`pipelines.calibration.cost.FORM_COSTS`); a test checks that every form has its entry
in each. This module imports only the standard library and :mod:`pipelines.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from .errors import ArgumentError

__all__ = [
    "FORMS",
    "TARGETS",
    "Form",
    "FormLeftOutWarning",
    "TimeoutNotEnforcedWarning",
    "form",
    "form_names",
    "forms_of_target",
    "model_name",
]

#: How a form schedules the steps of one request (the local runtime and the BLS executor read it):
#: "event" starts each step when its inputs are ready, with no orchestrator (Triton's ensemble
#: scheduler); "concurrent" is one orchestrator awaiting independent steps together;
#: "sequential" is one orchestrator calling the steps one after another.
SCHEDULERS = ("event", "concurrent", "sequential")


class FormLeftOutWarning(UserWarning):
    """A form of several (``compile("all")``, a benchmark, a prediction) was left out, as it
    cannot express the pipeline: an ensemble cannot skip the steps of a ``when`` block."""


class TimeoutNotEnforcedWarning(UserWarning):
    """A step declares ``timeout=``, and a form it is compiled into cannot enforce it: Triton's
    ensemble has no per-step timeout, so a hung step there holds its request until the client
    gives up (the BLS and fused forms bound each call)."""


@dataclass(frozen=True)
class Form:
    """One form: its name, how its top-level model is named, how it runs."""

    name: str  # what users pass: p.compile(name), p.run(mode=name), --forms name
    suffix: str  # the top-level model's suffix when forms sit side by side ("both", "all")
    scheduler: str  # one of SCHEDULERS
    one_execute_per_instance: bool  # a Python model: each instance runs one execute() at a time
    server_copies: int  # copies a server makes of a tensor at each step boundary (process crossings; none in-process)
    summary: str  # one line for help texts
    # Python steps run inside the top-level model, in its process: no step model, no copy
    # between steps; external model steps are still called through BLS.
    in_process: bool = False

    def model_name(self, pipeline: str, *, side_by_side: bool) -> str:
        """The top-level model's name: the pipeline's own, or with this form's suffix."""
        return pipeline + self.suffix if side_by_side else pipeline


FORMS: MappingProxyType[str, Form] = MappingProxyType({
    f.name: f
    for f in (
        # Form(name, suffix, scheduler, one_execute_per_instance, server_copies, summary[, in_process])
        Form("ensemble", "_ensemble", "event", False, 1,
             "platform: ensemble; Triton's scheduler starts each step when its inputs are ready"),
        Form("bls", "_bls", "concurrent", True, 2,
             "a Python model; async def execute, independent steps concurrent with async_exec()"),
        Form("bls-sync", "_bls_sync", "sequential", True, 2,
             "a Python model calling the steps one after another with exec()"),
        # Two server copies: an external step's BLS call, as in "bls".
        Form("fused", "_fused", "concurrent", True, 2,
             "one Python model running the Python steps in-process, concurrently; external models through BLS",
             in_process=True),
    )
})

#: Compile targets: each form alone (the top-level model is named after the pipeline), or
#: several side by side over the same step models: "both" (the three forms of the first
#: release, kept for compatibility) and "all" (every form in the table).
TARGETS: MappingProxyType[str, tuple[str, ...]] = MappingProxyType({
    **{name: (name,) for name in FORMS},
    "both": ("ensemble", "bls", "bls-sync"),
    "all": tuple(FORMS),
})


def form_names() -> tuple[str, ...]:
    return tuple(FORMS)


def form(name: str, *, what: str = "form") -> Form:
    """The form called ``name``; an unknown name is an :class:`~pipelines.errors.ArgumentError` (a ``ValueError``) listing the valid ones."""
    found = FORMS.get(name) if isinstance(name, str) else None
    if found is None:
        hint = ""
        if isinstance(name, str) and name.replace("_", "-") in FORMS:
            hint = f" (did you mean {name.replace('_', '-')!r}?)"
        raise ArgumentError(f"unknown {what} {name!r}{hint}; choose one of {', '.join(FORMS)}")
    return found


def forms_of_target(target: str) -> tuple[Form, ...]:
    """The forms a compile target builds; an unknown target is an :class:`~pipelines.errors.ArgumentError` (a ``ValueError``) listing the valid ones."""
    names = TARGETS.get(target) if isinstance(target, str) else None
    if names is None:
        raise ArgumentError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return tuple(FORMS[n] for n in names)


def model_name(pipeline: str, form_name: str, *, side_by_side: bool = True) -> str:
    """The top-level model of ``form_name`` for ``pipeline`` (side by side: with its suffix)."""
    return form(form_name).model_name(pipeline, side_by_side=side_by_side)
