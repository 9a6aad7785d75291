"""The embedded Triton server and its clients, in one import.

``TritonServer`` runs the real ``tritonserver`` of the ``nvidia-pytriton`` wheel; ``TritonClient``
and ``AsyncTritonClient`` talk to it, or to any remote Triton server, over HTTP or gRPC.
"""

from __future__ import annotations

from .client import AsyncTritonClient, TritonClient, message_to_dict
from .server import TritonInstallation, TritonServer, find_installation, find_tritonserver, serve_main

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
