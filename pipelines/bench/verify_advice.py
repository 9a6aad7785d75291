"""``advise --verify``: compile configurations side by side and measure them on a real server.

Each configuration becomes a copy of the pipeline named ``<pipeline>_v<i>`` (so their step
models do not collide), all written into one model repository and served by one server
(the bundled one, or the one at ``url`` that already serves such a repository), then
measured one after another with the benchmark's load generator at the advice's concurrency.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..compile import compile_pipeline
from ..core.graph import Graph
from ..errors import ArgumentError
from ..forms import model_name
from ..predict.configuration import Configuration, configured
from ..tables import format_table

__all__ = ["Verified", "measure_configurations", "verified_table"]


@dataclass(frozen=True)
class Verified:
    """One configuration, predicted and measured."""

    label: str
    configuration: Configuration
    predicted_throughput: float
    predicted_p95_ms: float
    measured_throughput: float
    measured_p50_ms: float
    measured_p95_ms: float
    errors: int

    @property
    def throughput_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_throughput - self.measured_throughput) / self.measured_throughput \
            if self.measured_throughput else float("inf")


def measure_configurations(
    pipeline: Graph,
    entries: Sequence[tuple[str, Configuration, float, float]],
    samples: Sequence[Mapping[str, Any]],
    *,
    concurrency: int,
    url: str | None = None,
    protocol: str = "http",
    duration: float = 3.0,
    warmup: float = 1.0,
    repository: str | None = None,
    note: Callable[[str], None] | None = None,
) -> list[Verified]:
    """Measure each ``(label, configuration, predicted infer/s, predicted p95 ms)`` on a server.

    Without ``url`` the bundled server is started on a repository holding every configuration
    (``repository``, or a temporary directory). With ``url`` the server there must already
    serve the models that ``--write`` or this function wrote (``<pipeline>_v<i>``).
    """
    import anyio

    from ..compile.repository import write_models
    from .loadgen import LoadPlan, run_load

    if concurrency < 1:
        raise ArgumentError(f"concurrency is an int >= 1; got {concurrency!r}")
    say = note or (lambda _text: None)
    copies = []
    for i, (label, configuration, tput, p95) in enumerate(entries):
        name = f"{pipeline.name}_v{i}"
        copy = configured(pipeline, configuration, name=name)
        copies.append((label, configuration, tput, p95, copy))
    with ExitStack() as stack:
        target = Path(repository) if repository else None
        if target is None and url is None:
            target = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipelines-verify-"))) / "repo"
        if target is not None:
            for _, configuration, _, _, copy in copies:
                write_models(compile_pipeline(copy.validate(), configuration.form, **configuration.compile_options()), target,
                             overwrite_hint=None)
            say(f"wrote {len(copies)} configurations to {target}: " + ", ".join(c[4].name for c in copies))
        if url is None:
            from ..triton import TritonServer

            say(f"starting the bundled Triton server on {target} ({len(copies)} configurations)")
            server = stack.enter_context(TritonServer(target, restart_on_crash=False))

            def connect():
                return server.async_client(protocol)
        else:
            from ..triton import AsyncTritonClient

            def connect():
                return AsyncTritonClient(url, protocol)

        async def main() -> list[Verified]:
            out = []
            async with connect() as client:
                for label, configuration, tput, p95, copy in copies:
                    model = model_name(copy.name, configuration.form, side_by_side=False)
                    say(f"measuring {label} ({model}) at concurrency {concurrency}")
                    plan = LoadPlan(concurrency=concurrency, duration=duration, warmup=warmup)

                    async def infer(inputs, model=model):
                        return await client.infer(model, inputs)

                    load = await run_load(infer, list(samples), plan, label=label)
                    window = load.measured
                    lat = window.latencies * 1e3
                    out.append(Verified(
                        label, configuration, tput, p95, window.throughput,
                        float(np.percentile(lat, 50)) if lat.size else float("nan"),
                        float(np.percentile(lat, 95)) if lat.size else float("nan"),
                        window.errors,
                    ))
            return out

        return anyio.run(main)


def verified_table(rows: Sequence[Verified]) -> str:
    headers = ["configuration", "predicted infer/s", "measured infer/s", "error", "predicted p95", "measured p95"]
    body = [[r.label, f"{r.predicted_throughput:.1f}", f"{r.measured_throughput:.1f}",
             f"{r.throughput_error:+.0%}", f"{r.predicted_p95_ms:.2f}", f"{r.measured_p95_ms:.2f}"] for r in rows]
    return format_table(headers, body)
