"""PNG plots of throughput and p95 latency against concurrency, one line per configuration,
the way the yolov5 Triton guide draws its BLS-against-ensemble figures; for a streaming
pipeline also its time to first response (p50).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .measurement import FORMS, Measurement

__all__ = ["PLOT_EXTRA", "PLOT_FILES", "plot_results"]

#: The extra that installs matplotlib: ``pip install 'pipelines[plot]'``.
PLOT_EXTRA = "plot"

#: The files plot_results writes (the last one for a streaming pipeline only).
PLOT_FILES = ("throughput.png", "latency_p95.png", "ttft_p50.png")

# One colour and marker per form; the local runtime dashed, the server solid, so each
# form's prediction sits next to its measurement.
_STYLES = {form: ("os^Dvp<>"[i % 8], f"C{i % 10}") for i, form in enumerate(FORMS)}


def plot_results(measurements: Sequence[Measurement], out: str | os.PathLike[str], *, title: str) -> list[Path]:
    """Write ``throughput.png`` and ``latency_p95.png`` into ``out``, and for a streaming pipeline
    ``ttft_p50.png`` (time to first response per form); return their paths.

    Raises ImportError without matplotlib (the ``plot`` extra); the benchmark then
    says so in one line, its results already written.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here, nor wanted
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[Measurement]] = {}
    for m in measurements:
        series.setdefault(m.config.label, []).append(m)
    written = []
    figures = [
        (PLOT_FILES[0], "throughput (infer/s)", lambda m: m.throughput),
        (PLOT_FILES[1], "p95 latency (ms)", lambda m: m.latency.p95_ms),
    ]
    if any(m.stream is not None for m in measurements):
        figures.append((PLOT_FILES[2], "time to first response, p50 (ms)",
                        lambda m: m.stream.ttft.p50_ms if m.stream is not None else None))
    for filename, ylabel, value in figures:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        try:
            for label, points in series.items():
                points = sorted((p for p in points if value(p) is not None), key=lambda p: p.concurrency)
                if not points:
                    continue
                where, form = points[0].config.where, points[0].config.form
                ax.plot(
                    [p.concurrency for p in points],
                    [value(p) for p in points],
                    marker=_STYLES.get(form, ("o", None))[0],
                    color=_STYLES.get(form, ("o", None))[1],
                    linestyle="-" if where == "server" else "--",
                    label=label,
                )
            levels = sorted({m.concurrency for m in measurements})
            if levels and levels[-1] / max(levels[0], 1) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(levels)
            ax.set_xticklabels([str(c) for c in levels])
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {ylabel.split(' (')[0]}")
            ax.grid(True, alpha=0.3)
            if series:
                ax.legend()
            fig.tight_layout()
            path = out / filename
            fig.savefig(path)
            written.append(path)
        finally:
            plt.close(fig)
    return written
