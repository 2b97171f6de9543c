"""Notebook 00's map (`nvrx_lab.observe.diagram.draw_architecture`): every arrow ends where the text says it goes.

Read from the figure itself: each box is found by its label, each arrow by its two ends.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from nvrx_lab.observe.diagram import draw_architecture  # noqa: E402


def _boxes(ax) -> list[tuple[tuple[float, float, float, float], str]]:
    """(x, y, w, h) and label of every box; a label belongs to the smallest box around its anchor."""
    rects = [(p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in ax.patches if isinstance(p, FancyBboxPatch)]
    labels = {r: "" for r in rects}
    for t in ax.texts:
        around = [r for r in rects if _inside(t.get_position(), r)]
        if around:
            labels[min(around, key=lambda r: r[2] * r[3])] += t.get_text()
    return list(labels.items())


def _inside(point, rect, eps=1e-6) -> bool:
    (px, py), (x, y, w, h) = point, rect
    return x - eps <= px <= x + w + eps and y - eps <= py <= y + h + eps


def _box_at(boxes, point) -> str:
    """Label of the smallest box around ``point`` ('' when none)."""
    around = [(r, label) for r, label in boxes if _inside(point, r)]
    return min(around, key=lambda b: b[0][2] * b[0][3])[1] if around else ""


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_beats_to_its_own_monitor(ranks):
    fig = draw_architecture(ranks=ranks)
    try:
        ax = fig.axes[0]
        boxes = _boxes(ax)
        workers = [r for r, label in boxes if label.startswith("worker process, rank")]
        assert len(workers) == ranks
        beats = {}
        for arrow in (p for p in ax.patches if isinstance(p, FancyArrowPatch)):
            start, end = arrow._posA_posB
            if _box_at(boxes, start).startswith("main thread") and end[1] > start[1]:  # up from a main thread
                (worker,) = [label for r, label in boxes if label.startswith("worker process") and _inside(start, r)]
                beats[int(worker.rsplit(" ", 1)[1])] = _box_at(boxes, end)
        assert sorted(beats) == list(range(ranks)), f"one heartbeat arrow per rank: {beats}"
        for rank, target in beats.items():
            assert "monitor" in target and f"rank {rank}" in target, \
                f"rank {rank}'s heartbeats point at {target!r}, not at rank {rank}'s monitor"
    finally:
        plt.close(fig)
