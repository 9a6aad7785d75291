"""The local runtime's options, checked as it is built: a wrong one is an error that names the
pipeline, what was given and what to give instead, before any step model starts.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.graph import Graph
from ..core.plan import ExecutionPlan
from ..errors import ArgumentError, InferenceError, StepError
from ..forms import Form, form
from .device import gpu_available, resolve_device
from .step_process import ISOLATIONS, isolation_supported

#: When a sync step may hop to a worker thread (see :mod:`pipelines.runtime.local_runtime`).
OFFLOADS = ("auto", "always", "never")
#: What an old ``profile=`` argument is told: the runtime executes, and prediction is a simulation.
NO_REPLAY = (
    "the local runtime no longer replays server profiles; predict the server with "
    "p.predict(profile, concurrency=...) or `pipelines predict MODULE:ATTR --profile FILE`"
)


def checked_options(
    name: str, *, mode: str, profile: Any, offload: str, isolation: str | None, device: str | None
) -> tuple[Form, str, str | None]:
    """The form of ``mode``, the isolation (``None`` is ``"thread"``) and the device it resolves to."""
    if profile is not None:
        raise ArgumentError(f"pipeline {name!r}: profile= was given, but {NO_REPLAY}", pipeline=name)
    try:
        chosen = form(mode, what="mode")
    except ValueError as exc:
        raise InferenceError(f"pipeline {name!r}: {exc}", pipeline=name) from None
    if offload not in OFFLOADS:
        raise InferenceError(
            f"pipeline {name!r}: offload must be one of {', '.join(OFFLOADS)}; got {offload!r}", pipeline=name
        )
    isolation = "thread" if isolation is None else isolation
    if isolation == "auto":
        raise InferenceError(
            f"pipeline {name!r}: isolation='auto' is gone (it moved a busy step into processes to predict "
            "a server, and the runtime no longer predicts); choose isolation='thread' or 'process'",
            pipeline=name,
        )
    if isolation not in ISOLATIONS:
        raise InferenceError(
            f"pipeline {name!r}: isolation must be one of {', '.join(ISOLATIONS)}; got {isolation!r}",
            pipeline=name,
        )
    if isolation == "process" and not isolation_supported():
        raise InferenceError(
            f"pipeline {name!r}: isolation='process' forks a process per step instance and shares memory "
            f"with it through memfd, which needs Linux; this is {sys.platform}. Use isolation='thread'",
            pipeline=name,
        )
    try:
        return chosen, isolation, resolve_device(device)
    except ValueError as exc:
        raise InferenceError(f"pipeline {name!r}: {exc}", pipeline=name) from None


def check_steps(pipeline: Graph, plan: ExecutionPlan, device: str | None) -> None:
    """Every live step can run here: an external model has a stand-in, a GPU is there where asked."""
    name = pipeline.name
    for node in (pipeline.nodes[n] for n in plan.order):
        if not node.step.runnable:
            raise StepError(
                f"pipeline {name!r} step {node.name!r} is an external model with no Python stand-in; "
                "give external_model(..., stand_in=fn) to run it in the local runtime, or run it on Triton",
                pipeline=name,
                step=node.name,
            )
        wants = node.step.options.device
        if (wants == "gpu" or device == "gpu") and not gpu_available():
            who = f"step {node.name!r} asks" if wants == "gpu" else "the runtime was asked"
            raise InferenceError(
                f"pipeline {name!r}: {who} for device 'gpu' but CuPy with a CUDA device is not available; "
                "install cupy-cuda12x on a machine with a GPU, or use device 'cpu'",
                pipeline=name,
                step=node.name if wants == "gpu" else None,
            )


def check_instance_counts(name: str, **counts: Any) -> None:
    """``bls_instance_count`` and ``fused_instance_count`` are ints >= 1."""
    for option, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InferenceError(f"pipeline {name!r}: {option} must be an int >= 1; got {count!r}", pipeline=name)
