"""Every compiled form on a real GPU server, measured side by side with the local runtime.

    python benchmarks/gpu_server.py --triton TRITON.tar.xz --out DIR [--quick]

Runs on a machine with an NVIDIA GPU, CuPy and numpy 2 (CuPy 14 needs it), in one go:

1. It unpacks the tritonserver that ``shared/gpu/pack_triton.sh`` packed from the
   ``nvidia-pytriton`` wheel, and makes the stubs' environment: a venv over this Python
   (3.12 there), whose site-packages (CuPy, PyTorch) it reaches through a ``.pth`` file.
2. It compiles three pipelines, every step ``device="gpu"`` (``KIND_GPU``,
   ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``), into every form (ensemble, bls, bls_sync, fused):
   - ``yolo_cupy``: the yolov5 example, letterbox -> stand-in detector -> NMS -> scale_boxes, on CuPy;
   - ``yolo_torch``: the same with a detector written in PyTorch (``array="torch"``);
   - ``chain64``: 4 steps passing a 64 MiB FP32 tensor.
3. For each pipeline, form and concurrency (1, 4, 16): p50, p95 and throughput over gRPC.
4. Host<->GPU copies per request, counted where a GPU step is handed a tensor that
   Triton put in host memory (``is_cpu()``), by the models themselves (``PIPELINES_HOPS_DIR``).
   The client sends host arrays, so one copy per request, at the first step, is the floor.
5. The local runtime on the same pipelines and inputs, at concurrency 1 and 4, and its error
   against the server.

It prints a table and writes ``gpu_server.json`` (and the server log) under ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.bench.loadgen import LoadPlan, run_load
from pipelines.bench.stability import StabilityRule
from pipelines.examples.yolov5 import compare_to_truth, make_sample
from pipelines.percentiles import percentiles
from pipelines.runtime import LocalRuntime
from pipelines.steps.detector import detector as stand_in_detector
from pipelines.steps.letterbox import letterbox
from pipelines.steps.nms import nms
from pipelines.steps.scale_boxes import scale_boxes
from pipelines.tables import format_table
from pipelines.triton import TritonServer
from pipelines.triton.installation import TritonInstallation

FORMS = ("ensemble", "bls", "bls_sync", "fused")
LOCAL_MODE = {"ensemble": "ensemble", "bls": "bls", "bls_sync": "bls-sync", "fused": "fused"}
BATCH = 4


# ------------------------------------------------------------------ the server and its stubs' Python


def unpack_server(tarball: Path, root: Path) -> TritonInstallation:
    with tarfile.open(tarball) as tar:
        tar.extractall(root)  # noqa: S202 - our own archive, made by pack_triton.sh
    server = root / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return TritonInstallation(
        binary=server / "bin" / "tritonserver",
        python_backend=server / "backends" / "python",
        stub=server / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root / "nvidia_pytriton.libs",
    )


def stub_environment(root: Path) -> Path:
    """A venv over this interpreter that sees its packages (CuPy, PyTorch, numpy 2) through a ``.pth``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(glob.glob(str(root / "lib" / "python3.*" / "site-packages"))[0])
    import cupy

    paths = {str(Path(cupy.__file__).parents[1])}
    paths |= {p for p in sys.path if p.endswith("site-packages")}
    (site / "zz_machine_site.pth").write_text("\n".join(sorted(paths)) + "\n")
    return root


# ------------------------------------------------------------------ the pipelines, every step on the GPU


def yolo(name: str, detector: Any, device: str = "gpu") -> Pipeline:
    def gpu(s: Any) -> Any:
        return s.with_options(device=device)

    p = Pipeline(name, inputs={"image": TensorSpec("UINT8", [-1, -1, 3])}, max_batch_size=8)
    boxed = p.add(gpu(letterbox), image=p.input("image"))
    (det_in,) = detector.inputs
    (det_out,) = detector.outputs
    found = p.add(gpu(detector), **{det_in: boxed["images"]})
    kept = p.add(gpu(nms), candidates=found[det_out])
    scaled = p.add(gpu(scale_boxes), detections=kept["detections"], ratio_pad=boxed["ratio_pad"],
                   orig_size=boxed["orig_size"])
    p.output("detections", scaled["detections"])
    return p.validate()


class TorchDetector:
    """A yolov5-shaped head in PyTorch: three strided convolutions (8, 16, 32) give the 25,200
    candidate rows of 85 values; fixed seeded weights, so every form must answer alike."""

    def initialize(self, config: dict[str, Any]) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.heads = [torch.nn.Conv2d(3, 3 * 85, kernel_size=s, stride=s).cuda().eval() for s in (8, 16, 32)]

    def execute(self, images: Any) -> dict[str, Any]:
        torch = self.torch
        with torch.inference_mode():
            rows = []
            for head in self.heads:
                y = head(images)  # [B, 255, H, W]
                b, _, h, w = y.shape
                rows.append(y.view(b, 3, 85, h, w).permute(0, 1, 3, 4, 2).reshape(b, 3 * h * w, 85))
            out = torch.sigmoid(torch.cat(rows, 1))
            out[..., :4] *= 640.0
            out[..., 4] = torch.sigmoid(out[..., 4] * 20 - 18)  # few candidates pass NMS's threshold
            return {"output0": out.contiguous()}  # a torch.Tensor: read through DLPack


def torch_detector() -> Any:
    return step(TorchDetector, name="torch_detector", inputs=dict(stand_in_detector.inputs),
                outputs=dict(stand_in_detector.outputs), array="torch")


CHAIN = TensorSpec("FP32", [-1])


@step(inputs={"x": CHAIN}, outputs={"x": CHAIN}, device="gpu")
def scale_on_gpu(x):
    return {"x": x * 2}


def _pass_on(x):
    return {"x": x}


def chain64() -> Pipeline:
    """4 steps, each its own model: a step model shared by nodes would need the ensemble's gate,
    whose BYTES failure tensor the stub cannot carry under numpy 2 (docs/gpu.md)."""
    p = Pipeline("chain64", inputs={"x": CHAIN}, max_batch_size=2)
    ref = p.add(scale_on_gpu, name="first", x=p.input("x"))["x"]
    for i in range(3):
        hop = step(_pass_on, name=f"pass_on{i}", inputs={"x": CHAIN}, outputs={"x": CHAIN}, device="gpu")
        ref = p.add(hop, name=f"hop{i}", x=ref)["x"]
    p.output("y", ref)
    return p


def yolo_inputs() -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    samples = [make_sample(seed=s, n_objects=6, size=(480, 640)) for s in range(BATCH)]
    return {"image": np.stack([s["image"] for s in samples])}, samples


# ------------------------------------------------------------------ measuring


def load_figures(result: Any) -> dict[str, Any]:
    window = result.measured
    p50, p95 = percentiles(window.latencies * 1e3, [50, 95]) if window.successes else (None, None)
    return {"p50_ms": p50, "p95_ms": p95, "throughput": window.throughput, "errors": window.errors,
            "requests": window.completed,
            "error": next(iter(window.error_messages), None)}


async def measure_server(server: TritonServer, model: str, inputs: dict[str, Any], concurrency: int,
                         seconds: float) -> dict[str, Any]:
    async with server.async_client("grpc", timeout=120) as client:
        async def infer(sample: Any) -> Any:
            return await client.infer(model, sample)

        plan = LoadPlan(concurrency=concurrency, duration=seconds, warmup=min(1.0, seconds),
                        rule=StabilityRule(tolerance=0.5, windows=1, max_trials=1))
        return load_figures(await run_load(infer, [inputs], plan, label=model))


async def measure_local(p: Pipeline, mode: str, inputs: dict[str, Any], concurrency: int,
                        seconds: float, fused_instance_count: int = 1) -> dict[str, Any]:
    async with LocalRuntime(p, mode, fused_instance_count=fused_instance_count) as rt:
        async def infer(sample: Any) -> Any:
            out = await rt.infer(sample)
            return {k: (v if isinstance(v, np.ndarray) else v.get()) for k, v in out.items()}  # on the host

        plan = LoadPlan(concurrency=concurrency, duration=seconds, warmup=min(1.0, seconds),
                        rule=StabilityRule(tolerance=0.5, windows=1, max_trials=1))
        return load_figures(await run_load(infer, [inputs], plan, label=f"{p.name} local {mode}"))


def hops_by_model(folder: Path) -> dict[str, dict[str, int]]:
    """The models' own tallies of host<->GPU copies, summed over their stubs."""
    totals: dict[str, dict[str, int]] = {}
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten at this moment: the next snapshot has it
        row = totals.setdefault(data["model"], {"to_device": 0, "to_host": 0, "bytes": 0})
        for key in row:
            row[key] += int(data[key])
    return totals


def hop_difference(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, int]:
    out = {"to_device": 0, "to_host": 0, "bytes": 0}
    for model, row in after.items():
        for key in out:
            out[key] += row[key] - before.get(model, {}).get(key, 0)
    return out


def count_hops(server: TritonServer, model: str, inputs: dict[str, Any], folder: Path, n: int) -> dict[str, Any]:
    before = hops_by_model(folder)
    with server.client("grpc", timeout=120) as client:
        for _ in range(n):
            client.infer(model, inputs)
    time.sleep(0.3)
    diff = hop_difference(before, hops_by_model(folder))
    return {"per_request_to_device": diff["to_device"] / n, "per_request_to_host": diff["to_host"] / n,
            "mib_per_request": diff["bytes"] / n / 2**20}


# ------------------------------------------------------------------ the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", required=True, help="the tar.xz that shared/gpu/pack_triton.sh made")
    parser.add_argument("--out", required=True, help="folder for gpu_server.json and the server log")
    parser.add_argument("--quick", action="store_true", help="short windows (a smoke run)")
    parser.add_argument("--work", default="/tmp/gpu_server", help="scratch folder (server, venv, models)")
    parser.add_argument("--local-only", action="store_true", help="measure the local runtime alone (no server)")
    parser.add_argument("--pipelines", default="yolo_cupy,yolo_torch,chain64", help="which pipelines, comma-separated")
    parser.add_argument("--forms", default=",".join(FORMS), help="which forms, comma-separated")
    parser.add_argument("--concurrency", default="1,4,16", help="requests in flight on the server, comma-separated")
    parser.add_argument("--fused-instance-count", type=int, default=1, help="instances of the fused model")
    args = parser.parse_args()
    import cupy

    out_dir, work = Path(args.out), Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    seconds = 1.0 if args.quick else 2.0
    props = cupy.cuda.runtime.getDeviceProperties(0)
    figures: dict[str, Any] = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cupy.__version__, "numpy": np.__version__, "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d"), "window_s": seconds, "server": {}, "local": {}, "hops": {},
        "answers": {}, "failures": [],
    }

    def save() -> None:
        (out_dir / "gpu_server.json").write_text(json.dumps(figures, indent=2, default=str))

    t0 = time.perf_counter()
    forms = tuple(args.forms.split(","))
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    chosen = args.pipelines.split(",")
    figures["fused_instance_count"] = args.fused_instance_count
    if args.local_only:
        wanted = {k: v for k, v in local_pipelines().items() if k in chosen}
        measure_local_all(wanted, seconds, figures, save, forms, args.fused_instance_count)
        report(figures)
        return
    installation = unpack_server(Path(args.triton), work / "triton")
    env = stub_environment(work / "stubenv")
    hops_dir = work / "hops"
    hops_dir.mkdir()
    image, samples = yolo_inputs()
    rng = np.random.default_rng(0)
    big = {"x": rng.standard_normal((1, 16 << 20), dtype=np.float32)}  # 64 MiB
    pipelines = {"yolo_cupy": (yolo("yolo_cupy", stand_in_detector), image),
                 "yolo_torch": (yolo("yolo_torch", torch_detector()), image),
                 "chain64": (chain64(), big)}
    pipelines = {k: v for k, v in pipelines.items() if k in chosen}
    repo = work / "models"
    for p, _ in pipelines.values():
        p.compile("all", fused_instance_count=args.fused_instance_count).write(repo)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    server_env = {"PIPELINES_HOPS_DIR": str(hops_dir),
                  "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
    print(f"set up in {time.perf_counter() - t0:.0f} s", flush=True)
    server = TritonServer(repo, python_env=env, installation=installation, env=server_env, startup_timeout=240,
                          extra_args=["--cuda-memory-pool-byte-size=0:1073741824",
                                      "--pinned-memory-pool-byte-size=268435456"])
    try:
        server.start()
        print(f"server up at {time.perf_counter() - t0:.0f} s", flush=True)
        local_expected = {}
        for name, (p, inputs) in pipelines.items():
            try:
                local_expected[name] = p.run(inputs, mode="ensemble")
            except Exception as exc:  # noqa: BLE001 - recorded, the rest goes on
                figures["failures"].append(f"{name} local run: {type(exc).__name__}: {exc}")
        for name, (_, inputs) in pipelines.items():
            for form in forms:
                model = f"{name}_{form}"
                try:
                    with server.client("grpc", timeout=120) as client:
                        got = client.infer(model, inputs)
                    want = local_expected.get(name)
                    answer: dict[str, Any] = {"same_as_local": bool(want is not None and all(
                        np.allclose(got[k], want[k], rtol=1e-4, atol=1e-3) for k in want))}
                    if name == "yolo_cupy":
                        answer["all_boxes_found"] = all(
                            compare_to_truth(got["detections"][i], s["boxes"], s["classes"]).exact
                            for i, s in enumerate(samples))
                    figures["answers"][model] = answer
                    figures["hops"][model] = count_hops(server, model, inputs, hops_dir, 5 if args.quick else 20)
                    for c in concurrency:
                        row = anyio.run(measure_server, server, model, inputs, c, seconds)
                        figures["server"][f"{model}@{c}"] = row
                        print(f"{model:22s} c={c:2d} p50 {row['p50_ms'] or 0:8.2f} ms  p95 {row['p95_ms'] or 0:8.2f} ms"
                              f"  {row['throughput']:8.1f}/s  errors {row['errors']}", flush=True)
                except Exception as exc:  # noqa: BLE001 - recorded, the rest goes on
                    figures["failures"].append(f"{model}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                save()
        measure_local_all(pipelines, seconds, figures, save, forms, args.fused_instance_count)
    finally:
        server.stop()
        log = server.log_path
        if log is not None and Path(log).exists():
            shutil.copy(log, out_dir / "tritonserver.log")
        save()
    report(figures)


def local_pipelines() -> dict[str, tuple[Pipeline, dict[str, Any]]]:
    image, _ = yolo_inputs()
    big = {"x": np.random.default_rng(0).standard_normal((1, 16 << 20), dtype=np.float32)}
    return {"yolo_cupy": (yolo("yolo_cupy", stand_in_detector), image),
            "yolo_torch": (yolo("yolo_torch", torch_detector()), image),
            "chain64": (chain64(), big)}


def measure_local_all(pipelines: dict[str, tuple[Pipeline, dict[str, Any]]], seconds: float,
                      figures: dict[str, Any], save: Any, forms: tuple[str, ...] = FORMS,
                      fused_instance_count: int = 1) -> None:
    """The local runtime on the same pipelines and host inputs, each form at concurrency 1 and 4."""
    for name, (p, inputs) in pipelines.items():
        for form in forms:
            for c in (1, 4):
                try:
                    row = anyio.run(measure_local, p, LOCAL_MODE[form], inputs, c, seconds, fused_instance_count)
                    figures["local"][f"{name}_{form}@{c}"] = row
                    print(f"local {name}_{form:10s} c={c} p50 {row['p50_ms'] or 0:8.2f} ms"
                          f"  {row['throughput']:8.1f}/s", flush=True)
                except Exception as exc:  # noqa: BLE001 - recorded, the rest goes on
                    figures["failures"].append(f"local {name} {form} c={c}: {type(exc).__name__}: {exc}")
            save()


def report(figures: dict[str, Any]) -> None:
    print(f"\n{figures['device']}, CuPy {figures['cupy']}, numpy {figures['numpy']}, Python {figures['python']}")
    rows = []
    for key, row in figures["server"].items():
        model, c = key.rsplit("@", 1)
        local = figures["local"].get(key)
        hops = figures["hops"].get(model, {})
        err = (f"{(local['p50_ms'] / row['p50_ms'] - 1) * 100:+.0f} %"
               if local and local.get("p50_ms") and row.get("p50_ms") else "")
        rows.append([model, c, f"{row['p50_ms'] or 0:.2f}", f"{row['p95_ms'] or 0:.2f}", f"{row['throughput']:.1f}",
                     f"{hops.get('per_request_to_device', float('nan')):.2f}",
                     f"{local['p50_ms']:.2f}" if local and local.get("p50_ms") else "", err])
    print(format_table(["model", "c", "p50 ms", "p95 ms", "infer/s", "H2D/req", "local p50", "local err"], rows))
    for failure in figures["failures"]:
        print("FAILED:", failure)


if __name__ == "__main__":
    main()
