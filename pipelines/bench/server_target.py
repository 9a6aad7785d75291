"""A Triton server as a benchmark target: one top-level model (``<name>_ensemble``,
``_bls`` or ``_bls_sync``) called through tritonclient's asyncio client, and the
server's statistics snapshots that give the per-model breakdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..forms import form as _form
from ..triton.statistics import ModelCounters, parse_statistics

__all__ = ["ServerTarget", "model_name"]


def model_name(pipeline: str, form: str) -> str:
    """The top-level model of ``form`` in a repository compiled with ``"all"`` (forms side by side)."""
    return _form(form).model_name(pipeline, side_by_side=True)


class ServerTarget:
    """Calls ``model`` with the shared async client; snapshots statistics with ``stats_client``."""

    def __init__(self, client: Any, stats_client: Any, model: str, *, timeout: float | None = None) -> None:
        self.client = client
        self.stats_client = stats_client
        self.model = model
        self.timeout = timeout

    async def infer(self, inputs: Mapping[str, Any]) -> Any:
        return await self.client.infer(self.model, inputs, timeout=self.timeout)

    async def snapshot(self) -> dict[tuple[str, str], ModelCounters]:
        """Every model's cumulative counters now (the composing models' too)."""
        stats = self.stats_client.statistics()
        if hasattr(stats, "__await__"):
            stats = await stats
        return parse_statistics(stats)
