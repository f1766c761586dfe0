"""curation.audit.charts: bars of counts binned a part at a time draw as the values themselves would."""

from __future__ import annotations

import numpy as np

from curation.audit import charts


def test_counted_histogram_draws_the_bars_of_the_values():
    values = np.random.default_rng(0).random(500)
    edges = np.linspace(0, 1, 21)
    counts = np.histogram(values[:200], edges)[0] + np.histogram(values[200:], edges)[0]
    fig = charts.figure()
    direct, counted = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    direct.hist(values, bins=edges)
    charts.counted_histogram(counted, edges, counts)
    assert [p.get_height() for p in direct.patches] == [p.get_height() for p in counted.patches]
    assert charts.png(fig).startswith(b"\x89PNG")


def test_bar_chart_and_score_histogram():
    fig = charts.bar_chart(["a", "b"], {"x": [1, 2], "y": [3, 4]}, "t", "images")
    assert len(fig.axes[0].patches) == 4
    values = np.append(np.linspace(0, 1, 100), 1000.0)
    fig = charts.score_histogram(values, values < 0.3, 0.3, title="q")
    assert "above" in fig.axes[0].get_title()  # the one huge value is counted in the last bin, and said so
