"""Does a BLS model that drops each ended decoupled response iterator at once kill its stub on Triton 2.51?

Hand-written models, no pipeline: ``gen``, a decoupled Python model that sends ``N`` responses of
16 floats, then the final flag; ``bls``, a decoupled async BLS model that calls it with
``async_exec(decoupled=True)``, reads every response (on an executor thread), answers once, and then
drops the iterator at once (``--hold 0``) or holds it ``--hold`` seconds before dropping it, as the
compiled BLS models do (``stream_calls._Kept``). A thread of the BLS model allocates Python objects
meanwhile, as a real model's work does. 8 clients stream over gRPC for ``--seconds``.

When the iterator reads its final response, the stub asks its own message thread to drop the
stub's reference; if the model's was dropped first, that thread frees the iterator and the numpy
arrays of its responses without the GIL (docs/triton_decoupled.md). The stub dies some thousands
of streams later, with a segfault in Python's allocator; the run then reports the first failure
(``Stub process 'bls_0_0' is not healthy``, or a stream that waits for ever).

    .venv/bin/python benchmarks/bls_iterator_release.py [--hold 0] [--seconds 90] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

GEN = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full([16], i, np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

BLS = """
import asyncio
import collections
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

HOLD_S = {hold}
held = collections.deque()


def busy():
    while True:
        work = [dict(a=i, b=str(i)) for i in range(2000)]
        del work
        time.sleep(0.001)


class TritonPythonModel:
    def initialize(self, args):
        threading.Thread(target=busy, daemon=True).start()

    async def execute(self, requests):
        await asyncio.gather(*(self.one(r) for r in requests))
        return None

    async def one(self, request):
        sender = request.get_response_sender()
        n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
        call = pb_utils.InferenceRequest(model_name="gen", requested_output_names=["OUT"],
                                         inputs=[pb_utils.Tensor("N", n)])
        responses = await call.async_exec(decoupled=True)

        def read():
            total = 0.0
            for response in responses:
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    total += float(out.as_numpy()[0])
            return total

        total = await asyncio.get_running_loop().run_in_executor(None, read)
        if HOLD_S:
            held.append((time.monotonic() + HOLD_S, responses))
            while held and held[0][0] < time.monotonic():
                held.popleft()
        del responses
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([total], np.float32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def write_model(repo: Path, name: str, code: str, dims: list[int]) -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    from pipelines.compile.configs import config_text

    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name="N", data_type=mc.TYPE_INT32, dims=[1])
    config.output.add(name="OUT", data_type=mc.TYPE_FP32, dims=dims)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    config.model_transaction_policy.decoupled = True
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config_text(config))
    (repo / name / "1" / "model.py").write_text(code)


async def stream_once(stub, responses: int, timeout: float = 30.0) -> None:
    import grpc

    from pipelines.bench.server_target import stream_request
    from pipelines.core.tensor import TensorSpec

    call = stub.ModelStreamInfer()
    await call.write(stream_request("bls", {"N": np.array([responses], np.int32)}, {"N": TensorSpec("INT32", [1])}))
    await call.done_writing()
    while (message := await asyncio.wait_for(call.read(), timeout)) is not grpc.aio.EOF:
        if message.error_message:
            raise RuntimeError(message.error_message)


async def load(url: str, seconds: float, done: list[int]) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.aio.insecure_channel(url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    end = time.monotonic() + seconds

    async def client():
        while time.monotonic() < end:
            await stream_once(stub, 50)
            done[0] += 1

    try:
        await asyncio.gather(*(client() for _ in range(8)))
    finally:
        await channel.close()


def one_run(hold: float, seconds: float) -> str:
    from pipelines.triton import TritonServer

    with tempfile.TemporaryDirectory(prefix="pipelines-bls-iterators-") as tmp:
        repo = Path(tmp) / "repo"
        write_model(repo, "gen", GEN, [16])
        write_model(repo, "bls", BLS.format(hold=hold), [1])
        done = [0]
        with TritonServer(repo, exit_timeout=5, restart_dead_stubs=False, restart_on_crash=False) as server:
            start = time.monotonic()
            try:
                asyncio.run(load(server.grpc_url, seconds, done))
            except Exception as exc:  # noqa: BLE001 - the failure is the finding
                return (f"hold {hold:g} s: FAILED after {done[0]} streams, {time.monotonic() - start:.0f} s: "
                        f"{type(exc).__name__}: {str(exc)[:160]}")
            return f"hold {hold:g} s: {done[0]} streams in {time.monotonic() - start:.0f} s, no failure"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=0.0, help="seconds the BLS model holds an ended iterator")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        print(one_run(args.hold, args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
