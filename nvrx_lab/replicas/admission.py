"""Who a coordinator's first quorum starts with, and from which step; the coordinator's view of a group.

* **A job's start**: every group is a founder at step 1. The first quorum waits ``--first-quorum-timeout`` for every
  group, then starts with those that came if they are at least ``--min-replicas`` (the others join later and heal),
  else the job ends in one line.
* **A restarted coordinator** (its pod rescheduled, its node lost): the ranks reconnect and each ``hello`` says the
  last step it applied and the last quorum it heard (:class:`~.protocol.Position`). The newest applied step ``C`` is
  where training goes on: the groups that hold it (or that reduced it and only missed its commit, ``C - 1``) go on at
  step ``C + 1``, the others heal from them; a step computed but not committed is computed again. The quorums go on
  numbering from the highest reported. It waits :data:`REJOIN_S` for every group to reconnect, not the first quorum's
  timeout: the survivors are running, and a group that does not come back joins later as a replacement does. A group
  that reconnected is waited for until it joins (it finishes the step it was computing first).
* **Every group lost, with storage checkpoints** (a group's ``hello`` says it saves them): the coordinator starts
  over as at a job's start, and the groups' next processes restore the newest checkpoint and join at the step after
  it, founders again.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REJOIN_S = 5.0
"""How long a restarted coordinator waits for every group to reconnect before it goes on with those that did."""


@dataclass
class Member:
    """One replica group as the coordinator knows it."""

    replica: int
    ranks: int
    conns: dict[int, socket.socket] = field(default_factory=dict)
    alive: bool = True
    healing: bool = False  # said hello after the first quorum: it needs a live member's state
    joined: int | None = None  # the step its rank 0 asked to compute next
    done: int | None = None  # the last step it finished (its reduction completed on every rank)
    stuck: bool = False
    finished: bool = False  # trained the last step and said bye
    last_beat: float = field(default_factory=time.monotonic)
    committed: dict[int, int | None] = field(default_factory=dict)  # per rank: the last step it applied, as it said
    incarnation: dict[int, str] = field(default_factory=dict)  # per rank: its process (a replacement's is new)

    def held(self) -> int | None:
        """The last step every rank of the group applied (None: one holds no trained state)."""
        steps = [self.committed.get(k) for k in range(self.ranks)]
        return None if None in steps else min(steps)


@dataclass
class FirstQuorum:
    """The first quorum's members, step, last committed step and joiners (with their donor)."""

    members: list[int]
    step: int
    committed: int | None
    joiners: list[int] = field(default_factory=list)
    resumed: bool = False


class Admission:
    """``clock``: where the waits' seconds come from (a test's own clock, so its figures are exact, not a sleep's)."""

    def __init__(self, expected: int, min_replicas: int, first_quorum_timeout: float, rejoin_s: float = REJOIN_S,
                 clock: Callable[[], float] = time.monotonic, awaits: bool = False):
        self.expected, self.min_replicas, self.clock = expected, min_replicas, clock
        self.first_quorum_timeout, self.rejoin_s = first_quorum_timeout, rejoin_s
        self.born = clock()
        self.awaits = awaits  # --await-replacements: the last step waits for every lost group's replacement
        self.last_step: int | None = None  # the run's last step, as the groups' first join says (beside its layout)
        self.gone: set[int] = set()  # groups whose launcher exited: no replacement of theirs will come
        self.due = False  # the wait for every group is over: start with --min-replicas
        self.resumed_since: float | None = None  # a rank reported a quorum of an earlier coordinator
        self.top_qid = 0  # the highest quorum reported: this coordinator's are numbered on from it

    def again(self) -> Admission:
        """The same settings for a new first quorum (every group lost: the job goes on from the storage checkpoint)."""
        return Admission(self.expected, self.min_replicas, self.first_quorum_timeout, self.rejoin_s, self.clock,
                         self.awaits)

    def holds(self, step: int, members: dict) -> bool:
        """Whether the quorum of ``step`` waits for a replacement (``awaits``): the last step's only, while a lost group
        is neither back and joined nor given up by its launcher, so that every replacement heals and trains before the
        job ends instead of being told it came after the last step (a demo's choice: a job would rather not wait)."""
        if not self.awaits or step != self.last_step:
            return False
        return any(not m.finished and r not in self.gone and (not m.alive or (m.healing and m.joined is None))
                   for r, m in members.items())

    def hello(self, msg: dict) -> None:
        if (qid := msg.get("qid") or 0) > 0:
            self.top_qid = max(self.top_qid, qid)
            if self.resumed_since is None:
                self.resumed_since = self.clock()

    @property
    def resuming(self) -> bool:
        return self.resumed_since is not None

    def waited(self) -> float:
        return self.clock() - (self.resumed_since if self.resuming else self.born)

    def overdue(self) -> bool:
        """The wait for every group is over (and was not before)."""
        if self.due:
            return False
        self.due = self.waited() >= (self.rejoin_s if self.resuming else self.first_quorum_timeout)
        return self.due

    def timeout_flag(self) -> str:
        return f"{self.rejoin_s:g} s for a restarted coordinator" if self.resuming else \
            f"--first-quorum-timeout {self.first_quorum_timeout:g}"

    def connected(self, members: dict) -> list[int]:
        """The groups with every rank connected (a founder, or a group back after a restart)."""
        return sorted(r for r, m in members.items() if m.alive and len(m.conns) == m.ranks and not m.healing)

    def ready(self, members: dict) -> list[int]:
        """The groups that can found the first quorum: every rank connected, group rank 0 joined."""
        return [r for r in self.connected(members) if members[r].joined is not None]

    def plan(self, members: dict) -> FirstQuorum | None:
        """The first quorum, once enough groups are ready (every one, or ``--min-replicas`` once overdue; after a
        restart, every group that reconnected)."""
        came = self.ready(members)
        if len(came) < (self.min_replicas if self.due else max(self.expected, self.min_replicas)):
            return None
        if self.resuming and len(came) < len(self.connected(members)) and self.waited() < self.first_quorum_timeout:
            return None  # a group back, still finishing the step it computed when the coordinator died
        if not self.resuming:
            return FirstQuorum(came, step=members[came[0]].joined, committed=None)
        held = {r: members[r].held() for r in came}
        newest = max((c for c in held.values() if c is not None), default=None)
        go_on = [r for r in came if newest is None or held[r] in (newest, newest - 1)]
        joiners = [r for r in came if r not in go_on]
        if len(go_on) + len(joiners) < self.min_replicas:
            return None
        return FirstQuorum(sorted(came), step=(newest or 0) + 1, committed=newest, joiners=joiners, resumed=True)
