"""The first control plane (before issue 11), kept to measure against: every rank loops over
every rank's keys.

* rendezvous: every rank polls, every 2 ms, the decision (1 ``check``), every expected rank's
  death notice and arrival (2 N ``check``\\ s); the monitor thread polls the attempt's first fault
  report every 10 ms;
* heartbeats: every rank's monitor thread ``check``\\ s every peer's counter, then ``multi_get``\\ s
  them, every heartbeat interval (N + 1 operations per rank per interval).

Written against a raw store client with the same key layout the first version used.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from nvrx_lab.inprocess.rank_assignment import ShiftRanks
from nvrx_lab.net import wait_for

MONITOR_INTERVAL, RENDEZVOUS_POLL = 0.01, 0.002


def _faults(c, n: int) -> list[dict]:
    if not c.check([f"it/{n}/nfaults"]):
        return []
    count = c.add(f"it/{n}/nfaults", 0)
    keys = [k for k in (f"it/{n}/fault/{i}" for i in range(count)) if c.check([k])]
    return [json.loads(v) for v in c.multi_get(keys)] if keys else []


def _report(c, n: int, rank: int) -> None:
    k = c.add(f"it/{n}/nfaults", 1) - 1
    c.set(f"it/{n}/fault/{k}", json.dumps({"iteration": n, "rank": rank, "cause": "exception", "detail": "", "t": 0}))


def _rendezvous(c, n: int, me: int, previous: dict, timeout: float, polls: list | None = None) -> dict:
    """``polls``, when given, gets how many times this rank polled (each poll reads 2 N + 1 keys)."""
    expected = set(previous)
    c.set(f"rdzv/{n}/arrived/{me}", "1")
    count = 0

    def ready():
        nonlocal count
        count += 1
        key = f"rdzv/{n}/members"
        if c.check([key]):
            return json.loads(c.get(key))
        dead = {r for r in expected if c.check([f"dead/{r}"])}
        arrived = {r for r in expected if c.check([f"rdzv/{n}/arrived/{r}"])}
        if me in dead or not (expected - dead) <= arrived:
            return None
        survivors = sorted(arrived - dead)
        assignment = ShiftRanks()(survivors, previous, len(previous))
        proposal = json.dumps({"members": survivors, "assignment": {str(k): v for k, v in assignment.items()}})
        return json.loads(c.compare_set(key, "", proposal))

    decision = wait_for(ready, timeout, f"legacy rendezvous {n}", interval=RENDEZVOUS_POLL)
    if polls is not None:
        polls.append(count)
    return decision


@dataclass
class Restart:
    """What the simulated ranks of one restart share: the start line, when the fault was reported, and
    how many times each rank polled the rendezvous."""

    go: threading.Barrier
    t0: list = field(default_factory=list)
    polls: list = field(default_factory=list)


def restart_rank(c, me: int, n: int, previous: dict, faulty: int, shared: Restart, timeout: float) -> float:
    shared.go.wait()
    if me == faulty:
        shared.t0.append(time.monotonic())
        _report(c, n, me)
    wait_for(lambda: c.check([f"it/{n}/fault/0"]), timeout, "the fault", interval=MONITOR_INTERVAL)
    _faults(c, n)  # the monitor's reason
    _faults(c, n)  # _record
    _rendezvous(c, n + 1, me, previous, timeout, shared.polls)
    _faults(c, n)  # _record again
    return time.monotonic()


def rendezvous0(c, me: int, n_ranks: int, timeout: float) -> dict:
    return _rendezvous(c, 0, me, {r: r for r in range(n_ranks)}, timeout)


def heartbeat_ops_per_rank(c, me: int, n_ranks: int) -> None:
    """One heartbeat interval of one rank: two beats, then every peer's counter read."""
    c.add(f"hb/{me}", 1)
    c.add(f"hb/{me}", 1)
    peers = [r for r in range(n_ranks) if r != me and c.check([f"hb/{r}"])]
    if peers:
        c.multi_get([f"hb/{r}" for r in peers])
