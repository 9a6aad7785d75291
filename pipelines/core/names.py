"""Naming rules for pipelines, steps and tensors.

Pipeline and step names become Triton model names, and so directory names in a
model repository: they must not escape it. Tensor names travel in configs and
over the wire. Every name is checked where it is declared, before anything is
written.
"""

from __future__ import annotations

import re

from ..errors import InvalidNameError

__all__ = ["MAX_NAME_LENGTH", "check_name"]

#: Room is left for the suffixes a compiled repository adds (``_bls_sync``…)
#: under the 255-byte limit most file systems put on one path component.
MAX_NAME_LENGTH = 128

_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# Tensor names of external models often hold ':' (TensorFlow) or '.' (ONNX exports).
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]*")


def check_name(
    name: object,
    *,
    what: str,
    tensor: bool = False,
    pipeline: str | None = None,
    step: str | None = None,
) -> str:
    """Return ``name`` if it is a valid model (or, with ``tensor=True``, tensor) name.

    ``what`` says what the name is for ("step", "pipeline input"…), for the message.
    """
    where = f"pipeline {pipeline!r}: " if pipeline else ""

    def fail(why: str) -> InvalidNameError:
        return InvalidNameError(
            f"{where}{what} name {name!r} {why}",
            pipeline=pipeline,
            step=step,
            tensor=name if tensor and isinstance(name, str) else None,
        )

    if not isinstance(name, str):
        raise fail(f"is a {type(name).__name__}; expected a string")
    if not name:
        raise fail("is empty; give it a name such as 'preprocess'")
    if len(name) > MAX_NAME_LENGTH:
        raise fail(f"is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise fail("holds a control character; use letters, digits, '_', '-' and '.'")
    if "/" in name or "\\" in name or ".." in name:
        raise fail("could escape the model repository ('/', '\\' or '..'); use letters, digits, '_', '-' and '.'")
    pattern = _TENSOR_NAME if tensor else _MODEL_NAME
    if not pattern.fullmatch(name):
        allowed = "letters, digits, '_', '-', '.' and ':'" if tensor else "letters, digits, '_', '-' and '.'"
        raise fail(f"breaks Triton's naming rules; use {allowed}, starting with a letter, digit or '_'")
    return name
