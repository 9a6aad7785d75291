"""A profile as tables (each boundary's line, and its cost at each size, with their confidence
intervals) and as a plot of cost against bytes (measured points, the cost per size with its
interval, the straight line through them), one panel per boundary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..tables import format_table
from .cost import BOUNDARIES, size_label

__all__ = ["plot_profile", "profile_table"]

# A profile is typed Any here: Profile.table and Profile.plot call this module, so it cannot import
# the one that defines Profile (pipelines.calibration.profile) without making an import circle.


def profile_table(profile: Any) -> str:
    """The profile's head line, each boundary's line (fixed µs, µs per MiB, with intervals), and
    each boundary's cost at each measured size (in + out, ms, with intervals)."""
    where = profile.url or "the bundled server"
    by_size = ", ".join(f"{lanes:.2f} at {size_label(n)}" for n, lanes in profile.lanes_by_size)
    head = (
        f"server profile: Triton {profile.server_version or '?'} at {where} over {profile.protocol}, "
        f"{profile.machine.get('cpu') or '?'} ({profile.machine.get('cpu_count') or '?'} cores), {profile.date}; "
        f"{profile.lanes:.2f} lanes{f' ({by_size})' if by_size else ''} "
        "(requests whose boundaries it works on at once)\n"
    )
    if profile.rounds:
        head += (f"medians over {profile.rounds} rounds; [low-high]: {profile.ci_level:.0%} intervals, "
                 "a bootstrap over the rounds\n")
    for points, what in ((profile.wake, "a hand-off to a side that waited, beyond the boundaries (wake)"),
                         (profile.wake_idle, "the same once every core idled (wake_idle)")):
        if points:
            head += f"{what}: {', '.join(f'{us:.0f} µs after {waited / 1e3:g} ms' for waited, us in points)}\n"
    if profile.round_request_us:
        head += f"each request of a fused model's round beyond the first (round_request): {profile.round_request_us:.0f} µs\n"
    rows = []
    for name in BOUNDARIES:
        cost = profile.costs[name]
        rows.append((name, _with(cost.fixed_us, cost.fixed_ci, _us), _with(cost.us_per_mib, cost.per_mib_ci, _us),
                     f"{cost.us(1 << 20) / 1e3:.2f}"))
    lines = format_table(("boundary", "fixed µs", "µs per MiB", "ms at 1 MiB"), rows)
    sizes = sorted({n for cost in profile.costs.values() for n in cost.sizes})
    if sizes:
        per_size = []
        for name in BOUNDARIES:
            cost = profile.costs[name]
            cells = []
            for n in sizes:
                if n not in cost.sizes:
                    cells.append("")
                    continue
                i = cost.sizes.index(n)
                total = (cost.in_us[i] + cost.out_us[i]) / 1e3
                ci = cost.total_ci[i] if cost.total_ci else None
                cells.append(_with(total, None if ci is None else (ci[0] / 1e3, ci[1] / 1e3), _ms))
            per_size.append((name, *cells))
        lines += ("\n\neach size, in + out, ms\n"
                  + format_table(("boundary", *(size_label(n) for n in sizes)), per_size))
    if _UNMEASURABLE in lines:
        head += (f"{_UNMEASURABLE} (≤ high): a cost this machine's noise cannot tell from 0 (its interval "
                 "reaches below zero); the profile prices it at its figure, and it is at most its high bound\n")
    return head + lines + "\n"


def _us(v: float) -> str:
    return f"{v:.0f}"


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _with(value: float, ci: tuple[float, float] | None, show) -> str:
    """``value``, and its interval after it where there is one: ``346 [295-383]``; where the
    interval reaches below zero, the cost cannot be told from 0 here: ``not measurable here (≤ 35)``."""
    if ci is None:
        return show(value)
    if not any(_below_zero(bound, show) for bound in ci):
        return f"{show(value)} [{show(max(0.0, ci[0]))}-{show(max(0.0, ci[1]))}]"
    at_most = show(ci[1]) if ci[1] > 0 else ""
    return _UNMEASURABLE + (f" (≤ {at_most})" if at_most.strip("0.") else "")


#: A cost whose interval reaches below zero: the bounds (``0 [−5797…+14414]``) would say less.
_UNMEASURABLE = "not measurable here"


def _below_zero(v: float, show) -> bool:
    """Whether ``v`` shows as a figure below zero (-0.3 µs shows as 0)."""
    return v < 0 and show(-v).strip("0.") != ""


def plot_profile(profile: Any, path: str | os.PathLike[str] | None = None) -> Any:
    """Cost against bytes per boundary, log-log; written as PNG to ``path`` if given. Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")  # a file only: no display needed
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(BOUNDARIES) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows + 0.4), dpi=100, squeeze=False)
    for ax in axes.flat[len(BOUNDARIES):]:
        ax.remove()  # no empty panel where the boundaries do not fill the last row
    for ax, name in zip(axes.flat, BOUNDARIES, strict=False):
        _panel(ax, profile, name)
    for row in axes:
        row[0].set_ylabel("cost (ms)")
    fig.suptitle(f"Triton {profile.server_version or '?'} over {profile.protocol}, {profile.date}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # the title's band, above every panel
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")  # at ``path`` as given: no extension added
        plt.close(fig)
    return fig


#: Below a microsecond a cost is noise, not a figure: nothing is drawn there on a log axis.
_FLOOR_MS = 1e-3


def _panel(ax: Any, profile: Any, name: str) -> None:
    """One boundary's panel: measured points, its line, and its cost per size with the interval."""
    points = [p for p in profile.points if p.boundary == name]
    cost = profile.costs[name]
    shown: list[float] = []  # every value drawn, for the axis's lower end
    if points:
        x = np.array([p.nbytes for p in points], float)
        y = np.array([p.cost_us for p in points], float) / 1e3
        keep = y > _FLOOR_MS  # a noisy probe can leave a remainder at or below zero, which a log axis cannot show
        ax.scatter(x[keep], y[keep], s=14, alpha=0.7, label="measured")
        shown += list(y[keep])
        grid = np.geomspace(x.min(), x.max(), 50)
    else:
        grid = np.geomspace(1 << 10, 64 << 20, 50)
    line = np.array([cost.us(b) / 1e3 for b in grid])
    if line.max() > _FLOOR_MS:
        ax.plot(grid, np.where(line > _FLOOR_MS, line, np.nan), "C1",
                label=f"{cost.fixed_us:.0f} µs + {cost.us_per_mib:.0f} µs/MiB")
        shown += [v for v in line if v > _FLOOR_MS]
    else:
        ax.plot([], [], "C1", label="line: not measurable here")
    if cost.sizes:  # what a prediction spends: the cost at each measured size, in + out
        x = np.array([2 * s for s in cost.sizes], float)
        y = np.array([(i + o) / 1e3 for i, o in zip(cost.in_us, cost.out_us, strict=True)])
        ax.plot(x, np.where(y > _FLOOR_MS, y, np.nan), "C2.--", label="per size")
        shown += [v for v in y if v > _FLOOR_MS]
        if cost.total_ci:
            low, high = (np.array([c[k] for c in cost.total_ci]) / 1e3 for k in (0, 1))
            shown += [v for v in high if v > _FLOOR_MS]
            # an interval that reaches below the axis is drawn to the axis's lower end
            ax.fill_between(x, np.maximum(low, _FLOOR_MS), np.maximum(high, _FLOOR_MS), color="C2", alpha=0.2,
                            label=f"{profile.ci_level:.0%} interval")
    ax.set_xscale("log")
    if shown:
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(shown) / 2)
    ax.set_title(name)
    ax.set_xlabel("bytes crossing (in + out)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
