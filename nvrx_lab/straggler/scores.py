"""Performance scores from every rank's section times (pure functions, no process group)
=====================================================================================

NVRx's two scores, per section (e.g. ``forward``, ``optimizer``):

* :func:`relative_perf_scores` — a rank's median time against the fastest rank's: ``best / own``;
  1.0 is the fastest rank, 0.5 a rank twice as slow as it. Every rank slowed alike (a loaded machine)
  keeps every score near 1.0: a straggler is slow *relative to its peers*.
* :func:`individual_perf_scores` — a rank's median against its own best interval so far: ``best_own /
  own``; a rank that became slower than it used to be scores below 1.0 (whatever its peers do).

:func:`identify_stragglers` names the ranks whose relative score on ``compute`` (the sum of a step's
sections: one number that noise in a single section moves less) is below a threshold, with the
section that is slowest relative to its peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Medians = list[dict[str, float]]
"""Per rank (the list index), per section: the median seconds of one reporting interval."""


def _ratio(best: float, own: float) -> float:
    """``best / own``; 1.0 when nothing was timed (a section a rank does not run)."""
    return 1.0 if own <= 0.0 or best <= 0.0 else min(1.0, best / own)


def relative_perf_scores(medians: Medians) -> list[dict[str, float]]:
    """Each rank's score per section against the fastest rank's median of that section."""
    sections = sorted({s for m in medians for s in m})
    best = {s: min((m[s] for m in medians if m.get(s, 0.0) > 0.0), default=0.0) for s in sections}
    return [{s: _ratio(best[s], m.get(s, 0.0)) for s in sections} for m in medians]


def individual_perf_scores(medians: Medians, history: Medians) -> list[dict[str, float]]:
    """Each rank's score per section against ``history``: its own best (smallest) median so far."""
    return [{s: _ratio(past.get(s, 0.0), own) for s, own in m.items()}
            for m, past in zip(medians, history, strict=True)]


def best_so_far(history: Medians, medians: Medians) -> Medians:
    """``history`` updated with this interval: the smallest (timed) median per rank and section."""
    if not history:
        return [dict(m) for m in medians]
    merged = []
    for m, past in zip(medians, history, strict=True):
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
    """Relative score of ``compute`` (the fastest rank's median / this rank's)."""
    section: str
    """The section (besides ``compute``) with the lowest relative score: where the time goes."""
    individual: float
    """The individual score of ``compute`` (against this rank's own best)."""


@dataclass
class Report:
    """One reporting interval, as every rank sees it (they all gather the same numbers)."""

    step: int
    medians: Medians
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
