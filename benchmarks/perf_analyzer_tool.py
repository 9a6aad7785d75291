"""perf_analyzer, NVIDIA's load generator: installed, run, and its figures read.

Shared by ``perf_analyzer_vs_bench.py`` (the bench against perf_analyzer) and ``prediction.py --measure
perf_analyzer`` (the predictions scored against perf_analyzer's figures).

perf_analyzer is installed into ~/.cache/pipelines/perf_analyzer on first use, from the tritonclient wheel that
ships it, with libcudart.so.12 from the nvidia-pytriton wheel (perf_analyzer links it even for CPU models) and
Debian's libb64; where that cannot be done, :class:`Unavailable` says why.

Each measurement is a fixed number of windows, as the bench's is: ``-s 1000`` (a stability rule no window fails)
with ``-r WINDOWS`` stops after max(3, WINDOWS) windows, perf_analyzer's stability rule comparing the last 3, and
reports those 3 windows merged; ``-v`` prints each window's throughput (its "Pass [n]" lines).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.bench.runner import write_bench_repository
from pipelines.bench.server_target import model_name
from pipelines.commands.loading import load_pipeline_and_module
from pipelines.commands.sample_inputs import sample_requests
from pipelines.compile import repository_pipelines
from pipelines.forms import FORMS
from pipelines.triton import TritonServer

TRITONCLIENT = "2.51.0"  # its manylinux x86-64 wheel ships a perf_analyzer that runs here
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipelines" / "perf_analyzer"
#: perf_analyzer's stability rule compares its last 3 windows: it never stops before 3, nor reports more
WINDOWS = 3
_PASS = re.compile(r"^\s*Pass \[(\d+)\] throughput: ([0-9.eE+-]+) infer/sec", re.MULTILINE)


class Unavailable(Exception):
    """perf_analyzer cannot be installed or run here; the message says why and what would fix it."""


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    library_path: Path  # holds libcudart.so.12

    def env(self) -> dict[str, str]:
        paths = [str(self.library_path), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
        return {**os.environ, "LD_LIBRARY_PATH": ":".join(paths)}


@dataclass(frozen=True)
class Figures:
    """What one perf_analyzer run measured: p50 latency, throughput, and each window's throughput."""

    p50_ms: float
    throughput: float
    windows: tuple[float, ...] = ()


def install_perf_analyzer(cache: Path = CACHE) -> PerfAnalyzer:
    """perf_analyzer from the tritonclient wheel, with what it links against; :class:`Unavailable` if not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise Unavailable(f"perf_analyzer ships in manylinux x86-64 wheels only; this is {sys.platform} "
                          f"{platform.machine()}")
    binary, lib = cache / "bin" / "perf_analyzer", cache / "lib"
    if not binary.exists():
        wheels = cache / "wheel"
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
             "manylinux1_x86_64", f"tritonclient=={TRITONCLIENT}", "-d", str(wheels)],
            capture_output=True, text=True)
        found = sorted(wheels.glob(f"tritonclient-{TRITONCLIENT}-*.whl"))
        if fetched.returncode or not found:
            raise Unavailable(f"pip could not download tritonclient=={TRITONCLIENT}'s wheel, which ships "
                              f"perf_analyzer: {fetched.stderr.strip()[-300:]}")
        with zipfile.ZipFile(found[0]) as wheel:
            member = f"tritonclient-{TRITONCLIENT}.data/data/bin/perf_analyzer"
            binary.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(member) as src, open(binary, "wb") as dst:
                shutil.copyfileobj(src, dst)
        binary.chmod(0o755)
    _link_cudart(lib)
    _require_libb64()
    pa = PerfAnalyzer(binary, lib)
    ran = subprocess.run([str(binary), "--help"], capture_output=True, text=True, env=pa.env())
    if "error while loading shared libraries" in ran.stderr:
        raise Unavailable(f"{binary} does not start: {ran.stderr.strip()}")
    return pa


def _link_cudart(lib: Path) -> None:
    """perf_analyzer links libcudart.so.12 even for CPU models; nvidia-pytriton's wheel ships one."""
    try:
        import pytriton
    except ImportError as exc:
        raise Unavailable("perf_analyzer needs libcudart.so.12, taken from nvidia-pytriton's wheel: "
                          "pip install nvidia-pytriton, or install a CUDA 12 runtime") from exc

    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    found = sorted(libs.glob("libcudart-*.so.12*"))
    if not found:
        raise Unavailable(f"no libcudart.so.12 in {libs}; install nvidia-pytriton, or a CUDA 12 runtime")
    lib.mkdir(parents=True, exist_ok=True)
    link = lib / "libcudart.so.12"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(found[0])


def _require_libb64() -> None:
    def present() -> bool:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        return "libb64.so.0d" in listed

    if present():
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "libb64-0d"], capture_output=True)
        if present():
            return
    raise Unavailable("perf_analyzer needs Debian's libb64-0d: apt-get install -y libb64-0d (as root)")


def input_data(samples: list[dict[str, np.ndarray]], path: Path, batched: bool = True) -> Path:
    """perf_analyzer's --input-data file: the bench's requests, in turn, raw bytes as base64
    (shapes without the batch axis: perf_analyzer adds it with -b 1; a pipeline that does not batch has none)."""
    def one(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a[0] if batched else a)

    data = [{name: {"b64": base64.b64encode(one(a).tobytes()).decode(), "shape": list(one(a).shape)}
             for name, a in s.items()} for s in samples]
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer_command(model: str, url: str, concurrency: int, window_s: float, windows: int = WINDOWS,
                          data: str = "data.json", csv_file: str = "pa.csv", protocol: str = "http") -> list[str]:
    """perf_analyzer measuring what ``pipelines bench --concurrency C --duration W`` measures
    after its warm-up: ``windows`` windows of ``window_s`` seconds, pooled (-s 1000: no window
    is refused, as the bench's --stability 0.99 refuses none)."""
    return ["perf_analyzer", "-m", model, "-u", url, "-i", protocol, "-b", "1",
            "--concurrency-range", f"{concurrency}:{concurrency}", "-p", str(int(window_s * 1000)),
            "-s", "1000", "-r", str(windows), "--input-data", data, "-f", csv_file]


def parse_csv(text: str) -> tuple[float, float]:
    """(p50 ms, infer/s) from perf_analyzer's -f CSV: its first row, the one concurrency measured (latencies in µs)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError(f"perf_analyzer's CSV has no row of figures: {text[:200]!r}")
    row = rows[0]
    try:
        return float(row["p50 latency"]) / 1000.0, float(row["Inferences/Second"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"perf_analyzer's CSV lacks 'p50 latency' or 'Inferences/Second': {text[:200]!r}") from exc


def parse_windows(stdout: str) -> tuple[float, ...]:
    """Each window's throughput (infer/s), in order, from perf_analyzer's -v output ("Pass [n] throughput: ...")."""
    return tuple(float(m.group(2)) for m in _PASS.finditer(stdout))


def measure_perf_analyzer(pa: PerfAnalyzer, command: list[str], work: Path, warmup_s: float) -> Figures:
    """perf_analyzer's figures; before them, ``warmup_s`` of the same load, not measured, as the
    bench warms up (perf_analyzer 2.51 has no warm-up of its own: a first run that is thrown away)."""
    if warmup_s > 0:
        warm = [*command[:command.index("-p")], "-p", str(int(warmup_s * 1000)), "-s", "1000", "-r", "1",
                "--input-data", command[command.index("--input-data") + 1]]
        subprocess.run([str(pa.binary), *warm[1:]], capture_output=True, env=pa.env(), cwd=work, timeout=120)
    out = work / command[command.index("-f") + 1]
    out.unlink(missing_ok=True)
    ran = subprocess.run([str(pa.binary), *command[1:], "-v"], capture_output=True, text=True, env=pa.env(),
                         cwd=work, timeout=300)
    if ran.returncode or not out.exists():
        raise RuntimeError(f"perf_analyzer failed ({ran.returncode}): {(ran.stdout + ran.stderr)[-600:]}")
    p50_ms, throughput = parse_csv(out.read_text())
    return Figures(p50_ms, throughput, parse_windows(ran.stdout))


def measure_forms(spec: str, pa: PerfAnalyzer, out_dir: Path, *, levels: tuple[int, ...], window_s: float,
                  warmup_s: float, turns: int, protocol: str = "http", progress: bool = True) -> dict:
    """A pipeline's every form at each level, measured by perf_analyzer on the embedded server as ``pipelines bench``
    measures them: the bench's requests, repository and server; the levels the outer loop, each level ``turns`` times
    round the forms (a warm-up of ``warmup_s`` in the first turn only), each turn :data:`WINDOWS` windows of
    ``window_s``; the turns pooled, infer/s and p50 each as their mean (perf_analyzer reports no single latencies).

    Returns ``{"figures": {(form, level): (p50 ms, infer/s, each window's infer/s)}, "failed": {...}, "commands":
    [...]}``: a measurement perf_analyzer could not make is named in ``failed`` with why, and left out of ``figures``.
    """
    pipeline, module = load_pipeline_and_module(spec)
    samples = sample_requests(pipeline, module=module)  # the bench's: batch 1, size 16
    forms = [f for f in FORMS if not (f == "ensemble" and pipeline.conditional)]
    turns_of: dict[tuple[str, int], list[Figures]] = {}
    failed: dict[str, str] = {}
    commands: list[str] = []
    with ExitStack() as stack:
        repo = write_bench_repository(pipeline, out_dir, stack)
        server = stack.enter_context(TritonServer(repo, restart_on_crash=False))
        server.require(repository_pipelines(repo).get(pipeline.name, []))
        url = (server.grpc_url if protocol == "grpc" else server.http_url).split("://")[-1]
        data = input_data(samples, out_dir / "perf_analyzer_data.json", pipeline.batched)
        for c in levels:
            for turn in range(turns):
                for form in forms:
                    if f"{form} {c}" in failed:
                        continue
                    command = perf_analyzer_command(model_name(pipeline.name, form), url, c, window_s, WINDOWS,
                                                    data.name, "perf_analyzer.csv", protocol)
                    commands.append(" ".join(command))
                    try:
                        got = measure_perf_analyzer(pa, command, out_dir, warmup_s if turn == 0 else 0.0)
                    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                        failed[f"{form} {c}"] = str(exc)[-300:]
                        turns_of.pop((form, c), None)
                        continue
                    turns_of.setdefault((form, c), []).append(got)
                    if progress:
                        print(f"perf_analyzer {pipeline.name} {form} c={c} turn {turn + 1}/{turns}: "
                              f"p50 {got.p50_ms:.2f} ms, {got.throughput:.1f} infer/s", file=sys.stderr, flush=True)
    figures = {key: (sum(t.p50_ms for t in got) / len(got), sum(t.throughput for t in got) / len(got),
                     tuple(w for t in got for w in t.windows)) for key, got in turns_of.items()}
    return {"figures": figures, "failed": failed, "commands": commands}
