"""What the coordinator and the replicas say to each other, and how a step's batch is shared.

One JSON object a line over one TCP connection a rank (:mod:`.client`, :mod:`.coordinator`), protocol
:data:`VERSION`. With a shared secret (``$NVRX_LAB_REPLICA_SECRET`` on the coordinator and every rank:
:func:`nvrx_lab.net.shared_secret`) the coordinator opens every connection with ``{"op": "challenge", "nonce": n}``
and a ``hello`` must carry ``"auth": HMAC-SHA256(secret, n)`` (:func:`proof`), or it is refused; a rank with a secret
refuses a coordinator without one. (The groups' data plane is torch's: gloo and NCCL connections carry no
authentication of their own.) A rank says:

* ``hello`` — ``{"op": "hello", "version": V, "replica": R, "rank": K, "ranks": W, "incarnation": I,
  "committed": c, "qid": q, "stored": b}``: who it is (rank ``K`` of replica group ``R``, which has ``W`` ranks;
  ``I``: its process, a new one for a replacement), the last step whose update it applied (``None``: it holds no
  trained state), the last quorum it heard, and whether its group saves storage checkpoints; first, and again after
  every reconnect to a restarted coordinator (:class:`Position`);
* ``join`` — group rank 0 only, once a step: ``{"op": "join", "step": s, "done": d}``: the group is ready for step
  ``s``, and finished the cross-replica reduction of step ``d`` (``None``: it did not, or has no step before);
* ``stuck`` — ``{"op": "stuck", "step": s, "qid": q}``: its reduction of step ``s`` has waited longer than the
  coordinator's patience (the coordinator then looks for who is missing);
* ``progress`` — ``{"op": "progress", "id": i, "rank": K, "ticks": n, "idle_s": t, "working": bool,
  "hang_after_s": h}``: the answer to probe ``i``: the units of work its device completed, the seconds since the
  last, whether it computes, and its hang limit (:mod:`.progress`);
* ``fail`` — ``{"op": "fail", "why": ...}``: an error is about to end this rank (its replica is dropped now, not
  once its process has exited, which a large process takes tens of milliseconds to do);
* ``beat`` — ``{"op": "beat"}``, every 0.5 s, so a silent node (no TCP reset) is noticed too;
* ``bye`` — ``{"op": "bye"}``: the group trained the last step and leaves (no failure).

The coordinator says:

* ``welcome`` — ``{"op": "welcome", "store_port": p, "healing": bool}``: the answer to ``hello``: the port of the
  ``TCPStore`` where every quorum's process group meets (:mod:`.group`; a restarted coordinator's is a new store),
  and whether the group starts without state;
* ``refused`` — ``{"op": "refused", "why": ...}``: the answer to a ``hello`` of another protocol version (the rank
  exits 2: a usage error);
* ``quorum`` — a :class:`Quorum`, to every rank of every member, once every live member joined the step;
* ``abort`` — ``{"op": "abort", "qid": q, "why": ...}``, to every rank, when a member of quorum ``q`` failed (its
  connection closed, its heartbeats stopped, or it is the one everybody waits for and its work makes no progress);
* ``evict`` — ``{"op": "evict", "why": ...}``, to the ranks of a member dropped as hung or silent, or of a replacement
  waiting to heal when every group failed and the job goes on from storage (they exit 3);
* ``probe`` — ``{"op": "probe", "id": i}``, to the ranks of a suspect: hung or only slow? (:mod:`.probe`);
* ``finished`` — ``{"op": "finished", "step": s}``: the job ended at step ``s`` before this group could join;
* ``state_lost`` — ``{"op": "state_lost", "why": ...}``: the job cannot go on (every member failed before a
  replacement healed and no group saves storage checkpoints, or fewer than ``--min-replicas`` groups came within
  ``--first-quorum-timeout``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from nvrx_lab.net import SECRET_ENV

if TYPE_CHECKING:
    import torch

VERSION = 2
"""The protocol's version, in every ``hello``: a coordinator refuses ranks of another (another nvrx_lab)."""


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
    resumed: bool = False
    """The first quorum of a restarted coordinator, rebuilt from what the members reported: ``committed`` is the
    newest step one of them applied; a step computed but not committed before is computed again by every member."""

    def index(self, replica: int) -> int:
        return self.members.index(replica)

    def to_json(self) -> str:
        return json.dumps({"op": "quorum", **asdict(self)})

    @classmethod
    def from_dict(cls, d: dict) -> Quorum:
        return cls(d["qid"], d["step"], tuple(d["members"]), d["committed"], d.get("donor"), tuple(d.get("joiners", ())),
                   d.get("epoch", {}), d.get("resumed", False))


@dataclass
class Position:
    """Where a rank stands, as its ``hello`` tells a coordinator: a restarted one rebuilds the quorum from these."""

    committed: int | None = None
    """The last step whose update this rank applied (``None``: no trained state, e.g. a replacement not yet healed)."""
    qid: int = 0
    """The last quorum it heard (a restarted coordinator numbers its quorums on from the highest reported)."""

    stored: bool = False
    """Its group saves storage checkpoints: should every group fail, the job goes on from the newest one."""

    def hello(self) -> dict:
        return {"committed": self.committed, "qid": self.qid, "stored": self.stored}


def layout(params: dict[str, torch.Tensor], ranks: int, **settings) -> dict:
    """What every group must share for its gradients to be summed with the others': the parameters' names, global
    shapes and dtypes (a digest, and counts a person can compare), the ranks per group and ``settings``."""
    spec = [(name, list(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in params.items()]
    digest = hashlib.sha256(json.dumps([spec, ranks, sorted(settings.items())]).encode()).hexdigest()[:16]
    return {"digest": digest, "parameters": len(spec), "numel": sum(math.prod(s) for _, s, _ in spec),
            "dtypes": sorted({d for _, _, d in spec}), "ranks": ranks, **settings}


def proof(key: bytes, nonce: str) -> str:
    """What a ``hello`` answers a ``challenge`` with: HMAC-SHA256 of the nonce under the shared secret."""
    return hmac.new(key, nonce.encode(), hashlib.sha256).hexdigest()


def auth_mismatch(key: bytes | None, nonce: str | None, hello: dict) -> str | None:
    """Why a ``hello`` is refused by a coordinator with the secret ``key`` (None: it is let in)."""
    if key is None or (nonce is not None and hmac.compare_digest(str(hello.get("auth", "")), proof(key, nonce))):
        return None
    who = f"replica {hello.get('replica')} rank {hello.get('rank')}"
    if "auth" not in hello:
        return f"{who} has no shared secret and this coordinator has one: set ${SECRET_ENV} on every rank as on it"
    return f"{who} answered with another shared secret than this coordinator's: ${SECRET_ENV} differs"


def version_mismatch(hello: dict) -> str | None:
    """Why a ``hello`` cannot be answered (another protocol version: another nvrx_lab), or None."""
    if hello.get("version") == VERSION:
        return None
    return (f"replica {hello.get('replica')} rank {hello.get('rank')} speaks protocol version {hello.get('version')}, "
            f"this coordinator {VERSION}: run the same nvrx_lab in the coordinator's image and the trainers'")


def layout_mismatch(replica: int, layout: dict, first: int, want: dict) -> str | None:
    """Why group ``replica``'s gradients cannot be summed with group ``first``'s (the settings that differ), or None."""
    if layout.get("digest") == want.get("digest"):
        return None
    differ = {k: (layout.get(k), want.get(k)) for k in sorted((set(want) | set(layout)) - {"digest"})
              if layout.get(k) != want.get(k)} or {"parameter names": "differ"}
    return (f"replica {replica}'s model and batch differ from replica {first}'s, so their gradients cannot be summed: "
            f"{differ} (every group must run the same model flags, --global-batch, --seq-len, --data, --seed and ranks per "
            "group)")


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


__all__ = ["Position", "Quorum", "StepShares", "encode", "rank_part", "share"]
