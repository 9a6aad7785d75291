"""Any ONNX file as a step: :func:`onnx_model` declares it as an external Triton model (backend
``onnxruntime``) whose local stand-in runs the file through onnxruntime, with the same code
(``serving.OnnxSession``) as the bundled server's stand-in for that backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .. import serving
from ..core.step import Step, external_model
from ..core.tensor import TensorSpec
from ..errors import StepDeclarationError, StepError
from .onnx_file import check_onnx_declared

__all__ = ["OnnxRuntimeStandIn", "onnx_model"]


class OnnxRuntimeStandIn:
    """The local stand-in of an :func:`onnx_model` step: an onnxruntime session on its file.

    :func:`onnx_model` subclasses it with the file set. The tensors it checks the file
    against are the step's, from ``initialize``'s config (as a server's model reads its
    own). A model with a fixed batch gets exactly that many rows: the local runtime cuts a
    batch into them (see :class:`~pipelines.core.step.ExternalModel`).
    """

    model_file: str = ""
    step_name: str = "onnx"
    fixed_batch: int | None = None
    providers: tuple[str, ...] | None = None

    @classmethod
    def check_file(cls, inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec], *,
                   max_batch_size: int) -> None:
        """Check the file against the step's tensors once its model's ``max_batch_size`` is known
        (a compiler asks): a file without a free batch axis cannot serve a batching model."""
        check_onnx_declared(cls.step_name, cls.model_file, inputs, outputs, fixed_batch=cls.fixed_batch,
                            max_batch_size=max_batch_size)

    def initialize(self, config: Mapping[str, Any]) -> None:
        what = f"step {self.step_name!r}"
        try:
            inputs, outputs = serving.config_specs(config.get("model_config") or {}, what)
            if self.fixed_batch is not None:  # its rows come cut to the batch: as the compiled config says
                inputs = {n: serving.Spec(s.dtype, (self.fixed_batch, *s.dims)) for n, s in inputs.items()}
                outputs = {n: serving.Spec(s.dtype, (self.fixed_batch, *s.dims)) for n, s in outputs.items()}
                max_batch_size: int | None = 0
            else:  # None: a step called on its own, outside a pipeline that says whether it batches
                given = config.get("max_batch_size")
                max_batch_size = None if given is None else int(given)
            self.session = serving.OnnxSession(
                self.model_file, inputs, outputs, max_batch_size=max_batch_size, providers=self.providers, what=what
            )
        except serving.OnnxFileError as exc:
            raise StepError(str(exc), step=self.step_name) from None

    def execute(self, **inputs: Any) -> dict[str, Any]:
        return self.session.run(inputs)

    def finalize(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()


def onnx_model(
    name: str,
    model_file: str | os.PathLike[str],
    *,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
    fixed_batch: int | None = None,
    providers: Sequence[str] | None = None,
    **options: Any,
) -> Step:
    """An ONNX file as a step: ``external_model(name, backend="onnxruntime", model_file=...)``
    whose stand-in runs the file through onnxruntime (``pip install 'pipelines[onnx]'``).

    ``inputs`` and ``outputs`` are the file's tensors, named as in the file (Triton's
    onnxruntime backend maps them by name), without the batch axis when the pipeline batches.
    They are checked against the file here, when the step is made (names, element types and
    static dims, read with ``onnx``; see :func:`~pipelines.steps.onnx_file.check_onnx_declared`),
    and again by the stand-in when it is initialised. ``fixed_batch``: the
    file's batch axis is that fixed size (see :func:`~pipelines.external_model`).
    ``providers``: onnxruntime's execution providers for the local run (default: the CPU's).
    ``options`` are the step's model options. Compiled, it is the same ``onnxruntime`` model
    as ``external_model`` writes; on the bundled server, which lacks that backend, a Python
    stand-in runs it (docs/declaring.md).
    """
    path = os.path.abspath(os.fspath(model_file))
    if not os.path.isfile(path):
        raise StepDeclarationError(f"step {name!r}: ONNX model file {path!r} does not exist", step=name)
    check_onnx_declared(name, path, inputs, outputs, fixed_batch=fixed_batch,
                        max_batch_size=options.get("max_batch_size"))
    stand_in = type(
        f"OnnxRuntimeStandIn_{name}",
        (OnnxRuntimeStandIn,),
        {
            "model_file": path,
            "step_name": name,
            "fixed_batch": fixed_batch,
            "providers": tuple(providers) if providers else None,
        },
    )
    return external_model(
        name, inputs=inputs, outputs=outputs, backend="onnxruntime", model_file=path, stand_in=stand_in,
        fixed_batch=fixed_batch, **options,
    )
