"""``Pipeline``: the graph a user declares, with what it turns into: ``p.compile``, ``p.run``,
``p.stream``, ``p.predict``, ``p.advise`` and its drawings.

It sits at the top of the package, above the layers it calls (compile, runtime, and the prediction:
the pipeline measured, then simulated, :mod:`pipelines.measured_prediction`), as
Merlin's ``Ensemble`` sits over its runtime-free ``Graph``: the declaration and its checks are the
core's (:class:`pipelines.core.graph.Graph`), which knows nothing of what a graph compiles to.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .compile import ModelRepository, compile_pipeline
from .core.graph import Graph
from .drawing.diagram import Diagram, diagram
from .drawing.diagram_text import to_dot, to_mermaid
from .measured_prediction import advise as advise_pipeline
from .measured_prediction import predict as predict_pipeline
from .predict import Advice, Prediction
from .runtime.local import run_pipeline, stream_pipeline

if TYPE_CHECKING:
    from .calibration import Profile

__all__ = ["Pipeline"]


class Pipeline(Graph):
    """A typed DAG of steps with named inputs and outputs, and what it can be turned into.

    ``max_batch_size > 0`` means every tensor has a leading batch dimension that
    the dims leave out, as in Triton's configs. Each of ``compile``, ``run``, ``stream``,
    ``predict`` and ``advise`` validates the pipeline first.
    """

    def compile(self, target: str = "both", **options: Any) -> ModelRepository:
        """Compile to an in-memory Triton model repository: ``"ensemble"``, ``"bls"``, ``"bls-sync"`` or ``"both"``.

        ``options`` go to :func:`pipelines.compile.compile_pipeline` (e.g. ``bls_instance_count``).
        """
        self.validate()
        return compile_pipeline(self, target, **options)

    # A streaming pipeline answers a list of responses and any other a dict of outputs, which
    # only the pipeline's steps tell apart, not its type: hence Any.
    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        mode: str = "ensemble",
        outputs: Iterable[str] | None = None,
        **options: Any,
    ) -> Any:
        """Run once in the local runtime (blocking; works inside Jupyter's running loop too).

        ``outputs``: answer only these, running only the steps they need (as tritonclient asks).
        A streaming pipeline (:attr:`~pipelines.core.graph.Graph.streaming`) answers the list of
        its responses, as :meth:`stream` yields them.
        """
        self.validate()
        if self.streaming:
            return list(self.stream(inputs, mode=mode, outputs=outputs, **options))
        return run_pipeline(self, inputs, mode=mode, outputs=outputs, **options)

    def stream(
        self,
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
        return stream_pipeline(self, inputs, mode=mode, outputs=outputs, **options)

    def predict(
        self,
        profile: Profile | str | os.PathLike[str],
        concurrency: Sequence[int] | int | None = (1, 4, 16),
        forms: Iterable[str] | None = None,
        **options: Any,
    ) -> Prediction:
        """Predict each form's latency and throughput on the server ``profile`` measured
        (``pipelines calibrate``; a :class:`~pipelines.calibration.Profile` or the path of its
        JSON file), by simulation: a :class:`~pipelines.predict.Prediction` table. ``options``
        go to :func:`pipelines.measured_prediction.predict` (``rate``, ``inputs``, ``costs``, ``cores``,
        ``allow_mismatch``...)."""
        self.validate()
        return predict_pipeline(self, profile, concurrency, forms, **options)

    def advise(self, profile: Profile | str | os.PathLike[str], **options: Any) -> Advice:
        """Search forms, instance counts and batching for the fastest configuration on the
        server ``profile`` measured (as for :meth:`predict`): an :class:`~pipelines.predict.Advice`,
        best first. ``options`` go to :func:`pipelines.measured_prediction.advise` (``concurrency``, ``rate``,
        ``p95_ms``, ``cores``...)."""
        self.validate()
        return advise_pipeline(self, profile, **options)

    # ------------------------------------------------------------------- drawing

    def to_mermaid(self) -> str:
        """The graph as a Mermaid flowchart (renders in GitHub and Jupyter)."""
        return to_mermaid(self)

    def to_dot(self) -> str:
        """The graph in Graphviz DOT."""
        return to_dot(self)

    def diagram(self) -> Diagram:
        """The pipeline drawn: stages left to right, each edge labelled with name, dtype and shape.

        ``.to_svg()`` needs nothing; ``.to_png(path)`` needs matplotlib. Jupyter shows a
        pipeline this way by itself (``_repr_mimebundle_``).
        """
        return diagram(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle = self.diagram()._repr_mimebundle_(include, exclude)
        bundle["text/plain"] = repr(self)
        return bundle
