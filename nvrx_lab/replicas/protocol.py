"""What the coordinator and the replicas say to each other, and how a step's batch is shared.

One JSON object a line over one TCP connection a rank (:mod:`.client`, :mod:`.coordinator`). A rank says:

* ``hello`` — ``{"op": "hello", "replica": R, "rank": K, "ranks": W, "heal": bool}``: who it is (a replica group
  of ``W`` ranks; ``heal``: it starts without state and must get it from a live replica);
* ``join`` — group rank 0 only, once a step: ``{"op": "join", "step": s, "done": d}``: the group is ready for step
  ``s``, and finished the cross-replica reduction of step ``d`` (``None``: it did not, or has no step before);
* ``stuck`` — ``{"op": "stuck", "step": s, "qid": q}``: its reduction of step ``s`` has waited longer than the
  coordinator's patience (the coordinator then looks for who is missing);
* ``fail`` — ``{"op": "fail", "why": ...}``: an error is about to end this rank (its replica is dropped now, not
  once its process has exited, which a large process takes tens of milliseconds to do);
* ``beat`` — a heartbeat, so a silent node (no TCP reset) is noticed too.

The coordinator answers a ``join`` with a :class:`Quorum` (``{"op": "quorum", ...}``) once every live member is
ready, and pushes ``{"op": "abort", "qid": q, "why": ...}`` to every rank when a member of quorum ``q`` failed (its
connection closed, its heartbeats stopped, or it is the one everybody waits for), and ``{"op": "evict"}`` to the
ranks of the replica that failed (a hung one exits on it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Quorum:
    """Who trains step ``step``, and what became of the step before."""

    qid: int
    """Changes whenever the members do, or a sum failed without a member lost: a new cross-replica process group is made for it
    (:mod:`.group`)."""
    step: int
    """The step to compute now (the same step again after an abort)."""
    members: tuple[int, ...]
    """Replica ids, sorted: a replica's index in it is its share of the batch."""
    committed: int | None
    """The step every member of the previous quorum finished: apply its update; ``None``: nothing to apply."""
    donor: int | None = None
    """A live replica that sends its state to the ``joiners`` before this step."""
    joiners: tuple[int, ...] = ()
    """Replicas that start without state (a replacement): they receive it from ``donor``, then train this step."""
    epoch: dict = field(default_factory=dict)
    """Coordinator facts for the log (quorum formed in seconds, members lost since the last one)."""

    def index(self, replica: int) -> int:
        return self.members.index(replica)

    def to_json(self) -> str:
        return json.dumps({"op": "quorum", **asdict(self)})

    @classmethod
    def from_dict(cls, d: dict) -> Quorum:
        return cls(d["qid"], d["step"], tuple(d["members"]), d["committed"], d.get("donor"), tuple(d.get("joiners", ())),
                   d.get("epoch", {}))


def share(global_batch: int, parts: int, index: int) -> range:
    """Rows ``index`` of ``parts`` takes of a global batch: contiguous, sizes differing by one at most, every row
    taken exactly once whatever ``parts`` is (the survivors of a fault take the missing replica's share)."""
    if not 0 <= index < parts:
        raise ValueError(f"index {index} is not among {parts} parts")
    return range(index * global_batch // parts, (index + 1) * global_batch // parts)


def _ranges(rows: list[int]) -> list[range]:
    """Sorted row numbers as contiguous ranges."""
    out: list[range] = []
    for r in rows:
        if out and out[-1].stop == r:
            out[-1] = range(out[-1].start, r + 1)
        else:
            out.append(range(r, r + 1))
    return out


class StepShares:
    """Which rows of one step's global batch each replica holds the gradients of, across the aborts of that step.

    A step starts with every member's :func:`share` of the batch. When members leave mid-step, the survivors keep
    what they computed and take the rows the leavers held, split among them: :meth:`redo` says which rows a
    replica must compute now. Every survivor sees the same quorums, so every one computes the same table; the
    union of the held rows is always the whole batch, each row once."""

    def __init__(self, global_batch: int, quorum: Quorum):
        self.global_batch = global_batch
        self.members = quorum.members
        self.held: dict[int, list[int]] = {m: list(share(global_batch, len(self.members), i))
                                           for i, m in enumerate(self.members)}

    def redo(self, quorum: Quorum) -> dict[int, list[range]]:
        """The new quorum (a subset of the last one) after an abort: what each member computes now."""
        gone = [m for m in self.members if m not in quorum.members]
        if any(m not in self.members for m in quorum.members):
            raise ValueError(f"a redo cannot admit replicas: {quorum.members} after {self.members}")
        lost = sorted(r for m in gone for r in self.held.pop(m))
        new: dict[int, list[range]] = {}
        for i, m in enumerate(quorum.members):
            part = [lost[j] for j in share(len(lost), len(quorum.members), i)]
            self.held[m] = sorted(self.held[m] + part)
            new[m] = _ranges(part)
        self.members = quorum.members
        return new

    def rows(self, replica: int) -> list[range]:
        return _ranges(self.held[replica])


def rank_part(rows: list[range], rank: int, ranks: int) -> list[range]:
    """A replica's rows split among its ``ranks`` ranks: this rank's part (contiguous in the flattened list)."""
    flat = [r for rng in rows for r in rng]
    return _ranges([flat[j] for j in share(len(flat), ranks, rank)])


def encode(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


__all__ = ["Quorum", "StepShares", "encode", "rank_part", "share"]
