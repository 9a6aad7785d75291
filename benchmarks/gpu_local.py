"""The local runtime on a GPU against the same pipelines on the CPU, in one run.

    python benchmarks/gpu_local.py [--json OUT.json] [--quick]

Needs CuPy and a CUDA device (``pip install 'pipelines[gpu]'``).

1. DLPack hand-offs: a chain of 4 identity steps passing a 64 MiB FP32 tensor
   that lives on the GPU. The last step must be handed the request's own memory
   (same device pointer) with no copy counted, in every form; the caller's
   answer is its own array, as a server's answer is.
2. The yolov5 example (letterbox -> stand-in detector -> NMS -> scale_boxes),
   a batch of 4 images, per form, on CuPy arrays against numpy arrays: p50
   latency, GPU/CPU speed-up, copies per request. A GPU request ends when its
   detections are back on the host, as a caller would read them. The GPU's
   detections must equal the CPU's.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import numpy as np
from runtime_overhead import chain_pipeline  # the benchmark beside this one

from pipelines import Pipeline, TensorSpec, step
from pipelines.examples.yolov5 import compare_to_truth, make_sample
from pipelines.examples.yolov5 import pipeline as yolov5
from pipelines.percentiles import percentiles
from pipelines.runtime import MODES, LocalRuntime
from pipelines.runtime.device import gpu_available
from pipelines.tables import format_table


async def _timed(p: Pipeline, mode: str, inputs: dict[str, Any], n: int,
                 to_host: Any) -> tuple[list[float], Any, Any]:
    """``n`` sequential requests after 3 warm-ups; each ends once ``to_host`` has its outputs."""
    async with LocalRuntime(p, mode) as rt:
        for _ in range(3):
            out, report = await rt.infer_with_report(inputs)
            to_host(out)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            out, report = await rt.infer_with_report(inputs)
            host = to_host(out)
            times.append((time.perf_counter() - t) * 1e3)
    return times, report, host


def _synchronized(outputs: dict[str, Any]) -> dict[str, Any]:
    import cupy

    cupy.cuda.Device().synchronize()
    return outputs


def _detections(outputs: dict[str, Any]) -> np.ndarray:
    """The detections on the host: a GPU request is not over before they are there."""
    detections = outputs["detections"]
    return detections if isinstance(detections, np.ndarray) else detections.get()


def dlpack_handoffs(cupy: Any, n: int) -> dict[str, Any]:
    spec = TensorSpec("FP32", [-1])
    x = cupy.arange(16 << 20, dtype=cupy.float32)[None]  # 64 MiB, a batch of one
    seen: list[int] = []

    @step(inputs={"x": spec}, outputs={"x": spec})
    def last(x):
        seen.append(x.data.ptr)
        return {"x": x}

    p = chain_pipeline(4, spec)
    p.output("z", p.add(last, x=p.nodes["noop3"]["x"])["x"])
    out: dict[str, Any] = {}
    for mode in MODES:
        seen.clear()
        times, report, answer = anyio.run(_timed, p, mode, {"x": x}, n, _synchronized)
        z = answer["z"]
        out[mode] = {
            "same_memory": bool(seen) and set(seen) == {x.data.ptr},
            "answer_on_gpu": isinstance(z, cupy.ndarray),
            "answer_is_its_own": bool(isinstance(z, cupy.ndarray) and z.data.ptr != x.data.ptr),
            "copies": report.copies,
            "p50_ms": percentiles(times, [50])[0],
        }
    return out


def yolov5_cpu_vs_gpu(cupy: Any, n: int, batch: int = 4) -> dict[str, Any]:
    samples = [make_sample(seed=s, n_objects=6, size=(480, 640)) for s in range(batch)]
    images = np.stack([s["image"] for s in samples])
    on_gpu = cupy.asarray(images)
    out: dict[str, Any] = {}
    for mode in MODES:
        cpu_times, _, cpu_det = anyio.run(_timed, yolov5, mode, {"image": images}, n, _detections)
        gpu_times, gpu_report, gpu_det = anyio.run(_timed, yolov5, mode, {"image": on_gpu}, n, _detections)
        cpu_p50, gpu_p50 = percentiles(cpu_times, [50])[0], percentiles(gpu_times, [50])[0]
        out[mode] = {
            "cpu_p50_ms": cpu_p50,
            "gpu_p50_ms": gpu_p50,
            "gpu_speedup": cpu_p50 / gpu_p50,
            "gpu_copies": gpu_report.copies,
            "same_detections": bool(np.allclose(cpu_det, gpu_det, rtol=1e-5, atol=1e-3)),
            "all_found_on_gpu": all(
                compare_to_truth(gpu_det[i], s["boxes"], s["classes"]).exact for i, s in enumerate(samples)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    if not gpu_available():
        raise SystemExit("gpu_local.py needs CuPy and a CUDA device: pip install 'pipelines[gpu]' on a GPU machine")
    import cupy

    n = 10 if args.quick else 50
    props = cupy.cuda.runtime.getDeviceProperties(0)
    figures = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "dlpack_chain_4x64MiB": dlpack_handoffs(cupy, n),
        "yolov5_batch4": yolov5_cpu_vs_gpu(cupy, n),
    }
    print(f"{figures['device']}, CuPy {figures['cupy']}, numpy {figures['numpy']}")
    print("chain of 4 identity steps, 64 MiB FP32 on the GPU:")
    print(format_table(["form", "last step has the request's memory", "answer on GPU, its own", "copies", "p50 ms"], [
        [mode, str(row["same_memory"]), str(row["answer_on_gpu"] and row["answer_is_its_own"]), str(row["copies"]),
         f"{row['p50_ms']:.3f}"]
        for mode, row in figures["dlpack_chain_4x64MiB"].items()]))
    print("yolov5 example, batch of 4 images 480x640:")
    print(format_table(["form", "CPU p50 ms", "GPU p50 ms", "speed-up", "GPU copies", "same", "all found"], [
        [mode, f"{row['cpu_p50_ms']:.2f}", f"{row['gpu_p50_ms']:.2f}", f"{row['gpu_speedup']:.1f}x",
         str(row["gpu_copies"]), str(row["same_detections"]), str(row["all_found_on_gpu"])]
        for mode, row in figures["yolov5_batch4"].items()]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
