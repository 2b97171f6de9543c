"""Hung, or only slow? The coordinator's second look before it drops the member everybody waits for.

The survivors of a step tell the coordinator when their reduction has waited longer than their patience (twice
their median step): the member they wait for is *suspected*. Time alone cannot tell a hang from a member that is
slow for a moment (a replacement starting on the same node took whole cores here, and a healthy member was
dropped in 2 runs of 6 under load), so the coordinator asks each of the suspect's ranks, every ``PROBE_S``, how
much CPU its training thread has used (its client's reader thread answers from ``pthread_getcpuclockid``):

* none of its ranks' training threads ran between two answers ``PROBE_S`` apart (blocked in a sleep, a ``recv``, a
  wait that never returns), or one of its ranks did not answer within ``REPLY_S``: **hung**, dropped;
* one did: **slow**, said once on the console, and looked at again every ``PROBE_S`` until the step is done or the
  member has been waited for ``HARD_S`` (a hang that spins is dropped then).
"""

from __future__ import annotations

import sys
import threading
import time

PROBE_S = 0.02
"""Between two looks at a suspect's CPU time."""
MIN_CPU_S = 50e-6
"""CPU a training thread that runs at all uses in ``PROBE_S`` (a thread blocked for good uses none)."""
REPLY_S = 0.5
"""How long a suspect's ranks have to answer (a stopped process cannot)."""
HARD_S = 30.0
"""Waited for this long, a suspect is dropped however busy it is."""


class Probes:
    """The coordinator's suspects: ``(qid, replica) ->`` what their ranks said so far. Called under the coordinator's
    lock (:meth:`suspect`, :meth:`busy`) or taking it (the timers)."""

    def __init__(self, coord):
        self.coord = coord
        self._cases: dict[tuple[int, int], dict] = {}
        self._ids = 0

    def suspect(self, qid: int, members: list) -> None:
        for m in members:
            if (qid, m.replica) not in self._cases or not self._open((qid, m.replica)):  # new, or left from a step before
                self._cases[(qid, m.replica)] = {"since": time.monotonic(), "last": None, "said": False,
                                                 "step": self.coord.quorum.step}
                self._ask(qid, m)

    def _ask(self, qid: int, m) -> None:
        case = self._cases[(qid, m.replica)]
        self._ids += 1
        case.update(id=self._ids, asked=time.monotonic(), now={})
        for conn in m.conns.values():
            self.coord._send(conn, {"op": "probe", "id": self._ids})
        threading.Timer(REPLY_S, self._late, args=(qid, m, self._ids)).start()

    def busy(self, replica: int, rank: int, probe: int, cpu: float) -> None:
        """Rank ``rank`` of ``replica`` answered probe ``probe``: its training thread's CPU seconds so far."""
        with self.coord.lock:
            self._busy(replica, rank, probe, cpu)

    def _busy(self, replica: int, rank: int, probe: int, cpu: float) -> None:
        key = next((k for k, c in self._cases.items() if k[1] == replica and c.get("id") == probe), None)
        if key is None or not self._open(key):
            return
        case, m = self._cases[key], self.coord.members[replica]
        if not m.alive:
            return
        case["now"][rank] = cpu
        if len(case["now"]) < len(m.conns):
            return
        last, now = case["last"], case["now"]
        case["last"] = now
        if last is not None:
            ran = max(now[r] - last.get(r, now[r]) for r in now)
            waited = time.monotonic() - case["since"]
            if ran < MIN_CPU_S or waited > HARD_S:
                why = (f"its training threads used no CPU in {PROBE_S * 1000:.0f} ms" if ran < MIN_CPU_S
                       else f"waited for {waited:.0f} s")
                self.coord._fail(m, f"hang: every other member waited for it in the step's reduction, and {why}",
                                 evict=True)
                return
            if not case["said"]:
                case["said"] = True
                self.coord.emit("replica_slow", replica=replica, qid=key[0], ran_ms=round(ran * 1000, 2))
                print(f"[nvrx_lab.replicas] replica {replica} is slow, not hung (its training thread ran "
                      f"{ran * 1000:.1f} ms of the last {PROBE_S * 1000:.0f}): the others wait for it", file=sys.stderr,
                      flush=True)
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
