"""Sample requests for a pipeline, as a benchmark sends them and a prediction profiles its
steps on: the module's own ``sample_inputs(batch)`` when it has one, else its
``make_sample(seed=...)`` images (the yolov5 example), else random tensors built from the
pipeline's input specs.

A few different samples are sent round-robin, so no step can answer from a cache of
one input; variable dims (-1) take ``size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ..core.graph import Graph
from ..core.tensor import TensorSpec
from ..errors import PipelinesError

__all__ = ["random_request", "sample_requests"]


def _random_tensor(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = spec.numpy_dtype
    if spec.dtype == "BYTES":
        return np.array([b"sample %d" % i for i in range(int(np.prod(shape)))], dtype=object).reshape(shape)
    if spec.dtype == "BOOL":
        return rng.random(shape) < 0.5
    if dtype.kind == "u":
        return rng.integers(0, min(256, np.iinfo(dtype).max), size=shape).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-100, 100, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def random_request(pipeline: Graph, *, batch: int = 1, size: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """One request of random data shaped by the pipeline's inputs (batch dim first when it batches)."""
    rng = np.random.default_rng(seed)
    lead = (batch,) if pipeline.batched else ()
    return {
        name: _random_tensor(spec, lead + tuple(size if d == -1 else d for d in spec.dims), rng)
        for name, spec in pipeline.inputs.items()
    }


def _as_list(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, Sequence) and value and all(isinstance(v, Mapping) for v in value):
        return [dict(v) for v in value]
    raise PipelinesError(
        f"{where} must be a dict of input name -> array, or a non-empty list of such dicts; "
        f"got {type(value).__name__}"
    )


def sample_requests(
    pipeline: Graph,
    *,
    module: ModuleType | None = None,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    batch: int = 1,
    size: int = 16,
    count: int = 4,
) -> list[dict[str, Any]]:
    """The benchmark's requests: ``inputs`` if given, else ``module.sample_inputs(batch)``, else random."""
    if batch < 1:
        raise PipelinesError(f"pipeline {pipeline.name!r}: --batch must be >= 1; got {batch}")
    if not pipeline.batched and batch != 1:
        raise PipelinesError(
            f"pipeline {pipeline.name!r} does not batch (max_batch_size 0), so --batch {batch} cannot be sent; "
            "use --batch 1",
            pipeline=pipeline.name,
        )
    if pipeline.batched and batch > pipeline.max_batch_size:
        raise PipelinesError(
            f"pipeline {pipeline.name!r}: --batch {batch} exceeds its max_batch_size {pipeline.max_batch_size}; "
            f"use --batch {pipeline.max_batch_size} or less",
            pipeline=pipeline.name,
        )
    if inputs is not None:
        return _as_list(inputs, "inputs")
    maker = getattr(module, "sample_inputs", None) if module is not None else None
    if callable(maker):
        takes_batch = _takes_batch(maker, f"{module.__name__}.sample_inputs")
        made = maker(batch) if takes_batch else maker()
        return _as_list(made, f"{module.__name__}.sample_inputs({batch if takes_batch else ''})")
    images = getattr(module, "make_sample", None) if module is not None else None
    if callable(images) and len(pipeline.inputs) == 1:
        return [_image_request(pipeline, images(seed=i), batch) for i in range(count)]
    return [random_request(pipeline, batch=batch, size=size, seed=i) for i in range(count)]


def _takes_batch(maker: Any, name: str) -> bool:
    """Whether a module's ``sample_inputs`` takes the batch size: ``sample_inputs(batch)`` or ``sample_inputs()``."""
    import inspect

    try:
        signature = inspect.signature(maker)
    except (TypeError, ValueError):  # a builtin or C callable: called as documented
        return True
    for args in ((1,), ()):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return bool(args)
    raise PipelinesError(f"{name}{signature} cannot be called: define it as sample_inputs(batch) (the rows a request "
                         "holds) or sample_inputs(), returning one request (a dict of arrays) or a list of them")


def _image_request(pipeline: Graph, sample: Mapping[str, Any], batch: int) -> dict[str, Any]:
    # An example's make_sample(seed) gives one HWC image (and its true boxes); a batch repeats it,
    # since the images of one batch must share a size.
    (name,) = pipeline.inputs
    image = np.asarray(sample["image"])
    stacked = np.repeat(image[None], batch, axis=0) if pipeline.batched else image
    return {name: np.ascontiguousarray(stacked)}
