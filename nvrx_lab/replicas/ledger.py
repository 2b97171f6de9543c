"""The data ledger: was every row of every committed step trained exactly once, across faults and heals?

Each rank writes a ``ledger`` event when its part of a step's reduction completes: the step, the quorum (``qid``)
and the rows of the global batch whose gradients it contributed. The coordinator's ``quorum`` events say which
steps were committed. A committed step's rows are those of its last reduction (an aborted step is redone under a
new quorum); their union must be the whole global batch, every row once.

A loop given the data's ``sample_ids`` also names each row's sample: no sample may be trained in two committed steps
(a resumed or healed replica that replayed the stream from the wrong position would). The rows say what was trained;
the ``fingerprint`` events (:mod:`.fingerprint`) say what it became: every few committed steps, rank ``k`` of each
replica reports sums over its shard of the parameters and the optimizer's state, which must be equal across the
replicas.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.observe.events import read_events


@dataclass
class Ledger:
    steps: int = 0
    """Committed steps checked."""
    lost: int = 0
    """Rows of committed steps no replica trained."""
    duplicated: int = 0
    """Rows trained more than once in a committed step."""
    bad_steps: list[int] = field(default_factory=list)
    samples: int = 0
    """Samples of committed steps named by id (a loop given ``sample_ids``: the data's own samples)."""
    repeated: int = 0
    """Samples trained in more than one committed step."""
    fingerprinted: int = 0
    """Steps whose replicas' fingerprints were compared."""
    diverged: list[str] = field(default_factory=list)
    """Each step and rank whose replicas' fingerprints differ, one line each."""

    @property
    def exact(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.repeated == 0

    @property
    def agree(self) -> bool:
        return not self.diverged

    def line(self) -> str:
        verdict = "every row exactly once" if self.exact else f"steps {self.bad_steps[:5]} wrong"
        prints = (f"; the replicas' parameters agree at {self.fingerprinted} fingerprinted steps" if self.agree else
                  f"; the replicas' parameters DIFFER at {len(self.diverged)} (step, rank): {self.diverged[0]}")
        named = f"; {self.samples} samples by id, {self.repeated} in two steps" if self.samples else ""
        return (f"ledger: {self.steps} committed steps, {self.lost} samples lost, {self.duplicated} duplicated "
                f"({verdict}){named}{prints if self.fingerprinted else ''}")


def check(coordinator_events: list[dict], replica_events: list[dict], global_batch: int) -> Ledger:
    committed = sorted({e["committed"] for e in coordinator_events if e["kind"] == "quorum" and e["committed"] is not None})
    rows: dict[tuple[int, int], Counter] = defaultdict(Counter)
    samples: dict[tuple[int, int], list[int]] = defaultdict(list)
    last_qid: dict[int, int] = {}
    for e in replica_events:
        if e["kind"] != "ledger":
            continue
        key = (e["step"], e["qid"])
        last_qid[e["step"]] = max(last_qid.get(e["step"], -1), e["qid"])
        for start, stop in e["rows"]:
            rows[key].update(range(start, stop))
        samples[key] += e.get("samples", [])
    out = Ledger(steps=len(committed))
    named = Counter(i for step in committed for i in set(samples.get((step, last_qid.get(step, -1)), [])))
    out.samples, out.repeated = len(named), sum(n - 1 for n in named.values() if n > 1)
    for step in committed:
        got = rows.get((step, last_qid.get(step, -1)), Counter())
        lost = sum(1 for r in range(global_batch) if got[r] == 0)
        dup = sum(n - 1 for n in got.values() if n > 1) + sum(n for r, n in got.items() if not 0 <= r < global_batch)
        out.lost, out.duplicated = out.lost + lost, out.duplicated + dup
        if lost or dup:
            out.bad_steps.append(step)
    prints = _fingerprints(replica_events)
    out.fingerprinted = len({step for step, _ in prints})
    out.diverged = [f"step {step} rank {rank}: " + ", ".join(f"replica {r} {v}" for r, v in sorted(by.items()))
                    for (step, rank), by in sorted(prints.items()) if len(set(by.values())) > 1]
    return out


FINGERPRINT_KINDS = ("params", "optimizer")


def _fingerprints(events: list[dict]) -> dict[tuple[int, int], dict[int, tuple[float, ...]]]:
    """(step, rank) -> replica -> its fingerprint."""
    out: dict[tuple[int, int], dict[int, tuple[float, ...]]] = defaultdict(dict)
    for e in events:
        if e["kind"] == "fingerprint":
            out[(e["step"], e["rank"])][e["replica"]] = tuple(x for k in FINGERPRINT_KINDS for x in e[k])
    return out


def fingerprint_gap(a: list[dict], b: list[dict]) -> dict[int, float]:
    """Step -> the largest relative difference between two runs' fingerprints (each rank of replica 0): a faulty run
    against a fault-free one, whose redo summed the same rows in another order."""
    pa, pb = _fingerprints(a), _fingerprints(b)
    gaps: dict[int, float] = {}
    for key in sorted(pa.keys() & pb.keys()):
        x, y = pa[key].get(0), pb[key].get(0)
        if x is not None and y is not None:
            gap = max(abs(u - v) / max(abs(u), abs(v), 1e-12) for u, v in zip(x, y, strict=True))
            gaps[key[0]] = max(gaps.get(key[0], 0.0), gap)
    return gaps


def redone_steps(coordinator_events: list[dict]) -> int:
    """Steps the members computed and did not commit: a quorum for the same step as the one before it (a redo)."""
    quorums = [e for e in coordinator_events if e["kind"] == "quorum"]
    return sum(1 for a, b in zip(quorums, quorums[1:], strict=False) if b["step"] == a["step"])


def check_dir(folder: str | Path, global_batch: int) -> Ledger:
    """:func:`check` over a :mod:`.local` run's folder (``coordinator.jsonl``, ``replica*.jsonl``)."""
    folder = Path(folder)
    replicas = [e for p in sorted(folder.glob("replica*.jsonl")) for e in read_events(p)]
    return check(read_events(folder / "coordinator.jsonl"), replicas, global_batch)
