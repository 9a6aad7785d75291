"""Which models a model in a repository calls: an ensemble's steps (its config), and the step
models a compiled BLS or fused model calls (its plan file). A model whose callee did not load
cannot answer, although Triton lists it as ready when it is a Python model."""

from __future__ import annotations

import json
from pathlib import Path

from .bls import BLS_PLAN
from .configs import ensemble_steps
from .fused import FUSED_PLAN

__all__ = ["models_called"]


def models_called(model_dir: Path) -> frozenset[str]:
    """The models that the model in ``model_dir`` calls; empty when it calls none, or when its
    files do not say (a hand-written Python model's calls are in its code, which is not read)."""
    called = set(ensemble_steps(model_dir))
    for plan_file in (BLS_PLAN, FUSED_PLAN):
        for version in _versions(model_dir):
            try:
                plan = json.loads((version / plan_file).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if plan_file == BLS_PLAN:
                models = (plan.get("plan") or {}).get("models", ())
                called |= {m["name"] for m in models if isinstance(m, dict) and "name" in m}
            else:
                called |= {n["model"] for n in plan.get("nodes", {}).values()
                           if isinstance(n, dict) and n.get("kind") == "external"}
    return frozenset(called)


def _versions(model_dir: Path) -> list[Path]:
    try:
        return [e for e in model_dir.iterdir() if e.is_dir() and e.name.isdigit()]
    except OSError:
        return []
