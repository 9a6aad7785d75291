"""The embedded Triton server (the ``tritonserver`` of the ``nvidia-pytriton`` wheel) and the
clients that talk to it, or to any remote Triton, over HTTP or gRPC. Shares no code with the local runtime.
"""

from __future__ import annotations

from .arguments import Ports, PythonBackendSettings, ServerArguments
from .async_client import AsyncTritonClient
from .client import TritonClient
from .foreground import serve_main
from .installation import TritonInstallation, find_installation, find_tritonserver
from .payloads import message_to_dict
from .server import TritonServer

__all__ = [
    "AsyncTritonClient",
    "Ports",
    "PythonBackendSettings",
    "ServerArguments",
    "TritonClient",
    "TritonInstallation",
    "TritonServer",
    "find_installation",
    "find_tritonserver",
    "message_to_dict",
    "serve_main",
]
