"""The scale model's straggler detection: one report, scored on every rank from the gathered ``n``-rank matrix."""

from __future__ import annotations

import random
import time

from nvrx_lab.straggler import SECTIONS, Detector


def measure_straggler_report(n: int, reports: int = 5) -> dict:
    """What one straggler report costs each rank at ``n`` ranks: the bytes its all-gather brings (3 float64 per
    rank) and the CPU time of :meth:`nvrx_lab.straggler.Detector.report` scoring the gathered ``n``-rank
    matrix (the gloo all-gather itself is data plane: not simulated). The last rank is slowed 1.5×; every
    rank's times carry up to 5 % noise. Returns the fastest of ``reports`` reports (the noise is the machine's)."""
    rng, sections = random.Random(0), ("compute", *SECTIONS)

    class Gathered(Detector):
        def gather(self, own):  # every rank's means, as the all-gather returns them
            times = [{s: 0.01 * (1 + 0.05 * rng.random()) for s in sections} for _ in range(n)]
            times[-1] = {s: 1.5 * t for s, t in times[-1].items()}
            return times

    detector, best = Gathered(interval=1, patience=2), float("inf")
    for step in range(1, reports + 1):
        t = time.perf_counter()
        report = detector.report(step)
        best = min(best, time.perf_counter() - t)
    if [s.rank for s in report.stragglers] != [n - 1]:
        raise RuntimeError(f"the scale model's straggler report named {report.stragglers}, not rank {n - 1}")
    return {"straggler_report_ms": 1000 * best, "straggler_bytes_per_rank": 8 * len(sections) * n}
