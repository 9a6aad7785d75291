"""Choosing free ports, and telling whether a started server holds them and answers ready."""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import re
import socket
import threading

from .arguments import Ports
from .cleanup import LISTEN, tcp_socket_inodes

__all__ = ["choose_ports", "health_ready", "listens", "taken_port"]

# Ports from below Linux's default ephemeral range (32768-60999), where outgoing
# connections never take a port between our choosing it and the server binding it.
_PORT_RANGE = (20000, 32000)
# How tritonserver 2.51 reports a port it could not bind (HTTP and metrics; gRPC).
_PORT_TAKEN = re.compile(r"Socket '[^']*:(\d+)' already in use|No address added .*? for '[^']*:(\d+)'")

_PORT_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()


def choose_ports(fixed: tuple[int | None, int | None, int | None], host: str) -> Ports:
    """``fixed`` ports as given, the ``None`` ones chosen free and not handed out before."""
    rng = random.SystemRandom()
    with _PORT_LOCK:
        chosen: list[int] = []
        for port in fixed:
            while port is None:
                candidate = rng.randrange(*_PORT_RANGE)
                # Remembering what was handed out keeps two servers of this process apart
                # even before either has bound its ports.
                if candidate not in _HANDED_OUT and candidate not in chosen and _bindable(host, candidate):
                    port = candidate
            chosen.append(port)
        _HANDED_OUT.update(chosen)
    return Ports(*chosen)


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


def taken_port(log: str) -> int | None:
    """The port a server's log says it could not bind, if any."""
    match = _PORT_TAKEN.search(log)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (True where /proc cannot tell)."""
    inodes = tcp_socket_inodes(state=LISTEN, ports={port}, remote=False)
    if not os.path.exists("/proc/net/tcp"):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def health_ready(host: str, port: int) -> bool:
    """Whether the server's HTTP endpoint answers ``/v2/health/ready`` with 200."""
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
