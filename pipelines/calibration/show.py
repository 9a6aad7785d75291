"""A profile as a small table and as a plot of cost against bytes (measured points,
the replayed cost per size, the straight line through them), one panel per boundary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..tables import format_table
from .probes import size_label
from .profile import BOUNDARIES, Profile

__all__ = ["plot_profile", "profile_table"]


def profile_table(profile: Profile) -> str:
    where = profile.url or "the bundled server"
    by_size = ", ".join(f"{lanes:.2f} at {size_label(n)}" for n, lanes in profile.lanes_by_size)
    head = (
        f"server profile: Triton {profile.server_version or '?'} at {where} over {profile.protocol}, "
        f"{profile.machine.get('cpu') or '?'} ({profile.machine.get('cpu_count') or '?'} cores), {profile.date}; "
        f"{profile.lanes:.2f} lanes{f' ({by_size})' if by_size else ''} "
        "(requests whose boundaries it works on at once)\n"
    )
    rows = []
    for name in BOUNDARIES:
        cost = profile.costs[name]
        rows.append((name, f"{cost.fixed_us:.0f}", f"{cost.us_per_mib:.0f}", f"{cost.us(1 << 20) / 1e3:.2f}"))
    return head + format_table(("boundary", "fixed µs", "µs per MiB", "ms at 1 MiB"), rows) + "\n"


def plot_profile(profile: Profile, path: str | os.PathLike[str] | None = None) -> Any:
    """Cost against bytes per boundary, log-log; written as PNG to ``path`` if given. Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")  # a file only: no display needed
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(BOUNDARIES) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows), dpi=100, squeeze=False)
    for ax, name in zip(axes.flat, BOUNDARIES, strict=False):
        points = [p for p in profile.points if p.boundary == name]
        cost = profile.costs[name]
        if points:
            x = np.array([p.nbytes for p in points], float)
            y = np.array([p.cost_us for p in points], float)
            keep = y > 0  # a noisy probe can leave a negative remainder, which a log axis cannot show
            ax.scatter(x[keep], y[keep] / 1e3, s=14, alpha=0.7, label="measured")
            grid = np.geomspace(x.min(), x.max(), 50)
        else:
            grid = np.geomspace(1 << 10, 64 << 20, 50)
        ax.plot(grid, [cost.us(b) / 1e3 for b in grid], "C1", label=f"{cost.fixed_us:.0f} µs + {cost.us_per_mib:.0f} µs/MiB")
        if cost.sizes:  # what the replay spends: the cost at each measured size, in + out
            ax.plot([2 * s for s in cost.sizes], [(i + o) / 1e3 for i, o in zip(cost.in_us, cost.out_us, strict=True)],
                    "C2.--", label="replayed (per size)")
        ax.set_xscale("log")
        if any(p.cost_us > 0 for p in points) or cost.fixed_us > 0 or cost.us_per_mib > 0:
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("bytes crossing (in + out)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("cost (ms)")
    fig.suptitle(f"Triton {profile.server_version or '?'} over {profile.protocol}, {profile.date}", fontsize=9)
    fig.tight_layout()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")  # at ``path`` as given: no extension added
        plt.close(fig)
    return fig
