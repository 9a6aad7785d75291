"""Running a step here as its Triton model runs it, for timing it; what its code raises is a
:class:`~pipelines.errors.StepError` naming the pipeline and the step."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from .. import serving
from ..core.step import Step, check_outputs, instance_config
from ..errors import PipelinesError, StepError

__all__ = ["StepRunner", "blame", "host", "rows_of"]


class StepRunner:
    """One instance of a step, as its Triton model holds it: ``initialize(config)`` once, then
    one ``execute`` a batch, outputs as arrays, on the step's device. ``name`` is the node's,
    ``model`` its model's; ``batched``: whether the pipeline batches (its outputs have rows)."""

    def __init__(self, pipeline: str, name: str, step: Step, *, model: str, max_batch_size: int, batched: bool,
                 instance_index: int = 0) -> None:
        self.pipeline, self.name, self.step = pipeline, name, step
        self.model, self.max_batch_size, self.batched = model, max_batch_size, batched
        self.gpu = step.options.device == "gpu"
        config = instance_config(step, pipeline=pipeline, node=name, model_name=model, instance_index=instance_index,
                                 device="gpu" if self.gpu else "cpu", max_batch_size=max_batch_size)
        with blame(pipeline, name, " (in initialize())"):
            self.instance = step.instantiate(config)
        self._loops: list[asyncio.AbstractEventLoop] = []

    def twin(self) -> StepRunner:
        """A second instance, as a second instance of its model holds it (a class step's state is its own)."""
        return StepRunner(self.pipeline, self.name, self.step, model=self.model, max_batch_size=self.max_batch_size,
                          batched=self.batched, instance_index=1)

    def placed(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """The arrays where the step's model receives them: on the GPU for a GPU step, else in host
        memory; read-only, as every form hands them."""
        if self.gpu:
            import cupy

            return {n: cupy.asarray(v) for n, v in arrays.items()}
        return {n: serving.read_only(host(v)) for n, v in arrays.items()}

    def caller(self, inputs: Mapping[str, Any]) -> Callable[[], Any]:
        """One execution on ``inputs``, as a call for the thread that makes it (an async step gets
        an event loop of its own; a GPU step's kernels are waited for: their time is its time)."""
        instance = self.instance
        if instance.is_async:
            loop = asyncio.new_event_loop()
            self._loops.append(loop)

            def run() -> Any:
                return loop.run_until_complete(instance.execute_async(inputs))
        else:
            run = functools.partial(instance.execute, inputs)
        if not self.gpu:
            return lambda: serving.as_arrays(run())
        import cupy

        def on_gpu() -> Any:
            outputs = serving.as_arrays(run())
            cupy.cuda.Device().synchronize()
            return outputs

        return on_gpu

    def call(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """One execution, its outputs checked against the step's declaration."""
        outputs = self.caller(inputs)()
        rows = int(next(iter(inputs.values())).shape[0]) if self.batched and inputs else None
        check_outputs(self.step, outputs, batched=self.batched, batch_size=rows)
        return outputs

    def finalize(self, *, quiet: bool = False) -> None:
        """``finalize()`` the instance; ``quiet``: say nothing of its error (another is on its way)."""
        while self._loops:
            self._loops.pop().close()
        try:
            with blame(self.pipeline, self.name, " (in finalize())"):
                self.instance.finalize()
        except StepError:
            if not quiet:
                raise


@contextmanager
def blame(pipeline: str, name: str, what: str = "") -> Iterator[None]:
    """What step ``name``'s own code raises here becomes a StepError naming the pipeline and the step."""
    try:
        yield
    except Exception as exc:
        ours = isinstance(exc, PipelinesError)
        if ours and exc.pipeline == pipeline and exc.step == name:
            raise
        reason = exc.message if ours else serving.exception_reason(exc)
        raise StepError(f"pipeline {pipeline!r} step {name!r} failed while being profiled{what}: {reason}",
                        pipeline=pipeline, step=name, node=name, tensor=exc.tensor if ours else None) from exc


def rows_of(arrays: Mapping[str, Any], rows: int, have: int) -> dict[str, Any]:
    """A batch of ``rows`` rows made by repeating the ``have`` rows of each array."""
    index = np.arange(rows) % have
    return {n: np.take(host(v), index, axis=0) for n, v in arrays.items()}


def host(value: Any) -> Any:
    """``value`` in host memory (a CuPy array copied out of the GPU)."""
    if hasattr(value, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(value)
    return value
