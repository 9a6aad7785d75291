"""The local endpoint: the local runtime served over Triton's own protocol (KServe v2, HTTP and gRPC).

``LocalServer(p)`` in Python, ``pipelines serve --local MODULE:ATTR`` on the command line.
"""

from __future__ import annotations

from .local_endpoint import LocalServer, serve_local
from .status import Refusal

__all__ = ["LocalServer", "Refusal", "serve_local"]
