"""The report's charts, drawn with matplotlib's Agg canvas (no display, no pyplot state) and saved as PNG."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np


def figure(width: float = 6.4, height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the Agg canvas: no display, no pyplot state
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def score_histogram(
    values: np.ndarray,
    rejected: np.ndarray,
    threshold: float | None,
    *,
    title: str,
    threshold_label: str = "",
    bins: int = 30,
):
    """Histogram of one score, stacked by whether the score's stage rejected the image; the threshold drawn."""
    fig = figure()
    ax = fig.add_subplot()
    lo, hi = float(np.min(values)), float(np.max(values))
    typical = float(np.quantile(values, 0.95))
    if typical > 0 and hi > 4 * typical:  # a few huge values (declared sizes of bombs) would squash the rest
        hi = 2 * typical
        title += f"\n{int((values > hi).sum())} above {hi:g} counted in the last bin"
        values = np.minimum(values, hi)
    if threshold is not None:
        lo, hi = min(lo, threshold), max(hi, threshold)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    ax.hist(
        [values[~rejected], values[rejected]],
        bins=edges,
        stacked=True,
        color=["#4c9a6a", "#c8553d"],
        label=["passed this stage", "rejected by this stage"],
    )
    if threshold is not None:
        ax.axvline(
            threshold, color="black", linestyle="--", linewidth=1.5, label=threshold_label or f"threshold {threshold:g}"
        )
    ax.set_title(title)
    ax.set_ylabel("images")
    ax.legend(fontsize=8)
    return fig


def bar_chart(
    labels: list[str], series: Mapping[str, Sequence[float]], title: str, ylabel: str, horizontal: bool = False
):
    fig = figure(
        max(6.4, 0.22 * len(labels) * len(series) + 2) if not horizontal else 6.4,
        3.2 if not horizontal else max(2.4, 0.32 * len(labels) + 1),
    )
    ax = fig.add_subplot()
    pos = np.arange(len(labels))
    width = 0.8 / max(1, len(series))
    colours = ["#5b7db1", "#4c9a6a", "#c8553d", "#9b6fb0"]
    for i, (name, values) in enumerate(series.items()):
        offset = pos + (i - (len(series) - 1) / 2) * width
        if horizontal:
            ax.barh(offset, values, height=width, label=name, color=colours[i % len(colours)])
        else:
            ax.bar(offset, values, width=width, label=name, color=colours[i % len(colours)])
    if horizontal:
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    else:
        ax.set_xticks(pos, labels, rotation=90 if len(labels) > 12 else 0, fontsize=8 if len(labels) > 12 else 10)
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return fig


def counted_histogram(ax, edges: np.ndarray, counts: np.ndarray, **style) -> None:
    """Bars of counts already binned on ``edges`` (a part of the data at a time), drawn as ``ax.hist`` draws the
    values themselves."""
    ax.hist(edges[:-1], bins=edges, weights=counts, **style)
