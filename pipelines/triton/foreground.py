"""``pipelines serve DIR``: a server in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from .server import TritonServer, describe_exit

__all__ = ["serve_main"]


def serve_main(repository: str | os.PathLike[str], *, out=None, **server_options: Any) -> int:
    """Serve ``repository`` in the foreground until Ctrl-C (or SIGTERM); return the exit status.

    ``server_options`` are :class:`TritonServer`'s keyword arguments (host, ports, model
    control mode, log verbosity, start-up timeout, extra arguments, ``python_env``,
    ``python_backend``), passed on as they are so that the two never disagree. Prints the
    URLs and the loaded models once the server is ready. A server that dies on its own
    returns 1 after printing its log's tail.
    """
    out = out or sys.stdout
    server = TritonServer(repository, **server_options)
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with server:
            print(f"Triton server ready (pid {server.pid}) serving {server.repository}", file=out)
            print(f"  HTTP     {server.http_url}", file=out)
            print(f"  gRPC     {server.grpc_url}", file=out)
            print(f"  metrics  {server.metrics_url}", file=out)
            models = server.models()
            stand_ins = server.stand_ins
            print(f"models ({len(models)}):", file=out)
            for model in models:
                reason = f"  {model['reason']}" if model.get("reason") else ""
                if model["name"] in stand_ins:
                    reason += f"  (STAND-IN for {stand_ins[model['name']].runtime})"
                print(
                    f"  {model['name']:<32} {model.get('version', '') or '-':<4} {model.get('state', '')}{reason}",
                    file=out,
                )
            for stand_in in stand_ins.values():
                print(f"stand-in: {stand_in.model!r} is {stand_in.label}", file=out)
            print("Press Ctrl-C to stop.", file=out, flush=True)
            code = server.wait()
            print(
                f"the Triton server exited on its own ({describe_exit(code)})\n--- log tail ---\n{server.log_tail()}",
                file=sys.stderr,
            )
            return 1
    except KeyboardInterrupt:
        print("stopped", file=out, flush=True)
        return 0
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
