"""What a written model repository's files are called, and what they say about which model
calls which: the compiler writes them (:mod:`pipelines.compile`), and the embedded server
reads them to tell why a model cannot answer (:mod:`pipelines.triton`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

__all__ = ["BLS_PLAN", "FUSED_PLAN", "STAGING_PREFIX", "ensemble_steps", "leftover_staging", "models_called"]

#: The plan file of a compiled BLS model, and of a fused model, in its version folder.
BLS_PLAN = "bls.json"
FUSED_PLAN = "fused.json"
#: How a repository write's staging directories start (removed when the write ends).
STAGING_PREFIX = ".pipelines-write-"


def ensemble_steps(model_dir: Path) -> frozenset[str]:
    """The models the ensemble whose folder is ``model_dir`` calls (its steps' ``model_name``);
    empty for another model, or for a config that cannot be read (Triton would not load it)."""
    try:
        config = text_format.Parse((model_dir / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError):
        return frozenset()
    return frozenset(step.model_name for step in config.ensemble_scheduling.step)


def models_called(model_dir: Path) -> frozenset[str]:
    """The models that the model in ``model_dir`` calls: an ensemble's steps (its config), and
    the step models a compiled BLS or fused model calls (its plan file). Empty when it calls
    none, or when its files do not say (a hand-written Python model's calls are in its code,
    which is not read). A model whose callee did not load cannot answer, although Triton
    lists it as ready when it is a Python model."""
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


def leftover_staging(path: str | os.PathLike[str]) -> list[str]:
    """Staging directories inside the repository at ``path`` (a mount point) that a write could not remove."""
    try:
        return sorted(e.name for e in os.scandir(path) if e.name.startswith(STAGING_PREFIX) and e.is_dir())
    except OSError:
        return []


def _versions(model_dir: Path) -> list[Path]:
    try:
        return [e for e in model_dir.iterdir() if e.is_dir() and e.name.isdigit()]
    except OSError:
        return []
