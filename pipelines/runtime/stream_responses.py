"""A streaming step's responses in the local runtime: its generator (or async generator) on an
instance it holds to the end, pulled one response at a time, each checked as a return value is,
within the step's timeout; ``close()`` runs the generator's ``finally`` blocks and gives the
instance back. :mod:`pipelines.runtime.streams` walks them through the steps after the stream.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import anyio

from .. import serving
from ..core.step import check_outputs
from ..errors import PipelinesError, StepError, StepTimeoutError
from ..serving import END, SKIPPED
from .instances import StepModel

__all__ = ["Responses"]


class Responses:
    """A streaming step's responses, each checked as a return value is; ``close()`` stops it."""

    def __init__(
        self, model: StepModel | None, gen: Any, lease: Any = None, held_by: Any = None, rows: int = 1
    ) -> None:
        self.model = model
        self.gen = gen
        self.lease = lease
        self.rows = rows
        self.index = 0
        self.is_async = inspect.isasyncgen(gen)
        self._held_by = held_by  # a whole_stream generator's items: ended on close, so it stops reading
        # The step's timeout bounds its whole stream in every mode, as each server form's step model does.
        timeout = model.step.options.timeout if model is not None else None
        self.timeout = timeout
        self.deadline = perf_counter() + timeout if timeout else math.inf

    @classmethod
    def skipped(cls, returns: list[str]) -> Responses:
        return cls(None, iter([{out: SKIPPED for out in returns}]))

    @classmethod
    async def start(cls, model: StepModel, inputs: dict[str, Any], rows: int, *, held_by: Any = None) -> Responses:
        assert model.pool is not None
        lease = await model.pool.acquire()
        try:
            gen = lease.instance.function(**inputs)
            if not (inspect.isasyncgen(gen) or isinstance(gen, Iterator)):
                gen = iter(gen)
        except BaseException as exc:
            model.pool.give_back(lease)
            if isinstance(exc, Exception):
                raise model._raised(exc) from exc
            raise
        return cls(model, gen, lease, held_by, rows)

    async def next(self) -> dict[str, Any] | None:
        """The next response's outputs, or ``None`` at the end of the stream."""
        model = self.model
        if perf_counter() > self.deadline:
            assert model is not None
            raise model._told(
                StepTimeoutError,
                f"ran past its timeout of {self.timeout:g} s after {self.index} responses; the stream was ended "
                "with this error. Raise the step's timeout, or find why its generator does not end",
            )
        try:
            if model is None:  # a skipped step's one response
                return next(self.gen, None)
            if self.is_async:
                try:
                    item = await self.gen.__anext__()
                except StopAsyncIteration:
                    return None
            else:
                # Not abandoned when cancelled: the generator is closed only once this call returns.
                item = await anyio.to_thread.run_sync(next, self.gen, END)
                if item is END:
                    return None
        except PipelinesError:
            raise
        except Exception as exc:
            assert model is not None
            raise model._raised(exc, f"(after {self.index} responses)") from exc
        self.index += 1  # counted from 1, as `pipelines run` numbers responses and the server forms name them
        return _checked(model, item, self.index, self.rows)

    async def close(self) -> None:
        gen, model, lease = self.gen, self.model, self.lease
        self.lease = None
        if self._held_by is not None:
            self._held_by.put(END)
        try:
            if self.is_async:
                await gen.aclose()
            elif hasattr(gen, "close"):
                await anyio.to_thread.run_sync(gen.close)
        except Exception:  # the stream's own error, if any, is the one worth reporting
            pass
        finally:
            if lease is not None and model is not None and model.pool is not None:
                model.pool.give_back(lease)


def _checked(model: StepModel, item: Any, index: int, rows: int) -> dict[str, Any]:
    """One yield as a dict of arrays of the step's declared outputs, or an error naming its number (from 1)."""
    step = model.step
    try:
        outputs = serving.normalise_outputs(list(step.outputs), item, _fail(step.name))
        outputs = serving.as_arrays(outputs)
        check_outputs(step, outputs, batched=model.batched, batch_size=rows if model.batched else None)
    except serving.Refused as exc:
        raise model._told(StepError, f"response {index}: output {exc}", exc.tensor) from None
    except PipelinesError as exc:
        reason = exc.message.removeprefix(f"step {step.name!r} ")
        raise model._told(StepError, f"response {index}: {reason}", exc.tensor) from None
    return outputs


def _fail(step: str) -> Callable[[str, str | None], StepError]:
    def fail(message: str, tensor: str | None) -> StepError:
        return StepError(f"step {step!r} {message}", step=step, tensor=tensor)

    return fail
