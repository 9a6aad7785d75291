"""What a client reads from a streaming model on the real server: tritonclient's gRPC stream
(``start_stream`` / ``async_stream_infer``) and HTTP ``generate_stream`` (server-sent events),
for the server tests of the streaming forms."""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

FINAL = "final"  # what grpc_stream reads for the final flag on an empty response


def _inputs(inputs: dict[str, np.ndarray]) -> list[Any]:
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def grpc_stream(url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                *, timeout: float = 60.0) -> list[Any]:
    """One request's responses, in order: each a dict of output lists, the error's text for an
    error response, and :data:`FINAL` for the final flag on an empty response (the last item).
    The final flag on a response that carries outputs is read as that response and then FINAL."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        wanted = [grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None
        client.async_stream_infer(model, _inputs(inputs), outputs=wanted, enable_empty_final_response=True)
        got: list[Any] = []
        while True:
            result, error = answers.get(timeout=timeout)
            if error is not None:
                got.append(str(error))
                continue
            response = result.get_response()
            values = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}
            if values:
                got.append(values)
            if response.parameters["triton_final_response"].bool_param:
                got.append(FINAL)
                return got
    finally:
        client.stop_stream()
        client.close()


def sse_stream(url: str, model: str, fields: dict[str, Any], *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """HTTP ``generate_stream``: one JSON event per response (outputs by name, or ``error``)."""
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream", data=json.dumps(fields).encode())
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        body = answer.read().decode()
    return [json.loads(event.removeprefix("data: ")) for event in body.split("\n\n") if event]


def local(responses: Any) -> list[dict[str, list[Any]]]:
    """``p.stream(...)``'s responses as grpc_stream reads them."""
    return [{name: value.tolist() for name, value in response.items()} for response in responses]


def cancel_after(url: str, model: str, inputs: dict[str, np.ndarray], k: int) -> list[Any]:
    """Read ``k`` responses, then cancel the stream as a client that gives up does."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(model, _inputs(inputs))
    got = [answers.get(timeout=60) for _ in range(k)]
    client.stop_stream(cancel_requests=True)
    client.close()
    return got


def wait_for_mark(marks: Path, prefix: str, timeout: float = 30.0) -> list[str]:
    """The marks whose name starts with ``prefix``, once there is one (or none after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(m.name for m in marks.glob(f"{prefix}*"))
        if found:
            return found
        time.sleep(0.05)
    return []
