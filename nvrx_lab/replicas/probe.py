"""Hung, or only slow? The coordinator's second look before it drops the member everybody waits for.

The survivors of a step tell the coordinator when their reduction has waited longer than their patience (twice
their median step): the member they wait for is *suspected*. Time alone cannot tell a hang from a member that is
slow for a moment (a replacement starting on the same node took whole cores here), and neither can a thread's CPU
time (on a GPU the backward runs on autograd's device threads while the caller sleeps, and a synchronize on a hung
GPU busy-waits). So the coordinator asks each of the suspect's ranks, every ``PROBE_S``, for its progress
(:mod:`.progress`: units of work the device has completed, seconds since the last one, whether it is computing):

* a rank computing with no unit completed for its ``hang_after_s``, or a rank that does not answer within
  ``REPLY_S`` (a stopped process): **hung**, the member is dropped;
* units completed between two looks: **slow**, said once on the console and as a ``replica_slow`` event, and
  looked at again until the step is done;
* not computing (already in its own reduction, or between two phases): looked at again.

Each report is a ``replica_waits`` event (who waited, in which step, on whom): the evidence when a slow member was
not looked at (it was never later than the others' patience).
"""

from __future__ import annotations

import sys
import threading
import time

from .progress import HANG_FLOOR_S

PROBE_S = 0.1
"""Between two looks at a suspect's progress."""
REPLY_S = HANG_FLOOR_S
"""How long a suspect's ranks have to answer (a stopped process cannot; a healthy one on a loaded box can)."""


class Probes:
    """The coordinator's suspects: ``(qid, replica) ->`` what their ranks said so far. Called under the coordinator's
    lock (:meth:`suspect`) or taking it (:meth:`answer`, the timers)."""

    def __init__(self, coord):
        self.coord = coord
        self._cases: dict[tuple[int, int], dict] = {}
        self._ids = 0

    def stuck(self, replica: int, qid: int) -> None:
        """A rank of ``replica`` waits too long in quorum ``qid``'s reduction: is every other member waiting for the
        same few? Those are suspects: the ones whose work makes no progress are dropped (below)."""
        c = self.coord
        with c.lock:
            if c.quorum is None or qid != c.quorum.qid or c.aborted:
                return
            live = [c.members[r] for r in c.quorum.members if c.members[r].alive]
            if any(m.joined == c.quorum.step + 1 for m in live):  # one finished the reduction: so did every member
                return                                               # (a report sent just before it completed)
            c.members[replica].stuck = True
            culprits = [m for m in live if not m.stuck]  # no more than the waiters: one merely slower than the first
            c.emit("replica_waits", replica=replica, qid=qid, step=c.quorum.step, on=[m.replica for m in culprits])
            if culprits and len(culprits) <= len(live) - len(culprits):  # to wait may wait too; hung or slow? (.probe)
                self.suspect(qid, culprits)

    def suspect(self, qid: int, members: list) -> None:
        for m in members:
            if (qid, m.replica) not in self._cases or not self._open((qid, m.replica)):  # new, or left from a step before
                self._cases[(qid, m.replica)] = {"since": time.monotonic(), "first": None, "said": False,
                                                 "step": self.coord.quorum.step}
                self._ask(qid, m)

    def _ask(self, qid: int, m) -> None:
        case = self._cases[(qid, m.replica)]
        self._ids += 1
        case.update(id=self._ids, asked=time.monotonic(), now={})
        for conn in m.conns.values():
            self.coord._send(conn, {"op": "probe", "id": self._ids})
        threading.Timer(REPLY_S, self._late, args=(qid, m, self._ids)).start()

    def answer(self, replica: int, rank: int, probe: int, report: dict) -> None:
        """Rank ``rank`` of ``replica`` answered probe ``probe`` with its :meth:`.progress.Progress.report`."""
        with self.coord.lock:
            self._answer(replica, rank, probe, report)

    def _answer(self, replica: int, rank: int, probe: int, report: dict) -> None:
        key = next((k for k, c in self._cases.items() if k[1] == replica and c.get("id") == probe), None)
        if key is None or not self._open(key):
            return
        case, m = self._cases[key], self.coord.members[replica]
        if not m.alive:
            return
        case["now"][rank] = report
        if len(case["now"]) < len(m.conns):
            return
        reports = list(case["now"].values())
        ticks = sum(r.get("ticks", 0) for r in reports)
        computing = [r for r in reports if r.get("working")]
        if computing:
            idle, limit = min(r["idle_s"] for r in computing), max(r["hang_after_s"] for r in computing)
            if idle >= limit:
                self.coord._fail(m, f"hang: every other member waited for it in the step's reduction, and no unit of its "
                                    f"work completed for {idle:.1f} s (limit {limit:.1f} s)", evict=True)
                return
        if case["first"] is None:
            case["first"] = ticks
        elif ticks > case["first"] and not case["said"]:
            case["said"] = True
            waited = time.monotonic() - case["since"]
            self.coord.emit("replica_slow", replica=replica, qid=key[0], step=case["step"], units=ticks - case["first"],
                            waited_s=round(waited, 3))
            print(f"[nvrx_lab.replicas] replica {replica} is slow, not hung ({ticks - case['first']} units of work "
                  f"completed in the last {waited:.2f} s): the others wait for it", file=sys.stderr, flush=True)
        threading.Timer(PROBE_S, self._again, args=(key[0], m)).start()

    def _again(self, qid: int, m) -> None:
        with self.coord.lock:
            if self._open((qid, m.replica)) and m.alive:
                self._ask(qid, m)

    def _late(self, qid: int, m, probe: int) -> None:
        with self.coord.lock:
            case = self._cases.get((qid, m.replica))
            if case and case["id"] == probe and len(case["now"]) < len(m.conns) and self._open((qid, m.replica)) and m.alive:
                self.coord._fail(m, f"hang: every other member waited for it, and it did not answer in {REPLY_S} s",
                                 evict=True)

    def _open(self, key: tuple[int, int]) -> bool:
        """Is the case ``key`` (qid, replica) still about the reduction the others wait in: the same quorum and step,
        not aborted, nobody through it? Else it is forgotten."""
        c, case = self.coord, self._cases.get(key)
        waiting = (case is not None and c.quorum is not None and (c.quorum.qid, c.quorum.step) == (key[0], case["step"])
                   and not c.aborted
                   and not any(c.members[r].joined == c.quorum.step + 1 for r in c.quorum.members if r in c.members))
        if not waiting:
            self._cases.pop(key, None)
        return waiting
