"""Performance scores from every rank's section times (pure functions, no process group)
=====================================================================================

NVRx's two scores, per section (e.g. ``forward``, ``optimizer``):

Each rank's time of a section is its mean per step over one reporting interval (:mod:`.detector` says
why the mean).

* :func:`relative_perf_scores` — a rank's time against the fastest rank's: ``best / own``;
  1.0 is the fastest rank, 0.5 a rank twice as slow as it. Every rank slowed alike (a loaded machine)
  keeps every score near 1.0: a straggler is slow *relative to its peers*.
* :func:`individual_perf_scores` — a rank's time against its own best interval so far: ``best_own /
  own``; a rank that became slower than it used to be scores below 1.0 (whatever its peers do).

:func:`identify_stragglers` names the ranks whose relative score on ``compute`` (the sum of a step's
sections: one number that noise in a single section moves less) is below a threshold, with the
section that is slowest relative to its peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THRESHOLD = 0.8
"""The default threshold: a rank computing below 0.8 of the fastest rank's speed (1.25× its time) is below.
A rank slowed 1.5× scores 0.67. On a shared 2-core CPU box, over 8,000 healthy steps (2 and 4 ranks, quiet
and under two busy loops) no healthy rank stayed below 0.86 for two 30-step reports in a row, while a rank
slowed 1.5× scored up to 0.79 in some reports: a threshold of 0.75 missed those."""

Times = list[dict[str, float]]
"""Per rank (the list index), per section: the mean seconds per step of one reporting interval."""


def _ratio(best: float, own: float) -> float:
    """``best / own``; 1.0 when nothing was timed (a section a rank does not run)."""
    return 1.0 if own <= 0.0 or best <= 0.0 else min(1.0, best / own)


def relative_perf_scores(times: Times) -> list[dict[str, float]]:
    """Each rank's score per section against the fastest rank's time of that section."""
    sections = sorted({s for m in times for s in m})
    best = {s: min((m[s] for m in times if m.get(s, 0.0) > 0.0), default=0.0) for s in sections}
    return [{s: _ratio(best[s], m.get(s, 0.0)) for s in sections} for m in times]


def individual_perf_scores(times: Times, history: Times) -> list[dict[str, float]]:
    """Each rank's score per section against ``history``: its own best (smallest) time so far."""
    return [{s: _ratio(past.get(s, 0.0), own) for s, own in m.items()}
            for m, past in zip(times, history, strict=True)]


def best_so_far(history: Times, times: Times) -> Times:
    """``history`` updated with this interval: the smallest (timed) time per rank and section."""
    if not history:
        return [dict(m) for m in times]
    merged = []
    for m, past in zip(times, history, strict=True):
        best = dict(past)
        for s, own in m.items():
            if own > 0.0:
                best[s] = min(own, past[s]) if past.get(s, 0.0) > 0.0 else own
        merged.append(best)
    return merged


@dataclass(frozen=True)
class Straggler:
    rank: int
    score: float
    """Relative score of ``compute`` (the fastest rank's time / this rank's)."""
    section: str
    """The section (besides ``compute``) with the lowest relative score: where the time goes."""
    individual: float
    """The individual score of ``compute`` (against this rank's own best)."""


@dataclass
class Report:
    """One reporting interval, as every rank sees it (they all gather the same numbers)."""

    step: int
    times: Times
    relative: list[dict[str, float]]
    individual: list[dict[str, float]]
    stragglers: list[Straggler] = field(default_factory=list)

    def by_section(self, scores: list[dict[str, float]]) -> dict[str, list[float]]:
        """``{section: [score of rank 0, rank 1, ...]}`` (how the event stream stores them)."""
        return {s: [round(r[s], 4) for r in scores] for s in sorted(scores[0])} if scores else {}


def identify_stragglers(relative: list[dict[str, float]], individual: list[dict[str, float]],
                        threshold: float, key: str = "compute") -> list[Straggler]:
    """Ranks whose relative score of ``key`` is below ``threshold``, each with its slowest section."""
    found = []
    for rank, (rel, ind) in enumerate(zip(relative, individual, strict=True)):
        if rel.get(key, 1.0) >= threshold:
            continue
        others = [s for s in rel if s != key] or [key]
        section = min(others, key=lambda s: (rel[s], s))
        found.append(Straggler(rank, rel[key], section, ind.get(key, 1.0)))
    return found
