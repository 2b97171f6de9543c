"""The detector: every interval, one small all-gather, then the same scores on every rank
=======================================================================================

Each rank keeps its own section times per step (:class:`~.timers.ComputeTimer`). Every ``interval``
steps :meth:`Detector.report` reduces them to one median per section and gathers those few floats
from every rank over the CPU (gloo) group — ``8 × sections`` bytes a rank, ``O(N)`` in all — so every
rank holds the same matrix and computes the same :class:`~.scores.Report`: relative and individual
scores, and the ranks whose ``compute`` score is below ``threshold``. Such a rank is *named* a
straggler once it was below in ``patience`` consecutive reports (default 2: one noisy interval on a
shared machine names nobody; a rank slowed for good is named at the second report).

The exchange is one collective of the group, bounded by the group's timeout: a peer that died
fails it at once (gloo sees the closed connection), one that hangs fails it after the timeout; the
error propagates to the caller like any failed collective.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .scores import Medians, Report, best_so_far, identify_stragglers, individual_perf_scores, relative_perf_scores
from .timers import SECTIONS


class Detector:
    """Scores every rank every ``interval`` steps (NVRx: ``straggler.Detector``)."""

    def __init__(self, interval: int = 10, threshold: float = 0.75, group: dist.ProcessGroup | None = None,
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
        self.history: Medians = []
        self.strikes: dict[int, int] = {}
        self.exchange_s = 0.0
        """Seconds spent in exchanges so far (the detector's own overhead, besides its hooks)."""

    def record(self, times: list[dict[str, float]]) -> None:
        """Section times of steps (``{section: seconds}`` each) since the last call."""
        self.steps.extend(times)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def own_medians(self) -> list[float]:
        return [statistics.median(t.get(s, 0.0) for t in self.steps) if self.steps else 0.0 for s in self.sections]

    def gather(self, own: list[float]) -> Medians:
        """Every rank's medians; one all-gather of ``len(sections)`` float64 per rank."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [dict(zip(self.sections, own, strict=True))]
        mine = torch.tensor(own, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, mine, group=self.group)
        return [dict(zip(self.sections, t.tolist(), strict=True)) for t in out]

    def report(self, step: int) -> Report:
        """Gather, score, and forget this interval's steps (a collective: every rank calls it at ``step``)."""
        t0 = time.perf_counter()
        medians = self.gather(self.own_medians())
        self.exchange_s += time.perf_counter() - t0
        self.steps = []
        relative = relative_perf_scores(medians)
        individual = individual_perf_scores(medians, self.history) if self.history else [
            dict.fromkeys(m, 1.0) for m in medians]
        self.history = best_so_far(self.history, medians)
        below = identify_stragglers(relative, individual, self.threshold)
        self.strikes = {s.rank: self.strikes.get(s.rank, 0) + 1 for s in below}
        named = [s for s in below if self.strikes[s.rank] >= self.patience]
        return Report(step, medians, relative, individual, named)
