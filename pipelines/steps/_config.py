"""Read a step parameter from whatever ``initialize(config)`` was given.

Triton's Python backend hands ``{"model_config": "<json>"}`` whose
``parameters`` map names to ``{"string_value": ...}``; ``instance_config``
(the local runtime, plain calls) hands ``{"parameters": {name: str}}``. Steps
accept both, and fall back to their defaults when a parameter is absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import StepDeclarationError

__all__ = ["read_parameter"]

T = TypeVar("T")


def _parameter_maps(config: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not config:
        return []
    maps: list[Mapping[str, Any]] = []
    model_config = config.get("model_config")
    if isinstance(model_config, (str, bytes)):
        try:
            model_config = json.loads(model_config)
        except ValueError:
            model_config = None
    if isinstance(model_config, Mapping) and isinstance(model_config.get("parameters"), Mapping):
        maps.append(model_config["parameters"])
    if isinstance(config.get("parameters"), Mapping):
        maps.append(config["parameters"])
    return maps


def read_parameter(
    config: Mapping[str, Any] | None,
    key: str,
    default: T,
    convert: Callable[[str], T],
    *,
    step: str,
    check: Callable[[T], bool] = lambda _: True,
    expected: str = "",
) -> T:
    """The parameter ``key`` converted by ``convert``, or ``default`` when absent."""
    for params in _parameter_maps(config):
        if key not in params:
            continue
        raw = params[key]
        if isinstance(raw, Mapping):
            raw = raw.get("string_value")
        try:
            value = convert(str(raw))
        except (TypeError, ValueError):
            value = None
        if value is None or not check(value):
            raise StepDeclarationError(
                f"step {step!r}: parameter {key!r} is {raw!r}; expected {expected or convert.__name__} "
                f"(default {default!r})",
                step=step,
            )
        return value
    return default
