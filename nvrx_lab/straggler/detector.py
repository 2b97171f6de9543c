"""The detector: every interval, one small all-gather, then the same scores on every rank
=======================================================================================

Each rank keeps its own section times per step (:class:`~.timers.ComputeTimer`). Every ``interval``
steps :meth:`Detector.report` reduces them to one mean per section and gathers those few floats
from every rank over the CPU (gloo) group — ``8 × sections`` bytes a rank, ``O(N)`` in all — so every
rank holds the same matrix and computes the same :class:`~.scores.Report`: relative and individual
scores, and the ranks whose ``compute`` score is below ``threshold``. Such a rank is *named* a
straggler once it was below in ``patience`` consecutive reports (default 2: one noisy interval on a
shared machine names nobody; a rank slowed for good is named at the second report).

Why the mean of an interval's steps and not their median: the noise a healthy rank sees is not a
few outlying steps but stretches of several steps at another speed (a core shared with something
else, for a while). On a 2-core box one rank ran 9–10 ms steps for 7 steps, then 14–15 ms, while its
peer did the opposite. A median snaps to whichever stretch holds half the interval and moves the
whole way; a mean moves by the stretch's share. Over 8,000 healthy steps there (2 and 4 ranks, quiet
and under two busy loops, 30-step intervals), the lowest score a healthy rank held for two reports in
a row was 0.82 with the median and 0.86 with the mean; a rank slowed 1.5× scored at most 0.84 with
the median and 0.79 with the mean. A single outlying step (a collection, a page fault) moves one
interval's mean a little, and ``patience`` absorbs one interval.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .scores import THRESHOLD, Report, Times, best_so_far, identify_stragglers, individual_perf_scores, relative_perf_scores
from .timers import SECTIONS


class Detector:
    """Scores every rank every ``interval`` steps (NVRx: ``straggler.Detector``)."""

    def __init__(self, interval: int = 10, threshold: float = THRESHOLD, group: dist.ProcessGroup | None = None,
                 sections: tuple[str, ...] = ("compute", *SECTIONS), patience: int = 2):
        if interval < 1:
            raise ValueError(f"Detector interval must be >= 1 step, got {interval}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"Detector threshold must be in (0, 1], got {threshold}")
        self.interval, self.threshold, self.group = interval, threshold, group
        if patience < 1:
            raise ValueError(f"Detector patience must be >= 1 report, got {patience}")
        self.sections, self.patience = sections, patience
        self.steps: list[dict[str, float]] = []
        self.history: Times = []
        self.strikes: dict[int, int] = {}
        self.exchange_s = 0.0
        """Seconds spent in exchanges so far (the detector's own overhead, besides its hooks)."""

    def record(self, times: list[dict[str, float]]) -> None:
        """Section times of steps (``{section: seconds}`` each) since the last call."""
        self.steps.extend(times)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def own_means(self) -> list[float]:
        """This rank's mean seconds per step, per section, over the steps since the last report."""
        return [statistics.fmean(t.get(s, 0.0) for t in self.steps) if self.steps else 0.0 for s in self.sections]

    def gather(self, own: list[float]) -> Times:
        """Every rank's means; one all-gather of ``len(sections)`` float64 per rank."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [dict(zip(self.sections, own, strict=True))]
        mine = torch.tensor(own, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, mine, group=self.group)
        return [dict(zip(self.sections, t.tolist(), strict=True)) for t in out]

    def report(self, step: int) -> Report:
        """Gather, score, and forget this interval's steps (a collective: every rank calls it at ``step``)."""
        t0 = time.perf_counter()
        times = self.gather(self.own_means())
        self.exchange_s += time.perf_counter() - t0
        self.steps = []
        relative = relative_perf_scores(times)
        individual = individual_perf_scores(times, self.history) if self.history else [
            dict.fromkeys(m, 1.0) for m in times]
        self.history = best_so_far(self.history, times)
        below = identify_stragglers(relative, individual, self.threshold)
        self.strikes = {s.rank: self.strikes.get(s.rank, 0) + 1 for s in below}
        named = [s for s in below if self.strikes[s.rank] >= self.patience]
        return Report(step, times, relative, individual, named)
