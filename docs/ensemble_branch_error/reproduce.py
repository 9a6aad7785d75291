"""Reproduce: an error response from one branch of a diamond ensemble takes tritonserver 2.51 down.

Plain Triton, no `pipelines` needed to run it against a server you started yourself:

    tritonserver --model-repository docs/ensemble_branch_error/models
    python docs/ensemble_branch_error/reproduce.py --url 127.0.0.1:8000 --protocol http

or let the script start the tritonserver bundled with `pipelines` (nvidia-pytriton's 2.51):

    python docs/ensemble_branch_error/reproduce.py --start --protocol grpc

`--clients` threads send requests for `--seconds`; every other thread sends a negative input,
which `twice` answers with an error while `plus1` runs beside it. The script prints how many
requests got their answer, their own error, no answer within `--request-timeout` (hung), or
failed because the server was gone, and whether the server is still alive at the end.
Exit status: 0 if the server survived and nothing hung, 1 otherwise.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

MODELS = Path(__file__).resolve().parent / "models"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="host:port of a running server (HTTP or gRPC port, per --protocol)")
    parser.add_argument("--start", action="store_true", help="start the tritonserver bundled with pipelines")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--model", default="diamond", help="the ensemble to load (default: diamond)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--request-timeout", type=float, default=10.0)
    args = parser.parse_args()
    if bool(args.url) == bool(args.start):
        parser.error("give either --url or --start")

    server = None
    if args.start:
        from pipelines.triton import TritonServer

        server = TritonServer(MODELS, exit_timeout=1).start()
        url = server.http_url if args.protocol == "http" else server.grpc_url
    else:
        url = args.url
    try:
        counts = hammer(url, args)
    finally:
        alive = server_alive(url, args.protocol)
        if server is not None:
            server.stop()
    print(", ".join(f"{k}: {v}" for k, v in counts.items()))
    print("server alive at the end:", alive)
    return 0 if alive and counts["hung"] == 0 and counts["server gone"] == 0 else 1


def make_client(url: str, protocol: str, timeout: float):
    if protocol == "http":
        import tritonclient.http as module

        return module, module.InferenceServerClient(url, network_timeout=timeout, connection_timeout=timeout)
    import tritonclient.grpc as module

    return module, module.InferenceServerClient(url)


def hammer(url: str, args) -> dict[str, int]:
    counts = {"answered": 0, "own error": 0, "other error": 0, "hung": 0, "server gone": 0}
    lock = threading.Lock()
    stop = time.monotonic() + args.seconds

    def worker(index: int) -> None:
        module, client = make_client(url, args.protocol, args.request_timeout)
        failing = index % 2 == 1
        x = np.full((1, 4), -1.0 if failing else 1.0, np.float32)
        while time.monotonic() < stop:
            tensor = module.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            kwargs = {"client_timeout": args.request_timeout} if args.protocol == "grpc" else {}
            try:
                result = client.infer(args.model, [tensor], **kwargs)
                y = result.as_numpy("y")
                outcome = "answered" if not failing and np.allclose(y, x * 2 + x + 1) else "other error"
            except Exception as exc:  # the client's exception types differ by protocol
                text = str(exc)
                if failing and "negative input" in text:
                    outcome = "own error"
                elif "Deadline" in text or "timed out" in text.lower():
                    outcome = "hung"
                elif not server_alive(url, args.protocol):
                    outcome = "server gone"
                else:
                    outcome = "other error"
            with lock:
                counts[outcome] += 1
            if outcome == "server gone":
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + args.request_timeout + 5)
    return counts


def server_alive(url: str, protocol: str) -> bool:
    try:
        _, client = make_client(url, protocol, 5.0)
        return bool(client.is_server_live())
    except Exception:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
