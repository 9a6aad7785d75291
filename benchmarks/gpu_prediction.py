"""The simulation against a GPU server: calibrate it, predict every form, measure the same, side by side.

    python benchmarks/gpu_prediction.py --triton TRITON.tar.xz --out DIR
    python benchmarks/gpu_prediction.py --out DIR --cpu        # the same run here, on the bundled server

On a machine with an NVIDIA GPU, CuPy and numpy 2 (as ``gpu_server.py``), in one go:

1. It unpacks the server that ``shared/gpu/pack_triton.sh`` packed and makes the stubs' Python.
2. It writes one repository holding the calibration's probe models and every form of the
   yolov5 pipelines of ``gpu_server.py`` (every step ``device="gpu"``), and serves it.
3. It calibrates that server over gRPC (``calibrate(url=...)``, quick unless ``--full``): the
   profile prices its boundaries (wire, stubs, the ensemble's hand-offs) as the probes cross them.
4. For each pipeline it profiles the steps on the GPU (CuPy arrays, as the server hands them)
   and predicts every form at concurrency 1, 4 and 16 (``pipelines.predict``).
5. It measures the same forms and levels on the server, and prints the errors against the
   targets of ``prediction.py`` (p50 at 1 within 10 %, throughput at 4 and 16 within 15 %,
   the winner named).

``--cpu`` runs the same steps on the CPU against the bundled server, to check the harness
without a GPU. Results go to ``gpu_prediction.json`` under ``--out``, written as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
from gpu_server import measure_server, stub_environment, torch_detector, unpack_server, yolo, yolo_inputs
from prediction import LEVELS, checks_of

from pipelines.calibration import load_profile
from pipelines.forms import FORMS
from pipelines.measured_prediction import predict
from pipelines.profiling.calibrate import calibrate
from pipelines.profiling.calibrate_command import QUICK
from pipelines.profiling.probes import probe_repository
from pipelines.steps.detector import detector as stand_in_detector
from pipelines.tables import format_table
from pipelines.triton import TritonServer

CHAINS = (1, 4, 8)


def chosen_pipelines(names: list[str], device: str) -> dict[str, Any]:
    made = {"yolo_cupy": lambda: yolo("yolo_cupy", stand_in_detector, device),
            "yolo_torch": lambda: yolo("yolo_torch", torch_detector(), device)}
    return {n: made[n]() for n in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", help="the tar.xz that shared/gpu/pack_triton.sh made (not with --cpu)")
    parser.add_argument("--out", required=True, help="folder for gpu_prediction.json, the profile and the server log")
    parser.add_argument("--cpu", action="store_true", help="CPU steps on the bundled server (checks the harness)")
    parser.add_argument("--profile", help="a profile of this kind of server, instead of calibrating (the probes stay out)")
    parser.add_argument("--full", action="store_true", help="a full calibration instead of a quick one")
    parser.add_argument("--pipelines", default="yolo_cupy,yolo_torch", help="which GPU pipelines, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement window")
    parser.add_argument("--work", default="/tmp/gpu_prediction", help="scratch folder (server, venv, models)")
    parser.add_argument("--deadline", type=float, default=420.0,
                        help="seconds after which no further pipeline is started (default 420)")
    args = parser.parse_args()
    began = time.perf_counter()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    figures: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "where": "cpu" if args.cpu else "gpu",
                               "steps": {}, "pipelines": {}, "failures": []}

    def save() -> None:
        (out / "gpu_prediction.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")

    def took() -> str:
        return f"{time.perf_counter() - began:.0f} s"

    if args.cpu:
        pipelines = chosen_pipelines(["yolo_cupy"], "cpu")  # the stand-in detector, in numpy here
        server_options: dict[str, Any] = {}
    else:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        figures["device"] = name.decode() if isinstance(name, bytes) else str(name)
        pipelines = chosen_pipelines(args.pipelines.split(","), "gpu")
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        server_options = {
            "installation": unpack_server(Path(args.triton), work / "triton"),
            "python_env": stub_environment(work / "stubenv"),
            "env": {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))},
            "startup_timeout": 240,
            "extra_args": ["--cuda-memory-pool-byte-size=0:1073741824", "--pinned-memory-pool-byte-size=268435456"],
        }
    compiled = [p.compile("all") for p in pipelines.values()]
    if not args.profile:
        compiled.insert(0, probe_repository(CHAINS))
    repo = compiled[0].merge(*compiled[1:]).write(work / "models")
    print(f"{len(list(repo.iterdir()))} models written at {took()}", flush=True)
    inputs, _ = yolo_inputs()
    server = TritonServer(repo, **server_options)
    try:
        server.start()
        url = server.grpc_url
        print(f"server up at {url} at {took()}", flush=True)
        profile_path = out / "profile.json"
        if args.profile:
            shutil.copy(args.profile, profile_path)
            profile = load_profile(profile_path)
        else:
            calibration = {} if args.full else QUICK
            profile = calibrate(url, "grpc", probes_dir=work / "probes", progress=False,
                                **{k: v for k, v in calibration.items() if k != "chains"}, chains=CHAINS)
            profile.save(profile_path)
        print(profile.table(), flush=True)
        print(f"calibrated at {took()}", flush=True)
        save()
        for name, p in pipelines.items():
            if time.perf_counter() - began > args.deadline:
                figures["failures"].append(f"{name}: not started, past the deadline of {args.deadline:g} s")
                continue
            try:
                started = time.perf_counter()
                predicted = predict(p, profile_path, concurrency=LEVELS, inputs=inputs, cache=work / "steps.json",
                                    allow_mismatch=bool(args.profile))
                print(predicted, flush=True)
                print(f"{name} predicted in {time.perf_counter() - started:.1f} s at {took()}", flush=True)
                figures["steps"] = json.loads((work / "steps.json").read_text())  # the step profiles, for the record
                measured: dict[tuple[str, int], tuple[float, float]] = {}
                for form in FORMS:
                    model = FORMS[form].model_name(p.name, side_by_side=True)
                    with server.client("grpc", timeout=120) as client:
                        for _ in range(3):  # each stub's first calls compile its kernels
                            client.infer(model, inputs)
                    for c in LEVELS:
                        row = anyio.run(measure_server, server, model, inputs, c, args.seconds)
                        if row["p50_ms"] is not None:
                            measured[form, c] = (row["p50_ms"], row["throughput"])
                        print(f"{model:22s} c={c:2d} p50 {row['p50_ms'] or 0:8.2f} ms "
                              f"{row['throughput']:8.1f}/s errors {row['errors']}", flush=True)
                checks, winners = checks_of(name, predicted, measured)
                figures["pipelines"][name] = {
                    "predicted": predicted.as_dicts(), "notes": list(predicted.notes),
                    "measured": {f"{f} {c}": list(v) for (f, c), v in sorted(measured.items())},
                    "checks": [c.row() for c in checks], "winners": winners,
                }
                print(format_table(["pipeline", "conc", "figure", "predicted", "measured", "error", "target", ""],
                                   [c.row() for c in checks]))
                print(format_table(["pipeline", "conc", "predicted winner", "measured winner", ""], winners))
            except Exception as exc:  # noqa: BLE001 - recorded, the next pipeline goes on
                figures["failures"].append(f"{name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            save()
    except Exception as exc:  # noqa: BLE001 - recorded with what was measured before it
        figures["failures"].append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        server.stop()
        log = server.log_path
        if log is not None and Path(log).exists():
            shutil.copy(log, out / "tritonserver.log")
        figures["seconds"] = round(time.perf_counter() - began)
        save()
    for failure in figures["failures"]:
        print("FAILED:", failure)
    print(f"done in {took()}")
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
