"""The scale model's in-process restart: what every rank does from an injected exception to its new assignment.

Every simulated rank (:class:`~nvrx_lab.bench._scale_model.Ranks`) runs :class:`~nvrx_lab.inprocess.loop.RestartLoop`'s
store protocol from the fault report through the attempt's end to the next rendezvous; ``restart_s`` = the last
new assignment − the fault, with every store operation of that window counted. :mod:`._scale_procs` runs the
same ranks spread over processes.
"""

from __future__ import annotations

import threading
import time

from nvrx_lab.bench._scale_model import WAIT_S, Ranks
from nvrx_lab.inprocess import rendezvous
from nvrx_lab.inprocess.rank_assignment import ShiftRanks
from nvrx_lab.inprocess.store import RestartStore


def restart_rank(store: RestartStore, me: int, n: int, previous: dict, faulty: int, go: threading.Barrier,
                 t0: list) -> float:
    """One rank of :class:`~nvrx_lab.inprocess.loop.RestartLoop` from attempt ``n`` to its assignment for ``n + 1``;
    returns when it had it."""
    wait = lambda key: store.wait(key, WAIT_S)  # noqa: E731  (the KeyWatch thread's one wait)
    go.wait()
    if me == faulty:
        t0.append(time.monotonic())
        store.report_fault(n, me, "exception", "injected")  # _run_attempt's except branch
    wait(store.end_key(n))  # the monitor thread sees the attempt's end ...
    store.end(n)  # ... and reads it once
    if me == faulty:
        store.faults(n)  # _record before the health check: only a rank that raised (was it the root cause?)
    rendezvous.join(store, n + 1, me, previous, ShiftRanks(), len(previous), wait)
    store.faults(n)  # _record again, once the dead are known
    return time.monotonic()


def measure_restart(ranks: Ranks, timeout: float) -> dict:
    """The first rendezvous of every rank, then one injected exception (the last rank's) to every new assignment."""
    n_ranks = ranks.n
    identity = {r: r for r in range(n_ranks)}
    wait0 = lambda s: (lambda key: s.wait(key, WAIT_S))  # noqa: E731
    t = time.monotonic()
    ranks.run(lambda r: rendezvous.join(ranks.stores[r], 0, r, identity, ShiftRanks(), n_ranks,
                                        wait0(ranks.stores[r])), timeout)
    rendezvous0_s = time.monotonic() - t
    ranks.reset()
    go, t0 = threading.Barrier(n_ranks), []
    ends = ranks.run(lambda r: restart_rank(ranks.stores[r], r, 0, identity, n_ranks - 1, go, t0), timeout)
    return {"restart_s": max(ends) - t0[0], "store_ops_per_restart": ranks.ops(), "rendezvous0_s": rendezvous0_s}
