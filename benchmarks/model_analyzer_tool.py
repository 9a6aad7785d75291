"""Triton Model Analyzer, installed into a virtual environment of its own and run against the bundled server.

Used by ``advise_vs_model_analyzer.py``. ``triton-model-analyzer`` pins its own versions of packages that
``pipelines`` also uses, so it goes into ``~/.cache/pipelines/model_analyzer/venv``; it starts the bundled
``tritonserver`` itself (``--triton-launch-mode local``) with this environment's Python backend, and calls the
perf_analyzer that ``perf_analyzer_tool.py`` installs. Where it cannot be installed or run, :class:`Blocked`
says why.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipelines.freed_memory import VARIABLES
from pipelines.triton import find_installation
from pipelines.triton.ports import choose_ports

MODEL_ANALYZER = "1.58.0"
MA_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipelines" / "model_analyzer"


class Blocked(Exception):
    """Model Analyzer cannot be installed or run here; the message says why."""


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def install_model_analyzer(cache: Path = MA_CACHE) -> Path:
    """``model-analyzer`` in a virtual environment of its own (its pins leave ours alone); :class:`Blocked` if not."""
    binary = cache / "venv" / "bin" / "model-analyzer"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([sys.executable, "-m", "venv", str(cache / "venv")], capture_output=True, text=True)
    if made.returncode:
        raise Blocked(f"python -m venv {cache / 'venv'} failed: {made.stderr.strip()[-300:]}")
    pip = subprocess.run([str(cache / "venv" / "bin" / "pip"), "install", "-q",
                          f"triton-model-analyzer=={MODEL_ANALYZER}"], capture_output=True, text=True)
    if pip.returncode or not binary.exists():
        raise Blocked(f"pip could not install triton-model-analyzer=={MODEL_ANALYZER}: {pip.stderr.strip()[-500:]}")
    return binary


def model_analyzer_config(work: Path, repository: Path, model: str, step_models: list[str], pa, backends: Path,
                          concurrency: int) -> Path:
    """Its profile config: quick search of the ensemble ``model`` at ``concurrency``, launching the bundled tritonserver
    (local mode, on free ports) with our Python backend; every step model on CPU instances."""
    ports = choose_ports((None, None, None), "127.0.0.1")
    config = {
        "model_repository": str(repository),
        "profile_models": model,
        "run_config_search_mode": "quick",
        # Quick search refuses a list of concurrencies; a range of one holds it.
        "run_config_search_min_concurrency": concurrency,
        "run_config_search_max_concurrency": concurrency,
        "cpu_only_composing_models": ",".join(step_models),
        "triton_launch_mode": "local",
        "triton_server_path": str(find_installation().binary),
        "triton_server_flags": {"backend_directory": str(backends)},
        "perf_analyzer_path": str(pa.binary),
        "output_model_repository_path": str(work / "ma_output_repository"),
        "override_output_model_repository": True,
        "export_path": str(work / "ma_export"),
        "checkpoint_directory": str(work / "ma_checkpoints"),
        "triton_output_path": str(work / "ma_tritonserver.log"),
        "triton_http_endpoint": f"localhost:{ports.http}",
        "triton_grpc_endpoint": f"localhost:{ports.grpc}",
        "triton_metrics_url": f"http://localhost:{ports.metrics}/metrics",
    }
    (work / "ma_export").mkdir(exist_ok=True)
    path = work / "model_analyzer.yaml"
    path.write_text(json.dumps(config, indent=1))  # YAML reads JSON
    return path


def run_model_analyzer(binary: Path, config: Path, pa, work: Path) -> dict:
    """``model-analyzer profile``, timed, with the environment the bundled server gets from ``TritonServer``
    (the stub finds numpy through our python on PATH; the wheel's libraries; the same malloc settings)."""
    installation = find_installation()
    env = {**VARIABLES, **os.environ}
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), str(binary.parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(installation.libs), str(pa.library_path),
                                                           env.get("LD_LIBRARY_PATH")]))
    log = work / "model_analyzer.log"
    load_before = load_average()
    began = time.perf_counter()
    with log.open("w") as out:
        ran = subprocess.run([str(binary), "profile", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT,
                             env=env, cwd=work, timeout=1800)
    seconds = time.perf_counter() - began
    text = log.read_text(errors="replace")
    checkpoints = sorted((work / "ma_checkpoints").glob("*.ckpt"))
    if ran.returncode or not checkpoints:
        raise Blocked(f"model-analyzer profile exited {ran.returncode} after {seconds:.0f} s: {text[-1500:]}")
    return {"seconds": round(seconds, 1), "load_average": [load_before, load_average()],
            "checkpoint": json.loads(checkpoints[-1].read_text()), "log_tail": text.splitlines()[-8:],
            # Each measurement it makes is logged as "Profiling <model>_config_<n>: concurrency=<c>".
            "configurations_profiled": sum("] Profiling " in line and "_config_" in line for line in text.splitlines())}


def model_analyzer_pick(checkpoint: dict, export: Path, model: str, concurrency: int) -> dict:
    """The configuration Model Analyzer ranks first (the first row of its metrics-model-inference.csv: the highest
    throughput, its objective by default, with no constraint given), with the config of each model in it, from its
    checkpoint."""
    ranked = export / "results" / "metrics-model-inference.csv"
    if not ranked.exists():
        raise Blocked(f"Model Analyzer wrote no ranking ({ranked} is missing)")
    with ranked.open() as f:
        first = next(csv.DictReader(f), None)
    if first is None:
        raise Blocked(f"Model Analyzer's ranking {ranked} has no row")
    variant = first["Model Config Path"].split(":", 1)[0].strip()
    runs = checkpoint["ResultManager.results"]["_results"][model][variant]
    mrc = runs[0]["_model_run_configs"][0]
    reported = {"row": dict(first)}
    for measurement in runs[1].values():
        for m in measurement["_model_config_measurements"]:
            if m["_model_specific_pa_params"]["concurrency-range"] == concurrency:
                figures = {k: v["_value"] for k, v in m["_non_gpu_data"]}
                reported.update(throughput=figures["perf_throughput"], p95_ms=figures["perf_latency_p95"],
                                p99_ms=figures["perf_latency_p99"])
    return {"variant": variant, "reported": reported,
            "configs": [mrc["_model_config_variant"]["model_config"],
                        *(c["model_config"] for c in mrc["_composing_config_variants"])]}
