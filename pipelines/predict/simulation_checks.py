"""What a simulation needs of its :class:`~pipelines.predict.spec.SimSpec` and load: the forms, and the checks that
refuse what the simulation could not run, or would run to no end.
"""

from __future__ import annotations

from .. import forms
from ..calibration.cost import FORM_COSTS
from ..errors import ArgumentError, PipelinesError
from .spec import Load, SimSpec, StepSpec

__all__ = ["FORMS", "check"]

#: The forms a :class:`SimSpec` may take.
FORMS = tuple(forms.FORMS)


def check(spec: SimSpec, load: Load) -> None:
    """Refuses what the simulation could not run, or would run to no end."""
    if spec.form not in FORMS:
        raise ArgumentError(f"no form {spec.form!r} to simulate; the forms are {', '.join(FORMS)}")
    if not spec.cores >= 1:
        raise PipelinesError(f"a server has at least one core; got cores={spec.cores!r}")
    if spec.rows < 1:
        raise PipelinesError(f"a request has at least one row; got rows={spec.rows!r}")
    if spec.top_instances < 1 or spec.top_max_batch_size < 0 or spec.call_threads < 0 or spec.step_threads < 0 \
            or not spec.round_request_us >= 0:
        raise PipelinesError(f"the {spec.form} model needs top_instances >= 1, top_max_batch_size >= 0, "
                             f"call_threads >= 0, step_threads >= 0 (0: no limit) and round_request_us is µs >= 0; "
                             f"got {spec.top_instances}, {spec.top_max_batch_size}, {spec.call_threads}, "
                             f"{spec.step_threads} and {spec.round_request_us!r}")
    if load.requests < 1 or load.warmup < 0:
        raise PipelinesError(f"a load measures at least one request after warmup >= 0 more; "
                             f"got requests={load.requests}, warmup={load.warmup}")
    seen: set[str] = set()
    models: dict[str, StepSpec] = {}
    for step in spec.steps:
        _check_step(step, seen)
        seen.add(step.name)
        first = models.setdefault(step.model_name, step)
        if _model_options(first) != _model_options(step):
            raise PipelinesError(f"steps {first.name!r} and {step.name!r} share model {step.model_name!r} but not its "
                                 f"options ({_model_options(first)} against {_model_options(step)}); one model has one "
                                 "configuration", step=step.name)
    _check_when(spec)
    _check_costs(spec)


def _model_options(step: StepSpec) -> tuple[object, ...]:
    """What the steps of one model must agree on: its options."""
    return (step.external, step.instances, step.max_batch_size, step.dynamic_batching,
            tuple(step.preferred_batch_sizes), step.max_queue_delay_us)


def _check_step(step: StepSpec, earlier: set[str]) -> None:
    def refuse(what: str) -> PipelinesError:
        return PipelinesError(f"step {step.name!r}: {what}", step=step.name)

    if step.name in earlier:
        raise refuse("two steps have this name; each step of a SimSpec is named once")
    if later := [d for d in step.deps if d not in earlier]:
        raise refuse(f"it takes from {later}, which are not among the steps before it; list SimSpec.steps "
                     "in a topological order")
    if step.instances < 1:
        raise refuse(f"instances is {step.instances}; a model has at least one instance")
    if step.max_batch_size < 0 or step.max_queue_delay_us < 0:
        raise refuse("max_batch_size and max_queue_delay_us are >= 0")
    if step.dynamic_batching and step.max_batch_size == 0:
        raise refuse("dynamic batching needs max_batch_size > 0; Triton refuses the configuration")
    if bad := [p for p in step.preferred_batch_sizes if not 1 <= p <= step.max_batch_size]:
        raise refuse(f"preferred batch sizes {bad} are outside 1..max_batch_size ({step.max_batch_size})")
    if not 0.0 <= step.gil_share <= 1.0:
        raise refuse(f"gil_share is a share of its CPU time, 0..1; got {step.gil_share}")
    if not 0.0 <= step.memory <= 1.0:
        raise refuse(f"memory is a share of its time, 0..1; got {step.memory}")
    if step.traffic is not None and not 0.0 <= step.traffic <= 1.0:
        raise refuse(f"traffic is how much it slows a copy beside it, 0..1 (None: its memory); got {step.traffic}")


def _check_when(spec: SimSpec) -> None:
    if spec.form == "ensemble" and any(s.when for s in spec.steps):
        raise PipelinesError("an ensemble cannot skip a step: a SimSpec whose steps have `when` blocks "
                             "simulates the bls, bls-sync or fused form")
    for name, share in spec.when_rates.items():
        if not 0.0 <= share <= 1.0:
            raise PipelinesError(f"when_rates[{name!r}] is the share of rows where it holds, 0..1; got {share!r}")
    if unknown := sorted({c for s in spec.steps for c in s.when} - set(spec.when_rates)):
        raise PipelinesError(f"steps run under {unknown}, which when_rates does not give a share for; "
                             "give each condition the share of rows where it holds")


def _check_costs(spec: SimSpec) -> None:
    form, fused = FORM_COSTS[spec.form], spec.form == "fused"
    python = any(not s.external for s in spec.steps)
    if spec.form == "ensemble":  # a gate's hand-offs are a step's, and its model runs in a stub
        pays = {form.own_cost: True, form.call_cost: True, form.stub_cost: python or spec.gate,
                "ensemble_gate": spec.gate}
    else:  # the fused model runs its Python steps in its process, and calls only the external ones
        pays = {form.own_cost: True, form.call_cost: any(not fused or s.external for s in spec.steps),
                form.stub_cost: python and not fused, form.in_process_step_cost: python and fused}
    if missing := [name for name, paid in {"request": True, **pays}.items() if paid and name not in spec.costs]:
        raise PipelinesError(
            f"the {spec.form} form pays {', '.join(missing)}, which the costs lack (they have "
            f"{', '.join(sorted(spec.costs)) or 'none'}); build the SimSpec from a full server profile")
