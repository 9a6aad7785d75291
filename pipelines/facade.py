"""The ``Pipeline`` facade: ``p.compile``, ``p.run``, ``p.stream``, ``p.predict`` and ``p.advise``.

They reach up from the core into ``compile``, ``runtime`` and ``predict``, lazily inside
each method, so that a user need not know the layers; nothing in the core calls them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compile.repository import ModelRepository
    from .graph import Pipeline

__all__ = ["PipelineFacade"]


class PipelineFacade:
    """What a :class:`~pipelines.graph.Pipeline` can be turned into; each validates it first."""

    def compile(self: Pipeline, target: str = "both", **options: Any) -> ModelRepository:
        """Compile to an in-memory Triton model repository: ``"ensemble"``, ``"bls"``, ``"bls-sync"`` or ``"both"``.

        ``options`` go to :func:`pipelines.compile.compile_pipeline` (e.g. ``bls_instance_count``).
        """
        self.validate()
        from .compile import compile_pipeline

        return compile_pipeline(self, target, **options)

    def run(
        self: Pipeline,
        inputs: Mapping[str, Any],
        *,
        mode: str = "ensemble",
        outputs: Iterable[str] | None = None,
        **options: Any,
    ) -> Any:
        """Run once in the local runtime (blocking; works inside Jupyter's running loop too).

        ``outputs``: answer only these, running only the steps they need (as tritonclient asks).
        A streaming pipeline (:attr:`~pipelines.graph.Pipeline.streaming`) answers the list of
        its responses, as :meth:`stream` yields them.
        """
        self.validate()
        if self.streaming:
            return list(self.stream(inputs, mode=mode, outputs=outputs, **options))
        from .runtime.local import run_pipeline

        return run_pipeline(self, inputs, mode=mode, outputs=outputs, **options)

    def stream(
        self: Pipeline,
        inputs: Mapping[str, Any],
        *,
        mode: str = "ensemble",
        outputs: Iterable[str] | None = None,
        **options: Any,
    ) -> Iterator[dict[str, Any]]:
        """Run once in the local runtime and yield each response as it comes: a dict of output
        arrays. A pipeline that does not stream yields its one answer. An error mid-stream is
        raised after the responses before it; stopping early (``break``, ``close()``) stops the
        pipeline's generators. ``mode`` and ``options`` as for :meth:`run`."""
        self.validate()
        from .runtime.local import stream_pipeline

        return stream_pipeline(self, inputs, mode=mode, outputs=outputs, **options)

    def predict(
        self: Pipeline,
        profile: Any,
        concurrency: Iterable[int] | int | None = (1, 4, 16),
        forms: Iterable[str] | None = None,
        **options: Any,
    ) -> Any:
        """Predict each form's latency and throughput on the server ``profile`` measured
        (``pipelines calibrate``), by simulation: a :class:`~pipelines.predict.Prediction`
        table. ``options`` go to :func:`pipelines.predict.predict` (``rate``, ``inputs``,
        ``costs``, ``cores``, ``allow_mismatch``...)."""
        self.validate()
        from .predict import predict

        return predict(self, profile, concurrency, forms, **options)

    def advise(self: Pipeline, profile: Any, **options: Any) -> Any:
        """Search forms, instance counts and batching for the fastest configuration on the
        server ``profile`` measured: an :class:`~pipelines.predict.Advice`, best first.
        ``options`` go to :func:`pipelines.predict.advise` (``concurrency``, ``rate``,
        ``p95_ms``, ``cores``...)."""
        self.validate()
        from .predict import advise

        return advise(self, profile, **options)
