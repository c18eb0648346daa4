"""Line charts as PNG files, drawn by matplotlib (Agg) from the optional `plot` extra.

The demo's reward curve and the benchmarks' charts (bench/report.py) are drawn here. Without
matplotlib (`pip install -e '.[plot]'`) `line_chart` draws nothing and returns None, so the
demo still runs and says where the chart would have been. Nothing else imports matplotlib,
and this module imports it only when a chart is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DPI = 100
MISSING = "matplotlib is not installed (pip install -e '.[plot]')"
"""Why a chart was skipped, for the caller's one-line note."""


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: tuple[int, int, int]
    """RGB, 0-255."""
    markers: bool = False


def line_chart(
    path: str | Path, series: Sequence[Series], title: str, x_label: str, width: int = 800, height: int = 450
) -> Path | None:
    """Draw `series` against shared axes (y from min(0, data) to max(1, data)) into a PNG of
    `width` x `height` pixels; None, with nothing written, when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    ys = [y for s in series for y in s.ys] or [0.0, 1.0]
    y0, y1 = min(0.0, min(ys)), max(1.0, max(ys))
    axes.set_ylim(y0, y1 + 0.03 * (y1 - y0))  # headroom, so markers at the top are whole
    if all(float(x).is_integer() for s in series for x in s.xs):  # steps, replicas, groups: no 2.5
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, color="#c8c8c8", linewidth=0.8)
    for s in series:
        axes.plot(
            list(s.xs),
            list(s.ys),
            color=tuple(c / 255 for c in s.color),
            linewidth=2,
            marker="o" if s.markers else None,
            markersize=5,
            label=s.label,
        )
    axes.set_title(title, loc="left")
    axes.set_xlabel(x_label)
    if series:
        axes.legend(loc="best", frameon=False)
    out = Path(path)
    figure.savefig(out, format="png")
    return out
