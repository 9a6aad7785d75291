"""Kept so that ``from pipelines.runtime.triton import TritonServer`` still works: the embedded
server and its clients live in :mod:`pipelines.triton`."""

from __future__ import annotations

from ..triton import (
    AsyncTritonClient,
    TritonClient,
    TritonInstallation,
    TritonServer,
    find_installation,
    find_tritonserver,
    message_to_dict,
    serve_main,
)

__all__ = [
    "AsyncTritonClient",
    "TritonClient",
    "TritonInstallation",
    "TritonServer",
    "find_installation",
    "find_tritonserver",
    "message_to_dict",
    "serve_main",
]
